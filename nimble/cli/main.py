"""The ``nimble`` command line.

This module holds the parser and the dispatch; each command lives in its own module.
``nimble inspect`` (:mod:`~nimble.cli.inspect_graph`) is plain Python and runs anywhere.
``bench``, ``record`` and ``debug`` live in ``nimble.cli.<name>`` modules that need torch and a
GPU; they are imported only when their subcommand is run (or asked for its help), so that
``nimble --help`` and ``nimble inspect`` work on machines without either.  Results go to stdout,
progress and timings to stderr through the ``nimble`` logger (:mod:`nimble.cli.output`); every
command takes ``-q`` to silence them.

Errors the user can act on end the command with status 2 and one line on stderr: a
:class:`~nimble.errors.NimbleError` as ``nimble: <ErrorType>: <message>``, a bad file, an unknown
model or a missing package as ``nimble: <message>``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable

from .. import __version__
from ..errors import NimbleError
from . import c_runtime, inspect_graph
from .common import Fail, Parser, context_fault, one_line
from .output import logging_to_stderr

# Subcommands implemented elsewhere: name -> one-line help shown by ``nimble --help``.
_LAZY = {
    "bench": "time eager PyTorch against Nimble on a model (needs torch and a GPU)",
    "record": "record a model's GPU work into a TaskGraph file (needs torch and a GPU)",
    "debug": "debugging tools for recording and rebuilding a model (needs torch and a GPU)",
    "save": "prepare a model and save it to a file that nimble.load rebuilds elsewhere "
            "(needs torch and a GPU)",
}


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help=inspect_graph.HELP, description=inspect_graph.DESCRIPTION)
    inspect_graph.add_arguments(p)
    p.set_defaults(run=inspect_graph.run)


def _add_c_runtime(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("c-runtime", help=c_runtime.HELP, description=c_runtime.__doc__)
    c_runtime.add_arguments(p)
    p.set_defaults(run=c_runtime.run)


# ---- lazily imported subcommands ------------------------------------------------------------

def _load_lazy(name: str) -> object:
    module = f"nimble.cli.{name}"
    try:
        return importlib.import_module(module)
    # Importing these modules loads torch and CUDA libraries, which fail in many ways
    # (OSError for a missing libcuda, RuntimeError from the driver...): all mean "unavailable".
    except Exception as e:  # noqa: BLE001
        if isinstance(e, ModuleNotFoundError) and e.name == module:
            raise Fail(f"{name}: not available, this installation has no {module}") from None
        raise Fail(f"{name}: unavailable here ({one_line(e)})") from None


def _add_lazy(sub: argparse._SubParsersAction, name: str, load: bool) -> None:
    p = sub.add_parser(name, help=_LAZY[name], description=_LAZY[name])
    if load:
        module = _load_lazy(name)
        module.add_arguments(p)
        run: Callable[[argparse.Namespace], int] = module.run
        p.set_defaults(run=lambda args: int(run(args) or 0))


# ---- entry point ----------------------------------------------------------------------------

def _command_of(argv: list[str]) -> str | None:
    """The subcommand named in ``argv``: the top-level parser takes no option with a value."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(load: str | None = None) -> Parser:
    """The ``nimble`` parser; the lazy subcommand named ``load`` gets its real arguments."""
    parser = Parser(
        prog="nimble", description="Ahead-of-time scheduled, multi-stream CUDA graph execution "
                                   "for PyTorch models.")
    parser.add_argument("--version", action="version", version=f"nimble {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_inspect(sub)
    _add_c_runtime(sub)
    for name in _LAZY:
        _add_lazy(sub, name, load == name)
    return parser


def _exit_if_context_lost(status: int) -> None:
    """Leave at once where a kernel fault took the CUDA context: torch frees its tensors at
    exit, and each free on a faulted context raises in a destructor, which aborts the process
    with a C++ backtrace."""
    fault = context_fault()
    if fault:
        print(f"nimble: the CUDA context was lost to {fault}; exiting without freeing GPU "
              "memory (the driver reclaims it)", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status or 1)


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
        with logging_to_stderr(getattr(args, "quiet", False)):
            status = args.run(args)
        _exit_if_context_lost(status)
        return status
    except Fail as e:
        print(f"nimble: {e}", file=sys.stderr)
        return 2
    except NimbleError as e:
        print(f"nimble: {one_line(e)}", file=sys.stderr)
        _exit_if_context_lost(2)
        return 2
    except KeyboardInterrupt:
        print("nimble: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
