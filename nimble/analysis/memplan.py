"""Static memory planning: every relocatable buffer gets a fixed offset in one arena.

The rebuilt graph runs tasks concurrently on several streams, so two buffers may share bytes only
if *every* access of one happens-before *every* access of the other in the transitive closure of
the executed graph's edges.  Recorded order is not enough: tasks on parallel branches are
unordered even when their recorded lifetimes are disjoint.

The host takes part at both ends.  An INPUT buffer is written by the host before the graph starts
(a virtual *source* task that precedes every task), an OUTPUT buffer is read by the host after it
ends (a virtual *sink* task that follows every task).  So nothing may precede an input and nothing
may follow an output.  Inputs and outputs never share bytes at all: the engine copies the next
call's inputs into the arena while the caller may still hold, or even pass in, the previous
call's outputs, and a copy between overlapping ranges is undefined.

Task sets are handled as reachability bitsets over ``n + 2`` positions: tasks ``0..n-1``, the
sink at ``n`` and the source at ``n + 1``.  ``plan_memory`` and ``check_plan`` (in
:mod:`nimble.analysis.plan_check`) compute reachability separately (numpy rows and Python ints) so that the
checker does not inherit the planner's mistakes.

``check_plan`` also checks the edges themselves, on every buffer whatever its kind (parameters and
external memory included, which the plan does not move): two accesses of overlapping bytes, at
least one a write, must come from tasks a path of edges orders.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from .deps import Dag, dag_from_edges
from ..ir.alignment import ALIGNMENT, align_up
from ..ir.taskgraph import BufferKind, TaskGraph
from ..errors import NimbleError


class MemPlanError(NimbleError, ValueError):
    """A memory plan that is malformed or lets two live byte ranges collide."""


@dataclass(slots=True)
class MemPlan:
    """Arena offsets for the relocatable buffers of one TaskGraph.

    ``buffer_bytes`` is what the arena would take with no reuse at all; ``lower_bound_bytes`` is
    the peak of live bytes in recorded order (see :func:`lower_bound_bytes`), which no plan that
    shares whole buffers only can beat.
    """

    offsets: dict[int, int]
    arena_bytes: int
    buffer_bytes: int
    lower_bound_bytes: int
    alignment: int

    def address_of(self, buffer_id: int, arena_base: int) -> int:
        """The device address of ``buffer_id`` in an arena allocated at ``arena_base``."""
        try:
            return arena_base + self.offsets[buffer_id]
        except KeyError:
            raise KeyError(f"buffer {buffer_id} has no arena offset: only relocatable buffers "
                           f"(input, output, intermediate, scratch) are planned") from None


def _planned(graph: TaskGraph) -> list[int]:
    return [b.id for b in graph.buffers if b.kind in BufferKind.RELOCATABLE]


def _edge_dag(n: int, edges: Iterable[tuple[int, int]]) -> Dag:
    # Reachability is built in one backward pass over the ids, which needs every edge forward.
    return dag_from_edges(n, edges, MemPlanError)


def _task_sets(graph: TaskGraph) -> dict[int, set[int]]:
    """Positions (tasks, sink ``n``, source ``n + 1``) that access each relocatable buffer.

    Zero-byte accesses count too: the planner errs on the side of keeping buffers apart.
    """
    n = len(graph.tasks)
    sets: dict[int, set[int]] = {bid: set() for bid in _planned(graph)}
    for t in graph.tasks:
        for a in t.accesses:
            if a.buffer in sets:
                sets[a.buffer].add(t.id)
    for b in graph.buffers:
        if b.id in sets:
            if b.kind == BufferKind.INPUT:
                sets[b.id].add(n + 1)
            elif b.kind == BufferKind.OUTPUT:
                sets[b.id].add(n)
    return sets


def lower_bound_bytes(graph: TaskGraph, alignment: int = ALIGNMENT) -> int:
    """Peak over recorded time of the aligned sizes of live relocatable buffers.

    A buffer is live from its first accessing task to its last; inputs from before the first task,
    outputs until after the last.  Two buffers live at the same point can never share bytes (their
    accesses interleave in recorded order, and any happens-before order is a sub-order of it), so
    every plan that shares whole buffers only (as :func:`plan_memory` does) needs at least this
    much, whatever the edges: it is what a single-stream allocator could reach.  Zero-byte
    accesses touch nothing and do not count.
    """
    n = len(graph.tasks)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for t in graph.tasks:
        for a in t.accesses:
            if a.size > 0:
                first.setdefault(a.buffer, t.id)
                last[a.buffer] = t.id
    # Time points -1 (host writes inputs) .. n (host reads outputs), shifted by one.
    delta = np.zeros(n + 3, dtype=np.int64)
    for b in graph.buffers:
        if b.kind not in BufferKind.RELOCATABLE:
            continue
        lo, hi = first.get(b.id), last.get(b.id)
        if b.kind == BufferKind.INPUT:
            lo, hi = -1, (-1 if hi is None else hi)
        if b.kind == BufferKind.OUTPUT:
            lo, hi = (n if lo is None else lo), n
        if lo is None:
            continue  # never touched: occupies nothing at any point
        size = align_up(b.size, alignment)
        delta[lo + 1] += size
        delta[hi + 2] -= size
    return int(np.cumsum(delta).max(initial=0))


# ---- planning -------------------------------------------------------------------------------

def _strict_reach_rows(dag: Dag) -> np.ndarray:
    """Packed rows (``bitorder='little'``): row ``p`` holds the positions strictly after ``p``."""
    n, succs = dag.n, dag.succs
    width = n + 2
    nbytes = (width + 7) // 8
    strict = np.zeros((width, nbytes), dtype=np.uint8)
    closed = np.zeros((width, nbytes), dtype=np.uint8)  # strict plus the position itself
    sink_byte, sink_bit = n >> 3, np.uint8(1 << (n & 7))
    for t in range(n - 1, -1, -1):
        if succs[t]:
            strict[t] = np.bitwise_or.reduce(closed[succs[t]], axis=0)
        strict[t, sink_byte] |= sink_bit
        closed[t] = strict[t]
        closed[t, t >> 3] |= np.uint8(1 << (t & 7))
    # The sink row stays empty; the source precedes every task and the sink.
    strict[n + 1] = np.packbits(np.arange(width) < n + 1, bitorder="little")
    return strict


def _conflicts(graph: TaskGraph, ids: list[int], dag: Dag) -> np.ndarray:
    """``C[i, j]``: planned buffers ``ids[i]`` and ``ids[j]`` must not overlap."""
    width = dag.n + 2
    strict = _strict_reach_rows(dag)
    sets = _task_sets(graph)
    index = [np.fromiter(sorted(sets[b]), dtype=np.int64, count=len(sets[b])) for b in ids]
    # after[i]: positions strictly after every access of buffer i (everything if it has none).
    after_packed = np.full((len(ids), strict.shape[1]), 0xFF, dtype=np.uint8)
    for i, rows in enumerate(index):
        if len(rows):
            after_packed[i] = np.bitwise_and.reduce(strict[rows], axis=0)
    after_t = np.ascontiguousarray(
        np.unpackbits(after_packed, axis=1, bitorder="little")[:, :width].T.astype(bool))
    # precedes_t[j, i]: buffer i precedes buffer j, i.e. every access of j is after all of i's.
    precedes_t = np.ones((len(ids), len(ids)), dtype=bool)
    for j, rows in enumerate(index):
        if len(rows):
            precedes_t[j] = np.logical_and.reduce(after_t[rows], axis=0)
    conflict = ~(precedes_t | precedes_t.T)
    np.fill_diagonal(conflict, False)
    kinds = np.array([graph.buffers[b].kind for b in ids], dtype=object)
    is_in, is_out = kinds == BufferKind.INPUT, kinds == BufferKind.OUTPUT
    conflict[np.ix_(is_in, is_out)] = True
    conflict[np.ix_(is_out, is_in)] = True
    return conflict


def _keep_apart(graph: TaskGraph, ids: list[int], conflict: np.ndarray,
                overlapping: Iterable[tuple[int, int]]) -> None:
    """Mark conflicting, in ``conflict``, every two different planned buffers that the two tasks
    of a pair of ``overlapping`` touch, one each."""
    pos = {b: i for i, b in enumerate(ids)}
    for u, v in overlapping:
        mine = sorted({pos[a.buffer] for a in graph.tasks[u].accesses if a.buffer in pos})
        theirs = sorted({pos[a.buffer] for a in graph.tasks[v].accesses if a.buffer in pos})
        if mine and theirs:
            conflict[np.ix_(mine, theirs)] = True
            conflict[np.ix_(theirs, mine)] = True
    np.fill_diagonal(conflict, False)


def _place(order: np.ndarray, sizes: np.ndarray, conflict: np.ndarray) -> np.ndarray:
    """Lowest-fit placement in ``order``: each buffer at the lowest offset free of its conflicts."""
    offsets = np.zeros(len(sizes), dtype=np.int64)
    placed = np.zeros(len(sizes), dtype=bool)
    for i in order:
        if sizes[i] == 0:
            continue  # occupies no bytes; left out of placed so it never splits a free gap
        others = np.flatnonzero(conflict[i] & placed)
        if len(others):
            starts = offsets[others]
            by_start = np.argsort(starts, kind="stable")
            starts = starts[by_start]
            ends = np.maximum.accumulate(starts + sizes[others][by_start])
            # Gap k runs from the furthest end among the first k intervals to start k; sizes and
            # offsets are aligned, so every gap start is an aligned offset.
            gap_starts = np.concatenate(([0], ends[:-1]))
            fits = np.flatnonzero(starts - gap_starts >= sizes[i])
            offsets[i] = gap_starts[fits[0]] if len(fits) else ends[-1]
        placed[i] = True
    return offsets


def plan_memory(graph: TaskGraph, edges: Iterable[tuple[int, int]],
                alignment: int = ALIGNMENT,
                overlapping: Iterable[tuple[int, int]] = ()) -> MemPlan:
    """Give every relocatable buffer an aligned arena offset, reusing bytes where ``edges`` allow.

    ``edges`` are the executed graph's happens-before edges (low task id to high).  Two greedy
    placements are tried (largest buffer first; first-accessed first) and the smaller arena kept.
    ``overlapping`` are task pairs that an edge orders but that may still run at once (a
    programmatic edge, :mod:`nimble.analysis.programmatic`): no buffer of one shares a byte
    with another buffer of the other.
    """
    if alignment <= 0:
        raise MemPlanError(f"alignment must be positive, not {alignment}")
    n = len(graph.tasks)
    dag = _edge_dag(n, edges)
    ids = _planned(graph)
    sizes = np.array([align_up(graph.buffers[b].size, alignment) for b in ids], dtype=np.int64)
    bound = lower_bound_bytes(graph, alignment)
    if not ids:
        return MemPlan({}, 0, 0, bound, alignment)
    conflict = _conflicts(graph, ids, dag)
    _keep_apart(graph, ids, conflict, overlapping)
    first_access = np.full(len(ids), n + 1, dtype=np.int64)
    pos = {b: i for i, b in enumerate(ids)}
    for t in reversed(graph.tasks):
        for a in t.accesses:
            if a.buffer in pos:
                first_access[pos[a.buffer]] = t.id
    for i, b in enumerate(ids):
        if graph.buffers[b].kind == BufferKind.INPUT:
            first_access[i] = -1
    best_offsets, best_arena = None, None
    for order in (np.lexsort((first_access, -sizes)), np.lexsort((-sizes, first_access))):
        offsets = _place(order, sizes, conflict)
        arena = int((offsets + sizes).max())
        if best_arena is None or arena < best_arena:
            best_offsets, best_arena = offsets, arena
    return MemPlan({b: int(o) for b, o in zip(ids, best_offsets)}, best_arena,
                   int(sizes.sum()), bound, alignment)
