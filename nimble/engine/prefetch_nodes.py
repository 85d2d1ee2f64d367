"""Weight prefetch nodes in a built graph (issue 53): ``nimble_prefetch_l2`` kernels
(``kernels/prefetch_l2.ptx``) that ask the L2 for a window of weights beside the schedule's
kernels.  :mod:`nimble.engine.prefetch` plans and measures them; :func:`add_prefetch_nodes` is
what :func:`nimble.engine.build.build_graph` adds for a :class:`~nimble.engine.build.GraphSpec`'s
``prefetch``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .. import driver
from ..analysis.prefetch import Prefetch, merged_ranges


#: Threads per block of a prefetch node, and the most blocks one takes: a handful of SMs ask
#: for a window while the chain's kernels keep the others.
PREFETCH_BLOCK = 256
PREFETCH_MAX_BLOCKS = 32
#: Bytes between two requests of one thread: an L2 sector, so no sector of a range is skipped
#: whatever line size the L2 fetches.
PREFETCH_STEP = 32


def prefetch_grid(nbytes: int) -> int:
    """Blocks for one range: a request per :data:`PREFETCH_STEP` bytes a thread, grid-stride
    beyond the cap."""
    return max(1, min(PREFETCH_MAX_BLOCKS, -(-nbytes // (PREFETCH_STEP * PREFETCH_BLOCK))))


@dataclass(frozen=True)
class PrefetchNode:
    """One prefetch node of a built graph: its range, and the buffers the range covers (a
    re-pointed weight turns the node off: :func:`turn_off_moved`)."""

    node: object
    address: int
    nbytes: int
    buffers: frozenset[int]


def add_prefetch_nodes(handle, function, prefetches: Sequence[Prefetch], bases: Sequence[int],
                       node_of: Callable[[int], object], roots: list,
                       priority: int | None) -> list[PrefetchNode]:
    """Each prefetch's merged ranges as nodes of the graph ``handle`` after its anchor's node
    (``node_of(task)``; ``roots``, the graph's first nodes, for a prefetch at the start); a
    prefetch whose anchor has no node in this build (a step-through's subset) is left out."""
    out = []
    for prefetch in prefetches:
        anchor = roots if prefetch.after is None else [node_of(prefetch.after)]
        if any(a is None for a in anchor):
            continue
        for address, nbytes in merged_ranges(prefetch, bases):
            node = driver.add_function_node(
                handle, list(anchor), function, (prefetch_grid(nbytes), 1, 1),
                (PREFETCH_BLOCK, 1, 1), (address, nbytes, PREFETCH_STEP), detail="prefetch")
            if priority is not None:
                driver.set_kernel_priority(node, priority)
            covered = frozenset(r.buffer for r in prefetch.ranges
                                if address <= bases[r.buffer] + r.offset < address + nbytes)
            out.append(PrefetchNode(node, address, nbytes, covered))
    return out


def turn_off_moved(exec_handle, nodes: Sequence[PrefetchNode], moved: set[int]) -> int:
    """Give every prefetch node over a buffer in ``moved`` (weights re-pointed to other
    storage) an empty range, in the instantiated graph: it would ask for the old storage.
    Returns how many were turned off."""
    off = 0
    for p in nodes:
        if p.buffers & moved:
            block = b"".join(v.to_bytes(8, "little") for v in (p.address, 0, PREFETCH_STEP))
            driver.set_exec_kernel_arguments(exec_handle, p.node, block,
                                             [(0, 8), (8, 8), (16, 8)], False,
                                             detail="prefetch turned off")
            off += 1
    return off
