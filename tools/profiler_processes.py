"""The speed after a profiler run, in several fresh processes per model (issue 50): how much
slower each kind of graph runs once ``torch.profiler`` has run in its process.

    python3 tools/profiler_processes.py MODEL [MODEL ...] [--dtype float16] [--processes 3]
        [--rounds 5] [--iters 50] [--limit 1.03] [--json F]

Each process is one ``nimble bench --profiler MODEL --dtype D`` (:mod:`nimble.cli.profiler_bench`:
the same objects timed before and after one profiler run, and fresh ones prepared after it).
Per model and mode it prints the after/before ratio's median over the processes, with its
min-max, and the prepared-after ratio likewise, and flags a median past ``--limit`` (the issue's
3%).  The processes run one after another on one GPU: the ratios compare within a process, and
the processes say how much they move between processes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from gpu_suite import NO_MULTICAST  # tools/ is a script's first path entry

ROOT = Path(__file__).resolve().parent.parent
RATIOS = ("after_over_before", "prepared_after_over_before")


def one_process(model: str, args, folder: Path, k: int) -> dict:
    """One fresh process's ``modes`` (per mode its ratios), or ``{"failed": why}``."""
    out = folder / f"{model}-{k}.json"
    cmd = [sys.executable, "-m", "nimble", "bench", "--profiler", model, "--dtype", args.dtype,
           "--rounds", str(args.rounds), "--iters", str(args.iters), "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **NO_MULTICAST}, timeout=1800)
    if done.returncode != 0 or not out.exists():
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        return {"failed": f"exit status {done.returncode}: {last[-300:]}"}
    results = json.loads(out.read_text()).get("results") or []
    return {"modes": results[0]["modes"]} if results else {"failed": "no result"}


def summarize(runs: list[dict], limit: float) -> dict:
    """Per mode, each ratio's median, min and max over the processes that ran, and whether the
    median is within ``limit``."""
    ran = [r["modes"] for r in runs if "modes" in r]
    rows: dict = {}
    for mode in (ran[0] if ran else {}):
        row = rows[mode] = {}
        for ratio in RATIOS:
            values = [m[mode][ratio] for m in ran if mode in m]
            row[ratio] = {"median": statistics.median(values), "min": min(values),
                          "max": max(values)}
        row["within_limit"] = row["after_over_before"]["median"] <= limit
    return {"processes": len(ran), "failed": [r["failed"] for r in runs if "failed" in r],
            "modes": rows}


def report(model: str, summary: dict, limit: float) -> str:
    lines = [f"{model}: {summary['processes']} process(es)"
             + (f", {len(summary['failed'])} failed: {summary['failed'][0]}"
                if summary["failed"] else "")]
    for mode, row in summary["modes"].items():
        a, p = row["after_over_before"], row["prepared_after_over_before"]
        flag = "" if row["within_limit"] else f"  (past {limit:.2f})"
        lines.append(f"  {mode}: after/before {a['median']:.3f} ({a['min']:.3f}-{a['max']:.3f}), "
                     f"prepared after/before {p['median']:.3f} ({p['min']:.3f}-{p['max']:.3f})"
                     + flag)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--processes", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--limit", type=float, default=1.03)
    p.add_argument("--json")
    args = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            runs = [one_process(model, args, Path(tmp), k) for k in range(args.processes)]
            results[model] = summarize(runs, args.limit)
            print(report(model, results[model], args.limit), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(s["processes"] for s in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
