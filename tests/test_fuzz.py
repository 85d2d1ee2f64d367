"""The proof's race fuzzer (nimble.engine.fuzz) on stand-in driver bindings: where the delay nodes
go, what a draw is, the fuzz launches the proof runs, what it records, and that the copies are
freed whether the proof passes or fails.  No GPU."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import param_words
from nimble.driver import calls
from nimble.engine import fuzz as fuzz_module
from nimble.engine import proving
from nimble.engine import proof, rebuild
from nimble.engine.build import DelaySpec, build_graph
from nimble.analysis import delays as delays_module
from nimble.analysis.delays import delay_caps_ns, draw_delays
from nimble.engine.fuzz import FuzzCopies
from nimble.engine.launcher import InputSlot
from nimble.engine.rebuild import PhaseOptions
from nimble.errors import VerificationError
from nimble.ir.taskgraph import TaskGraph
from test_rebuild import SCHEDULE, SPANS, StandIn, served_builder, task_graph

TABLE = 0x7000


class DelayStandIn(StandIn):
    """The rebuild tests' stand-in bindings, knowing the delay kernel and device memory."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[bytes] = []  # the delay table's bytes after every write into it
        self.allocated: list[int] = []
        self.memory: dict[int, bytearray] = {}
        self.host_copies = 0
        self.phase_ms = [0.0]
        self.cloned: dict[int, int] = {}  # a clone's node -> the original's
        self.first_event = 0

    def cuModuleLoadData(self, image):
        if b"nimble_delay" in image:
            return 0, "delay module"
        return super().cuModuleLoadData(image)

    def cuGraphAddKernelNode(self, graph, deps, count, params):
        code, node = super().cuGraphAddKernelNode(graph, deps, count, params)
        if params.func == "nimble_delay":
            self.nodes[node].args = param_words(params.kernelParams, 2)
        return code, node

    def cuMemAlloc(self, size):
        self.allocated.append(TABLE + 0x100000 * len(self.allocated))
        self.memory[self.allocated[-1]] = bytearray(size)
        return 0, self.allocated[-1]

    def cuMemFree(self, handle):
        self.freed.append(("cuMemFree", handle))
        return (0,)

    def _write(self, address: int, data: bytes) -> None:
        base = max(b for b in self.memory if b <= address)
        self.memory[base][address - base:address - base + len(data)] = data
        if base == TABLE:
            self.tables.append(bytes(self.memory[base]))

    def _read(self, address: int, size: int) -> bytes:
        base = max(b for b in self.memory if b <= address)
        return bytes(self.memory[base][address - base:address - base + size])

    def cuMemcpyHtoD(self, address, data, size):
        self.host_copies += 1
        self._write(address, bytes(data))
        return (0,)

    def cuGraphClone(self, graph):
        return 0, self._new()

    def cuGraphNodeFindInClone(self, node, clone):
        """A new number for the clone's node, remembering the original."""
        found = self._new()
        self.cloned[found] = node
        return 0, found

    def cuEventSynchronize(self, event):
        return (0,)

    def cuEventElapsedTime(self, start, end):
        """Phase k of a launch takes ``phase_ms[k]`` (the clock's events are made in order from
        ``first_event``, one per phase boundary)."""
        return 0, self.phase_ms[(start - self.first_event) % len(self.phase_ms)]

    def cuMemcpyDtoDAsync(self, dst, src, size, stream):
        self._write(dst, self._read(src, size))
        return (0,)


@pytest.fixture
def bindings(monkeypatch):
    fake = DelayStandIn()
    monkeypatch.setattr(calls, "_drv", fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(fuzz_module.Launcher, "stream", lambda self, raw=None: "stream")
    return fake


def _delays(bindings) -> dict[int, SimpleNamespace]:
    """Delay node -> its stand-in record."""
    return {k: v for k, v in bindings.nodes.items() if v.func == "nimble_delay"}


def test_each_delay_node_sits_between_its_task_and_the_tasks_predecessors(bindings):
    spec = served_builder().spec(1, PhaseOptions(delays=DelaySpec(TABLE), late_edges=[(5, 4)]))
    built = build_graph(task_graph(), [f"recorded {t}" for t in range(6)], [], spec)
    three, four, five = built.nodes
    delays = _delays(bindings)
    by_task = {v.args[1]: k for k, v in delays.items()}
    assert set(by_task) == {3, 4, 5} and all(v.args[0] == TABLE for v in delays.values())
    for task, node in zip((3, 4, 5), built.nodes):
        assert bindings.nodes[node].deps == [by_task[task]]  # the task waits for its delay alone
    assert delays[by_task[4]].deps == [three] and delays[by_task[5]].deps == [three]
    assert delays[by_task[3]].deps == []  # a root of the phase (no gathers in phase 1)
    assert bindings.late == [(five, four)]  # late edges still end at the task itself
    assert all(bindings.priority[k] == -3 for k in delays)  # at the top priority
    assert built.delay_module.handle == "delay module"
    built.close()
    assert ("cuModuleUnload", "delay module") in bindings.freed


def test_only_the_chosen_tasks_are_delayed(bindings):
    spec = served_builder().spec(1, PhaseOptions(delays=DelaySpec(TABLE, tasks={4})))
    built = build_graph(task_graph(), [f"recorded {t}" for t in range(6)], [], spec)
    (delay,) = _delays(bindings)
    assert bindings.nodes[delay].args == [TABLE, 4]
    assert bindings.nodes[built.nodes[1]].deps == [delay]
    assert bindings.nodes[built.nodes[2]].deps == [built.nodes[0]]


def test_the_served_phases_have_no_delay_nodes(bindings):
    builder = served_builder()
    assert all(builder.spec(k).delays is None for k in range(2))
    for k in range(2):
        builder.build(k).close()
    assert not _delays(bindings)


def test_verification_copies_may_leave_edges_out_and_move_buffers(monkeypatch, bindings):
    builder = served_builder()
    spec = builder.spec(0, PhaseOptions(removed_edges={(0, 2)}))
    assert (0, 2) not in spec.edges and set(spec.edges) == set(SCHEDULE.edges()) - {(0, 2)}
    seen = []
    monkeypatch.setattr(rebuild, "build_graph", lambda g, nodes, bases, spec: seen.append(bases))
    builder.build(0, PhaseOptions(bases=[7, 8]))
    builder.build(0)
    assert seen == [[7, 8], []]


def test_delay_caps_follow_the_longest_task_of_each_phase():
    graph = task_graph()
    graph.tasks[1].duration_us = 30.0
    graph.tasks[2].duration_us = 5.0
    caps = delay_caps_ns(graph, SPANS)
    assert list(caps[:3]) == [60_000] * 3  # twice phase 0's longest task
    assert list(caps[3:]) == [delays_module.UNTIMED_CAP_NS] * 3  # phase 1: none timed
    graph.tasks[4].duration_us = 1e6
    assert delay_caps_ns(graph, SPANS)[4] == delays_module.MAX_DELAY_NS


def test_a_draw_delays_about_half_the_tasks_within_their_caps():
    caps = np.array([4_000, 60_000] * 500)
    delays = draw_delays(np.random.default_rng(0), caps)
    assert delays.dtype == np.uint32
    chosen = delays > 0
    assert 0.4 < chosen.mean() < 0.6
    assert (delays[chosen] >= delays_module.MIN_DELAY_NS).all() and (delays <= caps).all()
    # log-uniform: as many delays in the lower as in the upper half of the log range
    long = delays[1::2][chosen[1::2]]
    middle = np.sqrt(delays_module.MIN_DELAY_NS * 60_000)
    assert 0.4 < (long < middle).mean() < 0.6


def _served_launchers():
    slot = InputSlot(torch.zeros(4), 0x1000, 16, (4,), torch.float32, True, 0x9000)
    forgot: list = []
    return [SimpleNamespace(slots=[slot], outputs=[torch.zeros(1)], rng=None, forgot=forgot,
                            forget_cells=lambda: forgot.append(0)),
            SimpleNamespace(slots=[], outputs=[], rng=None, forgot=forgot,
                            forget_cells=lambda: forgot.append(1))]


def test_the_fuzz_copies_draw_anew_before_each_launch_and_are_freed(bindings, monkeypatch):
    launched = []
    monkeypatch.setattr(fuzz_module.Launcher, "run_flat",
                        lambda self, inputs: launched.append(self) or [])
    served = _served_launchers()
    copies = FuzzCopies(served_builder(), served, torch.device("cpu"), seed=1, rows=2,
                        calibration=0, orders=False)
    assert all(len(d.deps) <= 1 for d in _delays(bindings).values())
    assert len(_delays(bindings)) == 6  # no targets known: every task of both phases
    assert bindings.tables == [bytes(24)]  # the table starts at no delay
    assert bindings.host_copies == 2  # the table, then every row in one copy
    for _ in range(3):
        copies.draw()
        copies.run([torch.zeros(4)])
    draws = bindings.tables[1:]
    assert len(draws) == 3 and len(set(draws)) == 3  # a different draw for each launch
    assert bindings.host_copies == 3  # the third draw, past the rows, written as it came
    assert len(launched) == 6 and copies.stats.launches == copies.stats.draws == 3
    meta = copies.stats.as_meta()
    assert meta["fuzz_launches"] == meta["delay_draws"] == 3
    assert sum(meta["draw_kinds"].values()) == 3 and meta["fuzz_targets"] == 0
    assert meta["max_delay_us"] * 1000 == max(
        int(np.frombuffer(d, dtype=np.uint32).max()) for d in draws)
    copies.close()
    copies.close()
    assert served[0].forgot[:2] == [0, 1]  # the served calls write their cells again
    modules = [h for name, h in bindings.freed if name == "cuModuleUnload"]
    assert modules.count("delay module") == 2  # both phases' copies
    assert ("cuMemFree", copies.table.address) in bindings.freed
    assert ("cuMemFree", copies.rows.address) in bindings.freed


def _graph_with_hazards() -> TaskGraph:
    """The rebuild tests' two phases, where task 0 writes what task 2 (another stream) reads
    and task 3 writes what task 5 reads: two direct hazards, one in each phase."""
    from nimble.ir.taskgraph import Access, Buffer, BufferKind

    graph = task_graph()
    graph.buffers = [Buffer(0, BufferKind.INTERMEDIATE, 256, 0x10000),
                     Buffer(1, BufferKind.INTERMEDIATE, 256, 0x20000)]
    graph.tasks[0].accesses = [Access(0, 0, 256, True)]
    graph.tasks[2].accesses = [Access(0, 0, 256, False)]
    graph.tasks[3].accesses = [Access(1, 0, 256, True)]
    graph.tasks[5].accesses = [Access(1, 0, 256, False)]
    for t, us in zip(graph.tasks, [10.0, 30.0, 5.0, 20.0, 8.0, 4.0]):
        t.duration_us = us
    return graph


def test_targeted_copies_delay_only_the_targets_each_by_its_phases_critical_path(bindings,
                                                                                monkeypatch):
    from dataclasses import replace

    monkeypatch.setattr(fuzz_module.Launcher, "run_flat", lambda self, inputs: [])
    builder = replace(served_builder(), graph=_graph_with_hazards())
    copies = FuzzCopies(builder, _served_launchers(), torch.device("cpu"), seed=0,
                        stream_of=SCHEDULE.stream_of, offsets={0: 0, 1: 256}, rows=4,
                        calibration=0, orders=False)
    assert sorted(v.args[1] for v in _delays(bindings).values()) == [0, 3]
    rows = []
    for _ in range(2):
        copies.draw()
        rows.append((copies.stats.last_kind,
                     list(np.frombuffer(bindings.tables[-1], dtype=np.uint32))))
    # One launch holds both back (the phases launch apart).  The chained draw first: a
    # target's lead over its partner (task 0 starts 10 us before task 2, task 3 20 us before
    # task 5) three times over plus 20 us, within each phase's critical path (10 + 30 us, then
    # 20 + 8 us), which the held draw waits.
    assert rows == [(delays_module.CHAINED, [40_000, 0, 0, 28_000, 0, 0]),
                    (delays_module.TARGETED, [40_000, 0, 0, 28_000, 0, 0])]
    assert copies.stats.as_meta()["fuzz_targets"] == 2
    assert copies.stats.as_meta()["fuzz_targets_held"] == 2
    assert copies.direct_cover == 2
    copies.close()


def test_the_first_launches_run_each_phase_in_serial_orders_of_the_copys_own_edges(
        bindings, monkeypatch):
    launched = []
    monkeypatch.setattr(fuzz_module.Launcher, "run_flat",
                        lambda self, inputs: launched.append(self) or [])
    copies = FuzzCopies(served_builder(), _served_launchers(), torch.device("cpu"), seed=1,
                        rows=2, calibration=0, options=PhaseOptions(removed_edges={(0, 2)}))
    # phase 0 lost its sync 0 -> 2: 2 is unordered with 0 and 1, and runs first; phase 1
    # leaves 4 and 5 unordered (both after 3): 5 runs first
    assert copies.plan[0].orders == [[2, 0, 1]] and copies.plan[1].orders == [[3, 5, 4]]
    assert [b.span for b in copies._bases] == SPANS
    assert not copies.builts and copies.draws is None  # no delay-noded copy before it is due
    assert not copies.order_builts and copies.order_launchers == [None]  # cloned when due
    for base in copies._bases:  # each phase built once, with no edge and no delay node
        own = set(base.nodes)
        assert all(not set(bindings.nodes[node].deps) & own for node in base.nodes)
        assert not any(v.func == "nimble_delay" and set(v.deps) & own
                       for v in bindings.nodes.values())
    copies.draw()
    order_copies = copies.order_builts
    assert [b.span for b in order_copies] == SPANS
    # each order a clone of its phase's build, chained in order
    first = order_copies[0].nodes  # tasks 0, 1, 2
    assert [bindings.cloned[node] for node in first] == copies._bases[0].nodes
    assert bindings.late[-4:] == [(first[2], first[0]), (first[0], first[1]),
                                  (order_copies[1].nodes[0], order_copies[1].nodes[2]),
                                  (order_copies[1].nodes[2], order_copies[1].nodes[1])]
    copies.run([torch.zeros(4)])
    assert launched == copies.order_launchers[0] and copies.stats.last_kind == fuzz_module.ORDER
    assert copies.order_builts == order_copies  # one order launch: nothing built ahead
    assert bindings.tables == []  # no table yet
    # the budget is told what readying the first delay launch costs, and nothing more
    assert copies.upcoming_seconds(0) == 0.0 < copies.upcoming_seconds(copies.required)
    copies.draw()
    copies.run([torch.zeros(4)])
    assert len(copies.builts) == 2 and launched[2:] == copies.launchers  # then the delays
    meta = copies.stats.as_meta()
    assert meta["serial_orders"] == [1, 1] and meta["unordered_pairs"] == 3
    assert meta["pairs_not_reversed"] == 0 and copies.required == 1
    assert copies.upcoming_seconds(copies.required + 1) == 0.0  # built by now
    assert set(meta["fuzz_build_s"]) == {"order_bases", "order_copies", "delay_copies"}
    assert all(b.exec is None for b in copies._bases)  # a base is cloned, never launched
    assert all(not b.device_launch for b in copies.builts)  # the copies launch from the host
    copies.close()
    for b in order_copies:
        assert ("cuGraphExecDestroy", b.exec.handle) in bindings.freed
    destroyed = [h for name, h in bindings.freed if name == "cuGraphDestroy"]
    assert destroyed.index(order_copies[0].graph.handle) < \
        destroyed.index(copies._bases[0].graph.handle)  # the clones before their original


def test_the_next_orders_copies_are_built_while_the_gpu_runs_the_one_before(bindings,
                                                                             monkeypatch):
    launched = []
    monkeypatch.setattr(fuzz_module.Launcher, "run_flat",
                        lambda self, inputs: launched.append(self) or [])
    # phase 0 keeps only 0 -> 2: 1 must run before 0 and 2 before 1, which no one order does
    copies = FuzzCopies(served_builder(), _served_launchers(), torch.device("cpu"), rows=0,
                        calibration=0, options=PhaseOptions(removed_edges={(0, 1)}))
    assert copies.plan[0].orders == [[1, 0, 2], [0, 2, 1]] and copies.required == 2
    copies.draw()
    assert copies.order_launchers[1] is None  # not yet
    copies.run([torch.zeros(4)])
    assert copies.order_launchers[1] is not None  # readied after the launch, before the check
    built = list(copies.order_builts)
    copies.draw()
    copies.run([torch.zeros(4)])
    assert copies.order_builts == built and launched[-2:] == copies.order_launchers[1]
    # phase 1 has one order: its copy serves both launches
    assert copies.order_launchers[0][1] is copies.order_launchers[1][1]
    copies.close()


def test_the_first_launches_time_each_phase_and_every_delay_is_stretched_past_it(
        bindings, monkeypatch):
    from dataclasses import replace

    monkeypatch.setattr(fuzz_module.Launcher, "run_flat", lambda self, inputs: [])
    builder = replace(served_builder(), graph=_graph_with_hazards())
    copies = FuzzCopies(builder, _served_launchers(), torch.device("cpu"), seed=0,
                        stream_of=SCHEDULE.stream_of, offsets={0: 0, 1: 256}, rows=4,
                        orders=False)
    bindings.phase_ms = [0.1, 0.01]  # phase 0 runs 100 us, phase 1 10 us
    bindings.first_event = copies._clocks[0].events[0].handle
    for _ in range(fuzz_module.CALIBRATION_LAUNCHES):
        copies.draw()
        copies.run([torch.zeros(4)])
    assert bindings.tables == [bytes(24)]  # no delay while timing
    assert bindings.host_copies == 1  # the rows wait for the times
    copies.draw()
    assert bindings.host_copies == 2  # every row, stretched, in one copy
    # phase 0's critical path (10 + 30 us) is under its launch: its delays grow until a held
    # pick waits 1.5 launches (150 us), so its chained pick waits 40 us * 3.75; phase 1's
    # critical path (28 us) already passes 1.5 of its 10 us launch
    assert list(np.frombuffer(bindings.tables[-1], dtype=np.uint32)) == \
        [150_000, 0, 0, 28_000, 0, 0]
    meta = copies.stats.as_meta()
    assert meta["draw_kinds"] == {fuzz_module.CALIBRATION: 2, delays_module.CHAINED: 1}
    assert meta["fuzz_launch_ms"] == [0.1, 0.01] and meta["delay_scale"] == [3.75, 1.0]
    assert copies.direct_cover == 2 + fuzz_module.CALIBRATION_LAUNCHES
    (clock,) = copies._clocks
    events = [e.handle for e in clock.events]
    assert len(events) == 3  # one before each of the 2 phases, one after the last
    copies.close()
    assert all(("cuEventDestroy", e) in bindings.freed for e in events)


def test_the_stretch_reaches_the_measured_launch_and_never_shrinks_a_delay():
    from nimble.analysis.delays import HEAVY_DELAY_NS, delay_scale, scaled

    heavy = np.array([40_000] * 3 + [28_000] * 2 + [HEAVY_DELAY_NS[1]])
    spans = [range(0, 3), range(3, 5), range(5, 6)]
    scale = delay_scale(heavy, spans, [100_000.0, 10_000.0, 9e9])
    assert list(scale) == [3.75] * 3 + [1.0] * 3
    assert list(scaled(np.array([40_000, 1_000, 0, 28_000, 0, HEAVY_DELAY_NS[1]]),
                       np.full(6, 1e3))) == [HEAVY_DELAY_NS[1], 1_000_000, 0,
                                             HEAVY_DELAY_NS[1], 0, HEAVY_DELAY_NS[1]]


def test_targeted_draws_come_first_then_two_to_one_random():
    from nimble.analysis.hazards import Hazard, TargetedPicks
    from nimble.analysis.delays import Draws

    n = 6
    hazards = [Hazard(0, 2, "write-read", -1, 0, 4), Hazard(1, 2, "write-read", -1, 4, 8)]
    picks = TargetedPicks(n, hazards, [(0, 2), (1, 2)], seed=0)
    draws = Draws(np.full(n, 8_000), np.full(n, 50_000), np.array([0, 1, 2, 2, 2, 2]), picks,
                  np.array([True, True, False, False, False, False]), seed=0)
    kinds = [draws.next()[0] for _ in range(8)]
    # tasks 0 and 1 share their partner: a launch each covers them
    assert kinds[:2] == [delays_module.TARGETED] * 2 and picks.all_covered
    assert kinds[2:] == ["stream", "targeted", "targeted", "per-task", "targeted", "targeted"]


def test_a_failed_build_frees_what_was_built(bindings, monkeypatch):
    builder = served_builder()
    real = builder.build
    calls_made = []

    def build(k, options):
        calls_made.append(k)
        if k == 1:
            raise RuntimeError("no more nodes")
        return real(k, options)
    monkeypatch.setattr(builder, "build", build)
    with pytest.raises(RuntimeError):
        FuzzCopies(builder, _served_launchers(), torch.device("cpu"), orders=False)
    assert calls_made == [0, 1]
    assert [h for name, h in bindings.freed if name == "cuModuleUnload"] == \
        ["gather module", "delay module"]
    assert ("cuMemFree", TABLE) in bindings.freed


# ---- the fuzz launches inside the proof (CPU stand-ins for the reference and the runs) ----

class FakeFuzz:
    """Fuzz copies that are right until ``wrong_at`` (a fuzz launch index)."""

    def __init__(self, wrong_at: int | None = None, upcoming: dict[int, float] | None = None
                 ) -> None:
        self.events: list[str] = []
        self.wrong_at = wrong_at
        self.upcoming = upcoming or {}  # launch: seconds readying it costs
        self.stats = fuzz_module.FuzzStats()
        self.closed = 0
        self.required = 0  # launches that run whatever the budget

    def draw(self) -> None:
        self.events.append("draw")
        self.stats.draws += 1

    def upcoming_seconds(self, launch: int) -> float:
        return self.upcoming.get(launch, 0.0)

    def run(self, inputs):
        self.events.append("run")
        self.stats.launches += 1
        (x,) = inputs
        return [x * 2 + (1.0 if self.stats.launches - 1 == self.wrong_at else 0.0)]

    def close(self) -> None:
        self.closed += 1


def _check(fake, **kw):
    def double(inputs):
        return [inputs[0] * 2]
    return proof.verify_against_reference(TaskGraph(), double, double, [torch.zeros(8)], [],
                                          None, relaunches=4, fuzz=fake, **kw)


@pytest.fixture
def no_device(monkeypatch):
    monkeypatch.setattr(proof, "poison", lambda ranges, stream: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)


def test_every_fuzz_launch_follows_a_fresh_draw(no_device):
    fake = FakeFuzz()
    assert _check(fake, fuzz_budget=proof.FuzzBudget(6)) == {}
    assert fake.events == ["draw", "run"] * 6


def test_a_launch_whose_copies_would_overrun_the_budget_is_not_readied(no_device):
    """The delay-noded copies are built only where the budget leaves room for them: building
    them for launches the budget then stops would overrun it."""
    fake = FakeFuzz(upcoming={2: 1e6})
    _check(fake, fuzz_budget=proof.FuzzBudget(6, time_factor=1.0, at_least=2))
    assert fake.events == ["draw", "run"] * 2
    fake = FakeFuzz(upcoming={2: 1e6})  # no time budget: only the count bounds it
    _check(fake, fuzz_budget=proof.FuzzBudget(6))
    assert fake.events == ["draw", "run"] * 6


def test_the_last_fuzz_launch_fits_the_budget(no_device, monkeypatch):
    """A launch runs only where the one before it would still fit: 40 ms launches after a
    proof of 100 ms run twice, not three times (the third would end at 120 ms)."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(proof, "time", SimpleNamespace(perf_counter=lambda: clock.now))

    class Slow(FakeFuzz):
        def run(self, inputs):
            clock.now += 0.04
            return super().run(inputs)
    def served(inputs):  # four served launches of 25 ms: a proof of 100 ms
        clock.now += 0.025
        return [inputs[0] * 2]
    fake = Slow()
    proof.verify_against_reference(TaskGraph(), lambda inputs: [inputs[0] * 2], served,
                                   [torch.zeros(8)], [], None, relaunches=4, fuzz=fake,
                                   fuzz_budget=proof.FuzzBudget(10, time_factor=1.0, at_least=1))
    assert fake.stats.launches == 2


def test_fuzz_launches_over_saved_state_see_the_same_budget(no_device, monkeypatch):
    """A graph that writes memory not its own (a training step's running statistics, a decode
    step's cache) runs its fuzz launches from the saved state: the budget still hears what
    readying them costs."""
    class Saved:
        def __init__(self, ranges):
            self.restores = 0

        def before(self, run):
            def restored(inputs):
                self.restores += 1
                return run(inputs)
            return restored

        def close(self):
            pass
    monkeypatch.setattr(proof, "SharedState", Saved)
    fake = FakeFuzz(upcoming={2: 1e6})
    _check(fake, fuzz_budget=proof.FuzzBudget(6, time_factor=1.0, at_least=2),
           state=[(0x1000, 64)])
    assert fake.events == ["draw", "run"] * 2


def test_a_race_only_the_delays_expose_fails_the_proof(no_device):
    with pytest.raises(VerificationError, match=r"fuzz launch 3 \(with random delays\)"):
        _check(FakeFuzz(wrong_at=3), fuzz_budget=proof.FuzzBudget(6))


def test_a_run_that_returns_fewer_outputs_than_the_reference_fails(no_device):
    """A copy that launched nothing returns no outputs: that is no pass."""
    class Empty(FakeFuzz):
        def run(self, inputs):
            super().run(inputs)
            return []
    with pytest.raises(VerificationError, match="0 outputs where the single-stream reference "
                                                "has 1"):
        _check(Empty(), fuzz_budget=proof.FuzzBudget(6))


def test_copies_without_delays_run_the_phases_as_served_over_the_changes(bindings,
                                                                         monkeypatch):
    launched = []
    monkeypatch.setattr(fuzz_module.Launcher, "run_flat",
                        lambda self, inputs: launched.append(self) or [])
    copies = FuzzCopies(served_builder(), _served_launchers(), torch.device("cpu"),
                        options=PhaseOptions(removed_edges={(0, 2)}), delays=False)
    assert len(copies.builts) == 2 and not copies.order_builts and not _delays(bindings)
    copies.draw()
    copies.run([torch.zeros(4)])
    assert launched == copies.launchers and copies.stats.draws == 0
    copies.close()


def test_the_budget_stops_the_fuzz_launches_once_they_take_as_long_as_the_proof():
    budget = proof.FuzzBudget(100, time_factor=1.0, spent_seconds=0.5, at_least=4)
    assert budget.allows(3, proof_seconds=0.1, fuzz_seconds=9.0)  # the first few run anyway
    assert budget.allows(4, proof_seconds=2.0, fuzz_seconds=1.4)
    assert not budget.allows(4, proof_seconds=2.0, fuzz_seconds=1.6)
    assert not budget.allows(100, proof_seconds=1e9, fuzz_seconds=0.0)
    unlimited = proof.FuzzBudget(10)  # only the count bounds it, whatever the proof took
    assert unlimited.allows(9, proof_seconds=0.0, fuzz_seconds=5.0)
    assert not unlimited.allows(10, proof_seconds=0.0, fuzz_seconds=0.0)


def _stand_in_prove(monkeypatch, fake: FakeFuzz):
    """``prove`` on a stand-in prepared graph whose fuzz copies are ``fake``."""
    monkeypatch.setattr(proving, "_fuzz_copies", lambda prepared, rec, seed: fake)
    monkeypatch.setattr(proving, "low_word_ranges", lambda prepared: [])
    graph = TaskGraph()
    launcher = SimpleNamespace(rng=None, stream=lambda: None, slots=[0],
                               run_flat=lambda inputs: [inputs[0] * 2])
    prepared = SimpleNamespace(graph=graph, launcher=launcher, launchers=[launcher], step=None,
                               arena_base=0, memplan=SimpleNamespace(arena_bytes=0), seconds={},
                               low_bits=())
    rec = SimpleNamespace(replay_reference=lambda inputs: [inputs[0] * 2],
                          static_inputs=[torch.zeros(8)])
    return prepared, rec


def test_prove_records_what_the_fuzzer_ran_and_frees_the_copies(no_device, monkeypatch):
    fake = FakeFuzz()
    prepared, rec = _stand_in_prove(monkeypatch, fake)
    proving.prove(prepared, rec, 4, fuzz_launches=5)
    verified = prepared.graph.meta["verified"]
    assert verified["launches"] == 4 and verified["fuzz"] is True
    assert verified["fuzz_launches"] == verified["delay_draws"] == 5
    assert fake.closed == 1
    assert {"verify_served", "verify_fuzz"} <= set(prepared.seconds)


def test_prove_frees_the_copies_when_the_fuzzer_finds_a_race(no_device, monkeypatch):
    fake = FakeFuzz(wrong_at=1)
    prepared, rec = _stand_in_prove(monkeypatch, fake)
    with pytest.raises(VerificationError, match="fuzz launch 1"):
        proving.prove(prepared, rec, 4, fuzz_launches=5)
    assert fake.closed == 1 and "verified" not in prepared.graph.meta


def test_prove_without_the_fuzzer_builds_no_copies(no_device, monkeypatch):
    fake = FakeFuzz(wrong_at=0)
    prepared, rec = _stand_in_prove(monkeypatch, fake)
    proving.prove(prepared, rec, 4, fuzz=False)
    assert fake.events == [] and prepared.graph.meta["verified"]["fuzz_launches"] == 0


def test_a_heavy_draw_delays_one_task_of_each_slow_stream_by_up_to_the_scale():
    import numpy as np

    from nimble.analysis.delays import draw_stream_delays

    stream_of = np.array([0, 1, 2, 3, -1] * 40)
    rng = np.random.default_rng(3)
    slow = []
    for _ in range(300):
        delays = draw_stream_delays(rng, stream_of, 1_000_000)
        assert not delays[stream_of < 0].any()
        for s in range(4):
            mine = delays[stream_of == s]
            assert np.count_nonzero(mine) <= 1
            assert all(500_000 <= d <= 1_000_000 for d in mine[mine > 0])
        slow.append(sum(1 for s in range(4) if delays[stream_of == s].any()))
    assert 1.0 < sum(slow) / len(slow) < 1.67  # a third of the four streams


def test_the_heavy_scale_is_the_critical_path_of_the_known_durations():
    from nimble.analysis.delays import HEAVY_DELAY_NS, heavy_delay_ns
    from nimble.ir.taskgraph import Task, TaskGraph

    g = TaskGraph()
    g.tasks = [Task(i, "kernel", duration_us=d) for i, d in enumerate([30.0, 50.0, 20.0])]
    assert heavy_delay_ns(g, [(0, 2), (1, 2)]) == 70_000  # 50 then 20
    g.tasks = [Task(i, "kernel") for i in range(3)]
    assert heavy_delay_ns(g, []) == HEAVY_DELAY_NS[1]


def test_every_fuzz_launch_starts_from_a_poisoned_arena(bindings, monkeypatch):
    events = []
    monkeypatch.setattr(fuzz_module.Launcher, "run_flat",
                        lambda self, inputs: events.append("launch") or [])
    monkeypatch.setattr(fuzz_module.Launcher, "stream", lambda self, raw=None: "stream")
    monkeypatch.setattr(fuzz_module, "poison",
                        lambda ranges, stream: events.append(("poison", tuple(ranges), stream)))
    copies = FuzzCopies(served_builder(), _served_launchers(), torch.device("cpu"), seed=1,
                        repoison=[(0x5000, 256)])
    for _ in range(2):
        copies.draw()
        copies.run([torch.zeros(4)])
    poisoned = ("poison", ((0x5000, 256),), "stream")
    assert events == [poisoned, "launch", "launch", poisoned, "launch", "launch"]
    copies.close()
