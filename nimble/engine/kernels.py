"""Nimble's own kernels: PTX from ``kernels/``, loaded through the driver's JIT once per prepare.

Finding a source needs no GPU; loading it does.  The folder is data, installed as
``nimble._kernels``, and holds no ``__init__.py``: a checkout's root on ``sys.path`` (pytest's,
or a script run there) would otherwise shadow the ``kernels`` distribution transformers imports
(Hugging Face's kernel hub, a dependency of transformers from 5.25).  The module handle is owned by a
:class:`~nimble.driver.Module`, which the graph that uses its functions keeps alive.
"""
from __future__ import annotations

from pathlib import Path

from .. import driver
from ..errors import NimbleError

GATHER_SOURCE = "gather_input.ptx"
GATHER_INPUT = "nimble_gather_input"  # in GATHER_SOURCE: cell, dst, nbytes
TIMESTAMP_SOURCE = "timestamp.ptx"
TIMESTAMP = "nimble_timestamp"  # in TIMESTAMP_SOURCE: slot
DELAY_SOURCE = "delay.ptx"
DELAY = "nimble_delay"  # in DELAY_SOURCE: table, slot (u32 nanoseconds per task)
PREFETCH_SOURCE = "prefetch_l2.ptx"
PREFETCH = "nimble_prefetch_l2"  # in PREFETCH_SOURCE: address, nbytes, step


def source(filename: str) -> bytes:
    """The text of ``kernels/<filename>`` from a source checkout or an installed package."""
    package = Path(__file__).resolve().parents[1]  # nimble/
    for candidate in (package.parent / "kernels" / filename, package / "_kernels" / filename):
        if candidate.is_file():
            return candidate.read_bytes()
    raise NimbleError(f"Nimble's kernel source {filename} is missing (looked in kernels/ beside "
                      "the package and in nimble/_kernels/): reinstall nimble")


def load(filename: str) -> driver.Module:
    """``kernels/<filename>`` compiled for the current GPU and loaded into the current context."""
    return driver.Module.load_data(source(filename) + b"\0", detail=filename)
