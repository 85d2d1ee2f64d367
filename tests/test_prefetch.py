"""Weight prefetch into the L2 (issue 53) without a GPU: the plan of windows and anchors
(nimble.analysis.prefetch) on hand-made graphs and a recorded decoder, the nodes build_graph
adds for it and the measured choice at prepare, on the stand-in bindings of test_rebuild."""
from __future__ import annotations


import pytest
import torch

from helpers import FIXTURE_DIR, param_words, timed_stand_in
from nimble.analysis.prefetch import (GAP_SHARE, PLANS, Prefetch, WeightRange, merged_ranges,
                                      plan, plan_gap_prefetch, plan_prefetch, weight_reads,
                                      window_bytes)
from nimble.errors import InputError
from nimble.engine import prefetch as prefetch_module
from nimble.engine import prepared as prepared_module
from nimble.engine.build import GraphSpec, InputGather, build_graph
from nimble.engine.options import PrepareOptions
from nimble.engine.prefetch_nodes import (PREFETCH_BLOCK, PREFETCH_MAX_BLOCKS, PREFETCH_STEP,
                                          prefetch_grid, turn_off_moved)
from nimble.engine.rebuild import PhaseOptions
from nimble.ir.taskgraph import Access, Buffer, Task, TaskGraph, TaskKind
from test_rebuild import (SCHEDULE, SPANS, StandIn, served_builder, served_input,
                          served_recording, task_graph)

MB = 1 << 20


def _chain(sizes: list[int], written: int | None = None) -> TaskGraph:
    """A chain of kernels, kernel ``k`` reading weight ``k`` of ``sizes[k]`` bytes (and the
    activation, buffer ``len(sizes)``, which it writes)."""
    n = len(sizes)
    g = TaskGraph()
    g.buffers = [Buffer(k, "param", s, 0x1000_0000 * (k + 1)) for k, s in enumerate(sizes)]
    g.buffers.append(Buffer(n, "intermediate", MB, 0x9000_0000))
    g.tasks = [Task(k, TaskKind.KERNEL, short_name=f"k{k}",
                    accesses=[Access(k, 0, sizes[k], k == written), Access(n, 0, MB, True)])
               for k in range(n)]
    return g


def test_weights_are_cut_into_windows_each_fetched_after_the_window_before_begins():
    g = _chain([4 * MB, 4 * MB, 4 * MB, 4 * MB, 4 * MB])
    plans = plan_prefetch(g, range(5), window=8 * MB)
    assert [p.after for p in plans] == [None, 0, 2]
    assert [p.tasks for p in plans] == [(0, 1), (2, 3), (4,)]
    assert [[r.buffer for r in p.ranges] for p in plans] == [[0, 1], [2, 3], [4]]
    assert [p.nbytes for p in plans] == [8 * MB, 8 * MB, 4 * MB]
    # everything in one window: nothing ahead to fetch
    assert plan_prefetch(g, range(5), window=64 * MB) == []
    with pytest.raises(ValueError, match="positive size"):
        plan_prefetch(g, range(5), window=0)


def test_small_and_written_weights_are_left_out_a_reread_one_goes_last_large_ones_clipped():
    g = _chain([4 * MB, 64 << 10, 4 * MB, 20 * MB, 2 * MB], written=2)
    # buffer 0 read again, in part, after the others: a tied table's head reads it last
    g.tasks.append(Task(5, TaskKind.KERNEL, accesses=[Access(0, MB, 3 * MB, False)]))
    g.tasks.append(Task(6, TaskKind.MEMSET, accesses=[Access(4, 0, 4, False)]))  # no kernel
    assert [(t, r) for t, r in weight_reads(g, range(7))] == [
        (3, WeightRange(3, 0, 20 * MB)), (4, WeightRange(4, 0, 2 * MB)),
        (5, WeightRange(0, 0, 4 * MB))]
    plans = plan_prefetch(g, range(7), window=8 * MB)
    assert [(p.after, [(r.buffer, r.size) for r in p.ranges]) for p in plans] == \
        [(None, [(3, 8 * MB)]), (3, [(4, 2 * MB), (0, 4 * MB)])]  # its head, a window's worth


def test_a_recorded_decoders_windows_hold_each_weight_once_within_the_window():
    g = TaskGraph.load(FIXTURE_DIR / "llama_small_float16.json.gz")
    span = range(len(g.tasks))
    window = 6 * MB
    plans = plan_prefetch(g, span, window)
    reads = weight_reads(g, span)
    assert len(plans) >= 2
    assert [r for p in plans for r in p.ranges] == \
        [WeightRange(r.buffer, r.offset, min(r.size, window)) for _, r in reads]
    assert len({r.buffer for _, r in reads}) == len(reads)  # each weight once
    assert all(p.nbytes <= window for p in plans)
    for before, p in zip(plans, plans[1:]):
        # fetched once the window before began, never after its own first reader
        assert p.after == before.tasks[0] and p.after < p.tasks[0]
    params = {b.id for b in g.buffers if b.kind == "param"}
    assert {r.buffer for p in plans for r in p.ranges} <= params
    assert window_bytes(50 * MB) == 20 * MB


def _with_idle(g: TaskGraph, idle_after: dict[int, int]) -> TaskGraph:
    """``g`` with ``idle_after[k]`` kernels that read no weight (only the activation) after
    kernel ``k`` (-1: before the first), renumbered in the recorded order."""
    act = len(g.buffers) - 1
    tasks: list[Task] = []

    def idle(n):
        for _ in range(n):
            tasks.append(Task(len(tasks), TaskKind.KERNEL, short_name="idle",
                              accesses=[Access(act, 0, MB, True)]))
    idle(idle_after.get(-1, 0))
    for t in g.tasks:
        tasks.append(Task(len(tasks), t.kind, short_name=t.short_name, accesses=t.accesses))
        idle(idle_after.get(t.id, 0))
    g.tasks = tasks
    return g


def test_a_gap_prefetch_asks_for_the_weight_after_kernels_that_read_none():
    # weights 0..4; kernels reading none after weight 1's reader (two) and weight 3's (one),
    # and one before the first reader
    g = _with_idle(_chain([4 * MB, 4 * MB, 4 * MB, 32 * MB, 64 << 10]), {-1: 1, 1: 2, 3: 1})
    names = [t.short_name for t in g.tasks]
    assert names == ["idle", "k0", "k1", "idle", "idle", "k2", "k3", "idle", "k4"]
    plans = plan_gap_prefetch(g, range(len(g.tasks)), most=16 * MB)
    # weight 0 at the start (the idle kernel before it); weight 2 after k1 (task 2); weight 4
    # is too small to fetch, so none after k3; weights 1 and 3 come right after a reader
    assert [(p.after, p.tasks, [(r.buffer, r.size) for r in p.ranges]) for p in plans] == [
        (None, (1,), [(0, 4 * MB)]), (2, (5,), [(2, 4 * MB)])]
    # a large weight after a gap: its head
    g = _with_idle(_chain([4 * MB, 32 * MB]), {0: 1})
    [p] = plan_gap_prefetch(g, range(3), most=16 * MB)
    assert p.after == 0 and p.ranges == (WeightRange(1, 0, 16 * MB),)
    # a chain with no gap fetches nothing; a kernel that is no task kernel is no gap
    assert plan_gap_prefetch(_chain([4 * MB] * 4), range(4), most=16 * MB) == []
    g = _chain([4 * MB] * 2)
    g.tasks.insert(1, Task(1, TaskKind.MEMSET, accesses=[Access(2, 0, 4, True)]))
    g.tasks[2] = Task(2, TaskKind.KERNEL, accesses=g.tasks[2].accesses)
    assert plan_gap_prefetch(g, range(3), most=16 * MB) == []
    with pytest.raises(ValueError, match="positive size"):
        plan_gap_prefetch(g, range(3), most=0)


def test_a_gap_prefetch_of_a_phase_sees_only_that_phases_kernels():
    g = _with_idle(_chain([4 * MB] * 4), {1: 1})  # k0 k1 idle k2 k3
    assert [p.after for p in plan_gap_prefetch(g, range(5), most=16 * MB)] == [1]
    # the phase from the idle kernel on: its first reader follows it, fetched at the start
    assert [(p.after, p.tasks) for p in plan_gap_prefetch(g, range(2, 5), most=16 * MB)] == \
        [(None, (3,))]
    assert plan_gap_prefetch(g, range(3, 5), most=16 * MB) == []


def test_a_recorded_decoders_gaps_are_the_weights_read_after_weightless_kernels():
    g = TaskGraph.load(FIXTURE_DIR / "llama_small_float16.json.gz")
    span = range(len(g.tasks))
    most = 2 * MB
    plans = plan_gap_prefetch(g, span, most)
    reads = dict(weight_reads(g, span))
    readers = sorted(reads)
    assert plans, "a decoder's attention and norms read no weight: gaps before projections"
    for p in plans:
        [t] = p.tasks
        assert t in reads and all(r.size <= most for r in p.ranges)
        before = [r for r in readers if r < t]
        assert p.after == (before[-1] if before else None)
        between = range((p.after if p.after is not None else -1) + 1, t)
        assert any(g.tasks[k].kind == TaskKind.KERNEL for k in between)
    fetched = {p.tasks[0] for p in plans}
    for a, b in zip(readers, readers[1:]):  # readers with no kernel between: not fetched for
        if not any(g.tasks[k].kind == TaskKind.KERNEL for k in range(a + 1, b)):
            assert b not in fetched
    assert [k for k in PLANS] == ["windows", "gaps"]
    assert plan("gaps", g, span, 8 * MB) == plan_gap_prefetch(g, span, int(8 * MB * GAP_SHARE))
    assert plan("windows", g, span, 8 * MB) == plan_prefetch(g, span, window_bytes(8 * MB))
    with pytest.raises(ValueError, match="one of windows, gaps"):
        plan("everything", g, span, 8 * MB)


def test_ranges_that_touch_become_one_node_each():
    p = Prefetch(None, (WeightRange(0, 0, 100), WeightRange(1, 0, 50), WeightRange(2, 8, 10)))
    assert merged_ranges(p, [1000, 1100, 5000]) == [(1000, 150), (5008, 10)]
    assert prefetch_grid(1) == 1
    assert prefetch_grid(3 * PREFETCH_STEP * PREFETCH_BLOCK) == 3
    assert prefetch_grid(1 << 40) == PREFETCH_MAX_BLOCKS


class PrefetchStandIn(StandIn):
    """test_rebuild's stand-in bindings, with the prefetch kernel's arguments read and its
    module told apart, the context's priority range, and exec updates recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.exec_args: list[tuple[int, list[int]]] = []

    def cuModuleLoadData(self, image):
        if b"nimble_prefetch_l2" in image:
            return 0, "prefetch module"
        return super().cuModuleLoadData(image)

    def cuCtxGetStreamPriorityRange(self):
        return 0, 0, -5

    def cuGraphAddKernelNode(self, graph, deps, count, params):
        err, node = super().cuGraphAddKernelNode(graph, deps, count, params)
        if params.func == "nimble_prefetch_l2":
            self.nodes[node].args = param_words(params.kernelParams, 3)
        return err, node

    def cuGraphExecKernelNodeSetParams(self, exec_handle, node, params):
        self.exec_args.append((node, param_words(params.kernelParams, 3)))
        return (0,)


@pytest.fixture
def bindings(monkeypatch):
    from nimble.driver import calls

    fake = PrefetchStandIn()
    monkeypatch.setattr(calls, "_drv", fake)
    return fake


BASES = [0x10_0000, 0x10_0000 + 4 * MB, 0x80_0000]
PLAN = (Prefetch(None, (WeightRange(0, 0, 4 * MB), WeightRange(1, 0, 2 * MB))),
        Prefetch(4, (WeightRange(2, 0, MB),)))


def test_build_graph_adds_each_prefetch_after_its_anchor_at_the_least_priority(bindings):
    spec = GraphSpec(SCHEDULE.edges(), span=SPANS[1], gathers=[InputGather(0x9000, 0x1000, 64)],
                     priorities=[0, -1, -2, 0, -3, -1], prefetch=PLAN)
    built = build_graph(task_graph(), [f"recorded {t}" for t in range(6)], BASES, spec)
    nodes = bindings.nodes
    (gather,) = [k for k, v in nodes.items() if v.func == "nimble_gather_input"]
    fetches = {k: v for k, v in nodes.items() if v.func == "nimble_prefetch_l2"}
    four = built.nodes[1]
    # buffers 0 and 1 touch: one node from the start (after the gather), one after task 4
    assert sorted((v.args, v.deps) for v in fetches.values()) == sorted([
        ([BASES[0], 6 * MB, PREFETCH_STEP], [gather]), ([BASES[2], MB, PREFETCH_STEP], [four])])
    assert all(bindings.priority[k] == 0 for k in fetches)  # the least priority
    assert all(v.block == PREFETCH_BLOCK for v in fetches.values())
    # nothing waits for a prefetch: no task node has one among its dependencies
    assert not any(set(nodes[t].deps) & set(fetches) for t in built.nodes)
    assert [p.buffers for p in built.prefetch_nodes] == [frozenset({0, 1}), frozenset({2})]
    assert built.prefetch_module.handle == "prefetch module"
    # a weight re-pointed elsewhere turns its nodes off in the exec
    assert turn_off_moved("exec", built.prefetch_nodes, {1}) == 1
    assert bindings.exec_args == [(built.prefetch_nodes[0].node, [BASES[0], 0, PREFETCH_STEP])]
    built.close()
    assert ("cuModuleUnload", "prefetch module") in bindings.freed


def test_a_prefetch_whose_anchor_has_no_node_is_left_out(bindings):
    spec = GraphSpec(SCHEDULE.edges(), span=SPANS[1], device_launch=False, only={3, 5},
                     prefetch=PLAN)
    built = build_graph(task_graph(), [f"recorded {t}" for t in range(6)], BASES, spec)
    assert [p.address for p in built.prefetch_nodes] == [BASES[0]]  # task 4 has no node
    assert not bindings.priority  # a graph without priorities gives its prefetches none
    built.close()


def test_the_builder_serves_its_prefetch_and_options_override_it():
    builder = served_builder()
    assert builder.prefetch == [(), ()] and builder.spec(1).prefetch == ()
    assert builder.spec(1, PhaseOptions(prefetch=PLAN)).prefetch == PLAN
    builder.prefetch[1] = PLAN
    assert builder.spec(1).prefetch == PLAN and builder.spec(0).prefetch == ()
    assert builder.spec(1, PhaseOptions(prefetch=())).prefetch == ()
    assert builder.spec(1, PhaseOptions(edgeless=True)).prefetch == ()


@pytest.mark.parametrize("faster", [True, False])
def test_a_prefetch_is_kept_only_where_its_phase_measures_faster(bindings, monkeypatch,
                                                                  faster):
    monkeypatch.setattr(prepared_module, "_after_phases",
                        timed_stand_in(faster, lambda built: bool(built.prefetch_nodes)))
    builder = served_builder()
    rec, slot = served_recording(builder), served_input()
    builder.bases = BASES
    builts: list = []
    prepared_module._build_phases(builder, rec, [slot], [torch.zeros(1)], torch.device("cpu"),
                                  None, None, builts, prefetch_trials={1: {"windows": PLAN}})
    assert builder.prefetch == [(), PLAN if faster else ()]
    assert bool(builts[1].prefetch_nodes) is faster and not builts[0].prefetch_nodes
    [measured] = builder.graph.meta["prefetch_l2"]
    assert measured["phase"] == 1 and measured["kept"] is faster
    assert measured["plan"] == "windows"
    assert measured["windows"] == 2 and measured["bytes"] == 7 * MB
    assert measured["prefetch_ms"] < measured["plain_ms"]
    for built in builts:
        built.close()


def test_of_two_plans_the_faster_is_kept_and_each_is_reported(bindings, monkeypatch):
    gaps = (Prefetch(4, (WeightRange(2, 0, MB),)),)  # one node: the plan the stand-in favours
    monkeypatch.setattr(prepared_module, "_after_phases",
                        timed_stand_in(True, lambda built: len(built.prefetch_nodes) == 1))
    builder = served_builder()
    rec, slot = served_recording(builder), served_input()
    builder.bases = BASES
    builts: list = []
    prepared_module._build_phases(builder, rec, [slot], [torch.zeros(1)], torch.device("cpu"),
                                  None, None, builts,
                                  prefetch_trials={1: {"windows": PLAN, "gaps": gaps}})
    assert builder.prefetch == [(), gaps]
    assert [p.nbytes for p in builts[1].prefetch_nodes] == [MB]
    measured = builder.graph.meta["prefetch_l2"]
    assert [(m["plan"], m["kept"], m["windows"]) for m in measured] == [
        ("windows", False, 2), ("gaps", True, 1)]
    assert measured[0]["plain_ms"] == measured[1]["plain_ms"]
    assert measured[1]["prefetch_ms"] < measured[0]["prefetch_ms"]
    for built in builts:
        built.close()


def test_the_option_is_off_by_default_and_plans_on_the_devices_l2(monkeypatch):
    g = _chain([4 * MB] * 5)
    assert PrepareOptions().prefetch_l2 is False
    assert prefetch_module.planned_prefetch(g, PrepareOptions()) is None
    monkeypatch.setattr(prefetch_module, "l2_bytes", lambda: 20 * MB)  # windows of 8 MB
    g.meta["prefetch_l2"] = ["of an earlier prepare"]
    plans = prefetch_module.planned_prefetch(g, PrepareOptions(prefetch_l2=True))
    # a chain with no gap: only the windows' plan fetches anything
    assert list(plans) == [0] and list(plans[0]) == ["windows"]
    assert [p.after for p in plans[0]["windows"]] == [None, 0, 2]
    assert "prefetch_l2" not in g.meta
    assert prefetch_module.planned_prefetch(g, PrepareOptions(prefetch_l2="gaps")) is None
    gapped = _with_idle(_chain([4 * MB] * 5), {2: 1})
    plans = prefetch_module.planned_prefetch(gapped, PrepareOptions(prefetch_l2=True))
    assert list(plans[0]) == ["windows", "gaps"]
    assert [(p.after, p.tasks) for p in plans[0]["gaps"]] == [(2, (4,))]
    plans = prefetch_module.planned_prefetch(gapped, PrepareOptions(prefetch_l2="gaps"))
    assert list(plans[0]) == ["gaps"]
    with pytest.raises(InputError, match="a plan \\(windows, gaps\\)"):
        PrepareOptions(prefetch_l2="everything")
    monkeypatch.setattr(prefetch_module, "communicates", lambda graph: True)
    assert prefetch_module.planned_prefetch(g, PrepareOptions(prefetch_l2=True)) is None


def test_a_graph_of_collectives_serves_the_plan_asked_for_by_name_unmeasured(monkeypatch):
    """Its ranks must launch alike: nothing is timed; the plan named is served as planned (the
    graph's and the L2's, the same on every rank), and said so in the graph's meta."""
    monkeypatch.setattr(prefetch_module, "l2_bytes", lambda: 20 * MB)
    gapped = _with_idle(_chain([4 * MB] * 5), {2: 1})
    gaps = PrepareOptions(prefetch_l2="gaps")
    assert prefetch_module.served_prefetch(gapped, gaps) is None  # no collective: timed
    monkeypatch.setattr(prefetch_module, "communicates", lambda graph: True)
    assert prefetch_module.planned_prefetch(gapped, gaps) is None
    served = prefetch_module.served_prefetch(gapped, gaps)
    assert [[(p.after, p.tasks) for p in phase] for phase in served] == [[(2, (4,))]]
    assert gapped.meta["prefetch_l2"] == [{"phase": 0, "plan": "gaps", "windows": 1,
                                           "bytes": 4 * MB, "measured": False, "kept": True}]
    assert prefetch_module.served_prefetch(gapped, PrepareOptions(prefetch_l2=True)) is None
    assert prefetch_module.served_prefetch(gapped, PrepareOptions()) is None
    assert prefetch_module.served_prefetch(_chain([4 * MB] * 5), gaps) is None  # no gap
