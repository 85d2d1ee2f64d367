"""Kernel priorities from slack: the GPU's block scheduler favours the tasks that bound the run.

Streams make independent kernels *eligible* to run together; which of them gets the SMs first is
the hardware's choice, and by default it is first come, first served.  When the GPU is already
full (a training step at batch 32 is), a kernel off the critical path, such as a weight gradient
whose result is only needed by the optimizer, can take the SMs while the kernel the whole step
waits for queues behind it.  CUDA graphs let each kernel node carry a priority (honoured when the
exec is instantiated with ``CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY``): pending blocks of a
higher-priority kernel are dispatched before those of a lower one.

A task's *slack* is how long it could be delayed without lengthening the longest path through
the DAG, with each task weighted by its isolated duration.  Tasks with no slack get the highest
priority, and priority falls as the slack grows relative to the whole path.  The DAG is the built
graph's own dependencies (the schedule's edges), so the slack is that of the graph as it runs;
a training step's forward and backward are two launches with the host between them, so each
phase's slack is its own (an edge from a forward task into the backward orders nothing inside
either launch).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from .deps import dag_from_edges, path_lengths
from .schedule import induced

#: Upper bounds of slack, as fractions of the critical path, for each level from the highest
#: priority down; a slack beyond the last bound gets the lowest level.  Fine steps near zero:
#: the tasks that most need the SMs first are the ones with almost no slack, so that is where
#: levels are worth telling apart (the comparison of bounds is in docs/findings.md).
SLACK_BOUNDS = (0.001, 0.005, 0.01, 0.03, 0.1)


class Slack(NamedTuple):
    """Per-task timing of a weighted DAG: earliest start, slack, and the critical path length."""

    earliest: list[float]
    slack: list[float]
    length: float


def slack(n: int, edges: Sequence[tuple[int, int]], durations: Sequence[float]) -> Slack:
    """Earliest start and slack of every task of a DAG whose edges go from lower to higher ids.

    ``durations[t]`` is task ``t``'s weight (negative weights count as zero).
    """
    if len(durations) != n:
        raise ValueError(f"{len(durations)} durations for {n} tasks")
    dag = dag_from_edges(n, edges)
    weight = [max(float(d), 0.0) for d in durations]
    earliest = path_lengths(dag, weight).before
    # from a task's start to the end of the run, through the task
    remaining = path_lengths(dag, weight, reverse=True).through
    length = max((earliest[t] + remaining[t] for t in range(n)), default=0.0)
    return Slack(earliest, [max(length - earliest[t] - remaining[t], 0.0) for t in range(n)],
                 length)


def priority_levels(n: int, edges: Sequence[tuple[int, int]], durations: Sequence[float],
                    levels: int, phases: Sequence[range] | None = None,
                    secondary: Sequence[int] | None = None) -> list[int]:
    """Each task's priority level, ``0`` the highest and ``levels - 1`` the lowest.

    Levels follow slack as a fraction of the critical path (:data:`SLACK_BOUNDS`); with fewer
    levels than bounds, the finest bounds are the ones kept.  ``phases`` (consecutive spans of
    task ids covering all ``n``) are separate launches with a barrier between them: each
    phase's slack is measured within it, over its own edges, against its own critical path.

    ``secondary`` (0 or 1 per task) is a second key: a task marked 1 goes one level below the
    unmarked tasks of its slack level, level with those of the next (the lowest level stays the
    lowest); :mod:`nimble.analysis.resources` marks kernels by the resources they use.
    """
    if levels < 1:
        raise ValueError(f"levels must be at least 1, got {levels}")
    if secondary is not None:
        if len(secondary) != n or any(s not in (0, 1) for s in secondary):
            raise ValueError(f"secondary must be 0 or 1 for each of the {n} tasks")
        slack_levels = priority_levels(n, edges, durations, levels, phases)
        return [min(level + s, levels - 1) for level, s in zip(slack_levels, secondary)]
    bounds = SLACK_BOUNDS[:levels - 1]
    dag = dag_from_edges(n, edges)
    out: list[int] = []
    for span in phases if phases is not None else [range(n)]:
        timing = slack(len(span), induced(dag, span).edges(), durations[span.start:span.stop])
        for s in timing.slack:
            fraction = s / timing.length if timing.length > 0 else 0.0
            out.append(next((k for k, b in enumerate(bounds) if fraction <= b), len(bounds)))
    if len(out) != n:
        raise ValueError(f"the phases cover {len(out)} of {n} tasks")
    return out


def driver_priorities(levels: Sequence[int], least: int, greatest: int) -> list[int]:
    """Map levels (0 highest) onto the driver's priority numbers, where ``greatest`` (the
    numerically lowest) is the highest priority and ``least`` the lowest."""
    span = least - greatest
    if span < 0:
        raise ValueError(f"priority range least={least}, greatest={greatest} is reversed")
    return [min(greatest + level, least) for level in levels]
