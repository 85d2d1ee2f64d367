"""Several stops of a walk in one step-through run.

A walk (:mod:`nimble.debug.divergence`) stops after each op in recorded order: it runs the op's
tasks and every task they wait for (:func:`nimble.debug.step_through.run_until`), reads the op's
outputs and compares them.  Each stop is a pruned clone of the phase, instantiated, launched
and waited for: on a network of a thousand ops, a thousand of them.

Several ops can share one run when each one's outputs are still in place at its end: no task
of the run writes a byte of an op's outputs unless it is one of the op's own tasks or one they
wait for.  The arena hands an op's bytes to a later buffer once their last reader ran, and an
in-place op writes over its input, so a run that goes on past such a writer loses the op's
values; :func:`stop_groups` keeps such ops apart.  It needs only the dependencies (each task's
closure) and each write's device address, so it is plain Python over integers.  The walk reads
each member's outputs from its group's run.  A member that looks wrong there is judged on a stop
of its own, once every op before it was read: the plan trusts the recorded writes, and a fault
the walk hunts (a kernel writing outside them) can spoil an earlier member's bytes in a shared
run, so a group changes how many runs a walk makes, not what it finds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..analysis.deps import ancestors, dag_from_edges

#: The most ops one run stands for: a group's reads are every member's outputs.
GROUP_LIMIT = 32
#: The latest groups an op may join (first fit among them): an older group's run holds so
#: much of the graph that a later op rarely fits it, and looking at every group would make
#: planning a walk of thousands of ops quadratic.
OPEN_GROUPS = 64


@dataclass(frozen=True)
class StopPlanInput:
    """What :func:`stop_groups` plans from, for the tasks of one phase.

    ``closure[t]``: a bit mask of task ``t`` and every task it waits for (bit ``u`` for task
    ``u``); ``writes[t]``: the device byte ranges ``(start, end)`` task ``t`` writes;
    ``op_tasks[op]``: the tasks an op launched; ``op_outputs[op]``: the device byte ranges its
    outputs lie in (what a stop reads).
    """

    closure: Sequence[int]
    writes: Sequence[Sequence[tuple[int, int]]]
    op_tasks: dict[int, list[int]]
    op_outputs: dict[int, list[tuple[int, int]]]


def closures(n: int, edges) -> list[int]:
    """Per task of ``n``, the bit mask of itself and every task it waits for, from ``edges``
    ``(u, v)`` (``v`` waits for ``u``), which must go forward in task order as a schedule's do
    (:func:`nimble.analysis.deps.ancestors`; ValueError otherwise)."""
    dag = dag_from_edges(n, edges, what="schedule edge (backward or out of range)")
    return [a | 1 << t for t, a in enumerate(ancestors(dag))]


def _writers(plan: StopPlanInput) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every write range as three arrays: its start, its end, its task."""
    starts, ends, owners = [], [], []
    for t, ranges in enumerate(plan.writes):
        for a, b in ranges:
            if b > a:
                starts.append(a)
                ends.append(b)
                owners.append(t)
    return (np.asarray(starts, dtype=np.uint64), np.asarray(ends, dtype=np.uint64),
            np.asarray(owners, dtype=np.int64))


def clobbers(plan: StopPlanInput) -> dict[int, int]:
    """Per op, the bit mask of the tasks that write a byte of its outputs and are neither its
    own nor one it waits for: a run holding any of them may leave other values there."""
    starts, ends, owners = _writers(plan)
    out: dict[int, int] = {}
    for op, tasks in plan.op_tasks.items():
        own = 0
        for t in tasks:
            own |= plan.closure[t]
        hit = np.zeros(len(owners), dtype=bool)
        for a, b in plan.op_outputs.get(op, []):
            if b > a:
                hit |= (starts < np.uint64(b)) & (ends > np.uint64(a))
        mask = 0
        for t in np.unique(owners[hit]).tolist():
            mask |= 1 << t
        out[op] = mask & ~own
    return out


def stop_groups(ops: Sequence[int], plan: StopPlanInput,
                limit: int = GROUP_LIMIT) -> list[list[int]]:
    """``ops`` (a walk's order) cut into groups of at most ``limit``, each op in the first
    group it fits (first fit), such that a run of every member's tasks and what they wait for
    leaves each member's outputs as its own tasks wrote them; the groups in the order of their
    first member, each in the walk's order.  An op with no task is a group of its own.  Ops on
    other branches of a wide network share runs with ops far before them, so first fit makes
    fewer runs than cutting the walk into consecutive pieces."""
    clobber = clobbers(plan)
    groups: list[list[int]] = []
    ran: list[int] = []  # per group, the tasks its run holds
    for op in ops:
        tasks = plan.op_tasks.get(op, [])
        mine = 0
        for t in tasks:
            mine |= plan.closure[t]
        for g in range(max(0, len(groups) - OPEN_GROUPS), len(groups)):
            group = groups[g]
            if not tasks or not ran[g] or len(group) >= limit:
                continue
            joined = ran[g] | mine
            if all(not joined & clobber[m] for m in group) and not joined & clobber[op]:
                group.append(op)
                ran[g] = joined
                break
        else:
            groups.append([op])
            ran.append(mine)
    return groups


def plan_input(graph, edges, bases: Sequence[int], outputs: dict[int, list]) -> StopPlanInput:
    """The planner's input for a one-phase ``graph`` (a TaskGraph) whose buffers live at
    ``bases`` (buffer id to device address) and whose schedule has ``edges``; ``outputs``: per
    op, the accesses a stop reads (its written ranges)."""
    n = len(graph.tasks)
    writes = [[(bases[a.buffer] + a.offset, bases[a.buffer] + a.end)
               for a in task.accesses if a.write] for task in graph.tasks]
    op_tasks: dict[int, list[int]] = {}
    for task in graph.tasks:
        if task.op is not None and task.op >= 0:
            op_tasks.setdefault(task.op, []).append(task.id)
    op_outputs = {op: [(bases[a.buffer] + a.offset, bases[a.buffer] + a.end)
                       for a in accesses] for op, accesses in outputs.items()}
    return StopPlanInput(closures(n, edges), writes, op_tasks, op_outputs)


def walk_groups(prepared, aligned, run_group):
    """The :class:`~nimble.debug.divergence.GroupedStops` of a walk over ``prepared`` (an
    inference graph, one phase) whose ``aligned`` ops are read from runs made by
    ``run_group(op indices)``; None where the schedule's edges do not all go forward in task
    order (then every op gets a stop of its own)."""
    from .divergence import GroupedStops

    graph = prepared.graph
    outputs = {op.index: [a for a, _ in op.pairs] for op in aligned}
    try:
        plan = plan_input(graph, prepared.schedule.edges(), prepared.bases, outputs)
    except ValueError:
        return None
    return GroupedStops(lambda ops: stop_groups(ops, plan), run_group)
