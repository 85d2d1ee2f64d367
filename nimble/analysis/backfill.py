"""Tail backfill: work with slack moved into the narrow end of a phase, where SMs sit idle.

A training step's backward ends in the network's stem, where kernels can be narrower than the
GPU: cuDNN's per-channel batch-norm backward runs one block per channel, fewer blocks than a big
GPU has SMs, one such kernel after another, with nothing else left to run beside them.  The
kernels that could have (weight gradients of later layers, read only by the optimizer) ran
earlier, while the GPU was full anyway.  Deferring some of them until the narrow tail begins
lets them use the idle SMs instead of competing for busy ones.

**Finding the tail.**  On the phase's critical path (tasks weighted by their isolated
durations), a kernel of ``b`` blocks is taken to keep ``min(1, b / SMs)`` of the GPU busy.  The
tail is the suffix of the path whose idle SM time most exceeds ``tail_idle`` of its length; the
path's task before it is the *anchor*.  Tails whose idle SM time is under
:data:`MIN_TAIL` of the path are not worth an edge.

**What moves.**  In order of falling slack, tasks that
- are neither before nor after the anchor already,
- could start before it ends, and
- still end within the critical path when started at its end

get an edge from the anchor.  This stops once the GPU time moved behind the anchor reaches
``fill`` times the tail's idle SM time.  The time moved counts a task's successors that were
not after the anchor before.

**Why the edges are safe.**  The edges only add ordering.  The arena plan (every two buffers
that share bytes are ordered) and the schedule's streams and syncs hold as they are.  The edges
run against the recorded order, so they are not added to the schedule, whose edges go from lower
to higher task ids.  They are added to the built graph after its nodes
(:func:`nimble.engine.build.build_graph`'s ``late_edges``).

**Whether they pay** is measured, not assumed: the narrow kernels' real width and what the
deferred work costs them are the GPU's to tell.  :func:`pick` times each candidate against the
phase built without them and keeps the fastest (what it gained on a training step is in
docs/findings.md).  The measured choice itself, :func:`fastest`, also picks among the
resource-aware priorities (:mod:`nimble.analysis.resources`).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

from .deps import Dag, ancestors, critical_path, dag_from_edges, reachability
from .priorities import slack
from .schedule import induced, set_bits

#: ``(fill, tail_idle)`` of the candidates :func:`plan_trials` makes, in the order tried.
TRIALS = ((0.5, 0.3), (1.0, 0.3), (0.5, 0.5))
#: A tail whose idle SM time is below this fraction of the critical path gets no edges.
MIN_TAIL = 0.05
#: A candidate is kept only when its median launch is at least this much faster than without
#: (a fraction of the plain graph's; below 0, slower by at most that much).
MIN_GAIN = 0.005


class Backfill(NamedTuple):
    """The late edges of one phase: ``anchor -> t`` for each ``t`` of ``deferred``."""

    phase: int
    anchor: int
    deferred: tuple[int, ...]
    moved: int  # tasks that now run after the anchor: the deferred ones and their successors
    idle_us: float  # the tail's idle SM time, in µs of the whole GPU
    work_us: float  # GPU time moved behind the anchor (µs of the whole GPU)

    def edges(self) -> list[tuple[int, int]]:
        return [(self.anchor, t) for t in self.deferred]


def widths(blocks: Sequence[int], sm_count: int) -> list[float]:
    """The share of the GPU each task keeps busy: its blocks over the SMs, at most 1."""
    if sm_count < 1:
        raise ValueError(f"sm_count must be positive, got {sm_count}")
    return [min(1.0, max(int(b), 1) / sm_count) for b in blocks]


def plan_phase(dag: Dag, durations: Sequence[float], width: Sequence[float], fill: float,
               tail_idle: float, phase: int = 0, first: int = 0) -> Backfill | None:
    """The backfill of one phase (its own DAG, tasks ``0..n-1`` here and ``first..first+n-1`` in
    the result), or None when its critical path has no narrow tail worth filling."""
    n = dag.n
    if n < 2:
        return None
    d = [max(float(x), 0.0) for x in durations]
    timing = slack(n, dag.edges(), d)
    path = critical_path(dag, d).tasks
    # The suffix whose idle SM time most exceeds ``tail_idle`` of its length: it begins at a
    # narrow kernel, and reaches back only as far as the idle time keeps that share.
    excess = best = 0.0
    start = None
    for k in range(len(path) - 1, 0, -1):
        t = path[k]
        excess += d[t] * (1.0 - width[t] - tail_idle)
        if excess > best:
            best, start = excess, k
    if start is None:
        return None
    idle_us = sum(d[t] * (1.0 - width[t]) for t in path[start:])
    if idle_us < MIN_TAIL * timing.length:
        return None
    anchor = path[start - 1]
    anchor_end = timing.earliest[anchor] + d[anchor]
    reach = reachability(dag)
    ordered = reach[anchor] | ancestors(dag)[anchor] | (1 << anchor)  # before or after it
    after = reach[anchor] | (1 << anchor)
    # From a task's start, through it, to the phase's end.
    to_end = [timing.length - timing.earliest[t] - timing.slack[t] for t in range(n)]
    candidates = [t for t in range(n) if not (ordered >> t) & 1 and d[t] > 0
                  and timing.earliest[t] < anchor_end
                  and to_end[t] <= timing.length - anchor_end]
    candidates.sort(key=lambda t: -timing.slack[t])
    moved = 0  # bitset of the tasks put behind the anchor so far
    deferred: list[int] = []
    work = 0.0
    for t in candidates:
        if work >= fill * idle_us:
            break
        if (moved >> t) & 1:
            continue  # already behind the anchor through a deferred predecessor
        newly = (reach[t] | (1 << t)) & ~after & ~moved
        moved |= newly
        work += sum(d[u] * width[u] for u in set_bits(newly))
        deferred.append(t)
    if not deferred:
        return None
    return Backfill(phase, anchor + first, tuple(t + first for t in deferred),
                    moved.bit_count(), idle_us, work)


def plan_backfill(n: int, edges: Sequence[tuple[int, int]], spans: Sequence[range],
                  durations: Sequence[float], blocks: Sequence[int], sm_count: int,
                  fill: float, tail_idle: float, phases: Sequence[int] | None = None
                  ) -> list[Backfill]:
    """The backfill of each phase of ``spans`` (``phases``: only those, by index) that has a
    narrow tail, over the schedule's ``edges`` (forward, task ids ``0..n-1``), each task's
    isolated µs and its kernel's block count."""
    if not (len(durations) == len(blocks) == n):
        raise ValueError(f"{len(durations)} durations and {len(blocks)} block counts for "
                         f"{n} tasks")
    share = widths(blocks, sm_count)
    dag = dag_from_edges(n, edges)
    out: list[Backfill] = []
    for k, span in enumerate(spans):
        if phases is not None and k not in phases:
            continue
        got = plan_phase(induced(dag, span), durations[span.start:span.stop],
                         share[span.start:span.stop], fill, tail_idle, k, span.start)
        if got is not None:
            out.append(got)
    return out


def plan_trials(n: int, edges: Sequence[tuple[int, int]], spans: Sequence[range],
                durations: Sequence[float], blocks: Sequence[int], sm_count: int,
                phases: Sequence[int] | None = None) -> dict[int, list[Backfill]]:
    """Per phase, the distinct candidates of :data:`TRIALS` (each phase's own), to be measured."""
    trials: dict[int, list[Backfill]] = {}
    for fill, tail_idle in TRIALS:
        for b in plan_backfill(n, edges, spans, durations, blocks, sm_count, fill, tail_idle,
                               phases):
            mine = trials.setdefault(b.phase, [])
            if all(b.edges() != other.edges() for other in mine):
                mine.append(b)
    return trials


class Picked(NamedTuple):
    """What :func:`pick` measured for one phase: median ms per launch without late edges and
    with each candidate, and the candidate kept (None: none beat the plain graph)."""

    phase: int
    plain_ms: float
    trial_ms: tuple[float, ...]
    kept: Backfill | None


class Fastest(NamedTuple):
    """What :func:`fastest` measured: the graph kept, which it is (0: the plain one, ``k``: the
    ``k``-th candidate), and the median ms per launch of the plain one and of each candidate."""

    built: Any
    index: int
    plain_ms: float
    trial_ms: tuple[float, ...]


def fastest(plain, builds: Sequence[Callable[[], Any]], launch: Callable, rounds: int = 5,
            launches: int = 3) -> Fastest:
    """The measured choice among ``plain`` (a built graph) and the graphs ``builds`` make, timed
    by ``launch(built, count) -> ms`` of ``count`` launches in alternating rounds.  A candidate
    wins only when its median beats the plain one's by :data:`MIN_GAIN`.  The losers are
    closed, ``plain`` too when a candidate wins; on an error only the graphs built here are."""
    builts = [plain]
    try:
        for build in builds:
            builts.append(build())
        for b in builts:  # warm-up
            launch(b, 1)
        samples: list[list[float]] = [[] for _ in builts]
        for _ in range(rounds):
            for b, got in zip(builts, samples):
                got.append(launch(b, launches) / launches)
    except BaseException:
        for b in builts[1:]:
            b.close()
        raise
    medians = [sorted(s)[len(s) // 2] for s in samples]
    # the fastest candidate against the plain graph: a MIN_GAIN below 0 keeps one that loses by
    # less than that, as a test that must see a candidate built asks
    best = min(range(1, len(builts)), key=medians.__getitem__, default=0)
    if best and medians[best] > medians[0] * (1.0 - MIN_GAIN):
        best = 0
    for k, b in enumerate(builts):
        if k != best:
            b.close()
    return Fastest(builts[best], best, medians[0], tuple(medians[1:]))


def pick(plain, candidates: Sequence[Backfill], build: Callable, launch: Callable,
         rounds: int = 5, launches: int = 3):
    """``(built, Picked)``: :func:`fastest` of ``plain`` (a built phase) and the phase built with
    each candidate's edges (``build(edges)``)."""
    got = fastest(plain, [lambda c=c: build(c.edges()) for c in candidates], launch, rounds,
                  launches)
    phase = candidates[0].phase if candidates else -1
    return got.built, Picked(phase, got.plain_ms, got.trial_ms,
                             candidates[got.index - 1] if got.index else None)
