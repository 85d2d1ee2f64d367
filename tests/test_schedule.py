"""Nimble's stream assignment: validity, no lost concurrency, and the fewest synchronizations."""
from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nimble import TaskGraph
from nimble.analysis.deps import build_dag, dag_from_edges, reachability, transitive_reduction
from nimble.analysis.schedule import (Schedule, ScheduleError, assign_streams, check_schedule,
                             hopcroft_karp, max_antichain_width)
from nimble.ir.synthetic import branchy_graph, random_graph

from helpers import FIXTURE_PATHS, fixture_ids, random_dag


# ---- helpers ---------------------------------------------------------------------------------

def dag_strategy(max_n):
    return st.integers(0, max_n).flatmap(lambda n: st.lists(
        st.booleans(), min_size=n * (n - 1) // 2, max_size=n * (n - 1) // 2).map(
        lambda flags, n=n: dag_from_edges(n, [p for p, f in zip(
            itertools.combinations(range(n), 2), flags) if f])))


def sparse_dag_strategy(max_n):
    """Larger DAGs with a few predecessors each, nearby: long chains and wide layers."""
    return st.tuples(st.integers(0, max_n), st.integers(0, 3), st.integers(1, 12),
                     st.integers(0, 2**32)).map(lambda a: random_dag(*a))


def closure(n, edges):
    """The set of pairs (u, v) joined by a path, from edges that go low -> high."""
    reach = [set() for _ in range(n)]
    for u, v in sorted(edges, reverse=True):
        reach[u] |= {v} | reach[v]
    return {(u, v) for u in range(n) for v in reach[u]}


def ordered(reach, u, v):
    return bool((reach[min(u, v)] >> max(u, v)) & 1)


def matching_size(reduced):
    match = hopcroft_karp(reduced.n, reduced.n, reduced.succs)
    return sum(1 for v in match if v >= 0)


def assert_paper_guarantees(dag, sched: Schedule, reduced=None):
    """(a) no concurrency lost, (b) |syncs| = |E'| - |M|, (c) a valid schedule."""
    reduced = reduced or transitive_reduction(dag)
    check_schedule(dag, sched)  # (c)
    reach = reachability(dag)
    for stream in sched.streams:  # (a): consecutive pairs ordered, hence all pairs by transitivity
        assert all(ordered(reach, x, y) for x, y in zip(stream, stream[1:]))
    assert sched.reduced_edges == reduced.num_edges
    assert len(sched.sync_edges) == reduced.num_edges - matching_size(reduced)  # (b)
    assert set(sched.sync_edges) <= set(reduced.edges())
    # the final graph orders exactly what the DAG orders: no false dependency either
    assert reachability(dag_from_edges(dag.n, sched.edges())) == reach
    assert sched.width == max_antichain_width(dag)
    assert len(sched.streams) >= sched.width


def chain_partitions(n, reach):
    """Every partition of the tasks into chains of the DAG (blocks in increasing id order)."""
    blocks: list[list[int]] = []

    def place(t):
        if t == n:
            yield [list(b) for b in blocks]
            return
        for b in blocks:
            if all(ordered(reach, x, t) for x in b):
                b.append(t)
                yield from place(t + 1)
                b.pop()
        blocks.append([t])
        yield from place(t + 1)
        blocks.pop()

    yield from place(0)


def cross_reduced_edges(blocks, reduced):
    block_of = {t: i for i, b in enumerate(blocks) for t in b}
    return sum(1 for u, v in reduced.edges() if block_of[u] != block_of[v])


def fewest_syncs_by_search(dag, blocks):
    """The smallest S of cross-stream pairs with closure(stream order + S) = closure(DAG)."""
    target = closure(dag.n, dag.edges())
    stream_edges = [(b[i], b[i + 1]) for b in blocks for i in range(len(b) - 1)]
    block_of = {t: i for i, b in enumerate(blocks) for t in b}
    candidates = sorted(p for p in target if block_of[p[0]] != block_of[p[1]])
    for size in range(len(candidates) + 1):
        for s in itertools.combinations(candidates, size):
            if closure(dag.n, stream_edges + list(s)) == target:
                return size
    raise AssertionError("the DAG's own edges always suffice")


# ---- matching and width ----------------------------------------------------------------------

def brute_force_matching(n_left, adj):
    def best(u, used):
        if u == n_left:
            return 0
        result = best(u + 1, used)
        for v in adj[u]:
            if v not in used:
                result = max(result, 1 + best(u + 1, used | {v}))
        return result
    return best(0, frozenset())


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 6), st.integers(0, 6), st.data())
def test_hopcroft_karp_is_maximum(n_left, n_right, data):
    adj = [sorted(data.draw(st.sets(st.integers(0, n_right - 1), max_size=n_right)))
           if n_right else [] for _ in range(n_left)]
    match = hopcroft_karp(n_left, n_right, adj)
    assert len(match) == n_left
    used = [v for v in match if v >= 0]
    assert len(used) == len(set(used))
    assert all(v in adj[u] for u, v in enumerate(match) if v >= 0)
    assert len(used) == brute_force_matching(n_left, adj)


def test_hopcroft_karp_needs_augmenting_paths():
    # the greedy start matches 0-0 and 1-1 and leaves 2 free; only a long augmenting path fixes it
    adj = [[0, 1], [1, 2], [0]]
    assert sorted(hopcroft_karp(3, 3, adj)) == [0, 1, 2]
    n = 300  # a long path: exercises the iterative DFS far past the recursion limit
    adj = [[i, i + 1] for i in range(n - 1)] + [[0]]
    assert sorted(hopcroft_karp(n, n, adj)) == list(range(n))


def test_hopcroft_karp_rejects_bad_input():
    with pytest.raises(ValueError):
        hopcroft_karp(1, 1, [[1]])
    with pytest.raises(ValueError):
        hopcroft_karp(2, 1, [[0]])


@settings(max_examples=200, deadline=None)
@given(dag_strategy(9))
def test_width_is_the_largest_antichain(dag):
    reach = reachability(dag)
    largest = max((len(s) for r in range(dag.n + 1) for s in itertools.combinations(range(dag.n), r)
                   if not any(ordered(reach, x, y) for x, y in itertools.combinations(s, 2))),
                  default=0)
    assert max_antichain_width(dag) == largest
    assert max_antichain_width(dag, reach) == largest


# ---- the paper's guarantees ----------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(dag_strategy(7))
def test_syncs_are_the_fewest_any_maximally_concurrent_assignment_needs(dag):
    """Brute force over every stream assignment that keeps maximum logical concurrency.

    An assignment keeps maximum logical concurrency when every stream is a chain of the DAG: two
    tasks share a stream only if the DAG orders them, so streams serialize nothing the DAG leaves
    concurrent.  Streams run their tasks in id order.  Its synchronizations are a set S of
    cross-stream pairs such that the stream order T (consecutive pairs on each stream) together
    with S enforces exactly the DAG's happens-before relation: closure(T + S) = closure(DAG).
    The theorem: the fewest synchronizations over all such assignments is |E'| - |M| (E' the
    transitive reduction's edges, M a maximum matching of its bipartite graph), and Nimble's
    assignment attains it.  Since an edge of E' can be implied by no longer path of the closure,
    min |S| for one assignment is the number of E' edges whose ends are on different streams;
    ``test_fewest_syncs_for_one_assignment_by_exhaustive_search`` checks that step by searching
    all sets S, and this test takes the minimum of it over all chain partitions.
    """
    reduced = transitive_reduction(dag)
    reach = reachability(dag)
    sched = assign_streams(dag)
    assert_paper_guarantees(dag, sched, reduced)
    fewest = min(cross_reduced_edges(blocks, reduced) for blocks in chain_partitions(dag.n, reach))
    assert len(sched.sync_edges) == fewest


@settings(max_examples=40, deadline=None)
@given(dag_strategy(5))
def test_fewest_syncs_for_one_assignment_by_exhaustive_search(dag):
    """For each chain partition, min |S| (see above) equals its cross-stream reduced edges."""
    reduced = transitive_reduction(dag)
    reach = reachability(dag)
    overall = None
    for blocks in chain_partitions(dag.n, reach):
        fewest = fewest_syncs_by_search(dag, blocks)
        assert fewest == cross_reduced_edges(blocks, reduced)
        overall = fewest if overall is None else min(overall, fewest)
    assert len(assign_streams(dag).sync_edges) == (overall or 0)


@settings(max_examples=150, deadline=None)
@given(sparse_dag_strategy(80))
def test_guarantees_on_larger_random_dags(dag):
    assert_paper_guarantees(dag, assign_streams(dag))


@pytest.mark.parametrize("make", [
    lambda: branchy_graph(),
    lambda: branchy_graph(stages=5, branches=6, depth=2, scratch_every=2, seed=3),
    lambda: random_graph(120, seed=1),
    lambda: random_graph(200, n_buffers=30, max_accesses=2, seed=5),
])
def test_guarantees_on_synthetic_graphs(make):
    dag = build_dag(make())
    assert_paper_guarantees(dag, assign_streams(dag))


def test_branchy_graph_gets_one_stream_per_branch():
    dag = build_dag(branchy_graph(stages=4, branches=5, depth=3))
    sched = assign_streams(dag)
    assert sched.width == 5
    assert len(sched.streams) == 5


def test_reduced_argument_is_used_and_checked():
    dag = build_dag(random_graph(60, seed=2))
    reduced = transitive_reduction(dag)
    assert assign_streams(dag, reduced=reduced) == assign_streams(dag)
    with pytest.raises(ValueError):
        assign_streams(dag, reduced=dag_from_edges(3, []))


def test_schedule_edges():
    sched = Schedule(stream_of=[0, 1, 0, 1], streams=[[0, 2], [1, 3]],
                     sync_edges=[(0, 3), (1, 2)], reduced_edges=4, width=2)
    assert sched.stream_edges() == [(0, 2), (1, 3)]
    assert sched.edges() == [(0, 2), (0, 3), (1, 2), (1, 3)]


def test_empty_and_single_task_dags():
    for n in (0, 1):
        sched = assign_streams(dag_from_edges(n, []))
        assert sched.streams == [[0]] * n and sched.sync_edges == [] and sched.width == n


# ---- max_streams -----------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(sparse_dag_strategy(60), st.integers(1, 6))
def test_max_streams_stays_valid(dag, k):
    free = assign_streams(dag)
    sched = assign_streams(dag, max_streams=k)
    check_schedule(dag, sched)
    assert len(sched.streams) == min(k, len(free.streams))
    final = sched.edges()
    base = closure(dag.n, final)
    assert closure(dag.n, dag.edges()) <= base
    for edge in sched.sync_edges:  # every sync left is needed: none is implied by the rest
        assert closure(dag.n, [e for e in final if e != edge]) != base


def test_one_stream_needs_no_syncs():
    dag = build_dag(branchy_graph())
    sched = assign_streams(dag, max_streams=1)
    assert sched.streams == [list(range(dag.n))]
    assert sched.sync_edges == []
    check_schedule(dag, sched)


def false_edges(dag, streams):
    """Stream edges the DAG does not imply: the concurrency a merge gave up."""
    reach = reachability(dag)
    return sum(1 for s in streams for x, y in zip(s, s[1:]) if not ordered(reach, x, y))


@settings(max_examples=100, deadline=None)
@given(sparse_dag_strategy(40))
def test_one_merge_takes_the_cheapest_pair(dag):
    free = assign_streams(dag).streams
    if len(free) < 2:
        return
    sched = assign_streams(dag, max_streams=len(free) - 1)
    cheapest = min(false_edges(dag, [sorted(a + b)]) for a, b in itertools.combinations(free, 2))
    assert false_edges(dag, sched.streams) == cheapest


def test_max_streams_must_be_positive():
    dag = dag_from_edges(2, [(0, 1)])
    for k in (0, -1):
        with pytest.raises(ValueError):
            assign_streams(dag, max_streams=k)


# ---- check_schedule --------------------------------------------------------------------------

def test_check_schedule_rejects_broken_schedules():
    dag = dag_from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)])
    good = assign_streams(dag)
    check_schedule(dag, good)

    def broken(**changes):
        fields = dict(stream_of=list(good.stream_of), streams=[list(s) for s in good.streams],
                      sync_edges=list(good.sync_edges), reduced_edges=good.reduced_edges,
                      width=good.width)
        fields.update(changes)
        return Schedule(**fields)

    cases = [
        broken(sync_edges=good.sync_edges[1:]),  # a dependency no longer enforced
        broken(stream_of=good.stream_of[:-1]),
        broken(streams=[s[::-1] for s in good.streams]),
        broken(streams=good.streams + [[good.streams[0][0]]]),
        broken(streams=[s for s in good.streams if 3 not in s]),
        broken(sync_edges=good.sync_edges[::-1] + good.sync_edges[:1]),
        broken(sync_edges=sorted(good.sync_edges + [(3, 3)])),
    ]
    for sched in cases:
        with pytest.raises(ScheduleError):
            check_schedule(dag, sched)
    assert issubclass(ScheduleError, ValueError)


# ---- speed and recorded fixtures -------------------------------------------------------------

def test_large_dag_is_fast():
    dag = random_dag(5000, 3, 200, seed=1)
    t0 = time.perf_counter()
    sched = assign_streams(dag)
    elapsed = time.perf_counter() - t0
    check_schedule(dag, sched)
    assert elapsed < 10.0


@pytest.mark.parametrize("path", FIXTURE_PATHS, ids=fixture_ids())
def test_fixture_schedule(path):
    g = TaskGraph.load(path)
    t0 = time.perf_counter()
    dag = build_dag(g)
    reduced = transitive_reduction(dag)
    sched = assign_streams(dag, reduced=reduced)
    elapsed = time.perf_counter() - t0
    assert_paper_guarantees(dag, sched, reduced)
    assert elapsed < 3.0  # budget is 1 s; slack for a loaded machine
    for k in (1, 2, 4):
        check_schedule(dag, assign_streams(dag, max_streams=k, reduced=reduced))
