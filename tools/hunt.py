"""Run one command many times, several side by side, until one run fails: for a failure that
shows once in tens of runs (the two-model training sequence of docs/findings.md).

    python3 tools/hunt.py [--parallel 5] [--seconds 400] [--out DIR] -- COMMAND [ARG ...]

Rounds of ``--parallel`` copies of ``COMMAND`` start together (as the GPU suite's jobs share
the GPU) while fewer than ``--seconds`` have passed since the first; the hunt stops after the
round in which a run exits non-zero.  Each run gets its own ``$NIMBLE_FAULT_DIR``, so the
recording a failed proof saves (``nimble-mismatch-*.json.gz``, ``nimble-fault-*.json.gz``)
stays with its run.  A line per run: its exit status, seconds and last line of output.  Into
``--out`` (default ``$OUT`` on the device machine, else ``./out``) go, for the first failed
run only, its log (``hunt_failed.log``) and the recordings it saved, so that what comes back
from a device call stays within a few files.  Exit status: 1 if a run failed, else 0.

    python3 tools/hunt.py -- python3 -m nimble bench --training googlenet inception_v3 \\
        --batch 32 --rounds 1 --iters 2 --no-compile
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Run:
    """One run of the command: its name, folder (log and saved recordings) and outcome."""

    name: str
    folder: Path
    returncode: int = 0
    seconds: float = 0.0

    @property
    def log(self) -> Path:
        return self.folder / "run.log"

    def last_line(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return lines[-1][:200] if lines else ""

    def recordings(self) -> list[Path]:
        return sorted(self.folder.glob("nimble-*.json.gz"))


def run_round(command: list[str], runs: list[Run]) -> None:
    """Start every run of ``runs`` at once and wait for them all."""
    started = []
    for run in runs:
        run.folder.mkdir(parents=True)
        env = {**os.environ, "NIMBLE_FAULT_DIR": str(run.folder), "PYTHONUNBUFFERED": "1"}
        log = open(run.log, "wb")
        started.append((run, log, time.perf_counter(),
                        subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)))
    for run, log, began, process in started:
        run.returncode = process.wait()
        run.seconds = time.perf_counter() - began
        log.close()


def hunt(command: list[str], parallel: int, seconds: float, work: Path) -> list[Run]:
    """Rounds of ``parallel`` runs until ``seconds`` pass or a round holds a failure; every run
    made, in order."""
    began, done = time.perf_counter(), []
    round_no = 0
    while time.perf_counter() - began < seconds:
        round_no += 1
        runs = [Run(f"{round_no}.{k + 1}", work / f"run_{round_no}_{k + 1}")
                for k in range(parallel)]
        run_round(command, runs)
        for run in runs:
            print(f"run {run.name}: exit {run.returncode} after {run.seconds:.0f} s: "
                  f"{run.last_line()}", flush=True)
        done += runs
        if any(run.returncode for run in runs):
            break
    return done


def keep_failure(runs: list[Run], out: Path) -> Run | None:
    """The first failed run's log and recordings copied into ``out``; that run (None if none
    failed)."""
    failed = next((run for run in runs if run.returncode), None)
    if failed is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(failed.log, out / "hunt_failed.log")
    for recording in failed.recordings():
        shutil.copy(recording, out / recording.name)
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parallel", type=int, default=5, help="runs side by side per round")
    p.add_argument("--seconds", type=float, default=400,
                   help="start no round after this many seconds")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG ...]")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.parallel < 1:
        p.error("give the command after --, and --parallel of at least 1")
    with tempfile.TemporaryDirectory(prefix="nimble-hunt-") as work:
        runs = hunt(command, args.parallel, args.seconds, Path(work))
        failed = keep_failure(runs, Path(args.out))
        print(f"{len(runs)} runs, {sum(1 for r in runs if r.returncode)} failed"
              + (f"; run {failed.name}'s log and {len(failed.recordings())} recording(s) "
                 f"are in {args.out}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
