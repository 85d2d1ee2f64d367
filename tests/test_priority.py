"""Kernel priorities from slack (CPU): the weighted longest path, slack and the level mapping."""
from __future__ import annotations

import pytest

from nimble.analysis.deps import critical_path, dag_from_edges
from nimble.analysis.arena_fit import schedule_within
from nimble.analysis.priorities import (SLACK_BOUNDS, driver_priorities, priority_levels, slack)
from nimble.ir.taskgraph import TaskGraph

from helpers import FIXTURE_DIR, random_dag


def test_slack_of_a_diamond_is_the_shorter_branch_s_spare_time():
    """0 -> {1 (10 us), 2 (4 us)} -> 3: branch 2 may wait 6 us, the rest bound the run."""
    timing = slack(4, [(0, 1), (0, 2), (1, 3), (2, 3)], [1.0, 10.0, 4.0, 2.0])
    assert timing.length == 13.0
    assert timing.earliest == [0.0, 1.0, 1.0, 11.0]
    assert timing.slack == [0.0, 0.0, 6.0, 0.0]


def test_a_sink_off_the_path_has_slack_up_to_the_end():
    """A weight gradient: produced early, needed by nothing after it."""
    timing = slack(4, [(0, 1), (1, 2), (0, 3)], [5.0, 5.0, 5.0, 1.0])
    assert timing.slack[3] == 9.0
    levels = priority_levels(4, [(0, 1), (1, 2), (0, 3)], [5.0, 5.0, 5.0, 1.0], 6)
    assert levels[:3] == [0, 0, 0] and levels[3] == 5


@pytest.mark.parametrize("seed", range(5))
def test_the_weighted_critical_path_has_no_slack_and_nothing_has_negative_slack(seed):
    dag = random_dag(300, 3, 40, seed)
    edges = [(u, v) for v in range(dag.n) for u in dag.preds[v]]
    durations = [float((7 * t + seed) % 13 + 1) for t in range(dag.n)]
    timing = slack(dag.n, edges, durations)
    path = critical_path(dag, durations)
    assert timing.length == pytest.approx(path.length)
    assert all(timing.slack[t] == pytest.approx(0.0) for t in path.tasks)
    assert min(timing.slack) >= 0.0
    for u, v in edges:  # a task starts no earlier than its predecessors end
        assert timing.earliest[v] >= timing.earliest[u] + durations[u] - 1e-9


def test_levels_follow_the_bounds_and_fewer_levels_keep_the_finest():
    """A chain of 100 one-µs tasks, and beside it one side task per level whose slack lies
    between that level's bounds: each side task gets its own level."""
    chain = 100
    lower = (0.0,) + SLACK_BOUNDS
    upper = SLACK_BOUNDS + (0.9,)
    fractions = [(a + b) / 2 for a, b in zip(lower, upper)]
    edges = [(t, t + 1) for t in range(chain - 1)]
    durations = [1.0] * chain
    for k, f in enumerate(fractions):  # after task 0, ends f * 100 µs before the chain
        edges.append((0, chain + k))
        durations.append(chain - 1 - f * chain)
    n = len(durations)
    levels = priority_levels(n, edges, durations, len(SLACK_BOUNDS) + 1)
    assert levels[:chain] == [0] * chain
    assert levels[chain:] == list(range(len(SLACK_BOUNDS) + 1))
    assert priority_levels(n, edges, durations, 1) == [0] * n
    assert priority_levels(n, edges, durations, 2)[chain:] == [0] + [1] * len(SLACK_BOUNDS)


def test_each_phase_of_a_training_step_has_its_own_slack():
    """Forward 0 -> 2 (5 us each) beside a 1 us task 1 whose output the backward's first task
    reads; backward 3 -> 4 -> 5 (10 us each), whose last task reads task 2's output.  Over both
    phases as one DAG, 1 -> 3 -> 4 -> 5 is the longest path and 0 -> 2 may wait; but the
    backward launches after the whole forward, so inside the forward it is the other way round."""
    edges = [(0, 2), (1, 3), (3, 4), (4, 5), (2, 5)]
    durations = [5.0, 1.0, 5.0, 10.0, 10.0, 10.0]
    joined = priority_levels(6, edges, durations, 6)
    phased = priority_levels(6, edges, durations, 6, [range(0, 3), range(3, 6)])
    assert joined == [5, 0, 5, 0, 0, 0]
    assert phased == [0, 5, 0, 0, 0, 0]
    with pytest.raises(ValueError):
        priority_levels(6, edges, durations, 6, [range(0, 3)])


def test_the_length_of_a_phased_schedule_adds_its_phases_critical_paths():
    from nimble.analysis.arena_fit import schedule_length
    from nimble.engine.prepared import single_stream_schedule

    one = single_stream_schedule(6, [3, 3])
    assert schedule_length(one, 6, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == 21.0


def test_driver_numbers_run_from_greatest_to_least():
    assert driver_priorities([0, 1, 5, 9], least=0, greatest=-5) == [-5, -4, 0, 0]
    assert driver_priorities([0, 3], least=0, greatest=0) == [0, 0]
    with pytest.raises(ValueError):
        driver_priorities([0], least=-5, greatest=0)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="durations"):
        slack(3, [], [1.0])
    with pytest.raises(ValueError, match="forward"):
        slack(3, [(2, 1)], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="levels"):
        priority_levels(1, [], [1.0], 0)


@pytest.mark.parametrize("name", ["resnet50_train", "mobilenet_v2_train"])
def test_training_step_weight_gradients_rank_below_the_critical_path(name):
    """In a recorded training step scheduled as Nimble builds it, the critical path gets the
    top level and the backward has tasks (weight gradients) at lower levels."""
    graph = TaskGraph.load(FIXTURE_DIR / f"{name}.json.gz")
    schedule, _ = schedule_within(graph, None, graph.meta["pool_bytes"])
    n = len(graph.tasks)
    durations = [float(t.duration_us) if t.duration_us is not None else
                 max(1.0, t.grid[0] * t.grid[1] * t.grid[2] / 132) for t in graph.tasks]
    levels = priority_levels(n, schedule.edges(), durations, 6)
    path = critical_path(dag_from_edges(n, schedule.edges()), durations)
    assert all(levels[t] == 0 for t in path.tasks)
    backward = range(graph.meta["phases"][0], n)
    assert any(levels[t] == len(SLACK_BOUNDS) for t in backward)
