"""Which dependency edges of a built graph may be programmatic (issue 53).

The rule a prepare uses (:func:`waiting_edges`): an edge ``u -> v`` into one of Nimble's own
kernels (:data:`~nimble.ir.waiting_kernels.WAITING_KERNELS`, :mod:`nimble.kernel_waits`),
which runs ``griddepcontrol.wait`` in every program before it reads anything but its weight
(or, the rotary attention, its cache) and writes nothing before it.  Its wait returns once ``u`` has ended and ``u``'s writes are
visible; ``u`` ends only after everything before it has: a full dependency ended before ``u``
began, and a programmatic one ends into a kernel of the same kind, whose every program waited
before it ended.  So after its wait ``v`` sees what it would behind a full dependency, whatever the
arena lays over what, and before it ``v`` reads only memory outside the plan that no task
writes before it (what tasks recorded after it write waits for ``v`` to end).

The rule before it (:func:`programmatic_edges`, withdrawn: :data:`WITHDRAWN`) kept the edges
the capture itself launched programmatically between Inductor's kernels:

A kernel captured behind a programmatic edge (``graph.meta["programmatic_edges"]``: Inductor's
Triton kernels under ``torch._inductor.config.triton.enable_pdl``) runs ``griddepcontrol.wait``
before its first access to what its predecessor in the capture wrote or read; before that wait
it may already run while the predecessor finishes.  A built edge ``u -> v`` keeps that overlap
only where it stays as safe as in the capture:

- ``u -> v`` was itself a programmatic edge of the capture: ``v``'s wait covers ``u`` and no
  other task (an edge from another predecessor stays a full dependency);
- both are kernels;
- the arena lets no buffer that ``u`` touches share a byte with a different buffer that ``v``
  touches.  The capture's allocations never overlapped while both were live; the memory plan
  may put a buffer ``v`` writes over one ``u`` reads, trusting the edge between them to order the
  two, and ``v``'s code knows nothing of it, so it would write before its wait.

Buffers outside the arena (weights, external memory) keep their recorded addresses: sharing
one of those is sharing it as the capture did.  Numpy-free and GPU-free: plain Python on the
TaskGraph.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from ..ir.taskgraph import TaskGraph, TaskKind
from ..ir.waiting_kernels import may_be_programmatic, writers
from .memplan import MemPlan, plan_memory
from .plan_check import check_plan

#: Why the recorded rule (:func:`programmatic_edges`) is withdrawn: it kept an edge whose two
#: kernels the capture itself launched so, trusting the dependent's own wait; graphs built with
#: it raced (docs/findings.md), and which edge broke, and how, is not known.  Kept for the
#: experiment that brings it back (tools/experiments/programmatic_race.py); a prepare uses
#: :func:`waiting_edges`.
WITHDRAWN = (
    "the capture's own programmatic edges between Inductor's kernels are withdrawn: graphs "
    "built with them gave wrong outputs (their proof failed in 19 of 24 prepares) while another "
    "process kept the GPU busy, so a proof on an idle GPU cannot vouch for them "
    "(docs/findings.md, \"Programmatic edges raced on a busy GPU\")")

#: ``graph.meta``'s key for the capture's programmatic edges, ``[u, v]`` task ids.
META_KEY = "programmatic_edges"


def waiting_edges(graph: TaskGraph, edges: Iterable[tuple[int, int]]) -> frozenset[tuple[int, int]]:
    """The edges of ``edges`` (the built graph's dependencies) that may be programmatic under
    the module docstring's rule (:func:`~nimble.ir.waiting_kernels.may_be_programmatic`), one
    such edge a kernel (from the predecessor recorded last, the likeliest to end last)."""
    written = writers(graph)
    into: dict[int, int] = {}
    for u, v in edges:
        if may_be_programmatic(graph, u, v, written):
            into[v] = max(u, into.get(v, -1))
    return frozenset((u, v) for v, u in into.items())


def recorded_pairs(graph: TaskGraph) -> set[tuple[int, int]]:
    """The capture's programmatic edges as ``(u, v)`` task ids."""
    return {(int(u), int(v)) for u, v in graph.meta.get(META_KEY, ())}


def _arena_ranges(graph: TaskGraph, offsets: Mapping[int, int], task: int
                  ) -> list[tuple[int, int, int]]:
    """``(buffer, start, end)`` arena byte ranges of the planned buffers ``task`` touches."""
    touched = {a.buffer for a in graph.tasks[task].accesses}
    return [(b, offsets[b], offsets[b] + graph.buffers[b].size) for b in sorted(touched)
            if b in offsets]


def shares_other_bytes(graph: TaskGraph, offsets: Mapping[int, int], u: int, v: int) -> bool:
    """Whether a planned buffer of task ``u`` and a different planned buffer of task ``v``
    overlap in the arena (``offsets``: the memory plan's, buffer id to arena offset)."""
    mine = _arena_ranges(graph, offsets, u)
    return any(bu != bv and su < ev and sv < eu
               for bu, su, eu in mine for bv, sv, ev in _arena_ranges(graph, offsets, v))


def programmatic_edges(graph: TaskGraph, edges: Iterable[tuple[int, int]],
                       offsets: Mapping[int, int]) -> frozenset[tuple[int, int]]:
    """The edges of ``edges`` (the built graph's dependencies) that may be programmatic: see the
    module docstring.  Empty for a capture without programmatic edges."""
    return frozenset((u, v) for u, v in candidate_edges(graph, edges)
                     if not shares_other_bytes(graph, offsets, u, v))


def candidate_edges(graph: TaskGraph, edges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The edges of ``edges`` the capture had programmatic, between two kernels: those
    :func:`programmatic_edges` then keeps where the arena lets them."""
    recorded = recorded_pairs(graph)
    tasks: Sequence = graph.tasks
    return sorted((u, v) for u, v in edges if (u, v) in recorded
                  and tasks[u].kind == TaskKind.KERNEL and tasks[v].kind == TaskKind.KERNEL)


def plan_apart(graph: TaskGraph, edges: Sequence[tuple[int, int]], plan: MemPlan,
               limit: int | None) -> MemPlan:
    """``plan``, or a plan of the same edges that lays no buffer of one end of a
    :func:`candidate_edges` pair over another buffer of the other (the memory plan's usual
    ping-pong of a chain, an output over the input its predecessor read, would keep most of a
    decoder's pairs full dependencies) where that fits ``limit`` (bytes; None: any), checked.
    The arena grows by what the pairs can no longer share."""
    pairs = candidate_edges(graph, edges)
    if not pairs:
        return plan
    apart = plan_memory(graph, edges, plan.alignment, overlapping=pairs)
    if limit is not None and apart.arena_bytes > max(limit, plan.arena_bytes):
        return plan
    check_plan(graph, edges, apart)
    return apart
