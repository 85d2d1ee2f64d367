"""Phased graphs (a training step: the forward graph, then the backward graph, one arena)."""
from __future__ import annotations

import random
import signal
from collections import defaultdict
from contextlib import contextmanager

import pytest

from nimble import BufferKind, TaskGraph
from nimble.engine.build import predecessors
from nimble.analysis.deps import build_dag, dag_from_edges, reachability
from nimble.analysis.arena_fit import schedule_within
from nimble.analysis.memplan import plan_memory
from nimble.analysis.plan_check import check_plan
from nimble.engine.prepared import single_stream_schedule
from nimble.analysis.schedule import (Schedule, ScheduleError, assign_phased, assign_streams,
                             check_schedule, induced, phase_spans)

from helpers import FIXTURE_DIR, random_dag

TRAIN = ["resnet50_train", "mobilenet_v2_train"]
_CACHE: dict = {}


@contextmanager
def deadline(seconds: int):
    """Fail instead of hanging (schedule_within once looped forever on phased graphs)."""
    def expire(signum, frame):
        raise TimeoutError(f"did not return within {seconds} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def load(name: str) -> TaskGraph:
    if name not in _CACHE:
        _CACHE[name] = TaskGraph.load(FIXTURE_DIR / f"{name}.json.gz")
    return _CACHE[name]


def scheduled(name: str):
    """``(graph, schedule, plan)`` of Nimble's schedule within the torch pool's size."""
    key = (name, "scheduled")
    if key not in _CACHE:
        graph = load(name)
        assert 0 < len(graph.tasks) < 5000  # a small graph: planning takes a second or so
        with deadline(60):
            _CACHE[key] = (graph, *schedule_within(graph, None, graph.meta["pool_bytes"]))
    return _CACHE[key]


def streams_in(schedule: Schedule, span: range) -> set[int]:
    return {schedule.stream_of[t] for t in span}


def random_phases(n: int, k: int, rng: random.Random) -> list[int]:
    cuts = sorted(rng.sample(range(1, n), k - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [n])]


# ---- spans and sub-DAGs -----------------------------------------------------------------------

def test_phase_spans_cover_the_tasks_and_reject_bad_counts():
    """Spans are consecutive, cover 0..n-1 in order; counts that do not add up are refused."""
    assert phase_spans([], 7) == [range(7)]
    assert phase_spans([3, 4], 7) == [range(0, 3), range(3, 7)]
    assert phase_spans([2, 0, 5], 7) == [range(0, 2), range(2, 2), range(2, 7)]
    for phases in ([10, 20, 30], [5, 5, 5, 5, 5]):
        spans = phase_spans(phases, sum(phases))
        assert [t for s in spans for t in s] == list(range(sum(phases)))
        assert [len(s) for s in spans] == phases
    for phases, n in (([3, 3], 7), ([3, 5], 7), ([8, -1], 7), ([7], 6), ([1], 0)):
        with pytest.raises(ValueError):
            phase_spans(phases, n)


@pytest.mark.parametrize("seed", range(5))
def test_induced_keeps_exactly_the_edges_inside_the_span(seed):
    """The sub-DAG has the span's internal edges, renumbered from 0, and nothing else."""
    dag = random_dag(80, 3, 12, seed)
    rng = random.Random(seed)
    for a, b in [(0, 80), (0, 30), (30, 80), (0, 0)] + [sorted(rng.sample(range(81), 2))
                                                        for _ in range(5)]:
        sub = induced(dag, range(a, b))
        want = dag_from_edges(b - a, [(u - a, v - a) for u, v in dag.edges()
                                      if a <= u and v < b])
        assert sub.n == b - a
        assert sub.succs == want.succs and sub.preds == want.preds


# ---- assign_phased ----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_assign_phased_on_random_dags(seed):
    """Valid; streams and syncs stay inside a phase, each phase scheduled as its sub-DAG alone;
    the barrier orders every task of a phase before every task of the next."""
    rng = random.Random(seed)
    n = rng.randint(20, 120)
    dag = random_dag(n, rng.randint(1, 3), rng.randint(2, 15), seed)
    phases = random_phases(n, 2 + seed % 2, rng)
    spans = phase_spans(phases, n)
    s = assign_phased(dag, phases)
    check_schedule(dag, s)
    assert s.phases == phases
    phase_of = [k for k, span in enumerate(spans) for _ in span]
    for stream in s.streams:
        assert len({phase_of[t] for t in stream}) == 1
    assert all(phase_of[u] == phase_of[v] for u, v in s.sync_edges)
    assert all(phase_of[v] == phase_of[u] + 1 for u, v in s.barrier_edges)
    reach = reachability(dag_from_edges(n, s.edges()))
    for before, after in zip(spans, spans[1:]):
        need = sum(1 << v for v in after)
        assert all(reach[u] & need == need for u in before)
    for span in spans:
        alone = assign_streams(induced(dag, span))
        assert len(streams_in(s, span)) == len(alone.streams)
        assert sum(1 for u, _ in s.sync_edges if u in span) == len(alone.sync_edges)


@pytest.mark.parametrize("seed", range(5))
def test_one_phase_is_assign_streams(seed):
    dag = random_dag(60, 2, 10, seed)
    for cap in (None, 2):
        want = assign_streams(dag, cap)
        assert assign_phased(dag, [], cap) == want
        assert assign_phased(dag, [60], cap) == want


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cap", [1, 2, 3])
def test_max_streams_caps_each_phase(seed, cap):
    rng = random.Random(seed)
    dag = random_dag(90, 3, 20, seed)
    phases = random_phases(90, 2 + seed % 2, rng)
    s = assign_phased(dag, phases, max_streams=cap)
    check_schedule(dag, s)
    for span in phase_spans(phases, 90):
        alone = assign_streams(induced(dag, span), cap)
        assert len(streams_in(s, span)) == len(alone.streams) <= cap
        assert sum(1 for u, _ in s.sync_edges if u in span) == len(alone.sync_edges)


def test_empty_phase_keeps_the_order_of_its_neighbours():
    """A phase of no tasks: the barrier goes from the phase before it to the one after."""
    dag = random_dag(40, 2, 6, 0)
    s = assign_phased(dag, [15, 0, 25])
    check_schedule(dag, s)
    reach = reachability(dag_from_edges(40, s.edges()))
    assert all((reach[u] >> v) & 1 for u in range(15) for v in range(15, 40))


def test_single_stream_schedule_has_one_stream_per_phase():
    graph = load("resnet50_train")
    dag = build_dag(graph)
    n, phases = len(graph.tasks), graph.meta["phases"]
    s = single_stream_schedule(n, phases)
    check_schedule(dag, s)
    fwd, bwd = phase_spans(phases, n)
    assert s.streams == [list(fwd), list(bwd)]
    assert s.barrier_edges == [(fwd.stop - 1, bwd.start)] and s.sync_edges == []
    assert single_stream_schedule(n).streams == [list(range(n))]
    with pytest.raises(ScheduleError):  # the forward -> backward dependencies need the barrier
        check_schedule(dag, Schedule(s.stream_of, s.streams, [], 0, 1))


def test_check_schedule_rejects_barrier_and_sync_edges_that_break_the_phases():
    """A backward barrier, a barrier inside a phase, a sync across phases: ScheduleError."""
    dag = dag_from_edges(4, [(0, 1), (2, 3)])
    for field, edges in (("barrier_edges", [(3, 0)]), ("barrier_edges", [(0, 1)]),
                         ("sync_edges", [(0, 3)])):
        s = assign_phased(dag, [2, 2])
        setattr(s, field, edges)
        with pytest.raises(ScheduleError):
            check_schedule(dag, s)

# ---- the training fixtures --------------------------------------------------------------------

@pytest.mark.parametrize("name", TRAIN)
def test_training_schedule_fits_the_pool(name):
    """Several streams per phase within torch's pool; the barrier lets phases share memory."""
    graph, schedule, plan = scheduled(name)
    dag = build_dag(graph)
    check_schedule(dag, schedule)
    check_plan(graph, schedule.edges(), plan)
    assert plan.arena_bytes <= graph.meta["pool_bytes"]
    spans = phase_spans(graph.meta["phases"], len(graph.tasks))
    assert all(len(streams_in(schedule, span)) > 1 for span in spans)
    assert plan.arena_bytes < plan.buffer_bytes
    unordered = plan_memory(graph, schedule.stream_edges() + schedule.sync_edges)
    assert unordered.arena_bytes >= plan.arena_bytes
    with pytest.raises(ScheduleError):
        check_schedule(dag, Schedule(schedule.stream_of, schedule.streams, schedule.sync_edges,
                                     schedule.reduced_edges, schedule.width))


@pytest.mark.parametrize("name", TRAIN)
def test_unreachable_arena_limit_stops_at_one_stream_per_phase(name):
    """A limit no plan meets: the cap goes down to one stream per phase and stops there."""
    graph = load(name)
    with deadline(60):
        schedule, plan = schedule_within(graph, None, 1)
    single = single_stream_schedule(len(graph.tasks), graph.meta["phases"])
    assert schedule.streams == single.streams
    assert schedule.barrier_edges == single.barrier_edges
    check_plan(graph, schedule.edges(), plan)


@pytest.mark.parametrize("name", TRAIN)
def test_training_fixture_phases(name):
    """Inputs and outputs split by phase; activations cross; gradients come from the backward."""
    graph = load(name)
    meta = graph.meta
    fwd, bwd = phase_spans(meta["phases"], len(graph.tasks))
    assert len(meta["phases"]) == 2 and len(fwd) and len(bwd)
    assert len(graph.inputs) == sum(meta["phase_inputs"])
    assert len(graph.outputs) == sum(meta["phase_outputs"])
    touched, written = defaultdict(set), defaultdict(set)
    for task in graph.tasks:
        for a in task.accesses:
            touched[a.buffer].add(task.id)
            if a.write:
                written[a.buffer].add(task.id)
    saved = [b for b, ts in touched.items()
             if graph.buffers[b].kind == BufferKind.INTERMEDIATE
             and min(ts) in fwd and max(ts) in bwd]
    assert saved
    grads = graph.outputs[meta["phase_outputs"][0]:]
    assert grads
    for ref in grads:
        assert written[ref.buffer] and all(t in bwd for t in written[ref.buffer])
        assert not touched[ref.buffer] & set(fwd)
    for ref in graph.inputs[meta["phase_inputs"][0]:]:  # the incoming gradient
        assert touched[ref.buffer] and all(t in bwd for t in touched[ref.buffer])


@pytest.mark.parametrize("name", TRAIN)
def test_builder_span_filter_drops_exactly_the_barrier(name):
    """``build_graph(span=...)`` keeps ``[u for u in preds[t] if u >= first]``: inside a phase
    that is every edge but the barriers, which are the schedule's only cross-phase edges."""
    graph, schedule, _ = scheduled(name)
    n = len(graph.tasks)
    spans = phase_spans(graph.meta["phases"], n)
    preds = predecessors(n, schedule.edges())
    kept, dropped = set(), set()
    for span in spans:
        for t in span:
            for u in preds[t]:
                (kept if u >= span.start else dropped).add((u, t))
            assert all(u in span for u in preds[t] if u >= span.start)
    assert dropped == set(schedule.barrier_edges)
    phase_of = [k for k, span in enumerate(spans) for _ in span]
    assert {(u, v) for u, v in schedule.edges() if phase_of[u] != phase_of[v]} == dropped
    assert kept | dropped == set(schedule.edges()) and not kept & dropped
    bwd = spans[1]
    roots = {t for t in bwd if not any(u >= bwd.start for u in preds[t])}
    assert roots and roots <= {s[0] for s in schedule.streams if s[0] in bwd}


def test_library_scratch_that_training_writes_gets_a_private_copy():
    """cuDNN's training batch norm writes buffers of its own (partials and a grid semaphore);
    the engine copies exactly those into the arena, and nothing an inference graph reads."""
    from nimble.engine.arena_layout import state_layout, written_externals
    from nimble.ir.taskgraph import TaskGraph

    graph = TaskGraph.load(FIXTURE_DIR / "resnet50_train.json.gz")
    private = written_externals(graph)
    assert private and all(graph.buffers[b].kind == "external" for b in private)
    writers = {graph.tasks[t].short_name for t in range(len(graph.tasks))
               for a in graph.tasks[t].accesses if a.buffer in private and a.write}
    assert all(name.startswith("cudnn::bn_") for name in writers), writers
    assert not written_externals(TaskGraph.load(FIXTURE_DIR / "resnet50.json.gz"))
    # batch norm's partials carry over from one call to the next: copied, not zeroed
    assert not state_layout(graph, 0, 0).zeroed
    # a block of torch's allocator that only a library's kernel writes is its workspace: private,
    # and it starts zeroed
    bf16 = TaskGraph.load(FIXTURE_DIR / "inception_v3_bfloat16.json.gz")
    (workspace,) = written_externals(bf16)
    assert bf16.buffers[workspace].name.startswith("block@")
    assert state_layout(bf16, 0, 0).zeroed == {workspace}


def test_the_library_memory_an_int_was_taken_to_point_into_keeps_its_low_bits():
    """inception_v3's averaged training step as recorded on four H200s (2026-11-27), whose
    rebuilt graph faulted in its proof: cuDNN's region_transform kernels carry the ints 0x600
    and 0x800 under a stale top half (a struct argument, not a whole pointer), which read as
    pointers into a library's 64 MiB at 0x7fdd_0000_0000; the graph writes through them, so the
    memory gets a private copy, which must keep its low 32 bits or the ints are rewritten.  The
    recording lists no low-word buffer (made before the resolver listed such memory): the
    engine finds it from the words."""
    from nimble.engine.arena_layout import ambiguous_targets, low_word_buffers, \
        written_externals
    from nimble.ir.taskgraph import TaskGraph

    graph = TaskGraph.load(FIXTURE_DIR / "inception_v3_train_averaged_fault.json.gz")
    assert graph.meta["low_word_buffers"] == []
    private = written_externals(graph)
    [kept] = low_word_buffers(graph)
    memory = graph.buffers[kept]
    assert kept in private and memory.address % (1 << 32) == 0 and memory.size == 64 << 20
    ints = {p.value - memory.address for t in graph.tasks for p in t.pointers
            if p.buffer == kept and t.short_name.startswith("internal::region_transform")}
    assert ints == {0x600, 0x800}
    assert ambiguous_targets(graph, set(private)) == {kept}  # no other private copy at risk


def test_a_phase_whose_cap_saves_no_memory_keeps_its_full_width():
    """resnet50's training step needs more than torch's pool with every phase uncapped; only the
    backward's cap saves memory, so the forward keeps all its streams and the plan fits."""
    graph = load("resnet50_train")
    dag = build_dag(graph)
    phases = graph.meta["phases"]
    fwd, bwd = phase_spans(phases, len(graph.tasks))
    free = assign_phased(dag, phases)
    assert plan_memory(graph, free.edges()).arena_bytes > graph.meta["pool_bytes"]
    _, schedule, plan = scheduled("resnet50_train")
    assert plan.arena_bytes <= graph.meta["pool_bytes"]
    assert streams_in(schedule, fwd) == set(range(len(streams_in(free, fwd))))
    assert len(streams_in(schedule, bwd)) < len(streams_in(free, bwd))


def test_per_phase_caps_apply_to_their_own_phase_and_must_match_the_phases():
    graph = load("mobilenet_v2_train")
    dag = build_dag(graph)
    phases = graph.meta["phases"]
    fwd, bwd = phase_spans(phases, len(graph.tasks))
    schedule = assign_phased(dag, phases, max_streams=[None, 2])
    check_schedule(dag, schedule)
    assert len(streams_in(schedule, bwd)) == 2
    assert len(streams_in(schedule, fwd)) == len(streams_in(assign_phased(dag, phases), fwd))
    with pytest.raises(ValueError, match="caps"):
        assign_phased(dag, phases, max_streams=[None])
