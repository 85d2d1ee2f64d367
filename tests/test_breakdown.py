"""Where a step's time goes (nimble.debug.breakdown), on hand-made and simulated timelines (no
GPU): busy and idle time, the gaps between dependent tasks, each kernel's bytes and rate, the
step's weights over its makespan (issue 53)."""
from __future__ import annotations

import pytest

from helpers import FIXTURE_DIR
from nimble.analysis.deps import dag_from_edges, topological_order
from nimble.analysis.report import analyze
from nimble.analysis.schedule import Schedule
from nimble.debug.breakdown import format_breakdown, step_breakdown, touched_bytes
from nimble.debug.timeline import Timeline
from nimble.ir.taskgraph import Access, Buffer, Task, TaskGraph

MB = 1 << 20


def _diamond():
    """0 -> (1 on stream 0, 2 on stream 1) -> 3; 1 and 2 read a weight each, 0 writes an
    activation that 1 and 2 read (twice, overlapping), 3 a memset."""
    g = TaskGraph(meta={"model": "diamond"})
    g.buffers = [Buffer(0, "param", 4 * MB, 0x1000_0000, "w1"),
                 Buffer(1, "param", 2 * MB, 0x2000_0000, "w2"),
                 Buffer(2, "intermediate", MB, 0x3000_0000)]
    act = [Access(2, 0, MB // 2, False), Access(2, MB // 4, MB // 2, False)]  # 3/4 MB
    g.tasks = [Task(0, "kernel", short_name="embed", accesses=[Access(2, 0, MB, True)]),
               Task(1, "kernel", short_name="gemm", accesses=[Access(0, 0, 4 * MB, False), *act]),
               Task(2, "kernel", short_name="gemm", accesses=[Access(1, 0, 2 * MB, False), *act]),
               Task(3, "memset", accesses=[Access(2, 0, MB, True)])]
    s = Schedule([0, 0, 1, 0], [[0, 1, 3], [2]], [(0, 2), (2, 3)], 4, 2)
    # 1 starts 2 µs after 0 ends, 2 starts 5 µs after; 3 waits 1 µs for 1 (the later end)
    times = [(0.0, 10.0), (12.0, 30.0), (15.0, 25.0), (31.0, 40.0)]
    return g, s, times


def test_a_diamonds_busy_time_gaps_and_path():
    g, s, times = _diamond()
    b = step_breakdown(Timeline(g, s, times), copy_bytes_per_s=1e12)
    assert b.makespan_us == 40.0 and b.busy_us == pytest.approx(10 + 18 + 9)
    assert b.idle_us == pytest.approx(3.0)
    assert b.work_us == pytest.approx(10 + 18 + 10 + 9)
    assert b.concurrency == pytest.approx(47 / 40)
    # waits: 1 after 0 (2 µs), 2 after 0 (5 µs), 3 after 1, which ended last (1 µs)
    assert (b.gaps.count, b.gaps.total_us, b.gaps.median_us, b.gaps.max_us) == (3, 8.0, 2.0, 5.0)
    assert b.path_tasks == 3 and b.path_busy_us == pytest.approx(37.0)
    assert b.path_gaps.count == 2 and b.path_gaps.total_us == pytest.approx(3.0)
    # the path's busy time and its gaps make the makespan
    assert b.path_busy_us + b.path_gaps.total_us == b.makespan_us


def test_a_kernels_bytes_count_each_range_once_and_its_rate_is_over_its_own_time():
    g, s, times = _diamond()
    b = step_breakdown(Timeline(g, s, times), copy_bytes_per_s=1e12)
    assert [k.task for k in b.kernels] == [0, 1, 2]  # the memset is no kernel
    gemm = b.kernels[1]
    assert gemm.weight_bytes == 4 * MB and gemm.bytes == 4 * MB + 3 * MB // 4
    assert gemm.bytes_per_s == pytest.approx(gemm.bytes / 18e-6)
    assert b.weight_bytes == 6 * MB and b.step_bytes == 7 * MB
    assert touched_bytes(g, [1, 2]) == 6 * MB + 3 * MB // 4
    assert b.weights_per_s == pytest.approx(6 * MB / 40e-6)
    [gemms, embed] = b.groups()
    assert (gemms.name, gemms.count, gemms.us) == ("gemm", 2, 28.0)
    assert gemms.bytes == (4 + 2) * MB + 2 * (3 * MB // 4)
    summary = b.summary()
    assert summary["weights_of_copy"] == pytest.approx(b.weights_per_s / 1e12)
    assert summary["by_name"][0]["of_copy"] == pytest.approx(gemms.bytes_per_s / 1e12)
    text = format_breakdown(b)
    assert "4 tasks in 40.0 µs: busy 37.0 µs, idle 3.0 µs; achieved concurrency 1.18" in text
    assert "gaps between dependent tasks: 3, 8.0 µs in all, median 2.00 µs" in text
    assert "executed critical path: 3 tasks, 37.0 µs busy, 3.0 µs in 2 gaps" in text
    assert "2 x gemm" in text and "% of copy" in text


def test_a_rate_above_the_copy_rate_says_the_kernel_names_more_than_it_reads():
    g, s, times = _diamond()
    text = format_breakdown(step_breakdown(Timeline(g, s, times), copy_bytes_per_s=1e9))
    assert "names more than it reads" in text
    assert "% of copy" not in format_breakdown(step_breakdown(Timeline(g, s, times)))


def test_a_recorded_decoders_gaps_add_up_along_its_path():
    """The small Llama's recording, each task started a fixed wait after its last
    predecessor: every wait is that gap, and the path's busy time and gaps are its makespan."""
    g = TaskGraph.load(FIXTURE_DIR / "llama_small_float16.json.gz")
    s = analyze(g).schedule
    wait = 1.3
    edges = s.edges()
    preds: dict[int, list[int]] = {}
    for u, v in edges:
        preds.setdefault(v, []).append(u)
    times: list[tuple[float, float]] = [(0.0, 0.0)] * len(g.tasks)
    for t in topological_order(dag_from_edges(len(g.tasks), edges, ordered=False)):
        start = max((times[u][1] + wait for u in preds.get(t, ())), default=0.0)
        times[t] = (start, start + g.tasks[t].duration_us)
    b = step_breakdown(Timeline(g, s, times), copy_bytes_per_s=4e12)
    assert b.gaps.count == len(preds) and b.gaps.median_us == pytest.approx(wait)
    assert b.path_gaps.total_us == pytest.approx(wait * (b.path_tasks - 1))
    assert b.path_busy_us + b.path_gaps.total_us == pytest.approx(b.makespan_us)
    accessed = {a.buffer for t in g.tasks for a in t.accesses
                if g.buffers[a.buffer].kind == "param"}
    assert b.weight_bytes == sum(g.buffers[i].size for i in accessed)
    assert len(b.kernels) == len(g.kernel_tasks())


def test_a_graph_of_another_size_or_a_missing_phase_is_refused():
    g, s, times = _diamond()
    other = TaskGraph(tasks=g.tasks[:3], buffers=g.buffers)
    with pytest.raises(ValueError, match="the graph has 3 tasks and the timeline 4"):
        step_breakdown(Timeline(g, s, times), other)
    with pytest.raises(ValueError, match="no phase 1"):
        step_breakdown(Timeline(g, s, times), phase=1)


def test_the_longest_waits_are_named_with_the_tasks_on_each_side():
    g, s, times = _diamond()
    b = step_breakdown(Timeline(g, s, times))
    # 2 waits 5 µs for 0; 1 waits 2 µs for 0; 3 waits 1 µs for 1, which ended after 2
    assert [(x.task, x.after, x.us) for x in b.largest_gaps] == [(2, 0, 5.0), (1, 0, 2.0),
                                                                 (3, 1, 1.0)]
    assert (b.largest_gaps[0].name, b.largest_gaps[0].after_name) == ("gemm", "embed")
    assert b.largest_gaps[2].name == "memset"
    assert b.summary()["largest_gaps"][0] == {"task": 2, "name": "gemm", "after": 0,
                                              "after_name": "embed", "us": 5.0}
    lines = format_breakdown(b).splitlines()
    assert lines[1].startswith("  gaps between dependent tasks")
    assert lines[2] == "       5.00 µs before task 2 (gemm), after task 0 (embed)"


def _filling_chain():
    """0 -> 1 -> 2 on one stream: kernel 1 reads a 64 MB weight; its start was stamped 15 µs
    after kernel 0 ended, 3 µs before its own end."""
    g = TaskGraph()
    g.buffers = [Buffer(0, "param", 64 * MB, 0x1000_0000, "w"),
                 Buffer(1, "intermediate", MB, 0x3000_0000)]
    g.tasks = [Task(0, "kernel", short_name="norm", accesses=[Access(1, 0, MB, True)]),
               Task(1, "kernel", short_name="gemm", accesses=[Access(0, 0, 64 * MB, False),
                                                              Access(1, 0, MB, False)]),
               Task(2, "kernel", short_name="act", accesses=[Access(1, 0, MB, True)])]
    s = Schedule([0, 0, 0], [[0, 1, 2]], [], 3, 1)
    return g, s, [(0.0, 2.0), (17.0, 20.0), (20.5, 22.0)]


def test_a_start_too_late_for_the_weights_it_read_is_taken_as_the_ready_time():
    """64 MB in 3 µs is 22 TB/s, past a 4 TB/s copy and with more weight than a 60 MB L2
    holds: the stamp beside a kernel that fills the GPU ran late, so the kernel is taken to
    have run from its predecessor's end, and no gap is counted before it."""
    g, s, times = _filling_chain()
    b = step_breakdown(Timeline(g, s, times), copy_bytes_per_s=4e12, l2_bytes=60 * MB)
    assert b.late_starts == [1]
    gemm = b.kernels[1]
    assert gemm.us == pytest.approx(18.0) and gemm.bytes_per_s < 4e12
    assert (b.gaps.count, b.gaps.total_us) == (2, pytest.approx(0.5))
    assert b.busy_us == pytest.approx(21.5) and b.idle_us == pytest.approx(0.5)
    assert "starts taken as their ready times" in format_breakdown(b)
    assert b.summary()["late_starts"] == [1]


@pytest.mark.parametrize("copy, l2", [(4e12, None), (None, 60 * MB), (4e12, 80 * MB),
                                      (30e12, 60 * MB)])
def test_a_start_stays_as_stamped_without_both_rates_or_where_the_weights_could_stream(copy, l2):
    """No L2 size or no copy rate: nothing to hold the stamp against; a weight the L2 holds
    may be read faster than the copy; within the copy rate the stamp may be right."""
    g, s, times = _filling_chain()
    b = step_breakdown(Timeline(g, s, times), copy_bytes_per_s=copy, l2_bytes=l2)
    assert b.late_starts == [] and b.kernels[1].us == pytest.approx(3.0)
    assert b.gaps.total_us == pytest.approx(15.5)


def test_a_kernel_whose_accesses_name_no_byte_is_named_with_its_op():
    from nimble.ir.taskgraph import Op

    g, s, times = _filling_chain()
    g.ops = [Op(0, "triton_poi_fused_0")]
    g.tasks[2].accesses, g.tasks[2].op = [], 0
    b = step_breakdown(Timeline(g, s, times))
    assert b.nameless == [(2, "act", "triton_poi_fused_0")]
    assert "1 kernel(s) whose accesses name no byte: task 2 act (triton_poi_fused_0)" in \
        format_breakdown(b)
    assert step_breakdown(Timeline(*_filling_chain())).nameless == []


def test_a_small_kernel_that_runs_long_is_named_with_where_it_starts_and_what_it_waited_for():
    """A kernel of a few bytes that takes microseconds is latency, not bytes: the report names
    it, its start in the step, the predecessor it waited for and whether the path runs
    through it; a small kernel that runs briefly and a large one that runs long are not
    named."""
    from nimble.ir.taskgraph import Op

    g, s, times = _filling_chain()
    g.ops = [Op(0, "triton_poi_fused_0")]
    g.tasks[2].accesses, g.tasks[2].op = [Access(1, 0, 4096, True)], 0
    times[2] = (20.5, 27.0)  # 4 KiB in 6.5 µs
    b = step_breakdown(Timeline(g, s, times))
    assert [(k.task, k.op, k.bytes, k.after, k.on_path) for k in b.slow_small] == \
        [(2, "triton_poi_fused_0", 4096, 1, True)]
    assert b.slow_small[0].us == pytest.approx(6.5)
    assert b.slow_small[0].start_us == pytest.approx(20.5)
    text = format_breakdown(b)
    assert "1 small kernel(s) (at most 64 KiB touched) running 3 µs or more:" in text
    assert "task 2 act (triton_poi_fused_0): 6.50 µs from 20.5 µs, 4096 B, after task 1, " \
           "on the critical path" in text
    assert b.summary()["slow_small"][0]["task"] == 2
    times[2] = (20.5, 22.0)  # 1.5 µs: not slow
    assert step_breakdown(Timeline(g, s, times)).slow_small == []
    assert "small kernel" not in format_breakdown(step_breakdown(Timeline(*_filling_chain())))
