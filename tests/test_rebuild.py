"""Every build of a phase goes through one builder (nimble.engine.rebuild) with named options:
the served phases and their backfill trials, the step-through's copies and the timeline's
instrumented copies; and what build_graph makes of a GraphSpec.  On stand-in driver bindings
(no GPU)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import param_words

from nimble.analysis.backfill import Backfill, Picked
from nimble.analysis.schedule import Schedule
from nimble.debug import step_through, timeline
from nimble.driver import calls
from nimble.engine import prepared as prepared_module
from nimble.engine import rebuild
from nimble.engine.build import GATHER_BLOCK, GraphSpec, InputGather, StampSpec, build_graph
from nimble.engine.launcher import InputSlot
from nimble.engine.prepared import Prepared
from nimble.engine.rebuild import AS_SERVED, PhaseBuilder, PhaseOptions
from nimble.ir.taskgraph import Task, TaskGraph, TaskKind

# Two phases of three kernels: 0 -> 1, 0 -> 2 | 3 -> 4, 3 -> 5, with the barrier 1, 2 -> 3.
SCHEDULE = Schedule([0, 0, 1, 2, 2, 3], [[0, 1], [2], [3, 4], [5]], [(0, 2), (3, 5)], 0, 2,
                    phases=[3, 3], barrier_edges=[(1, 3), (2, 3)])
SPANS = [range(0, 3), range(3, 6)]
LATE = [(5, 4)]  # a kept tail backfill: anchor 5, deferred 4
PRIORITIES = [0, -1, -2, 0, -3, -1]
GATHERS = [[InputGather(0x9000, 0x1000, 4096)], []]


_CALL_PATH = {"cuGraphLaunch", "cuMemcpyDtoDAsync", "cuStreamWriteValue64", "cuEventRecord",
              "cuStreamWaitEvent", "cuCtxSetCurrent"}


class StandIn:
    """Stand-in bindings: each node a number, with what it runs, its dependencies and its 64-bit
    arguments; the edges added late, the priorities set, the execs instantiated."""

    CUresult = SimpleNamespace(CUDA_SUCCESS=0)
    CUgraphInstantiate_flags = SimpleNamespace(
        CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY=1,
        CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH=2, CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD=4)
    CUlaunchAttributeID = SimpleNamespace(CU_LAUNCH_ATTRIBUTE_PRIORITY="priority")
    CUevent_flags = SimpleNamespace(CU_EVENT_DEFAULT=0, CU_EVENT_DISABLE_TIMING=2)
    CUDA_KERNEL_NODE_PARAMS = CUkernelNodeAttrValue = CUDA_GRAPH_INSTANTIATE_PARAMS = \
        SimpleNamespace

    def __init__(self) -> None:
        self.count = 1000
        self.nodes: dict[int, SimpleNamespace] = {}
        self.late: list[tuple[int, int]] = []
        self.priority: dict[int, int] = {}
        self.instantiated: list[tuple[int, object]] = []
        self.freed: list[tuple[str, object]] = []

    def _new(self) -> int:
        self.count += 1
        return self.count

    def __getattr__(self, name):
        if name.endswith(("Destroy", "Unload")):
            return lambda handle: (self.freed.append((name, handle)), (0,))[1]
        if name in _CALL_PATH:  # bound by each launcher, not called here
            return lambda *args: (0,)
        raise AttributeError(name)

    def cuCtxGetCurrent(self):
        return 0, "ctx"

    def cuGraphCreate(self, flags):
        return 0, self._new()

    def cuEventCreate(self, flags):
        return 0, self._new()

    def cuModuleLoadData(self, image):
        return 0, "stamp module" if b"nimble_timestamp" in image else "gather module"

    def cuModuleGetFunction(self, module, name):
        return 0, name.decode()

    def cuGraphKernelNodeGetParams(self, node):
        return 0, SimpleNamespace(func=f"kernel of {node}", sharedMemBytes=0, kernelParams=0,
                                  extra=0)

    def cuGraphAddKernelNode(self, graph, deps, count, params):
        args = []
        if params.kernelParams:
            names = {"nimble_gather_input": 3, "nimble_timestamp": 1}
            args = param_words(params.kernelParams, names.get(params.func, 0))
        node = self._new()
        self.nodes[node] = SimpleNamespace(func=params.func, deps=list(deps), args=args,
                                           grid=getattr(params, "gridDimX", None),
                                           block=getattr(params, "blockDimX", None))
        return 0, node

    def cuGraphKernelNodeCopyAttributes(self, dst, src):
        return (0,)

    def cuGraphKernelNodeSetAttribute(self, node, attr, value):
        self.priority[node] = value.priority
        return (0,)

    def cuGraphAddDependencies(self, graph, froms, tos, edge_data, count):
        self.late += list(zip(froms, tos))
        return (0,)

    def cuGraphInstantiate(self, graph, flags):
        self.instantiated.append((flags, None))
        return 0, self._new()

    def cuGraphInstantiateWithParams(self, graph, params):
        self.instantiated.append((params.flags, getattr(params, "hUploadStream", None)))
        return 0, self._new()

    def cuMemcpyHtoD(self, address, data, size):
        return (0,)

    def cuMemcpyDtoH(self, host, address, size):
        return (0,)


@pytest.fixture
def bindings(monkeypatch):
    fake = StandIn()
    monkeypatch.setattr(calls, "_drv", fake)
    return fake


def task_graph() -> TaskGraph:
    graph = TaskGraph(meta={"phases": [3, 3], "phase_inputs": [1, 0], "phase_outputs": [1, 0]})
    graph.tasks = [Task(t, TaskKind.KERNEL, short_name=f"k{t}") for t in range(6)]
    return graph


def served_builder(nodes: list | None = None) -> PhaseBuilder:
    nodes = nodes or [f"recorded {t}" for t in range(6)]
    return PhaseBuilder(task_graph(), [nodes] * 2, [], SCHEDULE.edges(), SPANS, GATHERS,
                        PRIORITIES, [True, True], upload_stream="upload")


def served_input() -> InputSlot:
    """The served stand-in's one input slot (gathered in phase 0)."""
    return InputSlot(torch.zeros(1024), 0x1000, 4096, (1024,), torch.float32, True, 0x9000)


def served_recording(builder: PhaseBuilder) -> SimpleNamespace:
    """A recording stand-in for ``builder``'s graph: one output, ``served_input``'s values."""
    return SimpleNamespace(graph=builder.graph, output_spec=SimpleNamespace(is_leaf=lambda: True),
                           static_inputs=[torch.arange(1024.0)])


def stand_in_prepared(served: list) -> Prepared:
    """A Prepared over ``served`` (the built phases), with one input slot gathered in phase 0
    and phase 1's tail backfill kept."""
    slot = served_input()
    launchers = [SimpleNamespace(slots=[slot]), SimpleNamespace(slots=[])]
    kept = Backfill(1, 5, (4,), 1, 1.0, 1.0)
    return Prepared(graph=task_graph(), schedule=SCHEDULE, memplan=None, builts=served,
                    arena=None, arena_base=0, bases=[], launchers=launchers, weights=None,
                    seconds={}, priorities=PRIORITIES,
                    backfill=[Picked(1, 1.0, (0.9,), kept)])


def test_build_graph_makes_what_its_spec_says(bindings):
    spec = GraphSpec(SCHEDULE.edges(), span=SPANS[1], upload_stream="upload",
                     gathers=[InputGather(0x9000, 0x1000, 1 << 20)], priorities=PRIORITIES,
                     late_edges=LATE, stamps=StampSpec(0x5000, start_stamps=False))
    built = build_graph(task_graph(), [f"recorded {t}" for t in range(6)], [], spec)
    nodes = bindings.nodes
    (gather,) = [k for k, v in nodes.items() if v.func == "nimble_gather_input"]
    assert nodes[gather].args == [0x9000, 0x1000, 1 << 20] and nodes[gather].deps == []
    assert nodes[gather].grid == 256 and nodes[gather].block == GATHER_BLOCK
    three, four, five = built.nodes
    assert nodes[three].deps == [gather]  # the phase's root waits for the gather alone
    assert nodes[four].deps == [three] and nodes[five].deps == [three]
    stamps = {v.args[0]: v.deps for v in nodes.values() if v.func == "nimble_timestamp"}
    # ends after each task; one start (the first root's, beside it), not the others
    assert stamps == {0x5008: [three], 0x5018: [four], 0x5028: [five], 0x5000: [gather]}
    assert sorted(bindings.late) == sorted([(five, four)])
    assert all(bindings.priority[k] == -3 for k, v in nodes.items()
               if v.func.startswith("nimble_"))  # Nimble's own nodes at the top priority
    assert [bindings.priority[k] for k in built.nodes] == PRIORITIES[3:]
    assert bindings.instantiated == [(1 | 2 | 4, "upload")] and built.device_launch
    assert (built.module.handle, built.stamp_module.handle) == ("gather module", "stamp module")
    built.close()
    assert ("cuModuleUnload", "gather module") in bindings.freed
    assert ("cuModuleUnload", "stamp module") in bindings.freed


def test_a_subset_leaves_the_other_tasks_without_nodes(bindings):
    spec = GraphSpec(SCHEDULE.edges(), span=SPANS[1], device_launch=False, only={3, 5},
                     late_edges=LATE)
    built = build_graph(task_graph(), [f"recorded {t}" for t in range(6)], [], spec)
    assert built.nodes[1] is None and None not in (built.nodes[0], built.nodes[2])
    assert bindings.late == []  # the late edge's end (task 4) has no node
    assert bindings.instantiated == [(0, None)] and not bindings.priority
    assert built.module is None and built.stamp_module is None


def test_the_options_name_every_difference_from_the_served_phase():
    served = served_builder()
    assert served.spec(0) == GraphSpec(SCHEDULE.edges(), span=SPANS[0], device_launch=True,
                                       upload_stream="upload", gathers=tuple(GATHERS[0]),
                                       priorities=PRIORITIES)
    trial = served.spec(1, PhaseOptions(late_edges=LATE))
    assert trial == GraphSpec(SCHEDULE.edges(), span=SPANS[1], upload_stream="upload",
                              priorities=PRIORITIES, late_edges=LATE)
    copies = stand_in_prepared([SimpleNamespace(span=s, nodes=[f"built {t}" for t in s],
                                                device_launch=k == 0)
                                for k, s in enumerate(SPANS)]).phase_builder("stream")
    assert copies.nodes[1] == [None] * 3 + ["built 3", "built 4", "built 5"]
    as_served = copies.spec(0)
    assert as_served == GraphSpec(SCHEDULE.edges(), span=SPANS[0], upload_stream="stream",
                                  gathers=tuple(GATHERS[0]), priorities=PRIORITIES,
                                  late_edges=LATE, nodes_relocated=True)
    assert copies.spec(1).device_launch is False  # where the served phase was refused it
    stop = copies.spec(0, step_through.stop_options({0, 1}))
    assert stop == GraphSpec(SCHEDULE.edges(), span=SPANS[0], device_launch=False,
                             upload_stream="stream", late_edges=LATE, only={0, 1},
                             nodes_relocated=True)
    stamped = copies.spec(1, timeline.instrumented_options(0x5000, SPANS[1], False, {4}))
    assert stamped == GraphSpec(SCHEDULE.edges(), span=SPANS[1], device_launch=False,
                                upload_stream="stream", priorities=PRIORITIES,
                                late_edges=LATE, nodes_relocated=True,
                                stamps=StampSpec(0x5000 + 16 * 3, False, {4}))


@pytest.fixture
def recorded_builds(monkeypatch, bindings):
    """Every build_graph call the builder makes, as ``(nodes, spec)``, each really built on the
    stand-in bindings."""
    seen: list[tuple[list, GraphSpec]] = []
    real = rebuild.build_graph

    def build(graph, nodes, bases, spec):
        seen.append((list(nodes), spec))
        return real(graph, nodes, bases, spec)
    monkeypatch.setattr(rebuild, "build_graph", build)
    return seen


def test_the_served_phases_and_their_backfill_trial_go_through_the_builder(
        recorded_builds, monkeypatch):
    refreshed = []

    def launch(before, stream, refresh):
        def timed(built, count):
            slot.tensor.fill_(-1.0)  # what a launch before may leave in the input's bytes
            refresh()
            refreshed.append(slot.tensor.clone())
            return float(count)
        return timed
    monkeypatch.setattr(prepared_module, "_after_phases", launch)
    builder = served_builder()
    rec, slot = served_recording(builder), served_input()
    trial = Backfill(1, 5, (4,), 1, 1.0, 1.0)
    builts: list = []
    launchers, picked = prepared_module._build_phases(
        builder, rec, [slot], [torch.zeros(1)], torch.device("cpu"), None, {1: [trial]}, builts)
    assert [spec for _, spec in recorded_builds] == [
        builder.spec(0), builder.spec(1), builder.spec(1, PhaseOptions(late_edges=[(5, 4)]))]
    assert all(nodes == [f"recorded {t}" for t in range(6)] for nodes, _ in recorded_builds)
    assert len(builts) == len(launchers) == 2 and [p.phase for p in picked] == [1]
    # the backfill's timed launches read the recording's own inputs too (a training step whose
    # inputs' bytes are reused within the step would otherwise time on what a launch left)
    assert refreshed and all(torch.equal(x, torch.arange(1024.0)) for x in refreshed)
    for built in builts:
        built.close()


def test_the_step_through_and_the_timeline_build_copies_through_the_builder(
        recorded_builds, bindings):
    served = [build_graph(task_graph(), [f"recorded {t}" for t in range(6)], [],
                          served_builder().spec(k)) for k in range(2)]
    recorded_builds.clear()
    prepared = stand_in_prepared(served)
    copies = prepared.phase_builder()
    stepper = step_through.StepThrough(prepared, 1)
    stop = step_through.build_phase(prepared, 0, {0, 2})
    assert [spec for _, spec in recorded_builds] == [
        copies.spec(1, step_through.stop_options(None)),
        copies.spec(0, step_through.stop_options({0, 2}))]
    assert recorded_builds[0][0] == prepared.built_nodes(1)
    stepper.close()
    stop.close()

    recorded_builds.clear()
    runner = SimpleNamespace(stream="stream", run=lambda execs: 2.0)
    stamps = SimpleNamespace(address=0x5000)
    us, raw = timeline._run_stamped(prepared, prepared.phase_builder(runner.stream), runner,
                                    stamps, 3, True, {1, 4})
    assert us == 2.0 and len(raw) == 16 * 6
    copies = prepared.phase_builder("stream")
    assert [spec for _, spec in recorded_builds] == [
        copies.spec(k, timeline.instrumented_options(0x5000, SPANS[k], True, {1, 4}))
        for k in range(2)]
    for built in served:
        built.close()


def test_as_served_changes_nothing():
    assert AS_SERVED == PhaseOptions()
    assert served_builder().spec(1, AS_SERVED) == served_builder().spec(1)
