"""A saved Nimble graph run from C against an AOTInductor package run from C++ (issue 49): each
loaded in fresh processes, to its first call, then its per-call cost.

    python3 tools/aoti_compare.py [MODEL ...] [--dtype float16] [--batch 1] [--calls 1000]
        [--rounds 3] [--work DIR] [--json F]

Per model (default resnet50), once: ``nimble save`` writes the Nimble file, and
``tools/cold_start.py``'s writer exports the model and compiles its AOTInductor package
(``torch._inductor.aoti_compile_and_package``) with the input it saves beside it.  Two programs
are built: ``tests/c_host/run_saved.c`` with Nimble's C runtime (the driver alone), and
``tools/aoti_host.cpp`` against libtorch (``AOTIModelPackageLoader``).  Then, ``--rounds``
times, ``run_saved FILE --bench CALLS`` and ``aoti_host PACKAGE DTYPE SHAPE CALLS``, each a
fresh process: load to first call in ms (the CUDA context, or libtorch's CUDA start, made
before the clock), host µs per call, GPU ms per call.  A program that fails or dies (a signal)
leaves its row with the reason and the other standing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
from cold_start import report  # tools/ is a script's first path entry
from gpu_suite import NO_MULTICAST

HOST_C = ROOT / "tests" / "c_host" / "run_saved.c"
HOST_CPP = Path(__file__).resolve().parent / "aoti_host.cpp"
#: The rows of a model's table: the program, and the JSON keys it prints.
KEYS = {"load_to_first_call_ms": "load to first call ms",
        "host_us_per_call": "host µs per call", "gpu_ms_per_call": "GPU ms per call"}
NIMBLE, AOTI = "Nimble C runtime", "AOTInductor C++"


def c_host_command(out: Path) -> list[str]:
    """The compile of ``run_saved`` with Nimble's C runtime (as its GPU test builds it)."""
    from nimble.cli import c_runtime

    return [c_runtime.compiler(), "-O2", "-std=c11", "-pthread", "-I", str(c_runtime.FOLDER),
            "-I", str(c_runtime.cuda_include()), str(HOST_C),
            *[str(c_runtime.FOLDER / s) for s in c_runtime.SOURCES], "-o", str(out),
            *c_runtime.libcuda()]


def cpp_host_command(out: Path, torch_dir: Path, cxx11_abi: bool, cxx: str = "c++") -> list[str]:
    """The compile of ``aoti_host.cpp`` against the libtorch of ``torch_dir`` (torch's package
    folder).  libtorch_cuda is linked whether or not a symbol of it is named: it registers the
    CUDA kernels the package's calls dispatch to."""
    lib = torch_dir / "lib"
    return [cxx, "-O2", "-std=c++20", str(HOST_CPP), f"-I{torch_dir / 'include'}",
            f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}", f"-L{lib}", f"-Wl,-rpath,{lib}",
            "-Wl,--no-as-needed", "-ltorch_cuda", "-lc10_cuda", "-Wl,--as-needed", "-ltorch",
            "-ltorch_cpu", "-lc10", "-o", str(out)]


def _run_json(cmd: list[str], timeout: int) -> dict:
    """The last JSON line ``cmd`` prints, or ``{"failed": why}``."""
    env = {**os.environ, **NO_MULTICAST}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"failed": f"no answer in {timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        how = f"signal {-done.returncode}" if done.returncode < 0 else \
            f"exit status {done.returncode}"
        return {"failed": f"{how}: {last[-300:]}"}
    return json.loads(lines[-1])


def _build(cmd: list[str]) -> str | None:
    """Run a compile; None where it worked, else the reason."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode == 0:
        return None
    return f"compile failed: {(done.stderr.strip() or 'no output').splitlines()[-1][-300:]}"


def summarize(runs: list[dict]) -> dict:
    """Per key of :data:`KEYS`, the median and range over the runs that worked; the failures'
    reasons."""
    good = [r for r in runs if "failed" not in r]
    out: dict = {"processes": len(good), "failed": [r["failed"] for r in runs if "failed" in r]}
    for key in KEYS:
        values = [float(r[key]) for r in good if key in r]
        if values:
            out[key] = {"median": statistics.median(values), "min": min(values),
                        "max": max(values)}
    return out


def table(model: str, rows: dict[str, dict], once: dict[str, str]) -> str:
    """A markdown table of one model's rows (program to :func:`summarize`'s result)."""
    lines = [f"### {model}", "", "| program | " + " | ".join(KEYS.values()) + " | processes |",
             "|---" * (len(KEYS) + 2) + "|"]
    for program, row in rows.items():
        cells = []
        for key in KEYS:
            v = row.get(key)
            cells.append("–" if v is None else
                         f"{v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})")
        lines.append(f"| {program} | " + " | ".join(cells) + f" | {row['processes']} |")
    for program, row in rows.items():
        for reason in dict.fromkeys(row["failed"]):
            lines.append(f"\n{program} failed: {reason}")
    lines += ["", "Once: " + "; ".join(f"{k} {v}" for k, v in once.items()), ""]
    return "\n".join(lines)


def _artifacts(model: str, args, work: Path) -> tuple[dict, dict]:
    """The Nimble file and the AOTInductor package of ``model`` (paths, or why not), and what
    making them took."""
    env = {**os.environ, **NO_MULTICAST}
    made, once = {}, {}
    saved = work / f"{model}.nimble"
    done = subprocess.run([sys.executable, "-m", "nimble", "save", model, "--dtype", args.dtype,
                           "--batch", str(args.batch), "-o", str(saved), "-q"],
                          capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode == 0:
        _, size, prepare, save = done.stdout.strip().split("\t")
        made[NIMBLE] = saved
        once["nimble save"] = f"{prepare}, {save}, {int(size.split()[0]) / 2**20:.1f} MB"
    else:
        made[NIMBLE] = f"nimble save failed: {done.stderr.strip()[-300:]}"
    package = work / f"{model}.pt2"
    wrote = _run_json([sys.executable, str(Path(__file__).parent / "cold_start.py"), "--write",
                       "aoti package", "--model", model, "--dtype", args.dtype, "--batch",
                       str(args.batch), "--path", str(package)], 3600)
    if "failed" in wrote:
        made[AOTI] = f"aoti_compile_and_package failed: {wrote['failed']}"
    else:
        made[AOTI] = package
        once["aoti_compile_and_package"] = (f"{wrote['seconds']:.1f} s, "
                                            f"{wrote['bytes'] / 2**20:.1f} MB")
    return made, once


def _input_shape(package: Path) -> str:
    import torch

    return ",".join(str(d) for d in torch.load(str(package) + ".input.pt").shape)


def measure(model: str, args, work: Path, programs: dict[str, object]) -> tuple[dict, dict]:
    """One model's rows (program to :func:`summarize`) and its once-only facts."""
    made, once = _artifacts(model, args, work)
    runs: dict[str, list[dict]] = {NIMBLE: [], AOTI: []}
    for _ in range(args.rounds):
        for program, artifact in made.items():
            binary = programs[program]
            if not isinstance(artifact, Path) or not isinstance(binary, Path):
                reason = artifact if not isinstance(artifact, Path) else binary
                runs[program].append({"failed": str(reason)})
                continue
            if program == NIMBLE:
                cmd = [str(binary), str(artifact), "--bench", str(args.calls)]
            else:
                cmd = [str(binary), str(artifact), args.dtype, _input_shape(artifact),
                       str(args.calls)]
            seen = _run_json(cmd, 600)
            if program == NIMBLE and "host_us_nimble_run" in seen:
                seen["host_us_per_call"] = seen["host_us_nimble_run"]
            runs[program].append(seen)
    return {p: summarize(r) for p, r in runs.items()}, once


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", default=["resnet50"])
    p.add_argument("--dtype", default="float16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work", default="", help="folder for the files and programs (default: a "
                                              "temporary one)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        programs: dict[str, object] = {NIMBLE: work / "run_saved", AOTI: work / "aoti_host"}
        for program, cmd in ((NIMBLE, c_host_command(work / "run_saved")),
                             (AOTI, cpp_host_command(work / "aoti_host",
                                                     Path(torch.__file__).parent,
                                                     torch._C._GLIBCXX_USE_CXX11_ABI))):
            failed = _build(cmd)
            if failed:
                programs[program] = failed
        report(args.models, lambda model: measure(model, args, work, programs), table,
               args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
