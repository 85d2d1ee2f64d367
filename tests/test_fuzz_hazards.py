"""The fuzzer's targets (nimble.analysis.hazards): the cross-stream hazard pairs of a schedule
at the copy's arena offsets, and the picks of the targeted draws, on synthetic graphs and the
recorded fixtures.  No GPU."""
from __future__ import annotations

import pytest

from nimble.analysis.deps import dag_from_edges, reachability
from nimble.analysis.hazards import (ARENA, CHAINED, HELD, ChainCosts, Hazard, TargetedPicks,
                                     cross_stream_hazards, direct_hazards, keeps_chained_rule,
                                     keeps_rule, lead_us)
from nimble.analysis.memplan import MemPlanError
from nimble.analysis.plan_check import check_plan
from nimble.engine.prepared import plan_graph
from nimble.ir.synthetic import branchy_graph, random_graph
from nimble.ir.taskgraph import TaskGraph

from helpers import FIXTURE_DIR

FIXTURES = ["googlenet_float16", "inception_v3_float16"]


def _planned(graph: TaskGraph):
    schedule, plan = plan_graph(graph, True, None, None)
    return schedule, plan, cross_stream_hazards(graph, plan.offsets, schedule.stream_of)


@pytest.fixture(scope="module", params=["random", "branchy"] + FIXTURES)
def planned(request):
    if request.param == "random":
        graph = random_graph(80, seed=3)
    elif request.param == "branchy":
        graph = branchy_graph()
    else:
        graph = TaskGraph.load(FIXTURE_DIR / f"{request.param}.json.gz")
    return (graph, *_planned(graph))


def _conflict(graph, offsets, e: int, l_: int) -> bool:
    """Naively: whether tasks ``e`` and ``l_`` touch common bytes, one of them writing."""
    def ranges(t):
        for a in graph.tasks[t].accesses:
            if a.size > 0:
                base = offsets.get(a.buffer)
                space = ARENA if base is not None else a.buffer
                lo = (base or 0) + a.offset
                yield space, lo, lo + a.size, a.write
    return any(s1 == s2 and lo1 < hi2 and lo2 < hi1 and (w1 or w2)
               for s1, lo1, hi1, w1 in ranges(e) for s2, lo2, hi2, w2 in ranges(l_))


def test_every_hazard_is_a_real_cross_stream_conflict(planned):
    graph, schedule, plan, hazards = planned
    assert hazards
    for h in hazards:
        assert h.earlier < h.later
        assert schedule.stream_of[h.earlier] != schedule.stream_of[h.later]
        assert _conflict(graph, plan.offsets, h.earlier, h.later)
        assert h.kind in ("write-read", "read-write", "write-write")


def test_every_needed_sync_edge_leaves_a_listed_pair_unordered(planned):
    """Remove each synchronization the plan check needs: some hazard pair is then unordered,
    and the edge's own writer is a target."""
    graph, schedule, plan, hazards = planned
    edges = schedule.edges()
    targets = set(TargetedPicks(len(graph.tasks), hazards, edges).targets)
    needed = 0
    for u, v in schedule.sync_edges[:60]:
        kept = [e for e in edges if e != (u, v)]
        try:
            check_plan(graph, kept, plan)
            continue
        except MemPlanError:
            needed += 1
        reach = reachability(dag_from_edges(len(graph.tasks), kept))
        assert any(not reach[h.earlier] >> h.later & 1 for h in hazards), (u, v)
        assert u in targets
    assert needed


def test_moved_offsets_give_the_hazards_at_the_new_bytes():
    graph = random_graph(60, seed=1)
    schedule, plan, hazards = _planned(graph)
    a, b = sorted(plan.offsets)[:2]
    moved = dict(plan.offsets)
    moved[b] = plan.offsets[a]
    listed = cross_stream_hazards(graph, moved, schedule.stream_of)
    for h in listed:
        assert _conflict(graph, moved, h.earlier, h.later)
    assert set(listed) != set(hazards) or plan.offsets[a] == plan.offsets[b]


def test_tasks_of_different_phases_are_no_hazard():
    graph = random_graph(40, seed=2)
    schedule, plan, hazards = _planned(graph)
    split = [range(0, 20), range(20, 40)]
    phased = cross_stream_hazards(graph, plan.offsets, schedule.stream_of, split)
    assert set(phased) == {h for h in hazards if (h.earlier < 20) == (h.later < 20)}


def test_every_targeted_pick_keeps_the_rule_and_covers_every_target(planned):
    graph, schedule, _, hazards = planned
    picks = TargetedPicks(len(graph.tasks), hazards, schedule.edges(), seed=0)
    direct, every = picks.tiers
    assert set(direct.targets) <= set(every.targets) == {h.earlier for h in hazards}
    launches = 0
    while not picks.all_covered:
        tier = picks.tier
        kind, picked, delays = picks.next()
        launches += 1
        assert kind == HELD and delays is None
        assert picked and keeps_rule(picked, tier.partners, picks.down)
        assert launches <= len(direct.targets) + len(every.targets)  # a new target each time
    assert direct.covered == set(direct.targets) and every.covered == set(every.targets)
    for _ in range(5):  # fresh sets keep the rule too
        assert keeps_rule(picks.next().tasks, every.partners, picks.down)


def test_seeded_picks_repeat_and_differ_for_another_seed():
    graph = branchy_graph(stages=6, branches=4)
    schedule, _, hazards = _planned(graph)

    def run(seed):
        picks = TargetedPicks(len(graph.tasks), hazards, schedule.edges(), seed=seed)
        return [picks.next().tasks for _ in range(12)]
    assert run(0) == run(0)
    assert run(0) != run(1)


def test_targets_sharing_a_partner_get_a_launch_each():
    """Branches joining: three writers on three streams, one reader.  Holding two writers back
    together holds the reader back behind the second, which hides the first one's race."""
    n = 4
    hazards = [Hazard(w, 3, "write-read", ARENA, 16 * w, 16 * w + 16) for w in range(3)]
    edges = [(0, 3), (1, 3), (2, 3)]
    picks = TargetedPicks(n, hazards, edges, seed=0)
    sets = [picks.next().tasks for _ in range(3)]
    assert sorted(sets) == [[0], [1], [2]] and picks.all_covered


def test_independent_targets_share_a_launch():
    """Two parallel pairs (0 -> 1, 2 -> 3) and a pair below them (4 -> 5, after both): the
    first two go together; 4 never goes with them (its partner is below both)."""
    hazards = [Hazard(0, 1, "write-read", ARENA, 0, 8), Hazard(2, 3, "write-read", ARENA, 8, 16),
               Hazard(4, 5, "write-read", ARENA, 16, 24)]
    edges = [(0, 1), (2, 3), (1, 4), (3, 4), (4, 5)]
    picks = TargetedPicks(6, hazards, edges, seed=0)
    sets = [picks.next().tasks for _ in range(4)]
    assert [0, 2] in sets and all(4 not in s or s == [4] for s in sets)
    assert picks.all_covered


def _chain(n: int, cost: int = 10, budget: int = 10**9) -> ChainCosts:
    return ChainCosts([cost] * n, [budget] * n, [0] * n)


def test_chained_picks_keep_their_rule_and_cover_every_tier_both_ways(planned):
    graph, schedule, _, hazards = planned
    n = len(graph.tasks)
    picks = TargetedPicks(n, hazards, schedule.edges(), seed=0, chain=[_chain(n, 7)] * 2)
    stages = []
    while not picks.all_covered:
        kind, k = picks.stage
        tier = picks.tiers[k]
        chosen = picks.next()
        assert chosen.kind == kind and chosen.tasks
        if kind == CHAINED:
            assert keeps_chained_rule(chosen.tasks, tier.partners, picks.down)
            assert chosen.delays_ns == [7] * len(chosen.tasks)
        else:
            assert keeps_rule(chosen.tasks, tier.partners, picks.down)
        if not stages or stages[-1] != (kind, k):
            stages.append((kind, k))
    assert stages == [(CHAINED, 0), (HELD, 0), (CHAINED, 1), (HELD, 1)]
    for tier in picks.tiers:
        assert tier.chained == tier.covered == set(tier.targets)


def test_chaining_covers_a_deep_network_in_fewer_launches():
    graph = branchy_graph(stages=8, branches=3)
    schedule, _, hazards = _planned(graph)
    n = len(graph.tasks)
    chained = TargetedPicks(n, hazards, schedule.edges(), seed=0, chain=[_chain(n)] * 2)
    while chained.chaining:
        chained.next()
    held = TargetedPicks(n, hazards, schedule.edges(), seed=0)
    while not held.tiers[0].done:
        held.next()
    assert chained.launches < held.launches / 2


def test_a_chained_pick_below_another_must_have_it_above_its_partners_too():
    """0 -> 1 -> 2 -> 3: target 0 (partner 1) and target 2 (partner 3) chain; target 1
    (partner 3 as well, beside 2) does not go with 2, whose delay would hold 3 back alone."""
    hazards = [Hazard(0, 1, "write-read", ARENA, 0, 8), Hazard(2, 3, "write-read", ARENA, 8, 16),
               Hazard(1, 3, "write-read", ARENA, 16, 24)]
    edges = [(0, 1), (1, 2), (1, 3), (2, 3)]
    picks = TargetedPicks(4, hazards, edges, seed=0, chain=[_chain(4)] * 2)
    partners, down = picks.tiers[0].partners, picks.down
    assert keeps_chained_rule([0, 2], partners, down)
    assert not keeps_chained_rule([1, 2], partners, down)
    assert not keeps_rule([0, 2], partners, down)  # the held rule never lets them go together


def test_chained_picks_keep_to_their_phase_budget():
    n = 8
    hazards = [Hazard(t, t + 1, "write-read", ARENA, 8 * t, 8 * t + 8) for t in range(0, 8, 2)]
    edges = [(t, t + 1) for t in range(7)]
    chain = ChainCosts([10] * n, [25] * n, [0] * 4 + [1] * 4)
    picks = TargetedPicks(n, hazards, edges, seed=0, chain=[chain] * 2)
    while picks.chaining:
        kind, picked, _ = picks.next()
        assert kind == CHAINED and 1 <= sum(1 for t in picked if t < 4) <= 2
        assert sum(1 for t in picked if t >= 4) <= 2


def test_a_chained_budget_bounds_each_path_not_the_sum_over_branches():
    """Two targets that each cost 15 of a budget of 25 fit one launch on separate branches
    (the launch waits for its slowest path), not on one path, where their delays add up."""
    from nimble.analysis.hazards import pick_chained

    hazards = [Hazard(0, 1, "write-read", ARENA, 0, 8), Hazard(2, 3, "write-read", ARENA, 8, 16)]
    chain = ChainCosts([15] * 4, [25] * 4, [0] * 4)
    for edges, want in (([(0, 1), (2, 3)], [0, 2]), ([(0, 1), (1, 2), (2, 3)], [0])):
        picks = TargetedPicks(4, hazards, edges, seed=0, chain=[chain] * 2)
        assert pick_chained([0, 2], picks.tiers[1].partners, picks.down, chain) == want
    # a pick below an earlier one is refused when the earlier one's path would overflow too
    picks = TargetedPicks(4, hazards, [(0, 1), (1, 2), (2, 3)], seed=0, chain=[chain] * 2)
    assert pick_chained([2, 0], picks.tiers[1].partners, picks.down, chain) == [2]


def test_a_targets_lead_is_the_longest_path_gap_to_its_partners():
    # 0 (5 us) -> 1 (30 us) -> 3; 0 -> 2 (1 us) -> 3: target 2 leads its partner 3 by 30 us
    edges = [(0, 1), (0, 2), (1, 3), (2, 3)]
    hazards = [Hazard(2, 3, "write-read", ARENA, 0, 8), Hazard(0, 2, "write-read", ARENA, 8, 16)]
    lead = lead_us(4, hazards, edges, [5.0, 30.0, 1.0, 2.0])
    assert lead == {2: 30.0, 0: 5.0}


def test_targeted_picks_and_heavy_delays_take_late_edges_that_go_back():
    from nimble.analysis.hazards import Hazard, TargetedPicks
    from nimble.analysis.delays import heavy_delay_ns
    from nimble.ir.synthetic import branchy_graph

    graph = branchy_graph()
    n = len(graph.tasks)
    edges = [(t, t + 1) for t in range(n - 1)]
    late = [(n - 1, n - 3)]  # a training step's tail backfill: the anchor comes later
    hazards = [Hazard(0, n - 3, "write-read", 0, 0, 4)]
    picks = TargetedPicks(n, hazards, edges[:-2] + late, seed=0)
    assert picks.targets
    assert heavy_delay_ns(graph, edges[:-2] + late) > 0


def test_a_pair_one_sync_orders_alone_is_direct_even_when_its_writer_precedes_the_source():
    """Stream 0 runs tasks 0, 1, 3; stream 1 runs 2 and 4, and a sync joins 1 to 2.  Task 0
    writes what task 2 reads (no edge of its own: the sync orders them), task 1 writes what 2
    reads, task 3 writes what 4 reads (ordered only through 3's own sync to 4)."""
    stream_of = [0, 0, 1, 0, 1]
    edges = [(0, 1), (1, 3), (1, 2), (2, 4), (3, 4)]
    hazards = [Hazard(0, 2, "write-read", 7, 0, 8), Hazard(1, 2, "write-read", 8, 0, 8),
               Hazard(3, 4, "write-read", 9, 0, 8), Hazard(0, 4, "write-read", 7, 0, 8)]
    direct = direct_hazards(hazards, edges, stream_of)
    # (0, 4): its later task has a sync of its own from stream 0, (3, 4), after task 0
    assert direct == hazards
    assert direct_hazards(hazards, [(0, 1), (1, 3), (2, 4), (0, 2), (3, 4)], stream_of) == \
        [hazards[0], hazards[2], hazards[3]]  # the sync now leaves 0, ahead of task 1
    picks = TargetedPicks(5, hazards, edges, direct=direct[:1])
    assert picks.tiers[0].targets == [0] and picks.targets == [0, 1, 3]


@pytest.mark.parametrize("name", FIXTURES)
def test_the_writer_of_every_race_one_missing_sync_opens_is_a_direct_target(name):
    """On the recorded models: remove each sync edge of the schedule in turn; wherever the plan
    check finds a race, its earlier task is among the first tier's targets, which the fuzzer
    holds back before any other."""
    import re

    graph = TaskGraph.load(FIXTURE_DIR / f"{name}.json.gz")
    schedule, plan, hazards = _planned(graph)
    edges = schedule.edges()
    direct = {h.earlier for h in direct_hazards(hazards, edges, schedule.stream_of)}
    races = 0
    for edge in schedule.sync_edges:
        try:
            check_plan(graph, [e for e in edges if e != edge], plan)
        except MemPlanError as e:
            races += 1
            writer = int(re.search(r"tasks (\d+) and (\d+)", str(e)).group(1))
            assert writer in direct, (edge, str(e))
    assert races > 50
