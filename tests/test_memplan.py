"""The static arena planner and its independent checker."""
from __future__ import annotations

import random
import time
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nimble import Access, Buffer, BufferKind, Task, TaskGraph, TaskKind
from nimble.analysis.deps import build_dag, dag_from_edges, reachability, transitive_reduction
from nimble.analysis.memplan import MemPlan, MemPlanError, lower_bound_bytes, plan_memory
from nimble.analysis.plan_check import check_plan
from nimble.analysis.schedule import assign_streams
from nimble.ir.synthetic import branchy_graph, random_graph

from helpers import FIXTURE_PATHS, fixture_ids


# ---- references, deliberately naive -----------------------------------------------------------

def naive_edges(graph: TaskGraph) -> list[tuple[int, int]]:
    """Every pair of tasks touching common bytes of a buffer, one of them writing (O(n^2))."""
    per_buffer = defaultdict(list)
    for t in graph.tasks:
        for a in t.accesses:
            if a.size:
                per_buffer[a.buffer].append((t.id, a))
    edges = set()
    for accs in per_buffer.values():
        if not any(a.write for _, a in accs):
            continue
        for i, (t1, a1) in enumerate(accs):
            for t2, a2 in accs[i + 1:]:
                overlap = a1.offset < a2.end and a2.offset < a1.end
                if t1 != t2 and (a1.write or a2.write) and overlap:
                    edges.add((t1, t2))
    return sorted(edges)


def serial_edges(graph: TaskGraph) -> list[tuple[int, int]]:
    return [(i, i + 1) for i in range(len(graph.tasks) - 1)]


def closure(n: int, edges) -> list[set[int]]:
    succs = defaultdict(set)
    for u, v in edges:
        succs[u].add(v)
    after = [set() for _ in range(n)]
    for t in range(n - 1, -1, -1):
        for s in succs[t]:
            after[t] |= after[s] | {s}
    return after


def must_separate(graph: TaskGraph, edges) -> callable:
    """``sep(b1, b2)``: the sharing rule of the brief, spelled out with sets and a host."""
    n = len(graph.tasks)
    source, sink = -1, n  # the host writing inputs before the graph, reading outputs after it
    after = closure(n, edges) + [set()]
    for t in range(n):
        after[t].add(sink)
    after.append(set(range(n + 1)))  # index -1: the source precedes every task and the sink
    acc = defaultdict(set)
    for t in graph.tasks:
        for a in t.accesses:
            acc[a.buffer].add(t.id)
    for b in graph.buffers:
        if b.kind == BufferKind.INPUT:
            acc[b.id].add(source)
        if b.kind == BufferKind.OUTPUT:
            acc[b.id].add(sink)

    def precedes(b1: int, b2: int) -> bool:
        return all(y in after[x] for x in acc[b1] for y in acc[b2])

    def sep(b1: int, b2: int) -> bool:
        kinds = {graph.buffers[b1].kind, graph.buffers[b2].kind}
        if kinds == {BufferKind.INPUT, BufferKind.OUTPUT}:
            return True
        return not precedes(b1, b2) and not precedes(b2, b1)

    return sep


def overlapping_pairs(graph: TaskGraph, plan: MemPlan):
    def end(b):
        return plan.offsets[b] + -(-graph.buffers[b].size // plan.alignment) * plan.alignment
    ids = sorted(plan.offsets)
    for i, b1 in enumerate(ids):
        for b2 in ids[i + 1:]:
            if plan.offsets[b1] < end(b2) and plan.offsets[b2] < end(b1):
                yield b1, b2


def assert_sound(graph: TaskGraph, edges, plan: MemPlan) -> None:
    check_plan(graph, edges, plan)
    sep = must_separate(graph, edges)
    for b1, b2 in overlapping_pairs(graph, plan):
        if graph.buffers[b1].size and graph.buffers[b2].size:
            assert not sep(b1, b2), (b1, b2)
    planned = {b.id for b in graph.buffers if b.kind in BufferKind.RELOCATABLE}
    assert set(plan.offsets) == planned
    assert all(off % plan.alignment == 0 for off in plan.offsets.values())
    assert plan.lower_bound_bytes == lower_bound_bytes(graph, plan.alignment)
    assert plan.lower_bound_bytes <= plan.arena_bytes <= plan.buffer_bytes


def graph_of(sizes: dict[int, tuple[str, int]], tasks: list[list[tuple[int, bool]]]) -> TaskGraph:
    """A hand-made graph: ``tasks[i]`` lists ``(buffer, write)``, each access the whole buffer."""
    g = TaskGraph()
    g.buffers = [Buffer(b, kind, size, 0x1000 * (b + 1))
                 for b, (kind, size) in sorted(sizes.items())]
    g.tasks = [Task(i, TaskKind.KERNEL, accesses=[Access(b, 0, sizes[b][1], w) for b, w in accs])
               for i, accs in enumerate(tasks)]
    g.validate()
    return g


SYNTHETIC = {
    "branchy": lambda: branchy_graph(),
    "branchy-wide": lambda: branchy_graph(stages=3, branches=6, depth=2, scratch_every=2, seed=1),
    "branchy-odd-sizes": lambda: branchy_graph(stages=2, branches=3, depth=4, size=1000, seed=2),
    "random": lambda: random_graph(60, seed=1),
    "random-many-buffers": lambda: random_graph(150, n_buffers=40, max_accesses=4, seed=2),
}
EDGES = {"serial": serial_edges, "naive": naive_edges}


# ---- plans are sound --------------------------------------------------------------------------

@pytest.mark.parametrize("edges_of", EDGES.values(), ids=EDGES.keys())
@pytest.mark.parametrize("make", SYNTHETIC.values(), ids=SYNTHETIC.keys())
@pytest.mark.parametrize("alignment", [512, 256, 4096])
def test_plans_on_synthetic_graphs_pass_the_checker(make, edges_of, alignment):
    g = make()
    edges = edges_of(g)
    assert_sound(g, edges, plan_memory(g, edges, alignment))


@pytest.mark.parametrize("make", [SYNTHETIC["branchy"], SYNTHETIC["branchy-wide"]])
def test_serial_chain_reuses_more_than_the_parallel_dag(make):
    g = make()
    serial, parallel = plan_memory(g, serial_edges(g)), plan_memory(g, naive_edges(g))
    assert serial.arena_bytes < parallel.arena_bytes < parallel.buffer_bytes
    assert serial.buffer_bytes == parallel.buffer_bytes


def test_moving_any_conflicting_buffer_onto_another_is_rejected():
    # branchy accesses cover whole buffers, so every forced overlap of a conflicting pair is a
    # real collision the checker must see.
    g = branchy_graph(stages=2, branches=3, depth=2)
    for edges in (serial_edges(g), naive_edges(g)):
        plan = plan_memory(g, edges)
        sep = must_separate(g, edges)
        ids = sorted(plan.offsets)
        pairs = [(p, q) for p in ids for q in ids if p != q and sep(p, q)]
        assert pairs
        for p, q in random.Random(0).sample(pairs, min(60, len(pairs))):
            bad = MemPlan(dict(plan.offsets), plan.arena_bytes + g.buffers[q].size,
                          plan.buffer_bytes, plan.lower_bound_bytes, plan.alignment)
            bad.offsets[q] = bad.offsets[p]
            with pytest.raises(MemPlanError):
                check_plan(g, edges, bad)


# ---- parallel branches, clobbers, races --------------------------------------------------------

I, O = BufferKind.INPUT, BufferKind.OUTPUT
X = Y = MID = BufferKind.INTERMEDIATE


def test_parallel_branches_never_share_even_with_disjoint_recorded_lifetimes():
    # Buffer 0 lives in tasks 0-1 and buffer 1 in tasks 2-3: disjoint in recorded order, but the
    # two chains are unordered, so they may run at the same time.
    g = graph_of({0: (X, 1000), 1: (Y, 1000)},
                 [[(0, True)], [(0, False)], [(1, True)], [(1, False)]])
    parallel = [(0, 1), (2, 3)]
    plan = plan_memory(g, parallel)
    assert plan.offsets[0] != plan.offsets[1]
    assert plan.arena_bytes == plan.buffer_bytes == 2048 == 2 * plan.lower_bound_bytes
    assert_sound(g, parallel, plan)
    assert plan_memory(g, serial_edges(g)).offsets == {0: 0, 1: 0}
    shared = MemPlan({0: 0, 1: 0}, 1024, 2048, 1024, 512)
    check_plan(g, serial_edges(g), shared)
    with pytest.raises(MemPlanError, match=r"buffers 0 and 1 share arena bytes \[0, 1000\)"):
        check_plan(g, parallel, shared)


def test_ordered_clobber_is_rejected():
    # Every task pair is ordered, yet buffer 1 is written between the write and the read of 0.
    g = graph_of({0: (X, 512), 1: (Y, 512)}, [[(0, True)], [(1, True)], [(0, False), (1, False)]])
    plan = plan_memory(g, serial_edges(g))
    assert plan.offsets[0] != plan.offsets[1]
    with pytest.raises(MemPlanError, match="lifetimes overlap"):
        check_plan(g, serial_edges(g), MemPlan({0: 0, 1: 0}, 512, 1024, 1024, 512))


def test_missing_dependency_is_reported_as_a_race():
    g = graph_of({0: (X, 512)}, [[(0, True)], [(0, False)]])
    plan = plan_memory(g, [])
    with pytest.raises(MemPlanError, match="tasks 0 and 1 both access buffer 0"):
        check_plan(g, [], plan)


def test_malformed_plans_and_edges_are_rejected():
    g = graph_of({0: (X, 512), 1: (BufferKind.PARAM, 512)}, [[(0, True), (1, False)]])
    for offsets, match in [({}, "no arena offset"), ({0: 0, 1: 0}, "not relocatable"),
                           ({0: 100}, "misaligned"), ({0: 512}, "outside")]:
        with pytest.raises(MemPlanError, match=match):
            check_plan(g, [], MemPlan(offsets, 512, 512, 512, 512))
    with pytest.raises(MemPlanError, match="lower task id to a higher"):
        plan_memory(g, [(0, 0)])
    assert plan_memory(g, []).address_of(0, 1 << 40) == 1 << 40
    with pytest.raises(KeyError):
        plan_memory(g, []).address_of(1, 0)


# ---- inputs and outputs --------------------------------------------------------------------

def test_input_is_reused_only_after_all_its_readers():
    # Tasks 0 and 1 read the input on two branches; buffer 3 (written by task 2) follows task 0
    # but not task 1, although it starts after the input's last recorded read.
    g = graph_of({0: (I, 1024), 1: (MID, 1024), 2: (MID, 1024), 3: (MID, 1024), 4: (O, 1024)},
                 [[(0, False), (1, True)], [(0, False), (2, True)], [(1, False), (3, True)],
                  [(3, False), (2, False), (4, True)]])
    dag = naive_edges(g)
    assert dag == [(0, 2), (1, 3), (2, 3)]
    plan = plan_memory(g, dag)
    assert plan.offsets[3] != plan.offsets[0]
    assert_sound(g, dag, plan)
    serial = plan_memory(g, serial_edges(g))
    assert serial.offsets[3] == serial.offsets[0]
    assert_sound(g, serial_edges(g), serial)
    with pytest.raises(MemPlanError, match="host .writing inputs|task 1"):
        check_plan(g, dag, serial)


def test_output_is_never_shared_with_anything_accessed_later_or_unordered():
    # 0 -> 1 -> 2 in a chain writes the output at task 2; buffer 3 is touched after it.
    g = graph_of({0: (MID, 1024), 1: (MID, 1024), 2: (O, 1024), 3: (MID, 1024)},
                 [[(0, True)], [(0, False), (1, True)], [(1, False), (2, True)],
                  [(3, True)], [(3, False)]])
    for edges in (serial_edges(g), naive_edges(g)):
        plan = plan_memory(g, edges)
        assert plan.offsets[3] != plan.offsets[2]
        assert_sound(g, edges, plan)
    serial = plan_memory(g, serial_edges(g))
    assert serial.offsets[0] == serial.offsets[2]  # buffer 0 dies before the output is born
    with pytest.raises(MemPlanError, match="host .reading outputs"):
        check_plan(g, serial_edges(g), MemPlan({0: 0, 1: 1024, 2: 2048, 3: 2048}, 3072, 4096,
                                               2048, 512))


def test_inputs_and_outputs_never_share_bytes():
    g = graph_of({0: (I, 512), 1: (O, 512)}, [[(0, False)], [(1, True)]])
    plan = plan_memory(g, serial_edges(g))
    assert plan.offsets[0] != plan.offsets[1]
    with pytest.raises(MemPlanError, match="input/output"):
        check_plan(g, serial_edges(g), MemPlan({0: 0, 1: 0}, 512, 1024, 1024, 512))


def test_untouched_buffers():
    g = graph_of({0: (I, 512), 1: (I, 512), 2: (O, 512), 3: (MID, 4096), 4: (MID, 512)},
                 [[(4, True)], [(4, False)]])
    plan = plan_memory(g, serial_edges(g))
    assert len({plan.offsets[b] for b in (0, 1, 2)}) == 3  # the host touches every one of them
    assert plan.offsets[3] == 0
    assert_sound(g, serial_edges(g), plan)


# ---- races on buffers the plan does not move ----------------------------------------------------

P, E = BufferKind.PARAM, BufferKind.EXTERNAL
FIXED_KINDS = [P, E, "rng"]  # "rng": any kind string a recorder may add is checked the same way
NO_PLAN = MemPlan({}, 0, 0, 0, 512)


def named(g: TaskGraph, names: dict[int, str]) -> TaskGraph:
    for b, name in names.items():
        g.buffers[b].name = name
    return g


@pytest.mark.parametrize("kind", FIXED_KINDS)
def test_unordered_writes_of_a_fixed_buffer_are_rejected(kind):
    # Tasks 0 and 2 both write buffer 0 (say, running statistics); task 1 lies between them in
    # recorded order but only follows task 0.
    g = named(graph_of({0: (kind, 512), 1: (MID, 512)}, [[(0, True)], [(1, True)], [(0, True)]]),
              {0: "bn.running_mean"})
    with pytest.raises(MemPlanError) as err:
        check_plan(g, [(0, 1)], plan_memory(g, [(0, 1)]))
    msg = str(err.value)
    assert f"tasks 0 and 2 both access buffer 0 ({kind} 'bn.running_mean')" in msg
    assert "task 0 writes, task 2 writes" in msg and "neither happens-before" in msg
    for edges in ([(0, 2)], [(0, 1), (1, 2)], serial_edges(g)):  # a path is enough
        check_plan(g, edges, plan_memory(g, edges))


@pytest.mark.parametrize("kind", FIXED_KINDS)
def test_read_and_write_of_a_fixed_buffer_must_be_ordered(kind):
    # Writes into disjoint halves need no order; a read spanning both halves needs both writes.
    g = graph_of({0: (kind, 512)}, [[], [], []])
    g.tasks[0].accesses = [Access(0, 0, 256, True)]
    g.tasks[1].accesses = [Access(0, 256, 256, True)]
    g.tasks[2].accesses = [Access(0, 200, 100, False)]
    check_plan(g, [(0, 2), (1, 2)], NO_PLAN)
    with pytest.raises(MemPlanError, match=r"tasks 1 and 2 both access buffer 0 \(" + kind
                       + r"\) at bytes \[256, 300\): task 1 writes, task 2 reads"):
        check_plan(g, [(0, 2)], NO_PLAN)
    with pytest.raises(MemPlanError, match=r"tasks 0 and 2 .* bytes \[200, 256\): task 0 writes, "
                       r"task 2 reads"):
        check_plan(g, [(1, 2)], NO_PLAN)
    # write-after-read: the read of task 0 must come before task 1's write
    g = graph_of({0: (kind, 512)}, [[(0, False)], [(0, True)]])
    with pytest.raises(MemPlanError, match="task 0 reads, task 1 writes"):
        check_plan(g, [], NO_PLAN)
    check_plan(g, [(0, 1)], NO_PLAN)


@pytest.mark.parametrize("kind", FIXED_KINDS + [MID])
def test_reads_alone_never_conflict(kind):
    g = graph_of({0: (kind, 512)}, [[(0, False)]] * 50)
    check_plan(g, [], plan_memory(g, []))
    g.tasks[0].accesses = [Access(0, 0, 0, True)]  # a zero-byte write touches nothing
    check_plan(g, [], plan_memory(g, []))


def test_one_task_reading_and_writing_a_fixed_buffer_is_not_a_race():
    g = graph_of({0: (P, 512)}, [[(0, False), (0, True)], [(0, False)]])
    check_plan(g, [(0, 1)], NO_PLAN)
    with pytest.raises(MemPlanError, match="tasks 0 and 1 both access buffer 0"):
        check_plan(g, [], NO_PLAN)


def brute_force_race(graph: TaskGraph, edges) -> bool:
    """Pair by pair and byte by byte: True if some conflicting pair of accesses is unordered."""
    after = closure(len(graph.tasks), edges)
    accs = [(t.id, a) for t in graph.tasks for a in t.accesses if a.size]
    for i, (t1, a1) in enumerate(accs):
        for t2, a2 in accs[i + 1:]:
            if (t1 != t2 and a1.buffer == a2.buffer and (a1.write or a2.write)
                    and a1.offset < a2.end and a2.offset < a1.end and t2 not in after[t1]):
                return True
    return False


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_tasks=st.integers(1, 30), slots=st.integers(1, 8),
       write_prob=st.floats(0, 1), edge_prob=st.floats(0, 1), kind=st.sampled_from(FIXED_KINDS))
def test_race_check_agrees_with_all_pairs(seed, n_tasks, slots, write_prob, edge_prob, kind):
    # Many tasks on one or two fixed buffers, with arbitrary partial overlaps: the sweep checks
    # only some pairs and relies on transitivity for the rest, which must lose nothing.
    rng = random.Random(seed)
    g = graph_of({0: (kind, 8 * slots), 1: (P, 8 * slots)}, [[] for _ in range(n_tasks)])
    for t in g.tasks:
        for _ in range(rng.randint(1, 3)):
            lo = rng.randrange(slots)
            hi = rng.randint(lo, slots)  # may be empty
            t.accesses.append(Access(rng.choice((0, 0, 1)), 8 * lo, 8 * (hi - lo),
                                     rng.random() < write_prob))
    edges = [(u, v) for u in range(n_tasks) for v in range(u + 1, n_tasks)
             if rng.random() < edge_prob / 2]
    try:
        check_plan(g, edges, NO_PLAN)
        raced = False
    except MemPlanError:
        raced = True
    assert raced == brute_force_race(g, edges)


def test_many_tasks_on_one_fixed_buffer_are_checked_quickly():
    # 3,000 tasks each reading and writing one workspace: 4.5 million conflicting pairs, which the
    # check must not visit one by one.
    n = 3000
    g = graph_of({0: (E, 1 << 20)}, [[(0, False), (0, True)]] * n)
    for i, t in enumerate(g.tasks):
        t.accesses = [Access(0, (i % 7) * 64, 4096, False), Access(0, (i % 5) * 64, 8192, True)]
    edges = serial_edges(g)
    start = time.perf_counter()
    check_plan(g, edges, NO_PLAN)
    assert time.perf_counter() - start < 2.0  # about 0.05 s on a laptop
    edges.remove((1500, 1501))
    with pytest.raises(MemPlanError, match=r"tasks (\d+) and (\d+) both access buffer 0 "
                       r"\(external\)") as err:
        check_plan(g, edges, NO_PLAN)
    a, b = map(int, err.value.args[0].split()[1:4:2])
    assert a <= 1500 < b  # a pair the missing edge really leaves unordered


# ---- property test --------------------------------------------------------------------------

@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_tasks=st.integers(0, 40), n_buffers=st.integers(1, 10),
       size=st.sampled_from([64, 1000, 1024, 3000]), extra=st.floats(0, 0.3),
       serial=st.booleans(), io=st.floats(0, 0.5), alignment=st.sampled_from([64, 512]))
def test_random_graphs_and_dags_pass_the_checker(seed, n_tasks, n_buffers, size, extra, serial,
                                                  io, alignment):
    g = random_graph(n_tasks, n_buffers=n_buffers, size=size, seed=seed)
    rng = random.Random(seed)
    for b in g.buffers:
        if b.kind != BufferKind.PARAM and rng.random() < io:
            b.kind = rng.choice([BufferKind.INPUT, BufferKind.OUTPUT])
    edges = set(serial_edges(g) if serial else naive_edges(g))
    n = len(g.tasks)
    edges |= {(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < extra}
    assert_sound(g, sorted(edges), plan_memory(g, edges, alignment))


def brute_force_verdict(graph: TaskGraph, edges, plan: MemPlan) -> bool:
    """Byte by byte: True if the plan is safe under check_plan's documented rules."""
    n = len(graph.tasks)
    after = closure(n, edges)
    sep = must_separate(graph, edges)
    touched = defaultdict(set)  # arena byte -> buffers touching it (the host touches I/O whole)
    writers = defaultdict(list)  # (buffer, byte) -> [(task, write)], for buffers of every kind
    for t in graph.tasks:
        for a in t.accesses:
            for x in range(a.offset, a.end):
                writers[a.buffer, x].append((t.id, a.write))
            if a.buffer in plan.offsets:
                for x in range(plan.offsets[a.buffer] + a.offset, plan.offsets[a.buffer] + a.end):
                    touched[x].add(a.buffer)
    for b in graph.buffers:
        if b.kind in (BufferKind.INPUT, BufferKind.OUTPUT):
            for x in range(plan.offsets[b.id], plan.offsets[b.id] + b.size):
                touched[x].add(b.id)
    for bufs in touched.values():
        if any(sep(p, q) for p in bufs for q in bufs if p < q):
            return False
    for accs in writers.values():
        for i, (t1, w1) in enumerate(accs):
            for t2, w2 in accs[i + 1:]:
                if t1 != t2 and (w1 or w2) and t2 not in after[t1]:
                    return False
    return True


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_tasks=st.integers(1, 12), n_buffers=st.integers(1, 6),
       slots=st.integers(1, 4), dag=st.sampled_from(["serial", "naive", "sparse"]),
       io=st.floats(0, 0.6), fixed=st.floats(0, 0.5))
def test_checker_agrees_with_a_byte_by_byte_reference(seed, n_tasks, n_buffers, slots, dag, io,
                                                      fixed):
    # Random offsets over a few slots: most plans collide somewhere, some do not.  Some written
    # buffers become kinds the plan does not move (races on those count as much).
    g = random_graph(n_tasks, n_buffers=n_buffers, size=128, seed=seed)
    rng = random.Random(seed)
    for b in g.buffers:
        if b.kind != BufferKind.PARAM and rng.random() < io:
            b.kind = rng.choice([BufferKind.INPUT, BufferKind.OUTPUT])
        elif b.kind != BufferKind.PARAM and rng.random() < fixed:
            b.kind = rng.choice(FIXED_KINDS)
    if dag == "sparse":  # drops dependencies, so races appear too
        edges = [e for e in naive_edges(g) if rng.random() < 0.7]
    else:
        edges = EDGES[dag](g)
    offsets = {b.id: 64 * rng.randrange(2 * slots) for b in g.buffers
               if b.kind in BufferKind.RELOCATABLE}
    plan = MemPlan(offsets, 64 * 2 * slots + 128, 0, 0, 64)
    try:
        check_plan(g, edges, plan)
        verdict = True
    except MemPlanError:
        verdict = False
    assert verdict == brute_force_verdict(g, edges, plan)


# ---- scale ----------------------------------------------------------------------------------

def test_plans_a_large_graph_quickly():
    g = branchy_graph(stages=25, branches=4, depth=10, scratch_every=3)
    assert len(g.tasks) >= 1300 and len(g.buffers) >= 1300
    edges = naive_edges(g)
    start = time.perf_counter()
    plan = plan_memory(g, edges)
    check_plan(g, edges, plan)
    assert time.perf_counter() - start < 5.0  # about 0.3 s on a laptop; this guards against O(n^3)
    assert plan.lower_bound_bytes <= plan.arena_bytes < plan.buffer_bytes // 4


# ---- recorded fixtures ----------------------------------------------------------------------

def scheduled_edges(graph: TaskGraph, max_streams: int | None = None) -> list[tuple[int, int]]:
    """The edges Nimble runs: stream order and synchronizations of its schedule."""
    dag = build_dag(graph)
    return assign_streams(dag, max_streams=max_streams, reduced=transitive_reduction(dag)).edges()


FIXTURE_EDGES = {**EDGES, "scheduled": scheduled_edges,
                 "scheduled-2-streams": lambda g: scheduled_edges(g, max_streams=2)}


@pytest.mark.parametrize("path", FIXTURE_PATHS, ids=fixture_ids())
@pytest.mark.parametrize("edges_of", FIXTURE_EDGES.values(), ids=FIXTURE_EDGES.keys())
def test_fixture_plans_pass_the_checker(path, edges_of):
    # The race check covers every buffer here, the model's parameters included.
    g = TaskGraph.load(path)
    assert any(not b.relocatable for b in g.buffers)
    edges = edges_of(g)
    plan = plan_memory(g, edges)
    check_plan(g, edges, plan)
    assert plan.lower_bound_bytes <= plan.arena_bytes <= plan.buffer_bytes
    assert all(off % plan.alignment == 0 for off in plan.offsets.values())


@pytest.mark.parametrize("path", FIXTURE_PATHS, ids=fixture_ids())
def test_fixture_parameter_written_on_two_parallel_branches(path):
    # Make two tasks that the real schedule leaves unordered write one parameter (as a kernel
    # updating running statistics would).  The old schedule must be rejected, naming the
    # parameter and both tasks; the schedule of the changed graph orders them and passes.
    g = TaskGraph.load(path)
    edges = scheduled_edges(g)
    reach = reachability(dag_from_edges(len(g.tasks), edges))
    unordered = ((t.id, y, a) for t in g.tasks for a in t.accesses
                 if g.buffers[a.buffer].kind == BufferKind.PARAM and a.size
                 for y in range(t.id + 1, len(g.tasks)) if not reach[t.id] >> y & 1)
    x, y, access = next(unordered, (None, None, None))
    if x is None:
        pytest.skip("the schedule is one chain: no parameter reader runs beside another task")
    buf = g.buffers[access.buffer]
    access.write = True
    g.tasks[y].accesses.append(Access(buf.id, access.offset, access.size, True))
    plan = plan_memory(g, edges)
    with pytest.raises(MemPlanError) as err:
        check_plan(g, edges, plan)
    assert f"tasks {x} and {y} both access buffer {buf.id} (param {buf.name!r})" in str(err.value)
    edges = scheduled_edges(g)
    check_plan(g, edges, plan_memory(g, edges))


def test_an_inputs_bytes_are_reused_once_its_last_reader_ran():
    """gpt2's token ids share their bytes with later activations: a launch with no call behind
    it (prepare's timing launches) must have the inputs copied in again, or it reads those
    activations as token ids."""
    graph, plan = _planned_fixture("gpt2_float16")
    (ids,) = [b for b in graph.buffers if b.kind == BufferKind.INPUT]
    sharers = _sharing_bytes_with(ids, graph, plan)
    assert sharers and all(b.kind == BufferKind.INTERMEDIATE for b in sharers)


@pytest.mark.parametrize("name", ["googlenet_train", "resnet50_train", "mobilenet_v2_train"])
def test_a_training_steps_inputs_keep_their_bytes_through_the_step(name):
    """The backward reads a step's inputs (the first layer's weight gradient, the loss's
    targets), so on these models no buffer shares an input's bytes; prepare's timing launches
    copy the inputs in before each launch all the same (a frozen first layer would free them)."""
    graph, plan = _planned_fixture(name)
    inputs = [b for b in graph.buffers if b.kind == BufferKind.INPUT]
    assert len(inputs) == 2  # images and labels
    for buffer in inputs:
        assert _sharing_bytes_with(buffer, graph, plan) == []


def _planned_fixture(name: str):
    """A recorded fixture and the arena plan prepare makes of it (multi-stream, torch's pool
    as the cap)."""
    from helpers import FIXTURE_DIR
    from nimble.analysis.deps import task_durations
    from nimble.engine.prepared import plan_graph

    graph = TaskGraph.load(FIXTURE_DIR / f"{name}.json.gz")
    _, plan = plan_graph(graph, True, None, "pool", task_durations(graph))
    return graph, plan


def _sharing_bytes_with(buffer, graph, plan) -> list:
    """The other buffers the plan puts on some of ``buffer``'s bytes."""
    start = plan.offsets[buffer.id]
    return [b for b in graph.buffers if b.id != buffer.id and b.id in plan.offsets
            and plan.offsets[b.id] < start + buffer.size
            and start < plan.offsets[b.id] + b.size]
