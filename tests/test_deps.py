"""The happens-before DAG, its transitive reduction, reachability and critical path."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nimble import Access, Buffer, BufferKind, Task, TaskGraph, TaskKind
from nimble.analysis.deps import (Dag, ancestors, build_dag, critical_path, dag_from_edges,
                                  path_lengths, reachability, task_durations, topological_order,
                                  transitive_reduction)
from nimble.analysis.schedule import induced
from nimble.ir.synthetic import branchy_graph, random_graph

from helpers import FIXTURE_PATHS, fixture_ids, random_dag


# ---- helpers ---------------------------------------------------------------------------------

def make_graph(task_accesses, buffer_sizes=(64,), ops=None, kind=BufferKind.INTERMEDIATE):
    """A TaskGraph whose task ``i`` has accesses ``task_accesses[i]`` as ``(buf, off, size, w)``."""
    buffers = [Buffer(i, kind, size, (i + 1) << 20) for i, size in enumerate(buffer_sizes)]
    tasks = [Task(i, TaskKind.KERNEL, op=-1 if ops is None else ops[i],
                  accesses=[Access(*a) for a in acc])
             for i, acc in enumerate(task_accesses)]
    g = TaskGraph(tasks=tasks, buffers=buffers)
    g.validate()
    return g


def closure_pairs(n, edges):
    """Every pair (u, v) with a path u -> ... -> v, by depth-first search."""
    succ = {u: [] for u in range(n)}
    for u, v in edges:
        succ[u].append(v)
    pairs = set()
    for s in range(n):
        stack, seen = list(succ[s]), set()
        while stack:
            v = stack.pop()
            if v not in seen:
                seen.add(v)
                stack.extend(succ[v])
        pairs |= {(s, v) for v in seen}
    return pairs


def bits(x):
    return {i for i in range(x.bit_length()) if (x >> i) & 1}


def conflict_pairs(graph, chain_ops):
    """Reference: every ordered pair of tasks that touch a common byte, one of them writing."""
    touched = []
    for t in graph.tasks:
        reads, writes = set(), set()
        for a in t.accesses:
            (writes if a.write else reads).update((a.buffer, b) for b in range(a.offset, a.end))
        touched.append((reads | writes, writes))
    pairs = set()
    for i, j in itertools.combinations(range(len(graph.tasks)), 2):
        (all_i, w_i), (all_j, w_j) = touched[i], touched[j]
        if (w_i & all_j) or (w_j & all_i):
            pairs.add((i, j))
    if chain_ops:
        last = {}
        for t in graph.tasks:
            if t.op >= 0:
                if t.op in last:
                    pairs.add((last[t.op], t.id))
                last[t.op] = t.id
    return pairs


def assert_well_formed(dag: Dag):
    for u in range(dag.n):
        assert dag.succs[u] == sorted(set(dag.succs[u]))
        assert dag.preds[u] == sorted(set(dag.preds[u]))
        assert all(v > u for v in dag.succs[u])
    assert sorted((u, v) for v in range(dag.n) for u in dag.preds[v]) == dag.edges()
    assert dag.num_edges == len(dag.edges())


dags = st.integers(0, 9).flatmap(lambda n: st.lists(
    st.booleans(), min_size=n * (n - 1) // 2, max_size=n * (n - 1) // 2).map(
    lambda flags, n=n: dag_from_edges(n, [p for p, f in zip(
        itertools.combinations(range(n), 2), flags) if f])))

accesses = st.tuples(st.integers(0, 1), st.integers(0, 7), st.integers(0, 8), st.booleans()).map(
    lambda a: (a[0], a[1], min(a[2], 8 - a[1]), a[3]))
task_lists = st.lists(st.lists(accesses, max_size=3), max_size=12)


# ---- build_dag: hazards ------------------------------------------------------------------------

def test_read_after_write_write_after_read_write_after_write():
    g = make_graph([[(0, 0, 64, True)], [(0, 0, 64, False)], [(0, 0, 64, True)],
                    [(0, 0, 64, True)]])
    assert build_dag(g).edges() == [(0, 1), (1, 2), (2, 3)]


def test_reads_never_order_reads():
    g = make_graph([[(0, 0, 64, True)], [(0, 0, 64, False)], [(0, 0, 64, False)],
                    [(0, 16, 8, False)]])
    assert build_dag(g).edges() == [(0, 1), (0, 2), (0, 3)]


def test_writes_to_disjoint_halves_are_not_ordered():
    g = make_graph([[(0, 0, 32, True)], [(0, 32, 32, True)]])
    assert build_dag(g).edges() == []


def test_read_spanning_two_writers_depends_on_both():
    g = make_graph([[(0, 0, 32, True)], [(0, 32, 32, True)], [(0, 0, 64, False)]])
    assert build_dag(g).edges() == [(0, 2), (1, 2)]


def test_partial_overlap_is_exact_to_the_byte():
    g = make_graph([[(0, 0, 32, True)], [(0, 32, 8, False)], [(0, 31, 2, False)],
                    [(0, 8, 40, True)]])
    # 1 reads bytes the writer 0 never touched; 2 overlaps 0 by one byte; 3 overwrites both
    assert build_dag(g).edges() == [(0, 2), (0, 3), (1, 3), (2, 3)]


def test_write_after_reads_of_many_segments():
    g = make_graph([[(0, 0, 16, False)], [(0, 16, 16, False)], [(0, 48, 16, False)],
                    [(0, 8, 32, True)]])
    assert build_dag(g).edges() == [(0, 3), (1, 3)]


def test_buffers_are_independent_and_empty_accesses_touch_nothing():
    g = make_graph([[(0, 0, 8, True)], [(1, 0, 8, True)], [(0, 0, 0, True)]],
                   buffer_sizes=(8, 8))
    assert build_dag(g).edges() == []


def test_scratch_buffers_order_like_any_memory():
    g = make_graph([[(0, 0, 64, True)], [(0, 0, 64, True)]], kind=BufferKind.SCRATCH)
    assert build_dag(g).edges() == [(0, 1)]


def test_a_task_reading_and_writing_one_range_gets_no_self_edge():
    g = make_graph([[(0, 0, 8, False), (0, 0, 8, True)], [(0, 0, 8, True), (0, 0, 8, False)],
                    [(0, 4, 4, False), (0, 0, 8, False)]])
    assert build_dag(g).edges() == [(0, 1), (1, 2)]


def test_chain_ops_orders_kernels_of_one_op():
    g = make_graph([[(0, 0, 8, False)], [(0, 8, 8, False)], [(0, 16, 8, True)], [(0, 32, 8, True)]],
                   ops=[0, 1, 0, -1])
    assert build_dag(g).edges() == [(0, 2)]
    assert build_dag(g, chain_ops=False).edges() == []


def test_rejects_ids_out_of_order():
    g = make_graph([[], []])
    g.tasks[0].id = 1
    with pytest.raises(ValueError, match="dense"):
        build_dag(g)


@settings(max_examples=200, deadline=None)
@given(task_lists, st.booleans(), st.lists(st.integers(-1, 2), min_size=12, max_size=12))
def test_build_dag_orders_exactly_the_conflicts(tasks, chain_ops, ops):
    g = make_graph(tasks, buffer_sizes=(8, 8), ops=ops[:len(tasks)])
    dag = build_dag(g, chain_ops=chain_ops)
    assert_well_formed(dag)
    reference = conflict_pairs(g, chain_ops)
    assert set(dag.edges()) <= reference  # no spurious edge
    assert closure_pairs(dag.n, dag.edges()) == closure_pairs(dag.n, reference)


# ---- dag_from_edges ------------------------------------------------------------------------

@pytest.mark.parametrize("edge", [(1, 1), (2, 1), (-1, 2), (0, 3)])
def test_dag_from_edges_rejects_bad_edges(edge):
    with pytest.raises(ValueError):
        dag_from_edges(3, [edge])


def test_dag_from_edges_merges_duplicates():
    dag = dag_from_edges(3, [(0, 2), (0, 1), (0, 2), (1, 2)])
    assert dag.edges() == [(0, 1), (0, 2), (1, 2)]
    assert dag.preds == [[], [0], [0, 1]]
    assert dag.num_edges == 3


# ---- reduction, reachability, critical path ------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(dags)
def test_transitive_reduction_is_the_minimum_equivalent_graph(dag):
    red = transitive_reduction(dag)
    assert_well_formed(red)
    closure = closure_pairs(dag.n, dag.edges())
    assert closure_pairs(red.n, red.edges()) == closure
    # the unique minimum: an edge stays iff no intermediate task lies on a path between its ends
    expected = {(u, v) for u, v in dag.edges()
                if not any((u, w) in closure and (w, v) in closure for w in range(dag.n))}
    assert set(red.edges()) == expected


@settings(max_examples=200, deadline=None)
@given(dags)
def test_reachability_and_ancestors(dag):
    closure = closure_pairs(dag.n, dag.edges())
    reach, anc = reachability(dag), ancestors(dag)
    for u in range(dag.n):
        assert bits(reach[u]) == {v for v in range(dag.n) if (u, v) in closure}
        assert bits(anc[u]) == {w for w in range(dag.n) if (w, u) in closure}


def all_paths(dag):
    def extend(path):
        yield path
        for v in dag.succs[path[-1]]:
            yield from extend(path + [v])
    for s in range(dag.n):
        yield from extend([s])


@settings(max_examples=200, deadline=None)
@given(dags, st.lists(st.floats(0, 100), min_size=9, max_size=9))
def test_critical_path_is_a_longest_path(dag, weights):
    paths = list(all_paths(dag))
    by_count = critical_path(dag)
    assert by_count.length == max((len(p) for p in paths), default=0)
    assert by_count.tasks in paths or (dag.n == 0 and by_count.tasks == [])
    assert len(by_count.tasks) == by_count.length
    w = weights[:dag.n]
    timed = critical_path(dag, w)
    best = max((sum(w[t] for t in p) for p in paths), default=0.0)
    assert timed.length == pytest.approx(best)
    if dag.n:
        assert timed.tasks in paths
        assert sum(w[t] for t in timed.tasks) == pytest.approx(timed.length)


def test_critical_path_rejects_wrong_duration_count():
    with pytest.raises(ValueError):
        critical_path(dag_from_edges(2, [(0, 1)]), [1.0])


def test_task_durations():
    g = branchy_graph()
    d = task_durations(g)
    assert d == [t.duration_us for t in g.tasks]
    g.tasks[3].duration_us = None
    assert task_durations(g) is None


# ---- synthetic and recorded graphs ---------------------------------------------------------

def test_branchy_graph_branches_are_independent():
    g = branchy_graph(stages=2, branches=3, depth=2, scratch_every=0)
    dag = build_dag(g)
    reach = reachability(dag)
    # stage 0: three branches of two ops each (tasks 0-1, 2-3, 4-5), then the concat (task 6)
    firsts = [0, 2, 4]
    for a, b in itertools.combinations(firsts, 2):
        assert not (reach[a] >> b) & 1 and not (reach[b] >> a) & 1
    assert all((reach[t] >> 6) & 1 for t in range(6))
    assert critical_path(dag).length == 2 * (2 + 1)


@pytest.mark.parametrize("make", [
    lambda: branchy_graph(stages=3, branches=4, depth=3),
    lambda: random_graph(150, seed=7),
    lambda: random_graph(80, n_buffers=3, max_accesses=4, seed=11),
])
def test_synthetic_graphs_match_the_reference(make):
    g = make()
    dag = build_dag(g)
    assert_well_formed(dag)
    reference = conflict_pairs(g, True)
    assert set(dag.edges()) <= reference
    assert closure_pairs(dag.n, dag.edges()) == closure_pairs(dag.n, reference)
    red = transitive_reduction(dag)
    assert closure_pairs(red.n, red.edges()) == closure_pairs(dag.n, dag.edges())


def test_reduction_of_a_large_dag_is_fast():
    import time
    dag = random_dag(5000, 3, 200, seed=1)
    t0 = time.perf_counter()
    red = transitive_reduction(dag)
    elapsed = time.perf_counter() - t0
    assert red.num_edges <= dag.num_edges
    assert elapsed < 6.0  # budget: a couple of seconds; slack for a loaded machine


@pytest.mark.parametrize("path", FIXTURE_PATHS, ids=fixture_ids())
def test_fixture_dag(path):
    import time
    g = TaskGraph.load(path)
    t0 = time.perf_counter()
    dag = build_dag(g)
    red = transitive_reduction(dag)
    elapsed = time.perf_counter() - t0
    assert dag.n == len(g.tasks)
    assert all(v > u for u, v in dag.edges())
    assert red.num_edges <= dag.num_edges
    assert reachability(red) == reachability(dag)
    assert elapsed < 3.0


# ---- one edge-list helper, one longest path -------------------------------------------------

def test_dag_from_edges_merges_duplicates_and_checks_direction():
    dag = dag_from_edges(4, [(0, 2), (1, 2), (0, 2), (2, 3)])
    assert dag.succs == [[2], [2], [3], []] and dag.preds == [[], [], [0, 1], [2]]
    with pytest.raises(KeyError, match="forward"):
        dag_from_edges(3, [(2, 1)], KeyError)
    late = dag_from_edges(3, [(0, 2), (2, 1)], ordered=False)
    assert late.succs == [[2], [], [1]] and late.preds == [[], [2], [0]]
    with pytest.raises(ValueError, match="outside"):
        dag_from_edges(3, [(0, 3)], ordered=False)


def test_a_backward_edge_is_walked_in_topological_order():
    # 0 -> 2 -> 1 -> 3: the late edge (2, 1) runs against task order
    dag = dag_from_edges(4, [(0, 2), (2, 1), (1, 3)], ordered=False)
    assert topological_order(dag) == [0, 2, 1, 3]
    path = critical_path(dag, [1.0, 2.0, 3.0, 4.0])
    assert path.tasks == [0, 2, 1, 3] and path.length == 10.0
    lengths = path_lengths(dag, [1.0, 2.0, 3.0, 4.0])
    assert lengths.before == [0.0, 4.0, 1.0, 6.0]
    assert lengths.via == [-1, 2, 0, 1]
    out = path_lengths(dag, [1.0, 2.0, 3.0, 4.0], reverse=True)
    assert out.through == [10.0, 6.0, 9.0, 4.0] and out.via == [2, 3, 1, -1]
    assert reachability(dag) == [0b1110, 0b1000, 0b1010, 0]  # walked in topological order
    with pytest.raises(ValueError):
        induced(dag, range(1, 3))  # the rest take edges in task order only


def test_a_cycle_raises():
    dag = dag_from_edges(3, [(0, 1), (1, 2), (2, 1)], ordered=False)
    with pytest.raises(ValueError, match="cycle"):
        topological_order(dag)
    with pytest.raises(ValueError, match="cycle"):
        critical_path(dag)


def test_ties_go_to_the_predecessor_first_in_topological_order():
    # 2 and 1 both lead into 3 with equal lengths; 2 comes first in the walk
    dag = dag_from_edges(4, [(0, 2), (2, 1), (0, 3), (1, 3), (2, 3)], ordered=False)
    assert critical_path(dag, [1.0, 0.0, 1.0, 1.0]).tasks == [0, 2, 3]
    assert critical_path(dag_from_edges(3, [(0, 2), (1, 2)]), [1.0, 1.0, 1.0]).tasks == [0, 2]


@settings(max_examples=100, deadline=None)
@given(dags, st.lists(st.floats(0, 100), min_size=9, max_size=9))
def test_path_lengths_forward_and_backward_meet_on_the_critical_path(dag, weights):
    w = weights[:dag.n]
    into = path_lengths(dag, w)
    out = path_lengths(dag, w, reverse=True)
    length = critical_path(dag, w).length
    for t in range(dag.n):
        assert into.through[t] == pytest.approx(into.before[t] + w[t])
        assert into.before[t] + out.through[t] <= length + 1e-9
    # relabelled against task order, the same DAG has the same longest path
    flip = dag_from_edges(dag.n, [(dag.n - 1 - v, dag.n - 1 - u) for u, v in dag.edges()],
                          ordered=False)
    assert critical_path(flip, w[::-1]).length == pytest.approx(length)


def test_reachability_follows_late_edges_that_go_against_task_order():
    from nimble.analysis.deps import reachability

    # 0 -> 1 -> 3, and a late edge 3 -> 2 (a backfill defers task 2 behind task 3)
    dag = dag_from_edges(4, [(0, 1), (1, 3), (3, 2)], ordered=False)
    reach = reachability(dag)
    assert reach == [0b1110, 0b1100, 0, 0b0100]
    ordered = reachability(dag_from_edges(4, [(0, 1), (1, 3), (1, 2)]))
    assert ordered == [0b1110, 0b1100, 0, 0]
