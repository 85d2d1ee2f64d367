"""``nimble inspect``: summarise a recorded TaskGraph (its schedule and memory plan on demand),
or a measured Chrome trace; plain Python, no torch or GPU needed."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..ir.taskgraph import TaskGraph
from ..progress import say
from .common import Fail, one_line, positive_int

#: ``nimble --help``'s line for the command.
HELP = "summarise a recorded TaskGraph, its schedule and memory plan"
DESCRIPTION = ("Summarise a TaskGraph file (.json.gz or .json): tasks, kernels, buffers; "
               "optionally its stream schedule and arena plan, and export them.")


def _progress(args: argparse.Namespace, message: str) -> None:
    say(message, getattr(args, "quiet", False), tag=None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH",
                   help="a TaskGraph file (.json.gz or .json), or a measured Chrome trace "
                        "(nm.trace(), nimble debug --trace) to summarise")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of the text report")
    p.add_argument("--schedule", action="store_true",
                   help="also assign streams and report the schedule")
    p.add_argument("--memplan", action="store_true",
                   help="also plan the memory arena (implies --schedule)")
    p.add_argument("--max-streams", type=positive_int, default=None, metavar="K",
                   help="use at most K streams (default: as many as the DAG's width)")
    p.add_argument("--export", metavar="FILE", help="write the schedule and plan (nimble.plan JSON)")
    p.add_argument("--dot", metavar="FILE", help="write the task graph as Graphviz DOT")
    p.add_argument("--trace", metavar="FILE",
                   help="write a Chrome trace of the simulated multi-stream timeline")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def _load_timeline(path: str):
    """The measured timeline in a Chrome trace written by Nimble, or None for other files."""
    p = Path(path)
    if not p.is_file() or p.suffix != ".json":
        return None
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "traceEvents" not in data:
        return None
    from ..debug.timeline import Timeline

    try:
        return Timeline.from_chrome(data)
    except (ValueError, KeyError, TypeError) as e:
        raise Fail(f"{path}: a Chrome trace, but not a measured Nimble timeline ({e}); "
                   "simulated traces carry no measurements") from None


def _load(path: str) -> TaskGraph:
    p = Path(path)
    if not p.exists():
        raise Fail(f"{path}: no such file")
    if p.is_dir():
        raise Fail(f"{path}: is a directory, not a TaskGraph file")
    try:
        return TaskGraph.load(p)
    # A truncated or foreign file can fail in the gzip, JSON or row-decoding layers; all of
    # them mean the same thing to the user.
    except (OSError, EOFError, ValueError, KeyError, TypeError, IndexError) as e:
        raise Fail(f"{path}: cannot read TaskGraph: {one_line(e)}") from None


def _write(path: str, text: str, what: str, args: argparse.Namespace) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise Fail(f"cannot write {what} to {path}: {one_line(e)}") from None
    _progress(args, f"wrote {what} to {path}")


def run(args: argparse.Namespace) -> int:
    # Imported here so that ``nimble --help`` does not pay for the analysis modules.
    from ..analysis import report as ins

    start = time.perf_counter()
    timeline = _load_timeline(args.path)
    if timeline is not None:  # a measured trace (nm.trace(), nimble debug --trace)
        from ..debug.timeline import format_timeline

        summary = timeline.summary()
        if args.json:
            print(json.dumps(summary, indent=2, default=str))
        else:
            sys.stdout.write(format_timeline(summary))
        return 0
    graph = _load(args.path)
    _progress(args, f"loaded {args.path}: {len(graph.tasks)} tasks, {len(graph.buffers)} "
                    f"buffers in {time.perf_counter() - start:.2f} s")
    summary = ins.summarize(graph)
    want_schedule = args.schedule or args.memplan
    want_plan = args.memplan or args.export is not None
    analysis = None
    if want_schedule or want_plan or args.trace or args.dot:
        analysis = ins.analyze(graph, args.max_streams, memplan=want_plan)
        _progress(args, f"scheduled in {analysis.seconds:.2f} s"
                  + (f", planned memory in {analysis.plan_seconds:.2f} s" if want_plan else ""))
    sched = ins.schedule_summary(graph, analysis=analysis) if want_schedule else None
    mem = ins.memplan_summary(graph, analysis=analysis) if args.memplan else None

    if args.export:
        plan = ins.export_plan(graph, analysis.schedule, analysis.plan)
        _write(args.export, json.dumps(plan, separators=(",", ":")) + "\n", "plan", args)
    if args.dot:
        _write(args.dot, ins.to_dot(graph, analysis.schedule), "DOT graph", args)
    if args.trace:
        trace = ins.to_chrome_trace(graph, analysis.schedule)
        _write(args.trace, json.dumps(trace, separators=(",", ":")) + "\n", "Chrome trace", args)

    if args.json:
        result = {**summary, **(sched or {}), **(mem or {})}
        # ``default=str`` because a live recording's meta may hold objects that are not JSON.
        print(json.dumps(result, indent=2, default=str))
    else:
        sys.stdout.write(ins.format_summary(summary, sched, mem))
    return 0
