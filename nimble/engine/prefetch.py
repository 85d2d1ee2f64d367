"""Weight prefetch into the L2 as nodes of a built graph, kept only where measured faster
(``PrepareOptions(prefetch_l2=True)``; issue 53).

:mod:`nimble.analysis.prefetch` plans, per phase, windows of weights (or the weights read after
a gap) and the task after which each prefetch may start. Each window becomes one
``nimble_prefetch_l2`` node per contiguous address range (``kernels/prefetch_l2.ptx``,
:mod:`nimble.engine.prefetch_nodes`), after its anchor task's node (the first window's after the
input gathers, or a root), at the device's least priority so that the schedule's kernels take
the SMs first; nothing waits for them. A prefetch only reads weights, so the graph computes what
it computed without them, and the proof holds as for any build.

:func:`pick_prefetch` builds a phase with the plan and times it against the phase as built
(:func:`nimble.analysis.backfill.fastest`, the measured choice the tail backfill and the
resource-aware priorities use), one build per plan asked for: the fastest plan is kept only
where it gains.  A graph of collectives times nothing (its ranks must launch alike): it
serves the plan asked for by name as it is (:func:`served_prefetch`), as it serves its
programmatic edges.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .. import driver
from ..analysis import backfill
from ..analysis.deps import communicates
from ..analysis.prefetch import PLANS, Prefetch
from ..analysis.prefetch import plan as prefetch_plan
from ..analysis.schedule import phase_spans
from ..ir.taskgraph import TaskGraph
from .rebuild import PhaseOptions


def l2_bytes() -> int:
    """The current device's L2 size in bytes."""
    import torch

    return int(driver.device_attributes(torch.cuda.current_device(),
                                        {"l2": "L2_CACHE_SIZE"})["l2"])


def plan_phases(graph: TaskGraph, spans: Sequence[range], l2: int,
                kinds: Sequence[str] = PLANS) -> dict[int, dict[str, tuple]]:
    """Per phase with something to fetch, its prefetches of each plan of ``kinds``
    (:data:`nimble.analysis.prefetch.PLANS`) that fetches anything, on a GPU of ``l2`` bytes
    of L2."""
    plans: dict[int, dict[str, tuple]] = {}
    for k, span in enumerate(spans):
        got = {kind: tuple(prefetch_plan(kind, graph, span, l2)) for kind in kinds}
        got = {kind: p for kind, p in got.items() if p}
        if got:
            plans[k] = got
    return plans


def asked_plans(prefetch_l2) -> tuple[str, ...]:
    """The plans ``PrepareOptions(prefetch_l2=...)`` times: every one for True, the one named,
    none for False."""
    if not prefetch_l2:
        return ()
    return PLANS if prefetch_l2 is True else (prefetch_l2,)


def planned_prefetch(graph: TaskGraph, options) -> dict[int, dict[str, tuple]] | None:
    """What ``PrepareOptions(prefetch_l2=...)`` asks of a recording to time: nothing (off, or a
    graph of collectives, whose ranks must launch alike rather than by their own timings:
    :func:`served_prefetch`), or each phase's prefetches to time, per plan
    (:func:`plan_phases` on the current device's L2)."""
    graph.meta.pop("prefetch_l2", None)  # a reused recording's is of an earlier prepare
    kinds = asked_plans(options.prefetch_l2)
    if not kinds or communicates(graph):
        return None
    spans = phase_spans(graph.meta.get("phases") or [], len(graph.tasks))
    return plan_phases(graph, spans, l2_bytes(), kinds) or None


def served_prefetch(graph: TaskGraph, options) -> list[tuple] | None:
    """Per phase, the prefetches a graph of collectives serves unmeasured: its ranks must
    launch alike, so none times a choice of its own (:func:`planned_prefetch`); a plan asked
    for by name (``PrepareOptions(prefetch_l2="gaps")``) is served as asked, the plan being
    the graph's and the L2's, the same on every rank.  None for any other graph or option
    (``True`` asks for a timed choice).  Call it after :func:`planned_prefetch`; what is
    served goes to ``graph.meta["prefetch_l2"]`` (``"measured": False``)."""
    kind = options.prefetch_l2
    if not isinstance(kind, str) or not communicates(graph):
        return None
    spans = phase_spans(graph.meta.get("phases") or [], len(graph.tasks))
    plans = plan_phases(graph, spans, l2_bytes(), (kind,))
    if not plans:
        return None
    served = [plans.get(k, {}).get(kind, ()) for k in range(len(spans))]
    graph.meta["prefetch_l2"] = [
        {"phase": k, "plan": kind, "windows": len(p), "bytes": sum(f.nbytes for f in p),
         "measured": False, "kept": True} for k, p in enumerate(served) if p]
    return served


@dataclass(frozen=True)
class PrefetchPicked:
    """What :func:`pick_prefetch` measured for one plan of one phase (median ms per launch)."""

    phase: int
    plan: str
    plain_ms: float
    prefetch_ms: float
    nodes: int
    nbytes: int
    kept: bool

    def as_meta(self) -> dict:
        return {"phase": self.phase, "plan": self.plan, "plain_ms": self.plain_ms,
                "prefetch_ms": self.prefetch_ms, "windows": self.nodes, "bytes": self.nbytes,
                "kept": self.kept}


def pick_prefetch(builder, phase: int, plain, plans: dict[str, Sequence[Prefetch]],
                  launch: Callable, graph: TaskGraph):
    """Phase ``phase`` built with each of ``plans`` (by name) timed against ``plain`` (the
    phase as built so far), the fastest returned (``plain`` is closed where a plan wins, and on
    an error); where a plan wins, the builder serves it from then on.  What was measured is
    appended to ``graph.meta["prefetch_l2"]``, an entry per plan
    (:meth:`PrefetchPicked.as_meta`)."""
    named = [(kind, tuple(p)) for kind, p in plans.items()]
    try:
        got = backfill.fastest(
            plain, [lambda p=p: builder.build(phase, PhaseOptions(prefetch=p))
                    for _, p in named], launch)
    except BaseException:
        plain.close()  # fastest frees the graphs it built, not this one
        raise
    if got.index:
        builder.prefetch[phase] = named[got.index - 1][1]
    for i, ((kind, p), ms) in enumerate(zip(named, got.trial_ms), start=1):
        picked = PrefetchPicked(phase, kind, got.plain_ms, ms, len(p),
                                sum(f.nbytes for f in p), got.index == i)
        graph.meta.setdefault("prefetch_l2", []).append(picked.as_meta())
    return got.built
