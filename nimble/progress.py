"""Progress lines on stderr: one format for every long step (recording, preparing, benchmarks)."""
from __future__ import annotations

import sys


def say(message: str, quiet: bool = False, tag: str | None = "nimble") -> None:
    """Print ``[tag] message`` (or the bare message) to stderr unless ``quiet``."""
    if not quiet:
        print(f"[{tag}] {message}" if tag else message, file=sys.stderr, flush=True)
