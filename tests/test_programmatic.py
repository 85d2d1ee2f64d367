"""Programmatic edges (issue 53) without a GPU: which built edges may be programmatic
(nimble.analysis.programmatic), their trip through the TaskGraph format, how build_graph adds
them and which copies of a phase keep them, on the stand-in bindings of test_rebuild."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from nimble.analysis.programmatic import programmatic_edges, recorded_pairs, shares_other_bytes
from nimble.driver import calls
from nimble.driver.edges import programmatic_pairs
from nimble.engine.build import DelaySpec, GraphSpec, build_graph
from nimble.engine.options import PrepareOptions
from nimble.engine.rebuild import PhaseOptions
from nimble.ir.taskgraph import Access, Buffer, Task, TaskGraph, TaskKind
from helpers import timed_stand_in
from test_rebuild import GATHERS, SCHEDULE, SPANS, StandIn, served_builder, task_graph

PROGRAMMATIC, DEFAULT = 1, 0


def _graph() -> TaskGraph:
    """Kernels 0 -> 1 -> 2 and a memset 3; the capture had 0 -> 1, 1 -> 2 and 2 -> 3
    programmatic.  Kernel 0 writes buffer 0, kernel 1 reads it and writes buffer 1, kernel 2
    reads buffer 1 and writes buffer 2; buffer 3 is a weight every kernel reads."""
    g = TaskGraph(meta={"programmatic_edges": [[0, 1], [1, 2], [2, 3]]})
    g.buffers = [Buffer(0, "intermediate", 256, 0x1000), Buffer(1, "intermediate", 256, 0x2000),
                 Buffer(2, "output", 256, 0x3000), Buffer(3, "param", 512, 0x9000)]
    weight = Access(3, 0, 512, False)
    g.tasks = [Task(0, TaskKind.KERNEL, accesses=[Access(0, 0, 256, True), weight]),
               Task(1, TaskKind.KERNEL, accesses=[Access(0, 0, 256, False),
                                                  Access(1, 0, 256, True), weight]),
               Task(2, TaskKind.KERNEL, accesses=[Access(1, 0, 256, False),
                                                  Access(2, 0, 256, True), weight]),
               Task(3, TaskKind.MEMSET, accesses=[Access(2, 0, 256, True)])]
    return g


EDGES = [(0, 1), (1, 2), (2, 3)]


def test_a_recorded_programmatic_edge_between_kernels_on_their_own_bytes_stays_programmatic():
    g = _graph()
    apart = {0: 0, 1: 256, 2: 512}
    assert recorded_pairs(g) == {(0, 1), (1, 2), (2, 3)}
    # 2 -> 3 ends at a memset: only kernels take programmatic edges
    assert programmatic_edges(g, EDGES, apart) == {(0, 1), (1, 2)}
    # an edge the capture had as a full dependency stays one, whatever the bytes
    assert programmatic_edges(g, [(0, 2)], apart) == frozenset()
    # a capture without programmatic edges has none
    assert programmatic_edges(TaskGraph(tasks=g.tasks, buffers=g.buffers), EDGES, apart) == set()


def test_an_edge_whose_tasks_the_arena_makes_share_other_buffers_bytes_stays_a_full_one():
    g = _graph()
    # buffer 2 (kernel 2 writes it) placed over buffer 0 (kernel 1 reads it): kernel 2 could
    # write before kernel 1 has read, and kernel 2's code waits only for what kernel 1 wrote
    reused = {0: 0, 1: 256, 2: 0}
    assert shares_other_bytes(g, reused, 1, 2) and not shares_other_bytes(g, reused, 0, 1)
    assert programmatic_edges(g, EDGES, reused) == {(0, 1)}
    # the same weight in both is shared as in the capture (it has no arena offset)
    assert not shares_other_bytes(g, {0: 0, 1: 256, 2: 512}, 0, 1)
    # touching ranges are not overlapping ones
    assert not shares_other_bytes(g, {0: 0, 1: 512, 2: 256}, 1, 2)


def test_the_captures_programmatic_edges_go_through_the_taskgraph_format():
    g = _graph()
    back = TaskGraph.from_json(g.to_json())
    assert back.meta["programmatic_edges"] == [[0, 1], [1, 2], [2, 3]]
    for bad in ([[1, 0]], [[0, 4]], [[2, 2]]):
        g.meta["programmatic_edges"] = bad
        with pytest.raises(ValueError, match="programmatic_edges"):
            g.validate()


class EdgeStandIn(StandIn):
    """The stand-in bindings with edge data: each added edge's type, and a captured graph's."""

    CUgraphDependencyType = SimpleNamespace(CU_GRAPH_DEPENDENCY_TYPE_DEFAULT=DEFAULT,
                                            CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC=PROGRAMMATIC)
    CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC = 1

    def __init__(self) -> None:
        super().__init__()
        self.edge_types: dict[tuple[int, int], tuple] = {}
        self.captured_edges: list[tuple[int, int, int]] = []

    def CUgraphEdgeData(self):  # noqa: N802 - the binding's name
        return SimpleNamespace(type=DEFAULT, from_port=0, to_port=0)

    def cuGraphAddDependencies(self, graph, froms, tos, edge_data, count):
        for k, (u, v) in enumerate(zip(froms, tos)):
            data = edge_data[k] if edge_data else None
            self.edge_types[(u, v)] = (data.type, data.from_port) if data else (DEFAULT, 0)
        return super().cuGraphAddDependencies(graph, froms, tos, edge_data, count)

    def cuGraphGetEdges(self, graph, count):
        if not count:
            return 0, None, None, None, len(self.captured_edges)
        return (0, [u for u, _, _ in self.captured_edges], [v for _, v, _ in self.captured_edges],
                [SimpleNamespace(type=t) for _, _, t in self.captured_edges],
                len(self.captured_edges))


@pytest.fixture
def bindings(monkeypatch):
    fake = EdgeStandIn()
    monkeypatch.setattr(calls, "_drv", fake)
    return fake


def test_a_captured_graphs_programmatic_edges_are_read_as_node_indices(bindings):
    nodes = [501, 502, 503]
    bindings.captured_edges = [(501, 502, PROGRAMMATIC), (502, 503, DEFAULT), (501, 503, DEFAULT)]
    assert programmatic_pairs("graph", nodes) == [(0, 1)]
    bindings.captured_edges = []
    assert programmatic_pairs("graph", nodes) == []


def test_a_graphs_edges_are_read_with_their_kind_and_a_node_outside_the_list_as_none(
        bindings):
    """What a tool reads off a built graph: every edge, Nimble's own nodes (not in the task
    list) as None."""
    from nimble.driver import GraphEdge, graph_edges

    bindings.captured_edges = [(900, 501, DEFAULT), (501, 502, PROGRAMMATIC)]
    assert graph_edges("graph", [501, 502]) == [GraphEdge(None, 0, False), GraphEdge(0, 1, True)]
    bindings.captured_edges = []
    assert graph_edges("graph", [501, 502]) == []


def test_build_graph_adds_a_programmatic_edge_instead_of_the_full_one(bindings):
    # SCHEDULE's edges in phase 0: 0 -> 1, 0 -> 2; make 0 -> 1 programmatic.  Task 0 waits
    # for the phase's input gather, so it is no root of the graph.
    spec = GraphSpec(SCHEDULE.edges(), span=SPANS[0], programmatic=frozenset({(0, 1)}),
                     gathers=tuple(GATHERS[0]))
    built = build_graph(task_graph(), [f"recorded {t}" for t in range(6)], [], spec)
    zero, one, two = built.nodes
    assert len(bindings.nodes[zero].deps) == 1  # the gather
    assert bindings.nodes[one].deps == []  # not a full dependency ...
    assert bindings.edge_types[(zero, one)] == (PROGRAMMATIC, 1)  # ... a programmatic one
    assert bindings.nodes[two].deps == [zero] and (zero, two) not in bindings.edge_types
    built.close()


def test_an_edge_out_of_a_graphs_root_stays_a_full_dependency(bindings):
    """A task that waits on no node of its graph (no input gather before it: a later phase, or
    inputs copied in before the launch) keeps its outgoing edges full, as the C runtime does
    (docs/findings.md, "A programmatic edge out of a graph's root"); an edge out of a task that
    waits on another, programmatically or not, is built programmatic."""
    spec = GraphSpec([(0, 1), (1, 2)], span=SPANS[0],
                     programmatic=frozenset({(0, 1), (1, 2)}))
    built = build_graph(task_graph(), [f"recorded {t}" for t in range(6)], [], spec)
    zero, one, two = built.nodes
    assert bindings.nodes[zero].deps == []  # a root
    assert bindings.nodes[one].deps == [zero] and (zero, one) not in bindings.edge_types
    assert bindings.nodes[two].deps == [] and bindings.edge_types[(one, two)] == (PROGRAMMATIC, 1)
    assert built.programmatic == {(1, 2)}  # what the graph holds, for the plan and the file
    built.close()


def test_a_trial_whose_edges_leave_a_root_serves_and_counts_none_of_them(bindings, monkeypatch):
    """Phase 1's task 3 waits on no node of its graph (the phase has no input gather), so a
    trial of its edge 3 -> 4 builds it full: kept (timed faster), it gives the builder no
    programmatic edge to serve and the measurement counts none."""
    builder, trial, builts = _phases_with_a_trial(monkeypatch, True, {1: frozenset({(3, 4)})})
    assert PROGRAMMATIC not in [kind for kind, _ in bindings.edge_types.values()]
    assert builder.programmatic == frozenset()
    [measured] = builder.graph.meta["programmatic"]
    assert measured["phase"] == 1 and measured["edges"] == 0 and measured["kept"]
    assert builts[1] in trial  # timed faster and served: a graph with every edge full
    for built in builts:
        built.close()


def test_a_delayed_task_waits_on_full_dependencies(bindings):
    spec = GraphSpec(SCHEDULE.edges(), span=SPANS[0], programmatic=frozenset({(0, 1)}),
                     delays=DelaySpec(table=0x7000, tasks={1}))
    built = build_graph(task_graph(), [f"recorded {t}" for t in range(6)], [], spec)
    zero, one, _ = built.nodes
    (delay,) = bindings.nodes[one].deps
    assert bindings.nodes[delay].deps == [zero] and not bindings.edge_types
    built.close()


def test_copies_keep_the_served_programmatic_edges_unless_timed_or_moved():
    builder = served_builder()
    builder.programmatic = frozenset({(0, 1), (3, 4)})
    assert builder.spec(0).programmatic == {(0, 1), (3, 4)}
    # an edge the copy leaves out is not built programmatic either
    assert builder.spec(1, PhaseOptions(removed_edges={(3, 4)})).programmatic == {(0, 1)}
    for options in (PhaseOptions(programmatic_edges=frozenset()),
                    PhaseOptions(edgeless=True), PhaseOptions(bases=[0] * 6),
                    PhaseOptions(stamps=SimpleNamespace(address=0, tasks=None))):
        assert builder.spec(0, options).programmatic == frozenset(), options
    # a fuzz copy keeps them: the tasks it delays wait on full dependencies (build_graph)
    assert builder.spec(0, PhaseOptions(delays=DelaySpec(table=0, tasks={1}))).programmatic


def test_the_option_is_off_unless_asked():
    from nimble.errors import InputError

    assert PrepareOptions().programmatic_launch is True  # kept only where measured faster
    assert PrepareOptions(programmatic_launch=True).programmatic_launch is True
    assert PrepareOptions(programmatic_launch="always").programmatic_launch == "always"
    with pytest.raises(InputError, match="'always' \\(served unmeasured\\)"):
        PrepareOptions(programmatic_launch="sometimes")


def test_the_recorder_reads_edges_only_where_inductor_launches_programmatically(monkeypatch):
    import sys

    from nimble.errors import CudaError
    from nimble.record import programmatic as recorder

    graphs = [(10, ["a", "b", "c"]), (20, ["d", "e", "f"])]
    read = {10: [(0, 1)], 20: [(1, 2)]}
    monkeypatch.setattr(recorder.driver, "programmatic_edges_of", lambda raw, nodes: read[raw])
    config = SimpleNamespace(triton=SimpleNamespace(enable_pdl=False))
    monkeypatch.setitem(sys.modules, "torch._inductor.config", config)
    assert recorder.programmatic_edges(graphs) == []  # no query at all
    config.triton.enable_pdl = True
    # the second graph's nodes are numbered after the first's three
    assert recorder.programmatic_edges(graphs) == [(0, 1), (4, 5)]

    def refused(raw, nodes):
        raise CudaError("cuGraphGetEdges", 1, "CUDA_ERROR_INVALID_VALUE")
    monkeypatch.setattr(recorder.driver, "programmatic_edges_of", refused)
    with pytest.warns(RuntimeWarning, match="full dependencies"):
        assert recorder.programmatic_edges(graphs) == []


def test_recording_turns_inductors_programmatic_launches_on_only_when_asked():
    import torch._inductor.config as inductor

    from nimble.record.programmatic import launched_programmatically

    before = inductor.triton.enable_pdl
    with launched_programmatically(False):
        assert inductor.triton.enable_pdl == before
    with launched_programmatically(True):
        assert inductor.triton.enable_pdl is True
    assert inductor.triton.enable_pdl == before


@pytest.mark.parametrize("faster", [True, False])
def test_programmatic_edges_are_kept_only_where_their_phase_measures_faster(bindings, monkeypatch,
                                                                          faster):
    builder, trial, builts = _phases_with_a_trial(monkeypatch, faster, {0: frozenset({(0, 1)})})
    # the trial was built with the edge programmatic (task 0 waits for phase 0's gather)
    assert [kind for kind, _ in bindings.edge_types.values()].count(PROGRAMMATIC) >= 1
    assert builder.programmatic == ({(0, 1)} if faster else set())
    assert (builts[0] in trial) is faster  # phase 0 served as timed; phase 1 never tried
    [measured] = builder.graph.meta["programmatic"]
    assert measured["phase"] == 0 and measured["kept"] is faster and measured["measured"]
    assert measured["edges"] == 1 and measured["programmatic_ms"] < measured["plain_ms"]
    for built in builts:
        built.close()


def test_the_plan_times_each_phase_serves_a_copy_the_first_ones_and_collectives_untimed(
        monkeypatch):
    from nimble.analysis.schedule import Schedule
    from nimble.engine import programmatic_pick

    monkeypatch.setattr(programmatic_pick, "RULE", "recorded")  # _graph's edges: the capture's
    g = _graph()
    g.meta["phases"] = [2, 2]
    schedule = Schedule([0, 0, 0, 0], [[0, 1, 2, 3]], [], 0, 1, phases=[2, 2])
    apart = SimpleNamespace(offsets={0: 0, 1: 256, 2: 512})
    on, off = PrepareOptions(programmatic_launch=True), PrepareOptions(programmatic_launch=False)
    assert programmatic_pick.planned_programmatic(g, schedule, apart, off).trials is None
    plan = programmatic_pick.planned_programmatic(g, schedule, apart, on)
    # (0, 1) lies in phase 0; (1, 2) crosses into phase 1: the phases' barrier, in neither graph
    assert plan.served == frozenset() and plan.trials == {0: {(0, 1)}}
    copy = programmatic_pick.planned_programmatic(
        g, schedule, apart, on, first=SimpleNamespace(programmatic={(0, 1)}))
    assert copy.served == {(0, 1)} and copy.trials is None
    always = programmatic_pick.planned_programmatic(
        g, schedule, apart, PrepareOptions(programmatic_launch="always"))
    assert always.served == {(0, 1), (1, 2)} and always.trials is None
    monkeypatch.setattr(programmatic_pick, "communicates", lambda graph: True)
    lockstep = programmatic_pick.planned_programmatic(g, schedule, apart, on)
    assert lockstep.served == {(0, 1), (1, 2)} and lockstep.trials is None
    assert g.meta["programmatic"] == [{"phase": None, "edges": 2, "measured": False,
                                       "kept": True}]


def test_the_memory_plan_keeps_a_pairs_buffers_apart_where_the_limit_allows():
    from nimble.analysis.memplan import plan_memory
    from nimble.analysis.programmatic import plan_apart

    g = _graph()
    g.buffers[2].kind = "intermediate"  # free to share bytes with buffer 0 once it is read
    plain = plan_memory(g, EDGES)
    # the usual ping-pong: kernel 2's output over the buffer kernel 1 read
    assert plain.offsets[2] == plain.offsets[0]
    assert programmatic_edges(g, EDGES, plain.offsets) == {(0, 1)}
    apart = plan_apart(g, EDGES, plain, limit=None)
    assert programmatic_edges(g, EDGES, apart.offsets) == {(0, 1), (1, 2)}
    assert apart.arena_bytes > plain.arena_bytes
    # a limit the pairs' arena does not fit keeps the plan as it was
    assert plan_apart(g, EDGES, plain, limit=plain.arena_bytes) is plain
    # a capture without programmatic edges is planned as before
    g.meta.pop("programmatic_edges")
    assert plan_apart(g, EDGES, plain, limit=None) is plain


def test_on_a_recorded_decoder_every_pair_stays_programmatic_once_planned_apart():
    """llama_small's decode recording with every two successive kernels taken as captured
    programmatic: the usual plan keeps fewer than half, the plan that keeps the pairs apart
    all of them, in an arena still inside the capture's pool."""
    from helpers import FIXTURE_DIR

    from nimble.analysis.programmatic import candidate_edges, plan_apart
    from nimble.engine.prepared import plan_graph

    g = TaskGraph.load(FIXTURE_DIR / "llama_small_float16.json.gz")
    kernels = [t.id for t in g.tasks if t.kind == TaskKind.KERNEL]
    g.meta["programmatic_edges"] = [[u, v] for u, v in zip(kernels, kernels[1:])]
    schedule, plan = plan_graph(g, False, None, None)
    candidates = candidate_edges(g, schedule.edges())
    assert len(candidates) > 100
    assert len(programmatic_edges(g, schedule.edges(), plan.offsets)) < len(candidates) / 2
    apart = plan_apart(g, schedule.edges(), plan, g.meta["pool_bytes"])
    assert programmatic_edges(g, schedule.edges(), apart.offsets) == set(candidates)
    assert plan.arena_bytes < apart.arena_bytes <= g.meta["pool_bytes"]


def test_asked_for_programmatic_launch_the_recording_leaves_inductors_launches_as_they_are(
        monkeypatch):
    """The waiting rule builds edges into Nimble's kernels only: Inductor is not asked to
    compile its kernels for programmatic launch (that was the withdrawn rule's), nor is the
    memory plan changed; the experiment's recorded rule asks for both."""
    from nimble.engine import preparation, programmatic_pick

    asked: list = []
    monkeypatch.setattr("nimble.record.programmatic.launched_programmatically",
                        lambda enabled: asked.append(enabled) or _nothing())
    monkeypatch.setattr("nimble.record.recorder.record",
                        lambda *a, **kw: SimpleNamespace(step=None))
    options = PrepareOptions(programmatic_launch=True)
    preparation._recording(None, (), False, options, True)
    monkeypatch.setattr(programmatic_pick, "RULE", "recorded")
    preparation._recording(None, (), False, options, True)
    assert asked == [False, True]


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def _waiting_graph() -> TaskGraph:
    """Kernels after an Inductor kernel (0, which writes buffer 0 and the weight of 2): Nimble's
    GEMV on a weight no task writes (1), on the weight 0 writes (2), on an intermediate as its
    weight (3); Nimble's attention's ``attend`` (4); a user's kernel named ``attend`` (5); a
    memset (6) and, after it, a GEMV (7)."""
    from nimble.ir.taskgraph import Op, Pointer

    g = TaskGraph()
    g.buffers = [Buffer(0, "intermediate", 256, 0x1000), Buffer(1, "param", 4096, 0x9000),
                 Buffer(2, "param", 4096, 0xA000), Buffer(3, "intermediate", 4096, 0xB000),
                 Buffer(4, "intermediate", 256, 0x2000)]
    g.ops = [Op(0, "triton_poi_fused_add_0"), Op(1, "nimble::gemv"), Op(2, "nimble::gemv"),
             Op(3, "nimble::gemv"), Op(4, "nimble::decode_attention"), Op(5, "aten::mm"),
             Op(6, "aten::zero_"), Op(7, "nimble::gemv")]
    layout = [(0, 8), (8, 8), (16, 8), (24, 4), (28, 4), (32, 4)]

    def gemv(i: int, weight: int) -> Task:
        return Task(i, TaskKind.KERNEL, op=i, name="gemv_kernel", param_layout=layout,
                    pointers=[Pointer(0, 0x1000, 0, 0), Pointer(8, 0, weight, 0),
                              Pointer(16, 0x2000, 4, 0)],
                    accesses=[Access(0, 0, 256, False), Access(weight, 0, 4096, False),
                              Access(4, 0, 256, True)])
    g.tasks = [Task(0, TaskKind.KERNEL, op=0, name="triton_poi_fused_add_0",
                    accesses=[Access(0, 0, 256, True), Access(2, 0, 4096, True)]),
               gemv(1, 1), gemv(2, 2), gemv(3, 3),
               Task(4, TaskKind.KERNEL, op=4, name="attend"),
               Task(5, TaskKind.KERNEL, op=5, name="attend"),
               Task(6, TaskKind.MEMSET, op=6, accesses=[Access(4, 0, 256, True)]),
               gemv(7, 1)]
    return g


def test_edges_into_nimbles_waiting_kernels_are_programmatic_where_their_early_read_is_constant():
    from nimble.analysis.programmatic import waiting_edges

    g = _waiting_graph()
    edges = [(0, v) for v in range(1, 7)] + [(6, 7)]
    # 1: its weight a parameter no task writes; 4: Nimble's attention reads nothing early.
    # Not 2 (kernel 0 writes its weight), 3 (its weight an intermediate), 5 (a kernel of that
    # name under another operator), 6 (a memset), nor 7 (its predecessor a memset)
    assert waiting_edges(g, edges) == {(0, 1), (0, 4)}
    # one programmatic edge into a kernel: from its predecessor recorded last
    assert waiting_edges(g, [(0, 1), (4, 1)]) == {(4, 1)}
    # a parameter the pointer does not resolve to is no weight
    g.tasks[1].pointers[1].buffer = -1
    assert waiting_edges(g, [(0, 1)]) == frozenset()


def _rope_attention_graph(writer_after: bool) -> TaskGraph:
    """A GEMV (0) writing the query into an intermediate, Nimble's rotary attention (1)
    reading it and a static cache (an external buffer) before its wait, and a kernel writing
    the cache (after the attention, or recorded before it)."""
    from nimble.ir.taskgraph import Op, Pointer

    g = TaskGraph()
    g.buffers = [Buffer(0, "intermediate", 256, 0x1000), Buffer(1, "external", 8192, 0x9000),
                 Buffer(2, "external", 8192, 0xC000), Buffer(3, "intermediate", 256, 0x2000)]
    g.ops = [Op(0, "nimble::gemv"), Op(1, "nimble::decode_attention_rope"),
             Op(2, "triton_poi_fused_index_copy_0")]
    layout = [(0, 8), (8, 8), (16, 8), (24, 8)]
    attend = Task(1, TaskKind.KERNEL, op=1, name="attend", param_layout=layout,
                  pointers=[Pointer(0, 0x1000, 0, 0), Pointer(8, 0, 1, 0),
                            Pointer(16, 0, 2, 0), Pointer(24, 0x2000, 3, 0)],
                  accesses=[Access(0, 0, 256, False), Access(1, 0, 8192, False),
                            Access(2, 0, 8192, False), Access(3, 0, 256, True)])
    write = Task(2, TaskKind.KERNEL, op=2, name="triton_poi_fused_index_copy_0",
                 accesses=[Access(1, 0, 128, True), Access(2, 0, 128, True)])
    gemv = Task(0, TaskKind.KERNEL, op=0, name="gemv_kernel",
                accesses=[Access(0, 0, 256, True)])
    if writer_after:
        g.tasks = [gemv, attend, write]
    else:  # the cache written first: the attention's early read could race it
        write.id, gemv.id, attend.id = 0, 1, 2
        write.op, gemv.op, attend.op = 2, 0, 1
        g.tasks = [write, gemv, attend]
    return g


def test_the_rotary_attention_reads_its_cache_early_only_where_its_writes_come_after_it():
    from nimble.analysis.programmatic import waiting_edges

    assert waiting_edges(_rope_attention_graph(True), [(0, 1), (1, 2)]) == {(0, 1)}
    assert waiting_edges(_rope_attention_graph(False), [(0, 1), (1, 2)]) == frozenset()
    # a cache laid in the arena (an intermediate) is no early read's, wherever it is written
    g = _rope_attention_graph(True)
    g.buffers[1] = Buffer(1, "intermediate", 8192, 0x9000)
    assert waiting_edges(g, [(0, 1)]) == frozenset()
    # nor one the attention is not recorded reading: nothing orders its writer after it
    g = _rope_attention_graph(True)
    g.tasks[1].accesses = [a for a in g.tasks[1].accesses if a.buffer != 2]
    assert waiting_edges(g, [(0, 1)]) == frozenset()


def test_every_waiting_kernel_names_a_weight_parameter_its_operator_passes():
    """The parameter index of each GEMV's early read is its weight's in the kernel's
    signature (pointers first, none left out: the launchers pass a tensor for every one)."""
    import inspect

    from nimble.ir.waiting_kernels import WAITING_KERNELS

    pytest.importorskip("triton", reason="reads the kernels' signatures")
    import nimble.gemv_prologue_kernels as prologues
    from nimble import fast_gemv

    import nimble.decode_attention_kernels as attention

    from nimble import gemm_rows

    from nimble import peer_sum

    kernels = {"gemv_kernel": fast_gemv._kernel(), "gemv_prologue_kernel":
               prologues.gemv_prologue_kernel, "attend": attention.attend,
               "gemm_rows_kernel": gemm_rows._kernel(), "nimble_peer_sum_kernel":
               peer_sum._kernel()}
    early = {"gemv_kernel": ["w_ptr"], "gemv_prologue_kernel": ["w_ptr"],
             "attend": ["k_ptr", "v_ptr"], "gemm_rows_kernel": ["w_ptr"],
             "nimble_peer_sum_kernel": ["table_ptr"]}
    for (op, name), reads in WAITING_KERNELS.items():
        assert op.startswith("nimble::")
        if reads:
            params = list(inspect.signature(kernels[name].fn).parameters)
            assert [params[i] for i in reads] == early[name], (op, name)
            assert all(p.endswith("_ptr") for p in params[:max(reads)]), (op, name)


def test_the_waiting_rule_is_the_plans_and_the_recorded_one_only_the_experiments(monkeypatch):
    from nimble.engine import programmatic_pick

    g = _waiting_graph()
    g.meta["programmatic_edges"] = [[0, 2]]  # a capture's own: not the waiting rule's
    schedule = SimpleNamespace(edges=lambda: [(0, 1), (0, 2), (1, 4), (6, 7)])
    plan = SimpleNamespace(offsets={})
    on = PrepareOptions(programmatic_launch=True)
    assert programmatic_pick.planned_programmatic(g, schedule, plan, on).trials == {
        0: {(0, 1), (1, 4)}}
    monkeypatch.setattr(programmatic_pick, "RULE", "recorded")
    assert programmatic_pick.planned_programmatic(g, schedule, plan, on).trials == {
        0: {(0, 2)}}


def test_a_graph_with_none_of_nimbles_waiting_kernels_plans_nothing_and_reads_no_schedule():
    """On by default, the option costs a prepare of an ordinary model nothing: no waiting
    kernel, no plan, the schedule's edges never asked for."""
    from nimble.engine import programmatic_pick
    from nimble.ir.waiting_kernels import has_waiting_kernels

    g = _waiting_graph()
    assert has_waiting_kernels(g)
    plain = _waiting_graph()
    plain.tasks = [t for t in plain.tasks if t.op in (0, 5, 6)]  # Inductor's, a user's attend
    assert not has_waiting_kernels(plain)
    plan = programmatic_pick.planned_programmatic(plain, None, None, PrepareOptions())
    assert plan == programmatic_pick.ProgrammaticPlan()


def _phases_with_a_trial(monkeypatch, faster: bool, trials: dict):
    """The served stand-in's phases built with programmatic ``trials`` (per phase, the edges
    tried), a trial's graph timed faster where ``faster``: ``(builder, the trial graphs,
    the phases' graphs as served)``."""
    import torch

    from nimble.engine import prepared as prepared_module
    from test_rebuild import served_input, served_recording

    trial: list = []
    real_build = served_builder().build.__func__

    def build(self, phase, options=PhaseOptions()):
        got = real_build(self, phase, options)
        if options.programmatic_edges is not None:
            trial.append(got)
        return got
    monkeypatch.setattr(prepared_module, "_after_phases",
                        timed_stand_in(faster, lambda built: built in trial))
    builder = served_builder()
    monkeypatch.setattr(type(builder), "build", build)
    builts: list = []
    prepared_module._build_phases(builder, served_recording(builder), [served_input()],
                                  [torch.zeros(1)], torch.device("cpu"), None, None, builts,
                                  programmatic_trials=trials)
    return builder, trial, builts
