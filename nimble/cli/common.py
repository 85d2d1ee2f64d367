"""What every ``nimble`` command shares: the one-line failure, argument types, and the checks
made before any work (the models known and installed, a GPU to run on)."""
from __future__ import annotations

from ..errors import NimbleError

import argparse
import importlib.util

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


def parse_batches(text: str) -> list[int]:
    """``--batch``: comma-separated positive ints, in the order given, no repeats."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give batch sizes like 32 or 32,64,128")
    return list(dict.fromkeys(values))


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_models(names: list[str]) -> None:
    """Fail (one line, status 2) on an unknown model name or a zoo model missing its package."""
    for name in names:
        try:
            package = models.package_of(name)
        except ValueError as e:
            raise Fail(str(e)) from None
        if package and not _installed(package):
            raise Fail(f"{name} needs {package}, which is not installed here: "
                       f"python -m pip install 'nimble-gpu[zoo]'")


def require_gpu(command: str) -> None:
    """Raise :class:`~nimble.errors.NoGpuError` unless torch sees a CUDA GPU; ``command`` is
    the subcommand that needs it."""
    gpu.require_gpu(f"nimble {command}")
