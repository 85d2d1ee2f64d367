"""The proof's serial orders (nimble.analysis.orders): linear extensions of each phase's DAG that
together run the later task of every unordered pair first, checked against a brute-force count
on random DAGs and on the recorded fixtures, and on the fixtures' synchronizations removed one
at a time (the races the proof must catch).  No GPU."""
from __future__ import annotations

import random
import re

import pytest

from nimble.analysis.orders import MAX_ORDERS, chain, phase_orders, reversing_orders
from nimble.engine.prepared import phase_spans, plan_graph
from nimble.ir.taskgraph import TaskGraph

from helpers import FIXTURE_DIR, load_tool


def _is_extension(order, n, edges) -> bool:
    at = {t: k for k, t in enumerate(order)}
    return sorted(order) == list(range(n)) and all(at[u] < at[v] for u, v in edges)


def _left_by_brute_force(n, edges, orders) -> tuple[int, int]:
    """``(unordered pairs, pairs no order runs later-first)``, by a plain closure."""
    below = [{v for u, v in edges if u == t} for t in range(n)]
    changed = True
    while changed:
        changed = False
        for t in range(n):
            more = set().union(*(below[v] for v in below[t])) - below[t]
            if more:
                below[t] |= more
                changed = True
    positions = [{t: k for k, t in enumerate(o)} for o in orders]
    pairs = left = 0
    for a in range(n):
        for b in range(a + 1, n):
            if b in below[a] or a in below[b]:
                continue
            pairs += 1
            left += not any(p[b] < p[a] for p in positions)
    return pairs, left


def _random_edges(n: int, seed: int, shuffled: bool) -> list[tuple[int, int]]:
    """A random DAG on ``n`` tasks; ``shuffled``: its topological order is not id order (as
    with a backfill's late edges)."""
    rng = random.Random(seed)
    at = list(range(n))
    if shuffled:
        rng.shuffle(at)
    return sorted({(at[i], at[j]) for j in range(1, n)
                   for i in rng.sample(range(j), min(j, rng.randint(0, 2)))})


@pytest.mark.parametrize("seed", range(12))
def test_every_order_is_a_linear_extension_and_the_count_of_pairs_left_is_exact(seed):
    n = 14
    edges = _random_edges(n, seed, shuffled=seed % 3 == 0)
    found = phase_orders(n, edges, limit=2 + seed % 3)
    assert all(_is_extension(o, n, edges) for o in found.orders)
    assert (found.pairs, found.left) == _left_by_brute_force(n, edges, found.orders)
    assert found.left == 0 or len(found.orders) == 2 + seed % 3


def test_no_orders_where_nothing_is_unordered_and_two_for_a_fork_and_join():
    line = phase_orders(4, [(0, 1), (1, 2), (2, 3)])
    assert line.orders == [] and line.pairs == line.left == 0
    # 0 forks into the branches 1-2 and 3-4, which join at 5
    diamond = phase_orders(6, [(0, 1), (1, 2), (0, 3), (3, 4), (2, 5), (4, 5)])
    assert len(diamond.orders) == 1 and diamond.left == 0  # the later branch first
    assert diamond.orders[0] == [0, 3, 4, 1, 2, 5]
    assert chain([3, 1, 2]) == [(3, 1), (1, 2)]


def test_a_cycle_is_refused():
    with pytest.raises(ValueError, match="cycle"):
        phase_orders(3, [(0, 1), (1, 0), (1, 2), (0, 2)])


FIXTURES = ["googlenet_float16", "inception_v3_float16", "nasnetalarge", "gpt2_float16",
            "resnet50_train"]


@pytest.fixture(scope="module", params=FIXTURES)
def planned(request):
    graph = TaskGraph.load(FIXTURE_DIR / f"{request.param}.json.gz")
    schedule, plan = plan_graph(graph, True, None, None)
    return request.param, graph, schedule, plan


def test_the_fixtures_every_unordered_pair_runs_later_first_in_a_few_orders(planned):
    name, graph, schedule, _ = planned
    spans = phase_spans(schedule.phases, len(graph.tasks))
    found = reversing_orders(schedule.edges(), spans)
    assert len(found) == len(spans)
    for span, phase in zip(spans, found):
        inside = [(u, v) for u, v in schedule.edges() if u in span and v in span]
        assert phase.pairs > 0 and phase.left == 0
        assert 1 <= len(phase.orders) <= MAX_ORDERS
        for order in phase.orders:
            assert sorted(order) == list(span)
            at = {t: k for k, t in enumerate(order)}
            assert all(at[u] < at[v] for u, v in inside)
    if name == "googlenet_float16":  # series-parallel: the two first extensions do it
        assert [len(p.orders) for p in found] == [2]


@pytest.mark.parametrize("name", ["googlenet_float16", "inception_v3_float16"])
def test_a_removed_synchronization_leaves_its_race_run_later_first(name):
    """For each sync edge the plan check needs (first 20 in a seeded order), the orders of the
    schedule without it run the race's later task before its writer."""
    power = load_tool("proof_power")
    graph = TaskGraph.load(FIXTURE_DIR / f"{name}.json.gz")
    schedule, plan = plan_graph(graph, True, None, None)
    edges = schedule.edges()
    sync = sorted(schedule.sync_edges)
    random.Random(0).shuffle(sync)
    checked = 0
    for edge in sync:
        change = power.Change("sync", removed_edges=frozenset({edge}))
        needed, reason = power.needed(graph, edges, plan, change)
        if not needed:
            continue
        first, second = map(int, re.search(r"tasks (\d+) and (\d+)", reason).groups())
        kept = [e for e in edges if e != edge]
        (phase,) = reversing_orders(kept, [range(len(graph.tasks))])
        assert any(o.index(second) < o.index(first) for o in phase.orders), edge
        checked += 1
        if checked == 20:
            break
    assert checked == 20
