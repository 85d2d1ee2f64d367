"""Weight prefetch into the L2 as nodes of a built graph, kept only where measured faster
(``PrepareOptions(prefetch_l2=True)``; issue 53).

:mod:`nimble.analysis.prefetch` plans, per phase, windows of weights and the task after which
each window's prefetch may start.  Each window becomes one ``nimble_prefetch_l2`` node per
contiguous address range (``kernels/prefetch_l2.ptx``, :mod:`nimble.engine.prefetch_nodes`),
after its anchor task's node (the first window's after the input gathers, or a root), at the
device's least priority so that the schedule's kernels take the SMs first; nothing waits for
them.  A prefetch only reads weights, so the graph computes what it computed without them, and
the proof holds as for any build.

:func:`pick_prefetch` builds a phase with the plan and times it against the phase as built
(:func:`nimble.analysis.backfill.fastest`, the measured choice the tail backfill and the
resource-aware priorities use): the plan is kept only where it gains.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .. import driver
from ..analysis import backfill
from ..analysis.deps import communicates
from ..analysis.prefetch import Prefetch, plan_prefetch, window_bytes
from ..analysis.schedule import phase_spans
from ..ir.taskgraph import TaskGraph
from .rebuild import PhaseOptions


def l2_bytes() -> int:
    """The current device's L2 size in bytes."""
    import torch

    return int(driver.device_attributes(torch.cuda.current_device(),
                                        {"l2": "L2_CACHE_SIZE"})["l2"])


def plan_phases(graph: TaskGraph, spans: Sequence[range], l2: int) -> dict[int, tuple]:
    """Per phase with something ahead to fetch, its prefetches on a GPU of ``l2`` bytes of
    L2 (:func:`nimble.analysis.prefetch.plan_prefetch`)."""
    plans = {k: tuple(plan_prefetch(graph, span, window_bytes(l2)))
             for k, span in enumerate(spans)}
    return {k: p for k, p in plans.items() if p}


def planned_prefetch(graph: TaskGraph, options) -> dict[int, tuple] | None:
    """What ``PrepareOptions(prefetch_l2=...)`` asks of a recording: nothing (off, or a graph
    of collectives, whose ranks must launch alike rather than by their own timings), or each
    phase's prefetches to time (:func:`plan_phases` on the current device's L2)."""
    graph.meta.pop("prefetch_l2", None)  # a reused recording's is of an earlier prepare
    if not options.prefetch_l2 or communicates(graph):
        return None
    spans = phase_spans(graph.meta.get("phases") or [], len(graph.tasks))
    return plan_phases(graph, spans, l2_bytes()) or None


@dataclass(frozen=True)
class PrefetchPicked:
    """What :func:`pick_prefetch` measured for one phase (median ms per launch)."""

    phase: int
    plain_ms: float
    prefetch_ms: float
    nodes: int
    nbytes: int
    kept: bool

    def as_meta(self) -> dict:
        return {"phase": self.phase, "plain_ms": self.plain_ms, "prefetch_ms": self.prefetch_ms,
                "windows": self.nodes, "bytes": self.nbytes, "kept": self.kept}


def pick_prefetch(builder, phase: int, plain, plan: Sequence[Prefetch], launch: Callable,
                  graph: TaskGraph):
    """Phase ``phase`` built with ``plan`` timed against ``plain`` (the phase as built so far),
    the faster returned (``plain`` is closed where the plan wins, and on an error); where the
    plan wins, the builder serves it from then on.  What was measured is appended to
    ``graph.meta["prefetch_l2"]`` (:meth:`PrefetchPicked.as_meta`)."""
    try:
        got = backfill.fastest(
            plain, [lambda: builder.build(phase, PhaseOptions(prefetch=tuple(plan)))], launch)
    except BaseException:
        plain.close()  # fastest frees the graphs it built, not this one
        raise
    if got.index:
        builder.prefetch[phase] = tuple(plan)
    picked = PrefetchPicked(phase, got.plain_ms, got.trial_ms[0], len(plan),
                            sum(p.nbytes for p in plan), bool(got.index))
    graph.meta.setdefault("prefetch_l2", []).append(picked.as_meta())
    return got.built
