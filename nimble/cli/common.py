"""What every ``nimble`` command shares: the one-line failure, argument types, and the checks
made before any work (the models known, a GPU to run on, then their packages installed)."""
from __future__ import annotations

from ..errors import NimbleError

import argparse
import importlib.util
import sys

from . import models
from ..driver import gpu


class Fail(NimbleError):
    """A user-facing failure of the command line: its message is printed on one line (without
    a type name) and the command exits 2."""


def one_line(e: BaseException) -> str:
    """``<ErrorType>: <message>`` with the message's line breaks and runs of spaces folded."""
    return " ".join(f"{type(e).__name__}: {e}".split())


def positive_int(text: str) -> int:
    """An argument type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def positive_ints(text: str, example: str, allow_none: bool = False) -> list[int]:
    """Comma-separated positive ints, in the order given, no repeats (``example`` shows the
    syntax in the error); an empty list only where ``allow_none``."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = None
    if values is None or (not values and not allow_none) or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give {example}")
    return list(dict.fromkeys(values))


def names_from(choices, text: str) -> list[str]:
    """The body of an argument type: comma-separated names from ``choices``, in the order
    given, no repeats."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in choices]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad) or repr(text)}: choose from {', '.join(choices)}, comma-separated")
    return list(dict.fromkeys(names))


def parse_batches(text: str) -> list[int]:
    """``--batch``: comma-separated positive ints, in the order given, no repeats."""
    return positive_ints(text, "batch sizes like 32 or 32,64,128")


def parse_stream_caps(text: str) -> list[int]:
    """``bench --max-streams``: the stream caps to try, like ``--batch``; '' for none."""
    return positive_ints(text, "stream caps like 4 or 2,4,8 ('' for none)", allow_none=True)


def parse_one_batch(text: str) -> int:
    """``--batch`` of a command that runs one batch size: :func:`parse_batches`'s syntax and
    checks, one value."""
    values = parse_batches(text)
    if len(values) > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: this command takes one batch size, like 32")
    return values[0]


def add_batch_argument(p: argparse.ArgumentParser, several: bool, default: str) -> None:
    """``--batch``, the same syntax in every command: a list where several make sense."""
    if several:
        p.add_argument("--batch", dest="batches", type=parse_batches, default=None,
                       metavar="B,B,...", help=f"batch sizes, comma-separated (default {default})")
    else:
        p.add_argument("--batch", type=parse_one_batch, default=1, metavar="B",
                       help=f"batch size (default {default})")


def add_quiet_argument(p: argparse.ArgumentParser) -> None:
    """``-q``, the same in every command: the ``nimble`` logger's progress silenced."""
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def add_stream_cap_argument(p: argparse.ArgumentParser) -> None:
    """``--max-streams K`` of a command that builds one schedule (``bench`` tries a list)."""
    p.add_argument("--max-streams", type=positive_int, default=None, metavar="K",
                   help="use at most K streams (default: as many as the DAG's width)")


def model_help(what: str) -> str:
    """The help of a MODEL argument: ``what`` it is, then every model a command can run."""
    return (f"{what}: the built-in {models.BUILTIN} or {models.CHAINS}, or a zoo model "
            f"({', '.join(models.ZOO)}; pip install 'nimble-gpu[zoo]')")


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line: ``nimble: <command>: <message>``."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        command = self.prog.removeprefix("nimble").strip()
        self.exit(2, f"nimble: {command + ': ' if command else ''}{message} "
                     f"(see {self.prog} --help)\n")


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_models(names: list[str], command: str) -> None:
    """Before any work of ``nimble <command>`` on the models ``names``, fail (one line, status
    2) on the first of: an unknown model name, no GPU (:func:`require_gpu`: on a machine
    without one, nothing else it lacks matters), a zoo model missing its package."""
    packages = {}
    for name in names:
        try:
            packages[name] = models.package_of(name)
        except ValueError as e:
            raise Fail(str(e)) from None
    require_gpu(command)
    for name, package in packages.items():
        if package and not _installed(package):
            raise Fail(f"{name} needs {package}, which is not installed here: "
                       f"python -m pip install 'nimble-gpu[zoo]'")


def require_gpu(command: str) -> None:
    """Raise :class:`~nimble.errors.NoGpuError` unless torch sees a CUDA GPU; ``command`` is
    the subcommand that needs it."""
    gpu.require_gpu(f"nimble {command}")


def context_fault() -> str | None:
    """The ``CUDA_ERROR_*`` fault that left this process's CUDA context unusable, or None
    (also where torch never touched the GPU)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    from ..driver import context_fault as fault_of_context

    return fault_of_context()
