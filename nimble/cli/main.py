"""The ``nimble`` command line.

``nimble inspect`` is plain Python and runs anywhere.  ``bench``, ``record`` and ``debug`` live in
``nimble.cli.<name>`` modules that need torch and a GPU; they are imported only when their
subcommand is run (or asked for its help), so that ``nimble --help`` and ``nimble inspect`` work
on machines without either.  Results go to stdout, progress and timings to stderr.

Errors the user can act on end the command with status 2 and one line on stderr: a
:class:`~nimble.errors.NimbleError` as ``nimble: <ErrorType>: <message>``, a bad file, an unknown
model or a missing package as ``nimble: <message>``.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Callable

from .. import __version__
from ..errors import NimbleError, NoGpuError
from ..progress import say
from ..ir.taskgraph import TaskGraph

# Subcommands implemented elsewhere: name -> one-line help shown by ``nimble --help``.
_LAZY = {
    "bench": "time eager PyTorch against Nimble on a model (needs torch and a GPU)",
    "record": "record a model's GPU work into a TaskGraph file (needs torch and a GPU)",
    "debug": "debugging tools for recording and rebuilding a model (needs torch and a GPU)",
}


class _Fail(Exception):
    """A user-facing failure: its message is printed on one line and the command exits 2."""


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def _progress(args: argparse.Namespace, message: str) -> None:
    say(message, getattr(args, "quiet", False), tag=None)


# ---- inspect --------------------------------------------------------------------------------

def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect", help="summarise a recorded TaskGraph, its schedule and memory plan",
        description="Summarise a TaskGraph file (.json.gz or .json): tasks, kernels, buffers; "
                    "optionally its stream schedule and arena plan, and export them.")
    p.add_argument("path", metavar="PATH",
                   help="a TaskGraph file (.json.gz or .json), or a measured Chrome trace "
                        "(nm.trace(), nimble debug --trace) to summarise")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of the text report")
    p.add_argument("--schedule", action="store_true",
                   help="also assign streams and report the schedule")
    p.add_argument("--memplan", action="store_true",
                   help="also plan the memory arena (implies --schedule)")
    p.add_argument("--max-streams", type=_positive_int, default=None, metavar="K",
                   help="use at most K streams (default: as many as the DAG's width)")
    p.add_argument("--export", metavar="FILE", help="write the schedule and plan (nimble.plan JSON)")
    p.add_argument("--dot", metavar="FILE", help="write the task graph as Graphviz DOT")
    p.add_argument("--trace", metavar="FILE",
                   help="write a Chrome trace of the simulated multi-stream timeline")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(run=_run_inspect)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


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
        raise _Fail(f"{path}: a Chrome trace, but not a measured Nimble timeline ({e}); "
                    "simulated traces carry no measurements") from None


def _load(path: str) -> TaskGraph:
    p = Path(path)
    if not p.exists():
        raise _Fail(f"{path}: no such file")
    if p.is_dir():
        raise _Fail(f"{path}: is a directory, not a TaskGraph file")
    try:
        return TaskGraph.load(p)
    # A truncated or foreign file can fail in the gzip, JSON or row-decoding layers; all of
    # them mean the same thing to the user.
    except (OSError, EOFError, ValueError, KeyError, TypeError, IndexError) as e:
        raise _Fail(f"{path}: cannot read TaskGraph: {_one_line(e)}") from None


def _write(path: str, text: str, what: str, args: argparse.Namespace) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise _Fail(f"cannot write {what} to {path}: {_one_line(e)}") from None
    _progress(args, f"wrote {what} to {path}")


def _run_inspect(args: argparse.Namespace) -> int:
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


# ---- lazily imported subcommands ------------------------------------------------------------

def _load_lazy(name: str) -> object:
    module = f"nimble.cli.{name}"
    try:
        return importlib.import_module(module)
    # Importing these modules loads torch and CUDA libraries, which fail in many ways
    # (OSError for a missing libcuda, RuntimeError from the driver...): all mean "unavailable".
    except Exception as e:  # noqa: BLE001
        if isinstance(e, ModuleNotFoundError) and e.name == module:
            raise _Fail(f"{name}: not available, this installation has no {module}") from None
        raise _Fail(f"{name}: unavailable here ({_one_line(e)})") from None


def _add_lazy(sub: argparse._SubParsersAction, name: str, load: bool) -> None:
    p = sub.add_parser(name, help=_LAZY[name], description=_LAZY[name])
    if load:
        module = _load_lazy(name)
        module.add_arguments(p)
        run: Callable[[argparse.Namespace], int] = module.run
        p.set_defaults(run=lambda args: int(run(args) or 0))


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_models(names: list[str]) -> None:
    """Fail (one line, status 2) on an unknown model name or a zoo model missing its package."""
    from . import models

    for name in names:
        try:
            package = models.package_of(name)
        except ValueError as e:
            raise _Fail(str(e)) from None
        if package and not _installed(package):
            raise _Fail(f"{name} needs {package}, which is not installed here: "
                        f"python -m pip install 'nimble-gpu[zoo]'")


def require_gpu(command: str) -> None:
    """Raise :class:`NoGpuError` unless torch sees a CUDA GPU (``command`` names who needs it)."""
    try:
        import torch
    except ImportError as e:
        raise _Fail(f"{command}: needs torch, which is not importable here ({_one_line(e)})"
                    ) from None
    if not torch.cuda.is_available():
        raise NoGpuError(
            f"nimble {command} needs an NVIDIA GPU, and no CUDA GPU/driver is visible here "
            "(torch.cuda.is_available() is False); run it on a machine with one. "
            "`nimble inspect` works on recorded TaskGraph files without a GPU.")


# ---- entry point ----------------------------------------------------------------------------

def _command_of(argv: list[str]) -> str | None:
    """The subcommand named in ``argv``: the top-level parser takes no option with a value."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    """The ``nimble`` parser; the lazy subcommand named ``load`` gets its real arguments."""
    parser = argparse.ArgumentParser(
        prog="nimble", description="Ahead-of-time scheduled, multi-stream CUDA graph execution "
                                   "for PyTorch models.")
    parser.add_argument("--version", action="version", version=f"nimble {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_inspect(sub)
    for name in _LAZY:
        _add_lazy(sub, name, load == name)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``nimble`` command line; returns the exit status (2 on any user-facing error).

    A :class:`NimbleError` escaping a subcommand prints ``nimble: <ErrorType>: <message>`` (one
    line; the message says what to do) instead of a traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    try:
        parser = build_parser(command if command in _LAZY else None)
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help, --version and usage errors
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        return args.run(args)
    except _Fail as e:
        print(f"nimble: {e}", file=sys.stderr)
        return 2
    except NimbleError as e:
        print(f"nimble: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # Run the package's module, not this __main__ copy: the subcommands import nimble.cli.main, and
    # its error classes must be the ones main() catches.
    from nimble.cli.main import main as package_main

    raise SystemExit(package_main())
