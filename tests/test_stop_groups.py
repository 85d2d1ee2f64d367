"""Several stops of a walk in one run (nimble.debug.stop_groups), and the walk that uses them
(nimble.debug.divergence), on plain data and stand-in runs (no GPU)."""
from __future__ import annotations

import random

import pytest
import torch

from nimble.debug.divergence import GroupedStops, first_divergence, first_nonfinite
from nimble.debug.eager_twins import align
from nimble.debug.step_through import Snapshot
from nimble.debug.stop_groups import StopPlanInput, closures, plan_input, stop_groups
from nimble.ir.taskgraph import Access, Op, Task, TaskGraph


def _plan(n: int, edges, writes, op_tasks=None, outputs=None) -> StopPlanInput:
    """Task ``k`` is op ``k`` and writes ``writes[k]``; an op's outputs are its task's writes."""
    op_tasks = op_tasks or {k: [k] for k in range(n)}
    outputs = outputs or {op: [r for t in ts for r in writes[t]] for op, ts in op_tasks.items()}
    return StopPlanInput(closures(n, edges), writes, op_tasks, outputs)


def _chain_edges(n: int):
    return [(k, k + 1) for k in range(n - 1)]


def test_closures_hold_every_task_waited_for_and_refuse_a_backward_edge():
    c = closures(4, [(0, 2), (1, 2), (2, 3)])
    assert c == [0b0001, 0b0010, 0b0111, 0b1111]
    with pytest.raises(ValueError, match="backward"):
        closures(3, [(2, 1)])


def test_ops_in_their_own_memory_share_runs_up_to_the_limit():
    n = 10
    writes = [[(100 * k, 100 * k + 16)] for k in range(n)]
    plan = _plan(n, _chain_edges(n), writes)
    assert stop_groups(range(n), plan) == [list(range(n))]
    assert stop_groups(range(n), plan, limit=4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_a_group_closes_before_a_task_reuses_or_writes_over_a_members_bytes():
    # op 2 gets op 0's bytes from the arena once op 1 read them; op 4 is in place over op 3's
    writes = [[(0, 16)], [(100, 116)], [(0, 16)], [(200, 216)], [(200, 216)], [(300, 316)]]
    plan = _plan(6, _chain_edges(6), writes)
    assert stop_groups(range(6), plan) == [[0, 1], [2, 3], [4, 5]]


def test_a_write_on_another_branch_over_a_members_bytes_closes_the_group():
    # op 1 and op 2 both follow op 0 and neither waits for the other; op 2 writes into op 1's
    writes = [[(0, 16)], [(100, 132)], [(116, 120)]]
    plan = _plan(3, [(0, 1), (0, 2)], writes)
    assert stop_groups(range(3), plan) == [[0, 1], [2]]


def test_what_a_member_waits_for_may_have_written_its_bytes_before_it():
    # op 0 zeroes a range that op 1 then fills: op 1's outputs are its own at the end
    writes = [[(0, 64)], [(0, 64)], [(500, 516)]]
    plan = _plan(3, _chain_edges(3), writes)
    # op 0's bytes are op 1's at the end, so op 0 is read from a run of its own
    assert stop_groups(range(3), plan) == [[0], [1, 2]]


def test_an_op_without_a_task_stands_alone_and_ops_with_several_tasks_count_them_all():
    writes = [[(0, 16)], [(100, 116)], [(200, 216)], [(0, 8)]]
    plan = _plan(4, _chain_edges(4), writes, op_tasks={0: [0, 1], 1: [], 2: [2, 3]},
                 outputs={0: [(100, 116)], 2: [(200, 216)]})
    # op 2's task 3 writes op 0's first task's range, which op 0's outputs do not name
    assert stop_groups([0, 1, 2], plan) == [[0, 2], [1]]
    plan = _plan(4, _chain_edges(4), writes, op_tasks={0: [0, 1], 1: [], 2: [2, 3]},
                 outputs={0: [(0, 16)], 2: [(200, 216)]})
    assert stop_groups([0, 1, 2], plan) == [[0], [1], [2]]  # now it does


def test_an_op_joins_the_first_group_it_fits_past_ops_that_do_not():
    # a chain 0 -> 1 -> 2 -> 3: op 1 writes over op 0's bytes in place, op 2 and op 3 elsewhere
    writes = [[(0, 16)], [(0, 16)], [(100, 116)], [(200, 216)]]
    plan = _plan(4, _chain_edges(4), writes)
    assert stop_groups(range(4), plan) == [[0], [1, 2, 3]]
    # two branches after op 0; op 3 (branch b) reuses op 1's bytes (branch a) after op 2 read
    writes = [[(0, 16)], [(100, 116)], [(200, 216)], [(100, 116)], [(300, 316)]]
    plan = _plan(5, [(0, 1), (1, 2), (0, 3), (2, 3), (3, 4)], writes)
    assert stop_groups(range(5), plan) == [[0, 1, 2], [3, 4]]


def _in_walk_order(groups: list[list[int]], ops: list[int]) -> None:
    """Every op in one group; each group in the walk's order; the groups by their first op."""
    assert sorted(op for g in groups for op in g) == sorted(ops)
    assert all(g == sorted(g) for g in groups) and [g[0] for g in groups] == \
        sorted(g[0] for g in groups)


def _random_plan(rng: random.Random, n: int):
    edges = sorted({(rng.randrange(v), v) for v in range(1, n) for _ in range(rng.randint(0, 2))})
    writes = [[(a, a + rng.choice((8, 16, 64)))] for a in
              (rng.randrange(0, 400, 8) for _ in range(n))]
    return _plan(n, edges, writes)


@pytest.mark.parametrize("seed", range(20))
def test_every_member_of_every_group_keeps_its_bytes_through_the_groups_run(seed):
    rng = random.Random(seed)
    n = rng.randint(5, 40)
    plan = _random_plan(rng, n)
    groups = stop_groups(range(n), plan, limit=rng.choice((3, 8, 32)))
    _in_walk_order(groups, list(range(n)))
    for group in groups:
        ran = 0
        for op in group:
            ran |= plan.closure[op]
        for op in group:
            (a, b), = plan.writes[op]
            for t in range(n):
                if ran >> t & 1 and not plan.closure[op] >> t & 1:
                    (c, d), = plan.writes[t]
                    assert d <= a or c >= b, (group, op, t)


def test_plan_input_reads_device_addresses_from_the_buffers_bases():
    g = TaskGraph()
    g.ops = [Op(0, "aten::relu", "", [Access(0, 0, 16, True)]),
             Op(1, "aten::relu_", "", [Access(1, 8, 16, True)])]
    g.tasks = [Task(0, "kernel", op=0, accesses=[Access(0, 0, 16, True)]),
               Task(1, "kernel", op=1, accesses=[Access(1, 8, 16, True)])]
    # buffer 1 lives 8 bytes into buffer 0: op 1 writes over op 0's last 8 bytes
    plan = plan_input(g, [(0, 1)], [1000, 992], {0: g.ops[0].accesses, 1: g.ops[1].accesses})
    assert plan.writes == [[(1000, 1016)], [(1000, 1016)]]
    assert stop_groups([0, 1], plan) == [[0], [1]]
    apart = plan_input(g, [(0, 1)], [1000, 2000], {0: g.ops[0].accesses, 1: g.ops[1].accesses})
    assert stop_groups([0, 1], apart) == [[0, 1]]


# ---- the walk over grouped stops ------------------------------------------------------------

def _chain(n: int):
    g = TaskGraph()
    g.ops = [Op(k, "aten::add.Tensor", f"layer{k}", [Access(k, 0, 16, True)]) for k in range(n)]
    g.tasks = [Task(k, "kernel", op=k) for k in range(n)]
    eager = [torch.arange(4.0) + k for k in range(n)]
    from nimble.debug.eager_twins import EagerOp
    return g, [EagerOp("aten::add.Tensor", [e]) for e in eager]


def _stand_in(graph, eager, off: dict[int, float], shared_off: dict[int, float] | None = None):
    """``run_until(op)`` and a group's run: each op's output eager's plus ``off[op]`` (plus
    ``shared_off[op]`` as well, in a group's run); the calls each got."""
    calls = {"single": [], "group": []}

    def snapshot(extra: dict[int, float]) -> Snapshot:
        buffers = {}
        for k, e in enumerate(eager):
            t = e.outputs[0] + off.get(k, 0.0) + extra.get(k, 0.0)
            buffers[k] = t.contiguous().view(torch.uint8).clone()
        return Snapshot(graph, set(), buffers)

    def run_until(op: int) -> Snapshot:
        calls["single"].append(op)
        return snapshot({})

    def run_group(ops: list[int]) -> Snapshot:
        calls["group"].append(list(ops))
        return snapshot(shared_off or {})
    return run_until, run_group, calls


def _every(size: int):
    return lambda ops: [list(ops[i:i + size]) for i in range(0, len(ops), size)]


def test_a_grouped_walk_finds_the_same_op_with_a_run_per_group():
    g, eager = _chain(100)
    aligned = align(g, eager)
    run, run_group, calls = _stand_in(g, eager, {61: 1.0, 80: 1.0})
    found = first_divergence(run, g, aligned, grouped=GroupedStops(_every(16), run_group))
    assert found.op == 61 and found.max_abs_diff == pytest.approx(1.0)
    assert len(calls["group"]) == 4 and calls["single"] == [61]  # the suspect alone
    run, run_group, calls = _stand_in(g, eager, {})
    assert first_divergence(run, g, aligned, grouped=GroupedStops(_every(16), run_group)) is None
    assert len(calls["group"]) == 7 and calls["single"] == []


def test_an_op_that_looks_wrong_only_in_a_shared_run_is_cleared_by_its_own_stop():
    g, eager = _chain(40)
    aligned = align(g, eager)
    run, run_group, calls = _stand_in(g, eager, {30: 1.0}, shared_off={5: 1.0})
    found = first_divergence(run, g, aligned, grouped=GroupedStops(_every(8), run_group))
    assert found.op == 30 and calls["single"] == [5, 30]


def test_a_fault_that_spoils_an_earlier_members_bytes_in_the_shared_run_is_still_named():
    """A kernel that writes outside its recorded accesses (the fault the walk hunts) may spoil
    the output of an earlier member of its group's run: that member looks wrong there, is
    cleared by its own stop, and the faulty op is named, as the sequential walk names it."""
    g, eager = _chain(40)
    aligned = align(g, eager)
    run, run_group, calls = _stand_in(g, eager, {30: 1.0}, shared_off={29: 0.5})
    found = first_divergence(run, g, aligned, grouped=GroupedStops(_every(8), run_group))
    assert found.op == 30 and calls["single"] == [29, 30]


def test_a_group_of_one_is_a_stop_of_its_own_and_the_nan_hunt_groups_too():
    g, eager = _chain(20)
    aligned = align(g, eager)
    run, run_group, calls = _stand_in(g, eager, {13: float("nan")})
    found = first_nonfinite(run, g, aligned, grouped=GroupedStops(_every(1), run_group))
    assert found.op == 13 and calls["group"] == [] and calls["single"] == list(range(14))
    run, run_group, calls = _stand_in(g, eager, {13: float("nan")})
    found = first_nonfinite(run, g, aligned, grouped=GroupedStops(_every(10), run_group))
    assert found.op == 13 and found.detail.endswith("write NaN")
    assert calls["single"] == [13] and len(calls["group"]) == 2


@pytest.mark.parametrize("name", ["resnet50", "googlenet", "inception_v3", "nasnetalarge"])
def test_on_a_recorded_network_groups_keep_every_members_bytes_and_save_runs(name):
    """A recorded network, scheduled and planned as prepare does (the arena reusing bytes):
    every member's outputs outlast its group's run, and the walk makes fewer runs."""
    from helpers import FIXTURE_DIR
    from nimble.analysis.report import analyze

    g = TaskGraph.load(FIXTURE_DIR / f"{name}.json.gz")
    a = analyze(g, memplan=True)
    bases = [(1 << 40) + a.plan.offsets[b.id] if b.id in a.plan.offsets else b.address
             for b in g.buffers]
    outputs = {op.index: [x for x in op.accesses if x.write] for op in g.ops}
    with_tasks = {t.op for t in g.tasks}
    ops = [op.index for op in g.ops if op.index in with_tasks and outputs[op.index]]
    plan = plan_input(g, a.schedule.edges(), bases, outputs)
    groups = stop_groups(ops, plan)
    _in_walk_order(groups, ops)
    assert len(groups) < 0.7 * len(ops), (len(groups), len(ops))
    print(f"{name}: {len(ops)} ops with outputs, {len(groups)} runs")
    for group in groups:
        ran = 0
        for op in group:
            for t in plan.op_tasks[op]:
                ran |= plan.closure[t]
        for op in group:
            mine = 0
            for t in plan.op_tasks[op]:
                mine |= plan.closure[t]
            for t in range(len(g.tasks)):
                if ran >> t & 1 and not mine >> t & 1:
                    for c, d in plan.writes[t]:
                        assert all(d <= a0 or c >= b0 for a0, b0 in plan.op_outputs[op]), \
                            (group, op, t)


def test_a_walk_over_interleaved_groups_names_the_first_op_once_all_before_it_were_read():
    g, eager = _chain(6)
    aligned = align(g, eager)
    interleaved = lambda ops: [[0, 2, 4], [1, 3, 5]]  # noqa: E731
    run, run_group, calls = _stand_in(g, eager, {3: 1.0, 4: 1.0})
    found = first_divergence(run, g, aligned, grouped=GroupedStops(interleaved, run_group))
    # 4 looked wrong first, but 1 and 3 were not read yet: 3 is the first that differs
    assert found.op == 3 and calls["single"] == [3]
    assert calls["group"] == [[0, 2, 4], [1, 3, 5]]
    run, run_group, calls = _stand_in(g, eager, {4: 1.0})
    found = first_divergence(run, g, aligned, grouped=GroupedStops(interleaved, run_group))
    assert found.op == 4 and calls["single"] == [4]
    mixed = lambda ops: [[0, 2], [1], [3, 4, 5]]  # noqa: E731  a group of one: its own stop
    run, run_group, calls = _stand_in(g, eager, {1: 1.0, 2: 1.0})
    found = first_divergence(run, g, aligned, grouped=GroupedStops(mixed, run_group))
    assert found.op == 1 and calls["single"] == [1]  # 2 is a suspect after 1, never confirmed
