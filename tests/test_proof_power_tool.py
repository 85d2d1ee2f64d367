"""tools/proof_power.py's choice of trials and its static classification, on synthetic graphs
(the proof runs need the GPU: tests/test_gpu_proof_power.py)."""
from __future__ import annotations

import random

import pytest

from helpers import load_tool
from nimble.engine.prepared import plan_graph
from nimble.ir.synthetic import random_graph

power = load_tool("proof_power")

COUNTS = {"sync": 50, "war": 20, "share": 20}


@pytest.fixture(scope="module")
def planned():
    graph = random_graph(60, seed=1)
    schedule, plan = plan_graph(graph, True, None, None)
    return graph, schedule, plan


def test_the_trials_repeat_for_a_seed_and_differ_for_another(planned):
    graph, schedule, plan = planned
    first = power.plan_trials(graph, schedule, plan, 0, COUNTS)
    assert first == power.plan_trials(graph, schedule, plan, 0, COUNTS)
    assert first != power.plan_trials(graph, schedule, plan, 1, COUNTS)
    kinds = [t.kind for t in first]
    assert kinds.count("sync") == min(50, len(schedule.sync_edges))
    assert kinds.count("war") == 20 and kinds.count("share") == 20


def test_a_war_only_edge_reads_what_its_successor_writes_and_nothing_more(planned):
    graph, schedule, plan = planned
    edges = power.war_only_edges(graph, schedule.edges(), plan)
    assert edges
    for u, v in edges:
        pairs = [(x, y) for x in power._ranges(graph, plan.offsets, u)
                 for y in power._ranges(graph, plan.offsets, v)
                 if x[0] == y[0] and x[1] < y[2] and y[1] < x[2]]
        assert any(not x[3] and y[3] for x, y in pairs)
        assert not any(x[3] for x, _ in pairs)


def test_shared_buffers_have_overlapping_lifetimes(planned):
    graph, _, plan = planned
    live = power.lifetimes(graph)
    changes = power.share_changes(graph, plan, random.Random(0), 10)
    assert len(changes) == 10
    for change in changes:
        ((moved, offset),) = change.moved
        assert offset == plan.offsets[change.onto] != plan.offsets[moved]
        assert offset + graph.buffers[moved].size <= plan.arena_bytes
        (a0, a1), (b0, b1) = live[change.onto], live[moved]
        assert a0 <= b1 and b0 <= a1


def test_the_plan_check_tells_a_needed_removal_from_a_redundant_one(planned):
    graph, schedule, plan = planned
    edges = schedule.edges()
    u, v = schedule.sync_edges[0]
    is_needed, reason = power.needed(graph, edges, plan,
                                     power.Change("sync", removed_edges=frozenset({(u, v)})))
    assert is_needed and reason
    # another path from u to v (through a task between them) makes the edge redundant
    u, v = next((u, v) for u, v in schedule.sync_edges if v - u > 1)
    detour = edges + [(u, u + 1), (u + 1, v)]
    is_needed, reason = power.needed(graph, detour, plan,
                                     power.Change("sync", removed_edges=frozenset({(u, v)})))
    assert not is_needed and "other edges" in reason


def test_the_table_credits_each_fuzz_catch_to_its_kind_of_draw():
    sync = power.Change("sync", removed_edges=frozenset({(1, 2)}))
    summary = power.Summary("m", "float16", proof_seconds={"verify_served": 0.1},
                            verified={"fuzz_targets": 9, "fuzz_targets_held": 7})
    summary.trials = [
        power.Trial(sync, True, "", caught_fuzz=True, caught_by="chained", fuzz_launches=3),
        power.Trial(sync, True, "", caught_fuzz=True, caught_by="targeted", fuzz_launches=40),
        power.Trial(sync, True, "", caught_fuzz=True, caught_by="chained", fuzz_launches=5),
        power.Trial(sync, True, "", caught_plain=True, caught_fuzz=True, caught_by="plain"),
        power.Trial(sync, True, "", fuzz_launches=60, apart="1 unordered pair(s)"),
        power.Trial(sync, False, "redundant")]
    (row,) = summary.rows()
    assert row[3:8] == ["5", "1", "1/5", "4/5", "0/1 | 4/4"] and row[-1] == "chained 2, targeted 1"
    assert "targets held back 7/9" in power.table(summary)


def test_a_shared_overlap_within_one_task_is_counted_apart():
    share = power.Change("share", moved=((5, 0),), onto=4)
    one = ("buffers 4 and 5 share arena bytes [0, 64) but task 9 (on buffer 4) does not "
           "happen-before task 9 (on buffer 5): their lifetimes overlap")
    two = one.replace("task 9 (on buffer 5)", "task 11 (on buffer 5)")
    assert "task 9 touches both buffers" in power.one_task(share, one)
    assert power.one_task(share, two) == ""
    assert power.one_task(power.Change("sync"), one) == ""


def test_a_moved_buffer_gives_the_fuzzer_its_new_offset(planned):
    graph, _, plan = planned
    (change,) = power.share_changes(graph, plan, random.Random(0), 1)
    prepared = type("Prepared", (), {"memplan": plan})()
    offsets = power.offsets_of(prepared, change)
    ((moved, offset),) = change.moved
    assert offsets[moved] == offset and offsets.keys() == plan.offsets.keys()


def _two_writers(read_after: bool = False, one_reads: bool = False, output: bool = False):
    """Tasks 0 and 2 write bytes [0, 8) of buffer 0; task 1 sits between them (edges 0->1->2);
    with ``read_after`` task 3 reads those bytes after both; with ``one_reads`` task 2 only
    reads them; with ``output`` buffer 0 is a graph output."""
    from nimble.analysis.memplan import MemPlan
    from nimble.ir.taskgraph import Access, Buffer, Task, TaskGraph, TensorRef

    kind = "output" if output else "param"
    buffers = [Buffer(0, kind, 64, 0x1000), Buffer(1, "param", 64, 0x2000)]
    tasks = [Task(0, "kernel", accesses=[Access(0, 0, 8, True)]),
             Task(1, "kernel", accesses=[Access(1, 0, 8, True)]),
             Task(2, "kernel", accesses=[Access(0, 0, 8, not one_reads)])]
    if read_after:
        tasks.append(Task(3, "kernel", accesses=[Access(0, 0, 8, False)]))
    outputs = [TensorRef(0, 0, [2], [1], "float32")] if output else []
    graph = TaskGraph(tasks=tasks, buffers=buffers, outputs=outputs)
    edges = [(0, 1), (1, 2)] + ([(2, 3)] if read_after else [])
    return graph, edges, MemPlan(offsets={}, arena_bytes=0, buffer_bytes=0, lower_bound_bytes=0,
                              alignment=256)


def test_a_removal_whose_races_are_only_writes_of_untouched_bytes_is_told_apart():
    change = power.Change("sync", removed_edges=frozenset({(1, 2)}))
    graph, edges, plan = _two_writers()
    assert power.needed(graph, edges, plan, change)[0]
    why = power.write_write_only(graph, edges, plan, change)
    assert "tasks 0 and 2 on buffer 0 bytes [0, 8)" in why
    for shape in ({"read_after": True}, {"one_reads": True}, {"output": True}):
        graph, edges, plan = _two_writers(**shape)
        assert power.needed(graph, edges, plan, change)[0], shape
        assert power.write_write_only(graph, edges, plan, change) == "", shape
    graph, edges, plan = _two_writers()
    war = power.Change("war", frozenset({(1, 2)}))
    assert power.write_write_only(graph, edges, plan, war) == ""
