"""``tools/sanitize.py`` without a GPU: reading compute-sanitizer's reports (the documented
layout, older and newer host-frame styles), which are Nimble's, and the command around a fake
sanitizer."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("sanitize_tool", ROOT / "tools" / "sanitize.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["sanitize_tool"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


sanitize = _tool()

BINDINGS = ("/usr/local/lib/python3.12/dist-packages/cuda/bindings/_bindings/"
            "cydriver.cpython-312-x86_64-linux-gnu.so")
TORCH_CUDA = "/usr/local/lib/python3.12/dist-packages/torch/lib/libtorch_cuda.so"


def _cudnn_read(thread: int) -> str:
    """An out-of-bounds read in a cuDNN kernel of a graph launched through cuda.bindings
    (older two-line host frames), by ``thread``."""
    return f"""\
========= Invalid __global__ read of size 2 bytes
=========     at void cudnn::cnn::conv2d_grouped_direct_kernel<__half>(int, __half const*)+0x1c0
=========     by thread ({thread},0,0) in block (12,0,0)
=========     Address 0x7f01dead{thread:04x} is out of bounds
=========     Saved host backtrace up to driver entry point at kernel launch time
=========     Host Frame: [0x2f1a2b]
=========                in /usr/lib/x86_64-linux-gnu/libcuda.so.1
=========     Host Frame:__pyx_f_cuGraphLaunch [0x3c1d]
=========                in {BINDINGS}
=========
"""


# A torch API error (newer one-line host frames), the target's own line, then the same cuDNN
# read in two threads.
MEMCHECK = f"""\
========= COMPUTE-SANITIZER
========= Program hit cudaErrorInvalidValue (error 1) due to "invalid argument" on CUDA API call to cudaPointerGetAttributes.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: [0x2d3f41] in /usr/lib/x86_64-linux-gnu/libcuda.so.1
=========         Host Frame: cudaPointerGetAttributes [0x4a1b2] in /usr/lib/libcudart.so.13
=========         Host Frame: c10::cuda::CUDAKernelLaunchRegistry::check() [0x12345] in {TORCH_CUDA}
=========         Host Frame: _PyEval_EvalFrameDefault [0x1a2b3c] in /usr/bin/python3.12
=========
googlenet float16, device-launchable: prepare and 5 calls: done
{_cudnn_read(3)}{_cudnn_read(4)}========= ERROR SUMMARY: 3 errors
"""

NIMBLE_KERNEL = """\
========= Invalid __global__ write of size 8 bytes
=========     at nimble_gather_input+0x90
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x10 is out of bounds
=========
========= Program hit CUDA_ERROR_INVALID_VALUE (error 1) due to "invalid argument" on CUDA API call to cuMemcpyDtoH_v2.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: cuMemcpyDtoH_v2 [0x2d3f41] in /usr/lib/x86_64-linux-gnu/libcuda.so.1
=========         Host Frame: __pyx_pw_4cuda_8bindings_6driver_cuMemcpyDtoH [0x8812] in driver.cpython-312-x86_64-linux-gnu.so
=========
========= ERROR SUMMARY: 2 errors
"""

SYNCCHECK = """\
========= COMPUTE-SANITIZER
========= Barrier error detected. Divergent thread(s) in warp
=========     at 0x58 in /tmp/torchinductor/ab/cab.py:12:triton_per_fused_mean_0
=========     by thread (37,0,0) in block (0,0,0)
=========
========= ERROR SUMMARY: 1 error
"""

RACECHECK = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at sumKernel(int *, int *)+0x140 in race.cu:13
=========     and Read access at sumKernel(int *, int *)+0x160 in race.cu:14 [4 hazards]
=========
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""


def test_reports_and_the_summary_of_a_memcheck_run():
    summary = sanitize.parse(MEMCHECK)
    assert summary.errors == 3
    api, first, second = summary.reports
    assert api.api_call == "cudaPointerGetAttributes" and api.kernel is None
    assert not api.nimble and "libtorch_cuda.so" in api.why
    assert first.kernel == ("void cudnn::cnn::conv2d_grouped_direct_kernel<__half>"
                            "(int, __half const*)")
    assert first.nimble and "a kernel of a graph Nimble launched" in first.why
    assert "cydriver" in first.why
    assert first.lines[0] == "Invalid __global__ read of size 2 bytes"
    assert "by thread (3,0,0) in block (12,0,0)" in first.lines
    assert first.key == second.key  # the same finding in two threads


def test_nimble_kernels_and_driver_calls_are_nimbles():
    summary = sanitize.parse(NIMBLE_KERNEL)
    kernel, call = summary.reports
    assert kernel.kernel == "nimble_gather_input" and kernel.nimble
    assert kernel.why == "Nimble's kernel nimble_gather_input"
    assert call.api_call == "cuMemcpyDtoH_v2" and call.nimble
    assert call.why.startswith("Nimble's driver call (host frame in cuda.bindings")


def test_synccheck_and_racecheck_reports():
    sync = sanitize.parse(SYNCCHECK)
    assert sync.errors == 1
    [barrier] = sync.reports
    assert barrier.kernel == "triton_per_fused_mean_0" and not barrier.nimble
    assert barrier.why == "not Nimble's: no Nimble kernel, no host backtrace"
    race = sanitize.parse(RACECHECK)
    assert (race.errors, race.race_hazards, race.race_warnings) == (1, 2, 1)
    [hazard] = race.reports
    assert hazard.kernel == "sumKernel(int *, int *)" and len(hazard.lines) == 2


def test_a_run_cut_off_has_no_summary_and_keeps_what_it_printed():
    cut = MEMCHECK[:MEMCHECK.index("========= ERROR SUMMARY")]
    summary = sanitize.parse(cut.rsplit("=========\n", 2)[0])
    assert summary.errors is None and len(summary.reports) == 2
    assert sanitize.parse("no sanitizer here\n").reports == []


def test_the_table_counts_distinct_reports():
    run = sanitize.Run("googlenet_fp16", "memcheck", 0, False, 12.0, sanitize.parse(MEMCHECK),
                       "log")
    assert len(run.nimble_reports) == 2 and run.complete
    text = sanitize.table([run])
    row = text.splitlines()[2].split()
    assert row[:4] == ["googlenet_fp16", "memcheck", "3", "2"]
    assert "googlenet_fp16 memcheck: 2x Invalid __global__ read of size 2 bytes" in text
    assert "1x Program hit cudaErrorInvalidValue" in text and "[cudaPointerGetAttributes]" in text
    data = run.to_json()
    assert data["errors"] == 3 and data["nimble_reports"] == 2
    assert [d["count"] for d in data["distinct"]] == [1, 2]
    json.dumps(data)


# ---- the command, around a fake compute-sanitizer --------------------------------------------

def _fake_sanitizer(tmp_path: Path, outputs: dict[str, str], sleep: float = 0.0) -> Path:
    """An executable that prints ``outputs[tool]`` and exits, ignoring its target."""
    data = tmp_path / "outputs.json"
    data.write_text(json.dumps(outputs))
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(f"#!{sys.executable}\n"
                    "import json, sys, time\n"
                    f"time.sleep({sleep})\n"
                    "tool = sys.argv[sys.argv.index('--tool') + 1]\n"
                    f"print(json.load(open({str(data)!r}))[tool], end='')\n")
    fake.chmod(0o755)
    return fake


def test_command_runs_every_script_under_every_tool(tmp_path, capsys):
    fake = _fake_sanitizer(tmp_path, {"memcheck": MEMCHECK.split("googlenet")[0]
                                      + "========= ERROR SUMMARY: 1 error\n",
                                      "synccheck": SYNCCHECK})
    out_json = tmp_path / "sanitize.json"
    status = sanitize.main(["--sanitizer", str(fake), "--out", str(tmp_path / "logs"),
                            "--scripts", "googlenet_fp16,compiled_branchy", "--json",
                            str(out_json)])
    assert status == 0  # torch's reports only
    data = json.loads(out_json.read_text())
    assert [(r["script"], r["tool"]) for r in data["runs"]] == [
        ("googlenet_fp16", "memcheck"), ("googlenet_fp16", "synccheck"),
        ("compiled_branchy", "memcheck"), ("compiled_branchy", "synccheck")]
    assert all(r["errors"] == 1 and r["nimble_reports"] == 0 for r in data["runs"])
    log = (tmp_path / "logs" / "compiled_branchy.synccheck.log").read_text()
    assert "--tool synccheck" in log and "compiled_branchy.py" in log
    assert "Barrier error detected" in log
    assert "compiled_branchy  synccheck" in capsys.readouterr().out


def test_command_fails_on_a_nimble_report_and_on_a_timeout(tmp_path, capsys):
    fake = _fake_sanitizer(tmp_path, {"memcheck": NIMBLE_KERNEL})
    assert sanitize.main(["--sanitizer", str(fake), "--out", str(tmp_path), "--tools",
                          "memcheck", "--scripts", "resnet50_train"]) == 1
    assert "Nimble's kernel nimble_gather_input" in capsys.readouterr().out
    slow = _fake_sanitizer(tmp_path, {"memcheck": NIMBLE_KERNEL}, sleep=30)
    assert sanitize.main(["--sanitizer", str(slow), "--out", str(tmp_path), "--tools",
                          "memcheck", "--scripts", "resnet50_train", "--timeout", "1"]) == 1
    row = capsys.readouterr().out.splitlines()[2]
    assert row.split()[:3] == ["resnet50_train", "memcheck", "?"] and row.endswith("timeout")


def test_missing_sanitizer_and_bad_names(tmp_path, capsys):
    assert sanitize.main(["--sanitizer", str(tmp_path / "none")]) == 2
    assert "compute-sanitizer not found" in capsys.readouterr().err
    for bad in (["--tools", "memcheck,leakcheck"], ["--scripts", "vgg"]):
        with pytest.raises(SystemExit):
            sanitize.parse_args(bad)


def test_every_script_takes_the_host_launch_option():
    import subprocess

    for script in sanitize.SCRIPTS:
        run = subprocess.run([sys.executable, str(sanitize.SCRIPT_DIR / f"{script}.py"),
                              "--help"], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and "--host-launch" in run.stdout, run.stderr
