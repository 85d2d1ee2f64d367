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


def _closure(n, edges) -> list[set[int]]:
    below = [{v for u, v in edges if u == t} for t in range(n)]
    changed = True
    while changed:
        changed = False
        for t in range(n):
            more = set().union(*(below[v] for v in below[t])) - below[t]
            if more:
                below[t] |= more
                changed = True
    return below


def _left_by_brute_force(n, edges, orders, pinned_edges=None) -> tuple[int, int, int]:
    """``(unordered pairs, pairs no order runs later-first, pairs the pins order)``, by a
    plain closure of ``edges`` and of ``pinned_edges`` (the edges with the pins)."""
    below = _closure(n, edges)
    pinned_below = _closure(n, pinned_edges) if pinned_edges is not None else below
    positions = [{t: k for k, t in enumerate(o)} for o in orders]
    pairs = left = pins = 0
    for a in range(n):
        for b in range(a + 1, n):
            if b in below[a] or a in below[b]:
                continue
            pairs += 1
            if b in pinned_below[a] or a in pinned_below[b]:
                pins += 1
            else:
                left += not any(p[b] < p[a] for p in positions)
    return pairs, left, pins


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
    # task 3 pinned before every later task (all pins kept where ids are topological)
    pins = [(3, b) for b in range(4, n)] if seed % 2 and seed % 3 else []
    found = phase_orders(n, edges, limit=2 + seed % 3, pins=pins)
    assert all(_is_extension(o, n, edges + pins) for o in found.orders)
    assert (found.pairs, found.left, found.pinned) == \
        _left_by_brute_force(n, edges, found.orders, edges + pins)
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
            "resnet50_train", "inception_v3"]


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


@pytest.mark.parametrize("name,streams", [("pnasnet5large", 8), ("nasnetalarge", 16),
                                          ("inception_v3_float16", 16)])
def test_stream_capped_schedules_are_covered_within_the_limit(name, streams):
    """A stream cap folds branches onto shared streams, which leaves tangled partial orders
    (the two first walks leave pairs): the further walks still cover every pair."""
    graph = TaskGraph.load(FIXTURE_DIR / f"{name}.json.gz")
    schedule, _ = plan_graph(graph, True, streams, None)
    (phase,) = reversing_orders(schedule.edges(), [range(len(graph.tasks))])
    assert phase.left == 0 and 2 < len(phase.orders) <= MAX_ORDERS


def test_a_memsets_pairs_are_pinned_where_a_removed_sync_leaves_them_unordered():
    """inception_v3 fp32: cuDNN's split-K convolutions wait on semaphores a memset before each
    zeroes; with that sync removed, no order runs the convolution before its memset."""
    from nimble.analysis.hazards import cross_stream_hazards
    from nimble.analysis.orders import pinned_pairs

    graph = TaskGraph.load(FIXTURE_DIR / "inception_v3.json.gz")
    schedule, plan = plan_graph(graph, True, None, None)
    pins = pinned_pairs(graph, cross_stream_hazards(graph, plan.offsets, schedule.stream_of))
    crossing = [(m, b) for m, b in pins if (m, b) in set(schedule.sync_edges)]
    assert crossing, "a memset and its convolution on two streams"
    m, b = crossing[0]
    kept = [e for e in schedule.edges() if e != (m, b)]
    (phase,) = reversing_orders(kept, [range(len(graph.tasks))], pins=pins)
    assert phase.pinned >= 1 and phase.left == 0 and phase.pairs > phase.pinned
    assert all(o.index(m) < o.index(b) for o in phase.orders)
    (loose,) = reversing_orders(kept, [range(len(graph.tasks))])
    assert any(o.index(b) < o.index(m) for o in loose.orders)  # unpinned, it would run first


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
