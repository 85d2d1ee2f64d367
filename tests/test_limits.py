"""The limits of a phase and the split of a measured run's executed path
(nimble.analysis.limits; no GPU)."""
from __future__ import annotations

import pytest

from helpers import FIXTURE_DIR
from nimble.analysis import limits, resources
from nimble.analysis.deps import build_dag, dag_from_edges, task_durations, transitive_reduction
from nimble.ir.taskgraph import TaskGraph


@pytest.mark.parametrize("blocks, sm_share, sms, share", [
    (132, 1.0, 132, 1.0), (66, 1.0, 132, 0.5), (264, 0.25, 132, 0.5), (10_000, 0.5, 132, 1.0),
    (1, 1 / 32, 132, 1 / (32 * 132)), (5, 0.0, 132, 0.0), (0, 0.25, 132, 0.0)])
def test_gpu_share(blocks, sm_share, sms, share):
    assert limits.gpu_share(blocks, sm_share, sms) == pytest.approx(share)


def test_phase_limits_of_a_diamond():
    # 0 -> {1, 2} -> 3; a single-stream launch took 30 µs for 22 µs of kernels: 2 µs a task
    dag = dag_from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)])
    got = limits.phase_limits(dag, [2.0, 10.0, 6.0, 4.0], 30.0, [1.0, 0.5, 0.5, 0.25])
    assert got.isolated_sum_us == 22.0
    assert got.critical_path_us == 16.0  # 0, 1, 3
    assert got.launch_us == pytest.approx(2.0)
    assert got.launch_aware_path_us == pytest.approx(22.0)  # three tasks of 2 µs more
    assert got.capacity_us == pytest.approx(2.0 + 5.0 + 3.0 + 1.0)
    assert got.tightest_us == pytest.approx(22.0)
    assert got.tightest == "launch-aware path"
    assert got.as_dict()["tightest_us"] == got.tightest_us
    assert got.as_dict()["tightest"] == "launch-aware path"
    # no launch cost: the path and the launch-aware path tie, and the path is named
    assert limits.phase_limits(dag, [2.0, 10.0, 6.0, 4.0], 0.0, [0.0] * 4).tightest == \
        "critical path"
    assert limits.phase_limits(dag, [2.0, 10.0, 6.0, 4.0], 0.0, [1.0] * 4).tightest == "capacity"


def test_no_launch_cost_without_a_single_stream_time_or_when_it_is_faster_than_the_sum():
    dag = dag_from_edges(2, [(0, 1)])
    for single in (0.0, 3.0):
        got = limits.phase_limits(dag, [2.0, 2.0], single, [0.0, 0.0])
        assert got.launch_us == 0.0 and got.launch_aware_path_us == got.critical_path_us == 4.0


def test_phase_limits_refuse_mismatched_lengths():
    with pytest.raises(ValueError, match="3 times and 2 shares for 2 tasks"):
        limits.phase_limits(dag_from_edges(2, []), [1.0, 1.0, 1.0], 0.0, [0.0, 0.0])


def test_path_breakdown_adds_up_to_the_makespan():
    # the path 0 -> 2 -> 3: 2 waits 1 µs after 0 and runs 2 µs longer than alone; 3 starts
    # before 2 ended (a start stamp's jitter): only its part after 2's end counts as running
    times = [(1.0, 4.0), (0.0, 9.0), (5.0, 10.0), (9.5, 12.0)]
    isolated = [3.0, 9.0, 3.0, 2.0]
    got = limits.path_breakdown(times, isolated, [0, 2, 3], begin=0.0)
    assert got.tasks == 3
    assert got.makespan_us == pytest.approx(12.0)
    assert got.wait_us == pytest.approx(1.0 + 1.0)  # before 0 from the phase's begin, before 2
    assert got.isolated_us == pytest.approx(8.0)
    assert got.stretch_us == pytest.approx((3.0 + 5.0 + 2.0) - 8.0)
    assert got.isolated_us + got.stretch_us + got.wait_us == pytest.approx(got.makespan_us)
    assert got.cross_stream_steps == 0  # no streams given
    # 0 and 2 on stream 0, 3 on stream 1: one step changes stream, with no wait (3 overlapped)
    streams = limits.path_breakdown(times, isolated, [0, 2, 3], 0.0, stream_of=[0, 1, 0, 1])
    assert (streams.cross_stream_steps, streams.cross_stream_wait_us) == (1, 0.0)
    streams = limits.path_breakdown(times, isolated, [0, 2, 3], 0.0, stream_of=[0, 1, 1, 1])
    assert (streams.cross_stream_steps, streams.cross_stream_wait_us) == (1, pytest.approx(1.0))
    assert limits.path_breakdown(times, isolated, []).tasks == 0


@pytest.mark.parametrize("name", ["nasnetalarge", "pnasnet5large", "googlenet"])
def test_limits_of_recorded_models(name):
    graph = TaskGraph.load(FIXTURE_DIR / f"{name}.json.gz")
    durations = task_durations(graph)
    assert durations is not None
    profiles = resources.profile_tasks(graph, resources.SmLimits(), durations)
    shares = [limits.gpu_share(p.blocks, p.occupancy.sm_share, 132)
              if p.occupancy is not None else 0.0 for p in profiles]
    assert all(0.0 <= s <= 1.0 for s in shares) and any(0.0 < s < 1.0 for s in shares)
    single = 1.1 * sum(durations)
    got = limits.phase_limits(transitive_reduction(build_dag(graph)), durations, single, shares)
    assert got.critical_path_us < got.launch_aware_path_us <= single + 1e-6
    assert got.capacity_us < got.isolated_sum_us
    assert got.launch_us == pytest.approx(0.1 * sum(durations) / len(durations))
