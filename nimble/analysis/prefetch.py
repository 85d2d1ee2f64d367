"""Which weights to ask the L2 for, and when (issue 53: weight prefetch on a side stream).

A batch-1 decode step is a chain of kernels, each waiting for the last, that stream every
weight once from DRAM; between two of them (a kernel's tail, the next one's launch and
ramp-up) no weights stream.  Work that could fill that time is the next kernels' weight
traffic: a prefetch kernel beside the chain (``kernels/prefetch_l2.ptx``) that asks the L2 for
the weights of the kernels ahead, so that they find them there.

:func:`plan_prefetch` walks a phase's weights in the recorded order of the kernels that read
them (a topological order of its DAG) and cuts them into **windows** of at most
``window_bytes`` each (a share of the L2: the window being read and the one being fetched must
fit beside the activations).  Window ``j``'s prefetch runs after the first weight-reading task
of window ``j - 1`` ends (the first window's at the phase's start), on no stream of the
schedule: a side branch of the graph that nothing waits for.  A weight counts where it is read
last (:func:`weight_reads`); a range written by any task of the phase (a cache the model
updates) is never fetched, nor one smaller than ``min_bytes`` (a norm's scale: not worth a
node).  A range larger than a window is fetched up to a window's bytes (its head: what a
GEMM's first waves read).

Measured on a decode step, those windows lose: each window's prefetch streams while the
kernels of the window before stream theirs, so the two compete for the same bandwidth
(docs/results.md).  :func:`plan_gap_prefetch` asks only where nothing streams: a weight whose
reader comes after kernels that read no weights (an attention over a cache, a norm, an
activation) is fetched after the weight reader before them ends, so that it streams while they
run, up to ``most`` bytes of it.  :data:`PLANS` names both; the engine times each.

Plain data: the engine turns each :class:`Prefetch` into nodes (:mod:`nimble.engine.prefetch`)
and keeps them only where the phase measures faster with them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..ir.taskgraph import BufferKind, TaskGraph, TaskKind

#: A weight range below this is not fetched (bytes): a node's launch would cost more than the
#: range's DRAM time.
MIN_BYTES = 256 << 10
#: The share of the L2 one window takes: two windows (the one read, the one fetched) and the
#: activations between them must fit.
WINDOW_SHARE = 0.4
#: The share of the L2 one gap's prefetch takes at most (the head of a larger weight).
GAP_SHARE = 0.25
#: The plans a prefetch is timed with: ``windows`` (:func:`plan_prefetch`), ``gaps``
#: (:func:`plan_gap_prefetch`).
PLANS = ("windows", "gaps")


@dataclass(frozen=True)
class WeightRange:
    """Bytes ``[offset, offset + size)`` of buffer ``buffer``."""

    buffer: int
    offset: int
    size: int


@dataclass(frozen=True)
class Prefetch:
    """One window's prefetch: its ranges, after task ``after`` (None: at the phase's start)."""

    after: int | None
    ranges: tuple[WeightRange, ...]
    #: The tasks whose weights these are (the window), for reports.
    tasks: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(r.size for r in self.ranges)


def window_bytes(l2_bytes: int, share: float = WINDOW_SHARE) -> int:
    """One window's bytes on a GPU of ``l2_bytes`` of L2."""
    return int(l2_bytes * share)


def _written(graph: TaskGraph, span: range) -> set[int]:
    return {a.buffer for t in span for a in graph.tasks[t].accesses if a.write}


def weight_reads(graph: TaskGraph, span: range, min_bytes: int = MIN_BYTES
                 ) -> list[tuple[int, WeightRange]]:
    """``(task, range)`` per weight the kernels of ``span`` read, ordered by ``task``: the last
    kernel that reads the weight (a tied embedding's table is named whole by the lookup at the
    start and streamed by the language-model head at the end), its range spanning every byte
    the phase reads of it.  Only parameter buffers no task of the phase writes, and ranges of
    at least ``min_bytes``."""
    written = _written(graph, span)
    hull: dict[int, list[int]] = {}  # buffer -> [first byte, end, last reader]
    for t in span:
        task = graph.tasks[t]
        if task.kind != TaskKind.KERNEL:
            continue
        for a in task.accesses:
            if graph.buffers[a.buffer].kind != BufferKind.PARAM or a.buffer in written:
                continue
            got = hull.setdefault(a.buffer, [a.offset, a.end, t])
            got[0], got[1], got[2] = min(got[0], a.offset), max(got[1], a.end), t
    reads = [(t, WeightRange(b, start, end - start)) for b, (start, end, t) in hull.items()
             if end - start >= min_bytes]
    return sorted(reads, key=lambda read: (read[0], read[1].buffer))


def plan_prefetch(graph: TaskGraph, span: range, window: int,
                  min_bytes: int = MIN_BYTES) -> list[Prefetch]:
    """The prefetches of the phase ``span`` with windows of at most ``window`` bytes (see the
    module's text); none where the phase reads fewer weights than two windows would hold
    apart (nothing ahead to fetch)."""
    if window <= 0:
        raise ValueError(f"a prefetch window needs a positive size, got {window}")
    windows: list[list[tuple[int, WeightRange]]] = [[]]
    filled = 0
    for t, r in weight_reads(graph, span, min_bytes):
        r = WeightRange(r.buffer, r.offset, min(r.size, window))
        if windows[-1] and filled + r.size > window:
            windows.append([])
            filled = 0
        windows[-1].append((t, r))
        filled += r.size
    if len(windows) < 2:
        return []
    plans = []
    for j, members in enumerate(windows):
        after = None if j == 0 else windows[j - 1][0][0]
        tasks = tuple(dict.fromkeys(t for t, _ in members))
        plans.append(Prefetch(after, tuple(r for _, r in members), tasks))
    return plans


def plan_gap_prefetch(graph: TaskGraph, span: range, most: int,
                      min_bytes: int = MIN_BYTES) -> list[Prefetch]:
    """The prefetches of the phase ``span`` into its gaps (see the module's text): for each
    weight reader (:func:`weight_reads`) that follows, in the recorded order, at least one
    kernel reading no weight since the reader before it, one prefetch of its weights (each
    range's head, up to ``most`` bytes) after that reader (None: at the phase's start, where
    the kernels before the first reader are the gap).  A reader right after another is not
    fetched for: its fetch would stream beside the other's weights."""
    if most <= 0:
        raise ValueError(f"a gap's prefetch needs a positive size, got {most}")
    ranges: dict[int, list[WeightRange]] = {}
    for t, r in weight_reads(graph, span, min_bytes):
        ranges.setdefault(t, []).append(WeightRange(r.buffer, r.offset, min(r.size, most)))
    plans = []
    before: int | None = None
    idle = 0  # kernels since ``before`` that read no weight
    for t in span:
        if graph.tasks[t].kind != TaskKind.KERNEL:
            continue
        if t not in ranges:
            idle += 1
            continue
        if idle:
            plans.append(Prefetch(before, tuple(ranges[t]), (t,)))
        before, idle = t, 0
    return plans


def plan(kind: str, graph: TaskGraph, span: range, l2_bytes: int) -> list[Prefetch]:
    """The ``kind`` of :data:`PLANS` for the phase ``span`` on a GPU of ``l2_bytes`` of L2."""
    if kind == "windows":
        return plan_prefetch(graph, span, window_bytes(l2_bytes))
    if kind == "gaps":
        return plan_gap_prefetch(graph, span, window_bytes(l2_bytes, GAP_SHARE))
    raise ValueError(f"no prefetch plan {kind!r}: one of {', '.join(PLANS)}")


def merged_ranges(prefetch: Prefetch, bases: Sequence[int]) -> list[tuple[int, int]]:
    """``(address, nbytes)`` of a prefetch's ranges where their buffers live (``bases``),
    ranges that touch or overlap joined: one node each."""
    spans = sorted((bases[r.buffer] + r.offset, bases[r.buffer] + r.offset + r.size)
                   for r in prefetch.ranges)
    out: list[list[int]] = []
    for b, e in spans:
        if out and b <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([b, e])
    return [(b, e - b) for b, e in out]
