"""``nimble inspect``: summarise any file Nimble writes; plain Python, no torch or GPU needed.

A TaskGraph gets its summary and, on demand, its stream schedule and arena plan, with their
exports (plan, DOT, simulated trace); a saved graph (:mod:`nimble.cli.inspect_saved`), a plan
export, a simulated trace and a measured trace each get their own summary.  Options that do not apply to the file given are an error.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

from ..progress import say
from .common import Fail, add_quiet_argument, add_stream_cap_argument
from .output import STDOUT, Outputs, outputs

if TYPE_CHECKING:
    from .inspect_files import NimbleFile

#: ``nimble --help``'s line for the command.
HELP = ("summarise a file Nimble wrote: a TaskGraph (its schedule and memory plan), a saved "
        "graph, a plan, a trace")
DESCRIPTION = ("Summarise a TaskGraph file (.json.gz or .json): tasks, kernels, buffers; "
               "optionally its stream schedule and arena plan, and export them.  Also reads the "
               "files Nimble writes besides: a saved graph (nm.save, nimble save: its GPU, "
               "buckets, kernels and weights), a plan export (--export), a simulated trace "
               "(--simulated-trace) and a measured trace (nm.trace(), nimble debug --trace).  "
               "Every output FILE may be '-' for stdout; the text report then goes to stderr.")

#: The options that only a TaskGraph takes, by attribute -> as the user writes it.
_GRAPH_ONLY = {"schedule": "--schedule", "memplan": "--memplan", "max_streams": "--max-streams",
               "export": "--export", "dot": "--dot", "simulated_trace": "--simulated-trace"}


class _Renamed(argparse.Action):
    """An old option spelling that now fails and names the new one."""

    def __init__(self, option_strings, dest, new: str, **kwargs) -> None:
        self.new = new
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is now {self.new}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Optional to argparse only so that a PATH taken by --json gets its own message (run).
    p.add_argument("path", metavar="PATH", nargs="?",
                   help="a TaskGraph file (.json.gz or .json), a saved graph (.nimble), a plan "
                        "export, or a simulated or measured Chrome trace")
    p.add_argument("--json", nargs="?", const=STDOUT, default=None, metavar="FILE",
                   help="write the report as one JSON object to FILE ('-' or no FILE: stdout, "
                        "instead of the text report)")
    p.add_argument("--schedule", action="store_true",
                   help="also assign streams and report the schedule")
    p.add_argument("--memplan", action="store_true",
                   help="also plan the memory arena (implies --schedule)")
    add_stream_cap_argument(p)
    p.add_argument("--export", metavar="FILE",
                   help="write the schedule and plan (nimble.plan JSON)")
    p.add_argument("--dot", metavar="FILE", help="write the task graph as Graphviz DOT")
    p.add_argument("--simulated-trace", metavar="FILE",
                   help="write a Chrome trace of the simulated multi-stream timeline (recorded "
                        "task durations, not a measurement: nimble debug --trace measures)")
    p.add_argument("--trace", nargs="?", action=_Renamed,
                   new="--simulated-trace FILE (a simulated timeline; nimble debug --trace "
                       "measures one)")
    add_quiet_argument(p)


def _refuse_options_for(file: NimbleFile, args: argparse.Namespace) -> None:
    given = [flag for name, flag in _GRAPH_ONLY.items() if getattr(args, name) not in (None, False)]
    if given:
        raise Fail(f"{file.path}: a {file.kind.value}; {', '.join(given)} "
                   f"appl{'ies' if len(given) == 1 else 'y'} to a TaskGraph only")


def _report(args: argparse.Namespace, out: Outputs, data: dict, text: str) -> None:
    """The report as JSON with ``--json``, and as text unless the JSON took stdout."""
    if args.json is not None:
        out.write_json("--json", data, "JSON report")
    if args.json != STDOUT:
        out.report.write(text)


def _report_other(file: NimbleFile, args: argparse.Namespace, out: Outputs) -> None:
    """The summary of a plan export or a trace."""
    from .inspect_files import FileKind, plan_summary, simulated_trace_summary
    if file.kind is FileKind.MEASURED_TRACE:
        from ..debug.timeline import Timeline, format_timeline
        from ..ir.json_fields import FieldError

        try:
            summary = Timeline.from_chrome(file.data).summary()
        except FieldError as e:  # a field of the wrong type, named
            raise Fail(f"{file.path}: a measured trace that does not decode ({e}); the file "
                       "is damaged, trace the run again") from None
        except (AttributeError, KeyError, TypeError, ValueError, IndexError):
            raise Fail(f"{file.path}: a measured trace that does not decode; the file is "
                       "damaged, trace the run again") from None
        text = f"{file.path}: measured trace\n" + format_timeline(summary)
    elif file.kind is FileKind.PLAN:
        summary = plan_summary(file)
        text = (f"{file.path}: plan export (nimble.plan) of {summary['model'] or 'a model'}\n"
                f"  tasks: {summary['tasks']}, streams: {summary['streams']}, "
                f"syncs: {summary['sync_edges']}, edges: {summary['edges']}"
                + (f", phases: {summary['phases']}" if summary["phases"] else "")
                + f"\n  arena: {summary['arena_bytes'] / 2**20:.1f} MiB for "
                f"{summary['buffers_placed']} buffers\n")
    else:
        summary = simulated_trace_summary(file)
        text = (f"{file.path}: simulated trace (the schedule run on recorded task durations, "
                f"not a measurement) of {summary['model'] or 'a model'}\n"
                f"  tasks: {summary['tasks']}, streams: {summary['streams']}, "
                f"syncs: {summary['sync_edges']}, simulated makespan: "
                f"{summary['simulated_us']:.1f} µs\n")
    _report(args, out, summary, text)


def _report_graph(file: NimbleFile, args: argparse.Namespace, out: Outputs,
                  start: float) -> None:
    from ..analysis import report as ins
    from .inspect_files import taskgraph_of

    graph = taskgraph_of(file)
    say(f"loaded {args.path}: {len(graph.tasks)} tasks, {len(graph.buffers)} buffers in "
        f"{time.perf_counter() - start:.2f} s", tag=None)
    summary = {**ins.summarize(graph), "outside_arena": _outside_arena(graph)}
    want_schedule = args.schedule or args.memplan
    want_plan = args.memplan or args.export is not None
    analysis = None
    if want_schedule or want_plan or args.simulated_trace or args.dot:
        analysis = ins.analyze(graph, args.max_streams, memplan=want_plan)
        say(f"scheduled in {analysis.seconds:.2f} s"
            + (f", planned memory in {analysis.plan_seconds:.2f} s" if want_plan else ""),
            tag=None)
    sched = ins.schedule_summary(graph, analysis=analysis) if want_schedule else None
    mem = ins.memplan_summary(graph, analysis=analysis) if args.memplan else None

    if args.export:
        plan = ins.export_plan(graph, analysis.schedule, analysis.plan)
        out.write("--export", json.dumps(plan, separators=(",", ":")) + "\n", "plan")
    if args.dot:
        out.write("--dot", ins.to_dot(graph, analysis.schedule), "DOT graph")
    if args.simulated_trace:
        trace = ins.to_chrome_trace(graph, analysis.schedule)
        out.write("--simulated-trace", json.dumps(trace, separators=(",", ":")) + "\n",
                  "simulated Chrome trace")
    _report(args, out, {**summary, **(sched or {}), **(mem or {})},
            ins.format_summary(summary, sched, mem))


def _outside_arena(graph) -> dict:
    """The memory a prepared graph of ``graph`` keeps beside its arena's plan: its private
    copies of library memory, and the buffers kept at their recorded low 32 address bits (a
    kernel word into each may be an integer under a stale top half)."""
    from ..engine.arena_layout import low_word_buffers, written_externals

    def row(bid: int) -> dict:
        b = graph.buffers[bid]
        return {"buffer": bid, "kind": b.kind, "name": b.name, "bytes": b.size,
                "address": hex(b.address)}
    return {"private_copies": [row(b) for b in written_externals(graph)],
            "low_bits": [row(b) for b in low_word_buffers(graph)]}


def _require_path(args: argparse.Namespace) -> None:
    if args.path is not None:
        return
    if args.json not in (None, STDOUT):
        raise Fail(f"inspect: no PATH to read; --json took {args.json!r} as the FILE to write: "
                   "put --json after PATH, or write --json - for stdout")
    raise Fail("inspect: give the PATH of a file to read (see nimble inspect --help)")


def run(args: argparse.Namespace) -> int:
    # Imported here so that ``nimble --help`` does not pay for the analysis modules.
    from .inspect_files import FileKind, read_nimble_file

    _require_path(args)
    start = time.perf_counter()
    out = outputs(args, "json", "export", "dot", "simulated_trace")
    file = read_nimble_file(args.path)
    if file.kind is FileKind.TASKGRAPH:
        _report_graph(file, args, out, start)
    elif file.kind is FileKind.SAVED:
        from .inspect_saved import format_saved, saved_summary

        _refuse_options_for(file, args)
        summary = saved_summary(file.path)
        _report(args, out, summary, format_saved(file.path, summary))
    else:
        _refuse_options_for(file, args)
        _report_other(file, args, out)
    return 0
