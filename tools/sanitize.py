"""NVIDIA compute-sanitizer over Nimble's three driver scripts; which reports are Nimble's.

    python3 tools/sanitize.py [--tools memcheck,synccheck] [--scripts S,S,...] [--timeout SEC]
                              [--host-launch] [--sanitizer PATH] [--out DIR] [--json FILE]

Runs ``compute-sanitizer --tool T python3 tools/sanitize/S.py`` for every tool T and script S
(``googlenet_fp16``: prepare + 5 calls of googlenet in float16; ``resnet50_train``: one training
step of resnet50 at CIFAR-10 shape, batch 8; ``compiled_branchy``: the built-in model under
``torch.compile``, prepared with Nimble), each run with its own time limit, and reads each run's
reports and its summary line (``ERROR SUMMARY: N errors``; racecheck's ``RACECHECK SUMMARY``).

A report is Nimble's where its kernel is one of Nimble's own (``nimble_*``, from ``kernels/``) or
its host backtrace passes through ``cuda.bindings``: only ``nimble/driver/`` calls it, so a
failing driver call or a kernel of Nimble's rebuilt graph (launched by ``cuGraphLaunch`` through
it) shows that frame, while torch's, cuDNN's and cuBLAS's own launches and calls do not.  The
table gives per run the errors, those of them Nimble's, the exit status, and the first line of
each distinct report with its kernel or API call and the reason for its class.  The whole logs go
to ``--out`` (default ``$OUT/sanitize`` where ``$OUT`` is set, else ``./out/sanitize``).

Exit status: 0 when every run ended with a summary and no report is Nimble's; 1 otherwise; 2
when compute-sanitizer is not found.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nimble.cli.common import names_from  # noqa: E402

SCRIPT_DIR = ROOT / "tools" / "sanitize"
SCRIPTS = ("googlenet_fp16", "resnet50_train", "compiled_branchy", "torch_googlenet_fp16")
TOOLS = ("memcheck", "synccheck", "racecheck", "initcheck")
DEFAULT_TOOLS = ("memcheck", "synccheck")
PRINT_LIMIT = 1000

PREFIX = "========="
# Lines the sanitizer prints at the top level that are no report of an error.
_NOT_REPORTS = re.compile(r"^(COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|"
                          r"Target application returned an error|Tool exit)")
# Top-level lines that continue a report (older releases print some without indent).
_CONTINUES = re.compile(r"^(at |by thread|Address |Access to |and is |and |Saved host backtrace|"
                        r"Host Frame|Device Frame|in |Race reported|Current value)")
_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, "
                           r"(\d+) warnings?\)")
_API_CALL = re.compile(r"on CUDA API call to (\w+)")
_KERNEL_AT_OFFSET = re.compile(r"\bat (?!0x)(?P<kernel>\S.*?)\+0x[0-9a-fA-F]+")
_KERNEL_AT_PC = re.compile(r"\bat 0x[0-9a-fA-F]+ in (?:.*?:\d+:)?(?P<kernel>\S.*)$")
_FRAME_LIB = re.compile(r"(?:^|\s)in (?P<lib>\S+)\s*$")
# cuda.bindings' extension modules, by path, by file name or by their Cython symbols.
_CUDA_BINDINGS = re.compile(r"[/\\]cuda[/\\]bindings[/\\]|\bcydriver\b|4cuda_8bindings")
_DRIVER_LIB = re.compile(r"libcuda\.so|libcudart\.so")
NIMBLE_KERNEL_PREFIX = "nimble_"


@dataclass(frozen=True)
class Report:
    """One report the sanitizer printed: its lines (prefix and indent removed, the first says
    what happened), the kernel or API call it names, and whether it is Nimble's, and why."""
    lines: tuple[str, ...]
    kernel: str | None
    api_call: str | None
    nimble: bool
    why: str

    @property
    def title(self) -> str:
        return self.lines[0]

    @property
    def key(self) -> tuple:
        """What makes two reports the same finding (threads and addresses aside)."""
        return (re.sub(r"0x[0-9a-fA-F]+", "0x…", self.title), self.kernel, self.api_call)


@dataclass
class Summary:
    """What a run's output says: its reports and its summary counts (``None``: no summary
    line, the run ended early)."""
    reports: list[Report] = field(default_factory=list)
    errors: int | None = None
    race_hazards: int | None = None
    race_warnings: int | None = None


def _kernel(lines: list[str]) -> str | None:
    """The kernel a report names: on its lines before the host backtrace (whose frames may read
    like the ``at`` line)."""
    for line in lines:
        if line.startswith("Saved host backtrace"):
            break
        for pattern in (_KERNEL_AT_OFFSET, _KERNEL_AT_PC):
            m = pattern.search(line)
            if m:
                return m.group("kernel").strip()
    return None


def classify(lines: list[str]) -> Report:
    """The :class:`Report` of one report's lines (see the module's docstring for the rule)."""
    kernel = _kernel(lines)
    m = _API_CALL.search(lines[0])
    api_call = m.group(1) if m else None
    frames = [line for line in lines if line.startswith(("Host Frame", "in "))]
    libs = [m.group("lib") for m in map(_FRAME_LIB.search, frames) if m]
    bindings = next((lib for lib in libs if _CUDA_BINDINGS.search(lib)), None) or next(
        (frame for frame in frames if _CUDA_BINDINGS.search(frame)), None)
    if kernel and kernel.startswith(NIMBLE_KERNEL_PREFIX):
        nimble, why = True, f"Nimble's kernel {kernel.split('(')[0]}"
    elif bindings:
        what = "a kernel of a graph Nimble launched" if kernel and not api_call \
            else "Nimble's driver call"
        nimble, why = True, f"{what} (host frame in cuda.bindings: {Path(bindings).name})"
    elif libs:
        caller = next((lib for lib in libs if not _DRIVER_LIB.search(lib)), libs[-1])
        nimble, why = False, f"not Nimble's: no cuda.bindings frame (called from " \
                             f"{Path(caller).name})"
    else:
        nimble, why = False, "not Nimble's: no Nimble kernel, no host backtrace"
    return Report(tuple(lines), kernel, api_call, nimble, why)


def parse(output: str) -> Summary:
    """The reports and summary counts in a compute-sanitizer run's output (the target's own
    lines, which lack the ``=========`` prefix, are skipped)."""
    summary = Summary()
    current: list[str] = []

    def close() -> None:
        if current:
            summary.reports.append(classify(current))
            current.clear()

    for raw in output.splitlines():
        if not raw.startswith(PREFIX):
            continue
        body = raw[len(PREFIX):]
        text = body.strip()
        if not text:
            close()
            continue
        if m := _ERROR_SUMMARY.search(text):
            summary.errors = int(m.group(1))
        if m := _RACE_SUMMARY.search(text):
            summary.race_hazards, summary.race_warnings = int(m.group(1)), int(m.group(3))
            if summary.errors is None:
                summary.errors = int(m.group(2))
        indented = len(body) - len(body.lstrip()) > 1
        if current and (indented or _CONTINUES.match(text)):
            current.append(text)
        elif _NOT_REPORTS.match(text):
            close()
        else:
            close()
            current.append(text)
    close()
    return summary


# ---- running --------------------------------------------------------------------------------

def find_sanitizer(given: str | None) -> str | None:
    """``given``, else ``compute-sanitizer`` on PATH, else the newest under /usr/local/cuda*/."""
    if given:
        return given if Path(given).is_file() else None
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    candidates = sorted(glob.glob("/usr/local/cuda*/bin/compute-sanitizer")
                        + glob.glob("/usr/local/cuda*/compute-sanitizer/compute-sanitizer"))
    return candidates[-1] if candidates else None


@dataclass
class Run:
    """One script under one tool: how it ended and what the sanitizer reported."""
    script: str
    tool: str
    returncode: int | None
    timed_out: bool
    seconds: float
    summary: Summary
    log: str

    @property
    def nimble_reports(self) -> list[Report]:
        return [r for r in self.summary.reports if r.nimble]

    @property
    def complete(self) -> bool:
        """Ended by itself, with the sanitizer's summary line."""
        return not self.timed_out and self.summary.errors is not None

    @property
    def status(self) -> str:
        if self.timed_out:
            return "timeout"
        if self.summary.errors is None:
            return f"exit {self.returncode}, no summary"
        return f"exit {self.returncode}"

    def distinct(self) -> list[tuple[Report, int]]:
        """Each distinct report (the first of its kind) and how often it came."""
        counts = Counter(r.key for r in self.summary.reports)
        first = {}
        for r in self.summary.reports:
            first.setdefault(r.key, r)
        return [(r, counts[k]) for k, r in first.items()]

    def to_json(self) -> dict:
        return {"script": self.script, "tool": self.tool, "returncode": self.returncode,
                "timed_out": self.timed_out, "seconds": self.seconds, "log": self.log,
                "errors": self.summary.errors, "race_hazards": self.summary.race_hazards,
                "race_warnings": self.summary.race_warnings,
                "nimble_reports": len(self.nimble_reports),
                "distinct": [{**asdict(r), "count": n} for r, n in self.distinct()]}


def run_one(sanitizer: str, tool: str, script: str, timeout: float, host_launch: bool,
            out_dir: Path) -> Run:
    """``script`` under ``tool``, stopped (its whole process group) after ``timeout`` seconds;
    its output goes to ``out_dir/<script>.<tool>.log``."""
    # The driver calls that fail by design (cuFuncGetParamInfo past a kernel's last parameter,
    # cuMemGetAddressRange on a word that is no device pointer, cuda-bindings' cuGetProcAddress
    # lookups) would fill the report; Nimble checks every call's status itself.
    api_errors = ["--report-api-errors", "no"] if tool == "memcheck" else []
    cmd = [sanitizer, "--tool", tool, *api_errors, "--print-limit", str(PRINT_LIMIT),
           "--target-processes", "application-only", sys.executable,
           str(SCRIPT_DIR / f"{script}.py"), *(["--host-launch"] if host_launch else [])]
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the sanitizer and the Python it runs
        except ProcessLookupError:
            pass
        output, _ = proc.communicate()
    seconds = time.perf_counter() - t0
    log = out_dir / f"{script}.{tool}.log"
    log.write_text(f"$ {' '.join(cmd)}\n{output}", encoding="utf-8")
    return Run(script, tool, None if timed_out else proc.returncode, timed_out, seconds,
               parse(output), str(log))


# ---- reporting ------------------------------------------------------------------------------

def table(runs: list[Run]) -> str:
    """A line per run, then each run's distinct reports (first line, kernel or call, count,
    class)."""
    head = f"{'script':<18}{'tool':<11}{'errors':>7}{'Nimble':>8}{'seconds':>9}  status"
    lines = [head, "-" * len(head)]
    for r in runs:
        errors = "?" if r.summary.errors is None else str(r.summary.errors)
        lines.append(f"{r.script:<18}{r.tool:<11}{errors:>7}{len(r.nimble_reports):>8}"
                     f"{r.seconds:>9.0f}  {r.status}")
    for r in runs:
        for report, count in r.distinct():
            where = report.kernel or report.api_call or "-"
            lines.append(f"{r.script} {r.tool}: {count}x {report.title} [{where}] "
                         f"-- {report.why}")
    lines.append("errors: the sanitizer's ERROR SUMMARY (racecheck: its errors; ? where the run "
                 "ended without one); Nimble: reports whose kernel is nimble_* or whose host "
                 "backtrace passes through cuda.bindings (Nimble's driver calls and launches)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tools", type=lambda text: names_from(TOOLS, text), default=list(DEFAULT_TOOLS),
                   help=f"comma-separated, from {', '.join(TOOLS)} (default "
                        f"{','.join(DEFAULT_TOOLS)})")
    p.add_argument("--scripts", type=lambda text: names_from(SCRIPTS, text), default=list(SCRIPTS),
                   help=f"comma-separated, from {', '.join(SCRIPTS)} (default all)")
    p.add_argument("--timeout", type=float, default=540.0,
                   help="seconds each run may take before it is stopped (default 540)")
    p.add_argument("--host-launch", action="store_true",
                   help="prepare plain host-launch graphs (device_launch=False)")
    p.add_argument("--sanitizer", help="compute-sanitizer to run (default: on PATH, else the "
                                       "newest /usr/local/cuda*/bin/compute-sanitizer)")
    p.add_argument("--out", type=Path, default=None,
                   help="directory of the logs (default $OUT/sanitize, else ./out/sanitize)")
    p.add_argument("--json", metavar="FILE", help="write every run's numbers and reports to FILE")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sanitizer = find_sanitizer(args.sanitizer)
    if sanitizer is None:
        print("sanitize: compute-sanitizer not found (not on PATH, not under "
              "/usr/local/cuda*/bin); give --sanitizer PATH", file=sys.stderr)
        return 2
    out_dir = args.out or Path(os.environ.get("OUT") or "out") / "sanitize"
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for script in args.scripts:
        for tool in args.tools:
            print(f"[sanitize] {tool} on {script} (limit {args.timeout:.0f} s)", file=sys.stderr,
                  flush=True)
            runs.append(run_one(sanitizer, tool, script, args.timeout, args.host_launch,
                                out_dir))
            print(table(runs[-1:]).splitlines()[2], file=sys.stderr, flush=True)
    print(table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps({"sanitizer": sanitizer,
                                               "host_launch": args.host_launch,
                                               "runs": [r.to_json() for r in runs]}, indent=2)
                                   + "\n", encoding="utf-8")
    return 0 if all(r.complete and not r.nimble_reports for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
