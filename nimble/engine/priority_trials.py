"""Resource-aware kernel priorities measured at prepare: the candidates, and the pick per phase.

:func:`resource_trials` turns the candidates of :mod:`nimble.analysis.resources` (kernels marked
by the resources they use, one level behind others of similar slack) into driver priority
numbers on the current device; :func:`pick_priorities` builds a phase with each that differs
in it, times them against the phase as built (:func:`nimble.analysis.backfill.fastest`, the
measured choice the tail backfill uses) and keeps the fastest.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

from .. import driver
from ..analysis import backfill, resources
from ..analysis.priorities import driver_priorities
from ..analysis.schedule import Schedule, phase_spans
from ..ir.taskgraph import TaskGraph, TaskKind
from .build import BuiltGraph
from .rebuild import PhaseBuilder


class PriorityTrial(NamedTuple):
    """A resource-aware candidate (:class:`nimble.analysis.resources.ResourceTrial`) and its
    driver priority numbers per task."""

    trial: resources.ResourceTrial
    priorities: list[int]


def device_limits() -> resources.SmLimits:
    """The current device's SM limits (:data:`nimble.analysis.resources.DEVICE_ATTRIBUTES`)."""
    import torch

    return resources.limits_from_attributes(
        driver.device_attributes(torch.cuda.current_device(), resources.DEVICE_ATTRIBUTES))


def kernel_resources(graph: TaskGraph, nodes: Sequence) -> list[driver.FunctionResources]:
    """Per task, its kernel function's registers and static shared memory (zeros for a task
    that is no kernel), read from its recorded node."""
    from ..record.decode import kernel_function

    none = driver.FunctionResources(0, 0)
    return [driver.function_resources(kernel_function(driver.kernel_node_params(node)))
            if t.kind == TaskKind.KERNEL else none for t, node in zip(graph.tasks, nodes)]


def resource_trials(rec, schedule: Schedule, durations: Sequence[float],
                    priority_range: tuple[int, int] | None = None) -> list[PriorityTrial]:
    """The resource-aware priorities worth timing (:func:`nimble.analysis.resources.plan_trials`)
    from each kernel's profile on the current device (its registers and static shared memory
    read from the recording's nodes), as driver priority numbers (``priority_range``: the
    device's ``(least, greatest)`` where the caller asked once)."""
    least, greatest = priority_range or driver.stream_priority_range()
    n = len(durations)
    functions = kernel_resources(rec.graph, rec.nodes)
    profiles = resources.profile_tasks(rec.graph, device_limits(), durations,
                                       [f.registers for f in functions],
                                       [f.static_shared for f in functions])
    trials = resources.plan_trials(n, schedule.edges(), durations, least - greatest + 1,
                                   profiles, phase_spans(schedule.phases, n))
    return [PriorityTrial(t, driver_priorities(t.levels, least, greatest)) for t in trials]


def pick_priorities(builder: PhaseBuilder, phase: int, plain: BuiltGraph,
                    trials: Sequence[PriorityTrial], launch: Callable
                    ) -> tuple[BuiltGraph, resources.ResourcePicked | None]:
    """Phase ``phase`` built with each trial's priorities that differ in it, timed against
    ``plain`` (:func:`nimble.analysis.backfill.fastest`); the kept priorities become the
    builder's for the phase's tasks.  None when no trial differs in the phase."""
    if builder.priorities is None:
        raise ValueError("resource-aware priorities are tried only on a graph with priorities")
    span = builder.spans[phase]
    served = list(builder.priorities)
    mine: list[tuple[PriorityTrial, int]] = []
    for t in trials:
        own = t.priorities[span.start:span.stop]
        changed = sum(a != b for a, b in zip(own, served[span.start:span.stop]))
        if changed and all(own != o.priorities[span.start:span.stop] for o, _ in mine):
            mine.append((t, changed))
    if not mine:
        return plain, None
    got = backfill.fastest(
        plain, [lambda t=t: dataclasses.replace(builder, priorities=t.priorities).build(phase)
                for t, _ in mine], launch)
    kept = mine[got.index - 1][0] if got.index else None
    if kept is not None:
        served[span.start:span.stop] = kept.priorities[span.start:span.stop]
        builder.priorities = served
    return got.built, resources.ResourcePicked(
        phase, got.plain_ms, got.trial_ms, tuple(t.trial.rule for t, _ in mine),
        tuple(c for _, c in mine), kept.trial.rule if kept else None)


def forced_rule(rule: str, ordering: Sequence[PriorityTrial], plain: list[int] | None
                ) -> list[int] | None:
    """The priorities of ``rule``'s candidate in ``ordering`` (``plain`` where it changes
    nothing), to serve without measuring: ``PrepareOptions(resource_order=rule)``, for tools
    that time each candidate side by side."""
    return next((t.priorities for t in ordering if t.trial.rule == rule), plain)


class Ordering(NamedTuple):
    """The priorities a graph is built with, and the candidates to time against them."""

    priorities: list[int] | None
    trials: list[PriorityTrial]


def planned_ordering(resource_order: bool | str, rec, schedule: Schedule,
                     durations: Callable[[], Sequence[float]], ranks: list[int] | None,
                     priority_range: tuple[int, int]) -> Ordering:
    """What ``PrepareOptions(resource_order=...)`` asks of a planned recording with the slack
    priorities ``ranks``: nothing (off, or no priorities: ``ranks`` None), every candidate to
    time (True), or one rule's priorities served as they are (a rule's name)."""
    if not resource_order or ranks is None:
        return Ordering(ranks, [])
    trials = resource_trials(rec, schedule, durations(), priority_range)
    if isinstance(resource_order, str):
        return Ordering(forced_rule(resource_order, trials, ranks), [])
    return Ordering(ranks, trials)
