"""The real timeline's analysis (nimble.debug.timeline), on hand-made and simulated times (no GPU).

The GPU half (timestamp nodes in a rebuilt graph) is in tests/test_gpu_timeline.py; here: what a
set of measured (start, end) times says, and the stamp layout both halves agree on.
"""
from __future__ import annotations

import json
import struct

import pytest

from nimble.engine import kernels
from nimble.engine.build import stamp_slots
from nimble.analysis.deps import build_dag
from nimble.analysis.report import simulate
from nimble.analysis.schedule import Schedule, assign_streams
from nimble.ir.synthetic import branchy_graph
from nimble.ir.taskgraph import Task, TaskGraph
from nimble.debug.timeline import (Timeline, executed_critical_path, format_timeline,
                             merge_group_stamps, stamp_groups, times_from_stamps)


def _diamond():
    """0 -> (1 on stream 0, 2 on stream 1) -> 3; stream 1 starts late."""
    g = TaskGraph(meta={"model": "diamond"})
    g.tasks = [Task(i, "kernel", name=f"k{i}", short_name=f"k{i}") for i in range(4)]
    s = Schedule([0, 0, 1, 0], [[0, 1, 3], [2]], [(0, 2), (2, 3)], 4, 2)
    times = [(0.0, 10.0), (10.0, 30.0), (15.0, 25.0), (30.0, 40.0)]
    return g, s, times


def test_concurrency_idle_and_paths_of_a_diamond():
    g, s, times = _diamond()
    [p] = Timeline(g, s, times, plain_us=40.0, instrumented_us=44.0).summary()["phases"]
    assert p["makespan_us"] == 40.0 and p["work_us"] == 50.0
    assert p["concurrency"] == pytest.approx(1.25)
    assert p["busy_us"] == {0: 40.0, 1: 10.0}
    assert p["idle_us"] == {0: 0.0, 1: 0.0}
    assert p["executed_path"] == [0, 1, 3]  # 3 waited on 1 (ended at 30), not on 2 (25)
    assert p["planned_path_us"] == 40.0 and p["planned_path_tasks"] == 3
    text = format_timeline(Timeline(g, s, times, 40.0, 44.0).summary())
    assert "achieved concurrency 1.25" in text and "+10%" in text


def test_gaps_inside_a_stream_count_as_idle_and_overlaps_once():
    g, s, _ = _diamond()
    times = [(0.0, 10.0), (12.0, 20.0), (11.0, 14.0), (19.0, 30.0)]  # 1 and 3 overlap by 1 µs
    [p] = Timeline(g, s, times).summary()["phases"]
    assert p["busy_us"][0] == pytest.approx(10.0 + 18.0)
    assert p["idle_us"][0] == pytest.approx(2.0)


def test_a_measured_trace_has_a_track_per_stream_and_an_arrow_per_sync():
    g, s, times = _diamond()
    trace = Timeline(g, s, times).to_chrome()
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["tid"], e["ts"], e["dur"]) for e in slices] == \
        [(0, 0.0, 10.0), (0, 10.0, 20.0), (1, 15.0, 10.0), (0, 30.0, 10.0)]
    assert sum(e["ph"] == "s" for e in trace["traceEvents"]) == len(s.sync_edges)
    assert trace["otherData"]["simulated"] is False


def test_late_edges_are_followed_by_both_paths_drawn_as_arrows_and_kept_in_the_trace():
    # The backfill deferred task 1 behind task 2 (a late edge goes against task order, from the
    # later anchor to the earlier task): 1 started when 2 ended, and 3 waited on 1.
    g, s, _ = _diamond()
    times = [(0.0, 10.0), (18.0, 38.0), (10.0, 18.0), (38.0, 48.0)]
    plain = Timeline(g, s, times).summary()["phases"][0]
    assert plain["executed_path"] == [0, 1, 3] and plain["planned_path_us"] == 40.0
    late = Timeline(g, s, times, late_edges=[(2, 1)])
    [p] = late.summary()["phases"]
    assert p["executed_path"] == [0, 2, 1, 3] and p["late_edges"] == 1
    assert p["planned_path_us"] == 48.0 and p["planned_path_tasks"] == 4
    assert "through 1 late edges" in format_timeline(late.summary())
    trace = late.to_chrome()
    arrows = [(e["ph"], e["tid"], e["ts"]) for e in trace["traceEvents"]
              if e.get("name") == "late"]
    assert arrows == [("s", 1, 10.0), ("f", 0, 18.0)]
    again = Timeline.from_chrome(json.loads(json.dumps(trace)))
    assert again.late_edges == [(2, 1)]
    assert again.summary()["phases"][0]["executed_path"] == [0, 2, 1, 3]
    with pytest.raises(ValueError, match="cycle"):
        Timeline(g, s, times, late_edges=[(3, 0)]).summary()


def test_on_the_simulated_schedule_the_executed_path_is_the_planned_one():
    g = branchy_graph(stages=3, branches=4, depth=3)
    for t in g.tasks:
        t.duration_us = 1.0 + (t.id * 7919 % 13)
    s = assign_streams(build_dag(g))
    times = simulate(g, s)
    [p] = Timeline(g, s, times).summary()["phases"]
    assert p["makespan_us"] == pytest.approx(p["planned_path_us"])
    path = executed_critical_path(s, times)
    assert sum(times[t][1] - times[t][0] for t in path) == pytest.approx(p["makespan_us"])


def test_phases_are_summarised_apart():
    g, s, times = _diamond()
    s.phases = [2, 2]
    s.sync_edges = []
    s.streams, s.stream_of = [[0, 1], [2, 3]], [0, 0, 1, 1]
    s.barrier_edges = [(1, 2)]
    rows = Timeline(g, s, [(0, 5), (5, 9), (0, 3), (3, 4)]).summary()["phases"]
    assert [(r["name"], r["tasks"], r["makespan_us"]) for r in rows] == \
        [("forward", 2, 9), ("backward", 2, 4)]


def test_stamps_are_16_bytes_a_task_start_then_end():
    span = range(3, 6)
    assert stamp_slots(span, 0x1000) == {3: (0x1000, 0x1008), 4: (0x1010, 0x1018),
                                         5: (0x1020, 0x1028)}
    raw = struct.pack("<6Q", 5000, 9000, 7000, 8000, 9500, 12000)
    assert times_from_stamps(raw, span) == [(0.0, 4.0), (2.0, 3.0), (4.5, 7.0)]


def test_a_start_stamp_that_ran_late_is_held_between_the_ready_time_and_the_end():
    # 3 -> 4 -> 5 in span 3..5; 4's start stamp ran after 4 ended, 5's before 4 (its only
    # predecessor) ended; 3 is a root whose start stamp came after its own end.
    span = range(3, 6)
    raw = struct.pack("<6Q", 6000, 5000, 9500, 9000, 8000, 12000)
    assert times_from_stamps(raw, span, [(3, 4), (4, 5)]) == [
        (0.0, 0.0), (4.0, 4.0), (4.0, 7.0)]
    for start, end in times_from_stamps(raw, span, [(3, 4), (4, 5)]):
        assert 0.0 <= start <= end


def test_the_timestamp_kernel_takes_one_slot_and_reads_the_global_timer():
    text = kernels.source("timestamp.ptx").decode()
    entry = text[text.index(".entry " + kernels.TIMESTAMP):]
    assert entry[:entry.index(")")].count(".param .u64") == 1
    assert "%globaltimer" in entry and "st.global.u64" in entry


def test_a_saved_trace_is_summarised_offline_by_inspect(tmp_path, capsys):
    import json

    import nimble.cli.main as cli

    g, s, times = _diamond()
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(Timeline(g, s, times, 40.0, 44.0).to_chrome()))
    again = Timeline.from_chrome(json.loads(path.read_text()))
    assert again.summary()["phases"][0]["concurrency"] == pytest.approx(1.25)
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "achieved concurrency 1.25" in out and "+10%" in out
    # a simulated trace carries no measurements: one line, status 2
    from nimble.analysis.report import to_chrome_trace
    sim = tmp_path / "sim.json"
    sim.write_text(json.dumps(to_chrome_trace(g, s, times)))
    assert cli.main(["inspect", str(sim)]) == 2
    assert "not a measured Nimble timeline" in capsys.readouterr().err


def test_a_dependency_the_run_broke_is_reported():
    g, s, times = _diamond()
    ok = Timeline(g, s, times)
    assert ok.overlapped([(0, 1), (0, 2), (1, 3), (2, 3)]) == []
    # 3 started at 20 while 2 (which it depends on) ran until 25: a missing synchronization
    raced = Timeline(g, s, [(0.0, 10.0), (10.0, 20.0), (15.0, 25.0), (20.0, 30.0)])
    assert raced.overlapped([(0, 1), (0, 2), (1, 3), (2, 3)]) == [(2, 3)]


def test_stamp_groups_split_each_stream_evenly_and_cover_every_task_once():
    g = branchy_graph()
    s = assign_streams(build_dag(g))
    groups = stamp_groups(s, 3)
    assert sorted(t for grp in groups for t in grp) == list(range(len(g.tasks)))
    for stream in s.streams:
        counts = [len(set(stream) & grp) for grp in groups]
        assert max(counts) - min(counts) <= 1
    assert stamp_groups(s, 1) == [set(range(len(g.tasks)))]
    with pytest.raises(ValueError):
        stamp_groups(s, 0)


def test_runs_of_stamp_groups_are_joined_on_their_own_root_starts():
    """Two runs 1 s apart: each task's stamps come from the run that took them, measured from
    that run's root start, so the joined times are those of one run."""
    span = range(3)  # 0 is the root; 1 and 2 follow it
    run_a_origin, run_b_origin = 5_000_000_000, 6_000_000_000

    def block(origin, stamped):
        values = [0] * 6
        values[0] = origin  # every run stamps the root's start
        ends = {0: 10_000, 1: 30_000, 2: 25_000}
        for t in stamped:
            values[2 * t + 1] = origin + ends[t]
        return struct.pack("<6Q", *values)

    raw = merge_group_stamps([block(run_a_origin, {0, 2}), block(run_b_origin, {1})],
                             [{0, 2}, {1}], span, roots={0})
    times = times_from_stamps(raw, span, [(0, 1), (0, 2)])
    assert times == [(0.0, 10.0), (10.0, 30.0), (10.0, 25.0)]
