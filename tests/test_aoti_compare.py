"""tools/aoti_compare.py without a GPU: the two programs' compiles, the rounds' summary, the
table, and what a program that fails or dies leaves."""
from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))
import aoti_compare  # noqa: E402


def test_the_cpp_host_links_libtorch_cuda_whatever_it_names():
    cmd = aoti_compare.cpp_host_command(Path("/w/aoti_host"), Path("/t"), True)
    assert cmd[:3] == ["c++", "-O2", "-std=c++20"] and str(aoti_compare.HOST_CPP) in cmd
    assert "-I/t/include" in cmd and "-I/t/include/torch/csrc/api/include" in cmd
    assert "-D_GLIBCXX_USE_CXX11_ABI=1" in cmd and "-Wl,-rpath,/t/lib" in cmd
    at = cmd.index("-Wl,--no-as-needed")
    assert cmd[at + 1:at + 4] == ["-ltorch_cuda", "-lc10_cuda", "-Wl,--as-needed"]
    assert cmd[-2:] == ["-o", "/w/aoti_host"]
    assert "-D_GLIBCXX_USE_CXX11_ABI=0" in aoti_compare.cpp_host_command(Path("x"), Path("/t"),
                                                                          False)


def test_the_c_host_is_built_as_its_gpu_test_builds_it():
    from nimble.cli.common import Fail

    try:
        cmd = aoti_compare.c_host_command(Path("/w/run_saved"))
    except Fail as e:
        pytest.skip(str(e))
    assert str(aoti_compare.HOST_C) in cmd and "-pthread" in cmd and cmd[-1].endswith("cuda")
    assert all(any(c.endswith(s) for c in cmd) for s in ("nimble.c", "nimble_plan.c"))


def test_a_program_that_prints_dies_or_says_nothing():
    ok = aoti_compare._run_json([sys.executable, "-c", "print('noise'); print('{\"a\": 1}')"],
                                60)
    assert ok == {"a": 1}
    died = aoti_compare._run_json([sys.executable, "-c", "import os, signal; "
                                   f"os.kill(os.getpid(), {int(signal.SIGSEGV)})"], 60)
    assert died["failed"].startswith("signal 11")
    quiet = aoti_compare._run_json([sys.executable, "-c", "import sys; "
                                    "sys.stderr.write('no package\\n'); sys.exit(3)"], 60)
    assert quiet == {"failed": "exit status 3: no package"}


def test_rounds_are_summarized_and_failures_kept_with_their_reason():
    runs = [{"load_to_first_call_ms": 150.0, "host_us_per_call": 20.0, "gpu_ms_per_call": 0.8},
            {"load_to_first_call_ms": 170.0, "host_us_per_call": 24.0, "gpu_ms_per_call": 0.9},
            {"failed": "signal 11: "}]
    s = aoti_compare.summarize(runs)
    assert s["processes"] == 2 and s["failed"] == ["signal 11: "]
    assert s["load_to_first_call_ms"] == {"median": 160.0, "min": 150.0, "max": 170.0}
    text = aoti_compare.table("resnet50", {aoti_compare.NIMBLE: s,
                                           aoti_compare.AOTI: aoti_compare.summarize(
                                               [{"failed": "signal 11: x"}] * 2)},
                              {"nimble save": "1.0 s"})
    assert "| Nimble C runtime | 160.000 (150.000-170.000) | 22.000 (20.000-24.000) |" in text
    assert "| AOTInductor C++ | – | – | – | 0 |" in text
    assert text.count("AOTInductor C++ failed: signal 11: x") == 1
    assert "Once: nimble save 1.0 s" in text


def test_each_round_runs_both_programs_and_a_missing_one_says_why(monkeypatch, tmp_path):
    package, saved = tmp_path / "m.pt2", tmp_path / "m.nimble"
    monkeypatch.setattr(aoti_compare, "_artifacts", lambda model, args, work: (
        {aoti_compare.NIMBLE: saved, aoti_compare.AOTI: package}, {}))
    monkeypatch.setattr(aoti_compare, "_input_shape", lambda p: "1,3,224,224")
    calls = []

    def run(cmd, timeout):
        calls.append(cmd)
        if cmd[0].endswith("run_saved"):
            return {"load_to_first_call_ms": 160.0, "host_us_nimble_run": 50.0,
                    "gpu_ms_per_call": 0.8}
        return {"load_to_first_call_ms": 900.0, "host_us_per_call": 30.0,
                "gpu_ms_per_call": 0.7}
    monkeypatch.setattr(aoti_compare, "_run_json", run)
    args = SimpleNamespace(rounds=2, calls=100, dtype="float16")
    programs = {aoti_compare.NIMBLE: tmp_path / "run_saved", aoti_compare.AOTI: tmp_path / "a"}
    rows, _ = aoti_compare.measure("resnet50", args, tmp_path, programs)
    assert len(calls) == 4
    assert calls[1] == [str(tmp_path / "a"), str(package), "float16", "1,3,224,224", "100"]
    assert rows[aoti_compare.NIMBLE]["host_us_per_call"]["median"] == 50.0
    programs[aoti_compare.AOTI] = "compile failed: no libtorch_cuda"
    rows, _ = aoti_compare.measure("resnet50", args, tmp_path, programs)
    assert rows[aoti_compare.AOTI] == {"processes": 0,
                                       "failed": ["compile failed: no libtorch_cuda"] * 2}
