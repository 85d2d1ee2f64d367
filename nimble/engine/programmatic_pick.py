"""Programmatic edges at prepare (``PrepareOptions(programmatic_launch=True)``; issue 53): each
phase built with the edges :func:`nimble.analysis.programmatic.waiting_edges` allows (into
Nimble's own kernels, which wait for their predecessor in their code), timed
against the phase without them, and kept only where it measures faster, as the weight
prefetch is (:mod:`nimble.engine.prefetch`).  A graph of collectives is not timed (its ranks
must launch alike, not by their own timings): it is served with them, unmeasured, as asked;
so is any graph with ``programmatic_launch="always"``.
What was measured goes to ``graph.meta["programmatic"]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..analysis import backfill
from ..analysis.programmatic import programmatic_edges, waiting_edges
from ..analysis.schedule import Schedule, phase_spans
from ..ir.taskgraph import TaskGraph
from ..ir.waiting_kernels import has_waiting_kernels
from .collectives import communicates
from .rebuild import PhaseOptions

META_KEY = "programmatic"

#: The rule that picks the edges: ``"waiting"``
#: (:func:`~nimble.analysis.programmatic.waiting_edges`) or ``"recorded"``, the withdrawn one
#: that kept the capture's own programmatic edges between Inductor's kernels
#: (:func:`~nimble.analysis.programmatic.programmatic_edges`, which raced:
#: :data:`~nimble.analysis.programmatic.WITHDRAWN`); only
#: ``tools/experiments/programmatic_race.py`` sets it, for its own process.
RULE = "waiting"


def recorded_rule(options) -> bool:
    """Whether ``options`` ask for programmatic edges under the withdrawn recorded rule, which
    needs Inductor's kernels compiled to launch programmatically and each pair's buffers kept
    apart in the arena."""
    return bool(options.programmatic_launch) and RULE == "recorded"


def allowed_edges(graph: TaskGraph, edges, offsets) -> frozenset:
    """The edges of ``edges`` that :data:`RULE` lets be programmatic (``offsets``: the memory
    plan's, which only the recorded rule reads)."""
    if RULE == "recorded":
        return programmatic_edges(graph, edges, offsets)
    return waiting_edges(graph, edges)


@dataclass(frozen=True)
class ProgrammaticPlan:
    """What a prepare does with programmatic edges: ``served`` built in from the start (a
    copy's, or a graph of collectives'), ``trials`` per phase to time against none."""

    served: frozenset = frozenset()
    trials: dict | None = None


def planned_programmatic(graph: TaskGraph, schedule: Schedule, memplan, options,
                         first=None) -> ProgrammaticPlan:
    """The :class:`ProgrammaticPlan` of a prepare: nothing where the option is off or the
    capture holds no programmatic edge, the first instance's choice for a copy (``first``: its
    ``Prepared``), else the allowed edges per phase."""
    if first is None:  # a copy's graph, and its meta, are the first instance's
        graph.meta.pop(META_KEY, None)  # a reused recording's is of an earlier prepare
    if not options.programmatic_launch:
        return ProgrammaticPlan()
    if first is not None:
        return ProgrammaticPlan(frozenset(first.programmatic))
    if RULE == "waiting" and not has_waiting_kernels(graph):  # on by default: most graphs
        return ProgrammaticPlan()
    allowed = allowed_edges(graph, schedule.edges(), memplan.offsets)
    if not allowed:
        return ProgrammaticPlan()
    if communicates(graph) or options.programmatic_launch == "always":
        graph.meta[META_KEY] = [{"phase": None, "edges": len(allowed), "measured": False,
                                 "kept": True}]
        return ProgrammaticPlan(allowed)
    spans = phase_spans(graph.meta.get("phases") or [], len(graph.tasks))
    # an edge between phases is their barrier, never built in either phase's graph
    trials = {k: frozenset(e for e in allowed if e[0] in span and e[1] in span)
              for k, span in enumerate(spans)}
    return ProgrammaticPlan(trials={k: e for k, e in trials.items() if e} or None)


def pick_programmatic(builder, phase: int, plain, edges: frozenset, launch: Callable,
                      graph: TaskGraph):
    """Phase ``phase`` built with ``edges`` programmatic, timed against ``plain`` (the phase as
    built so far); the faster returned (``plain`` closed where the edges win, and on an
    error).  Where they win, the builder serves them from then on; what was measured is
    appended to ``graph.meta["programmatic"]``."""
    # An edge out of a root of the phase's graph is built full (nimble.engine.build): the
    # builder serves, and the meta counts, the edges the trial really built programmatic.
    trials = []

    def trial():
        trials.append(builder.build(phase, PhaseOptions(programmatic_edges=edges)))
        return trials[-1]
    try:
        got = backfill.fastest(plain, [trial], launch)
    except BaseException:
        plain.close()  # fastest frees the graphs it built, not this one
        raise
    built = trials[0].programmatic  # fastest built the trial (closed now where it lost)
    if got.index:
        builder.programmatic = frozenset(builder.programmatic) | built
    graph.meta.setdefault(META_KEY, []).append(
        {"phase": phase, "plain_ms": got.plain_ms, "programmatic_ms": got.trial_ms[0],
         "edges": len(built), "measured": True, "kept": bool(got.index)})
    return got.built
