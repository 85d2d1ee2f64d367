"""The byte alignment every buffer keeps, and the round-up to it."""
from __future__ import annotations

#: PyTorch's caching allocator hands out blocks rounded up to this many bytes, so recorded
#: kernels may rely on it (and libraries use the slack past a requested size); the arena plan
#: gives every buffer an offset that keeps it.
ALIGNMENT = 512


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """The smallest multiple of ``alignment`` that is at least ``n``."""
    return -(-n // alignment) * alignment
