"""Fitting a schedule into the arena limit: workspace chains before lower stream caps (CPU, on the
recorded training steps)."""
from __future__ import annotations

import pytest

from nimble import TaskGraph
from nimble.analysis.deps import build_dag, reachability
from nimble.analysis.arena_fit import (capped_schedule, chain_workspaces, schedule_length, schedule_within,
                        workspace_bytes)
from nimble.analysis.plan_check import check_plan
from nimble.analysis.schedule import assign_phased, phase_spans

from helpers import FIXTURE_DIR

MB = 1 << 20


@pytest.fixture(scope="module")
def resnet50_train() -> TaskGraph:
    return TaskGraph.load(FIXTURE_DIR / "resnet50_train.json.gz")


def ordered(reach: list[int], u: int, v: int) -> bool:
    return bool(reach[u] >> v & 1 or reach[v] >> u & 1)


def test_workspace_bytes_counts_each_scratch_buffer_of_a_task_once(resnet50_train):
    sizes = {b.id: b.size for b in resnet50_train.buffers if b.kind == "scratch"}
    workspaces = workspace_bytes(resnet50_train)
    for task, total in zip(resnet50_train.tasks, workspaces):
        assert total == sum(sizes.get(b, 0) for b in {a.buffer for a in task.accesses})
    assert max(workspaces) >= 8 * MB  # cuDNN's convolution workspaces


def test_a_chain_orders_the_large_workspace_tasks_of_the_chosen_phases_only(resnet50_train):
    graph = resnet50_train
    dag = build_dag(graph)
    workspaces = workspace_bytes(graph)
    fwd, bwd = phase_spans(graph.meta["phases"], len(graph.tasks))
    chained, count = chain_workspaces(graph, dag, 4 * MB, workspaces, phases=[1])
    big = [t for t in bwd if workspaces[t] >= 4 * MB]
    assert count == len(big) >= 10
    assert set(dag.edges()) <= set(chained.edges())  # only ordering is added
    reach_before, reach = reachability(dag), reachability(chained)
    assert all(ordered(reach, u, v) for i, u in enumerate(big) for v in big[i + 1:])
    assert not all(ordered(reach_before, u, v) for i, u in enumerate(big) for v in big[i + 1:])
    # The forward is left alone: its large-workspace tasks stay as unordered as they were.
    fwd_big = [t for t in fwd if workspaces[t] >= 4 * MB]
    assert all(ordered(reach, u, v) == ordered(reach_before, u, v)
               for i, u in enumerate(fwd_big) for v in fwd_big[i + 1:])
    both, both_count = chain_workspaces(graph, dag, 4 * MB, workspaces)
    assert both_count == len(big) + len(fwd_big)
    # A threshold above every workspace adds nothing.
    same, none = chain_workspaces(graph, dag, max(workspaces) + 1, workspaces)
    assert none == 0 and same is dag


def test_a_workspace_chain_beats_a_lower_cap_within_the_pool(resnet50_train):
    """resnet50's training step needs more than torch's pool with every phase uncapped.  The cap
    alone fits by narrowing the backward; chaining the backward's big-workspace convolutions
    instead keeps more of its streams and shortens the schedule's critical path."""
    graph = resnet50_train
    pool = graph.meta["pool_bytes"]
    dag = build_dag(graph)
    fwd, bwd = phase_spans(graph.meta["phases"], len(graph.tasks))
    cap_alone = capped_schedule(graph, dag, None, pool)
    assert cap_alone.fits and cap_alone.lowered == {1}
    schedule, plan = schedule_within(graph, None, pool)
    check_plan(graph, schedule.edges(), plan)
    assert plan.arena_bytes <= pool
    n = len(graph.tasks)
    assert schedule_length(schedule, n, None) < schedule_length(cap_alone.schedule, n, None)
    width = [len({schedule.stream_of[t] for t in span}) for span in (fwd, bwd)]
    cap_width = [len({cap_alone.schedule.stream_of[t] for t in span}) for span in (fwd, bwd)]
    assert width[0] == cap_width[0]  # the forward keeps its full width either way
    assert width[1] > cap_width[1]


def test_durations_pick_among_the_schedules_that_fit(resnet50_train):
    """With task times, the winner is the one with the shortest critical path in µs: weighting
    one backward convolution's kernels heavily cannot make the search return a longer schedule
    than the cap alone."""
    graph = resnet50_train
    pool = graph.meta["pool_bytes"]
    workspaces = workspace_bytes(graph)
    durations = [100.0 if w >= 4 * MB else 1.0 for w in workspaces]
    n = len(graph.tasks)
    cap_alone = capped_schedule(graph, build_dag(graph), None, pool)
    schedule, plan = schedule_within(graph, None, pool, durations)
    assert plan.arena_bytes <= pool
    assert schedule_length(schedule, n, durations) <= schedule_length(cap_alone.schedule, n,
                                                                      durations)


def test_task_times_are_asked_for_once_and_only_where_the_limit_binds(resnet50_train):
    """prepare() times the tasks (seconds of GPU work) for the search even with kernel
    priorities off, so that both settings pick the same schedule; a graph that fits uncapped
    needs no times."""
    graph = resnet50_train
    pool = graph.meta["pool_bytes"]
    durations = [100.0 if w >= 4 * MB else 1.0 for w in workspace_bytes(graph)]
    asked = []

    def timer():
        asked.append(1)
        return durations
    lazy = schedule_within(graph, None, pool, timer)
    given = schedule_within(graph, None, pool, durations)
    assert len(asked) == 1
    assert lazy[0].stream_of == given[0].stream_of and lazy[0].edges() == given[0].edges()
    small = TaskGraph.load(FIXTURE_DIR / "mobilenet_v2_train.json.gz")
    schedule_within(small, None, small.meta["pool_bytes"], timer)
    assert len(asked) == 1


def test_a_schedule_that_fits_uncapped_is_left_as_it_is():
    graph = TaskGraph.load(FIXTURE_DIR / "mobilenet_v2_train.json.gz")
    dag = build_dag(graph)
    free = assign_phased(dag, graph.meta["phases"])
    schedule, plan = schedule_within(graph, None, graph.meta["pool_bytes"])
    assert schedule.stream_of == free.stream_of and schedule.edges() == free.edges()
