"""Cross-stream hazards of a schedule, and the race fuzzer's targeted picks over them.

A *hazard pair* is an earlier task E and a later task L (recorded order) of one phase, on
different streams, whose accesses touch common bytes with at least one of them writing
(write-read, read-write and write-write).  The bytes are those a built copy actually uses: the
planned buffers at their arena offsets (which a caller may override, as the power tool's
shared-bytes trials do), every other buffer in its own bytes.  The pairs are the ones the plan
check's race sweep orders (:func:`nimble.analysis.plan_check.conflict_pairs`), run once over
each buffer outside the arena and once over the whole arena: if all of them are ordered, every
conflicting pair is.  A missing synchronization therefore leaves at least one listed pair
unordered (pairs on one stream stay ordered by the stream's own chain of edges).

The *targets* are the distinct E tasks.  Holding E back long enough, with none of its partners
held back, runs E after L wherever nothing orders them, which is what shows the race: a missing
sync's slack is often whole kernels (the reader also waits for its own stream's work), so
small delays spread over many tasks cancel out.  :class:`TargetedPicks` chooses, per launch, a
set of targets to hold back such that no partner of a picked target is a picked task or a
descendant, in the schedule's DAG, of another picked task (else the partner is held back too
and the race hides), greedily as many as fit, uncovered targets first, so that every target is
held back in few launches.  The rule makes the picks an antichain (a partner is a descendant of
its own target), so one launch holds every path back by at most one delay.  Where k targets
share a partner (k branches joining), each needs a launch of its own: the launches a cover
takes are at least the largest such k.  The *chained* picks (:func:`pick_chained`) relax the
rule where delays add up along a path: a pick may hold back a partner of another pick if it
holds back that pick too, so one launch can hold back a target in every block of a deep
network, each by its own (shorter) delay.  Reachability is Python-int bitsets
(:func:`~nimble.analysis.deps.reachability`), which stays fast for thousands of tasks.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple, Sequence

from .deps import dag_from_edges, path_lengths, reachability
from .plan_check import collect_accesses, conflict_pairs
from ..ir.taskgraph import TaskGraph

#: The byte space of a hazard on planned buffers (others name their buffer).
ARENA = -1


@dataclass(frozen=True)
class Hazard:
    """Tasks ``earlier`` < ``later`` on different streams touching bytes ``[lo, hi)`` of
    ``space`` (a buffer id, or :data:`ARENA` for arena bytes)."""

    earlier: int
    later: int
    kind: str  # "write-read", "read-write" or "write-write" (earlier's access first)
    space: int
    lo: int
    hi: int


def _kind(first_writes: bool, second_writes: bool) -> str:
    return ("write" if first_writes else "read") + "-" + ("write" if second_writes else "read")


def _spaces(graph: TaskGraph, offsets: Mapping[int, int]
            ) -> Iterable[tuple[int, list[tuple[int, int, int, bool]]]]:
    """``(space, sorted (lo, hi, task, write))`` of every byte space that may hold a hazard."""
    by_buffer, arena = collect_accesses(graph, dict(offsets))
    for buf, accs in by_buffer.items():
        if buf not in offsets and accs[0][2] != accs[-1][2] and any(a[3] for a in accs):
            yield buf, sorted(accs)
    yield ARENA, sorted((lo, hi, task, write) for lo, hi, task, _, write in arena)


def cross_stream_hazards(graph: TaskGraph, offsets: Mapping[int, int],
                         stream_of: Sequence[int],
                         spans: Sequence[range] | None = None) -> list[Hazard]:
    """Every hazard pair of ``graph`` (see the module docstring), one per task pair and kind,
    sorted.  ``offsets`` maps each planned buffer to its arena offset in the copy; ``spans``
    are the phases (tasks of different phases are ordered by the launches; None: one phase)."""
    phase_of = [0] * len(graph.tasks)
    for k, span in enumerate(spans or ()):
        for t in span:
            phase_of[t] = k
    found: dict[tuple[int, int, str], Hazard] = {}
    for space, accs in _spaces(graph, offsets):
        for pair in conflict_pairs(accs):
            e, l_ = pair.first, pair.second
            if stream_of[e] == stream_of[l_] or phase_of[e] != phase_of[l_]:
                continue
            kind = _kind(pair.first_writes, pair.second_writes)
            found.setdefault((e, l_, kind), Hazard(e, l_, kind, space, pair.lo, pair.hi))
    return [found[k] for k in sorted(found)]


def direct_hazards(hazards: Iterable[Hazard], edges: Iterable[tuple[int, int]],
                   stream_of: Sequence[int]) -> list[Hazard]:
    """The hazards that one cross-stream edge of ``edges`` may order alone: the later task is
    the edge's target, and the earlier task is the edge's source or comes before it on the
    source's stream (a stream runs its tasks in id order).  Removing that edge leaves such a
    pair unordered unless another path joins them, and holding back the earlier task (which
    holds back the source too) shows the race.  Pairs whose earlier task precedes the source
    matter as much as the source's own: a batch norm's first kernel writes a buffer its third
    kernel reads, on another stream, with the sync from the second kernel between them
    (docs/findings.md, "The race fuzzer's misses at budget 1").  Pairs whose later task comes
    after the edge's target on its stream are left to the second tier: counting them in made
    the first tier half as large again and held the zoo's writers back later."""
    sources: dict[int, list[int]] = {}
    for u, v in edges:
        if stream_of[u] != stream_of[v]:
            sources.setdefault(v, []).append(u)
    return [h for h in hazards
            if any(stream_of[u] == stream_of[h.earlier] and h.earlier <= u
                   for u in sources.get(h.later, ()))]


#: The kinds of targeted pick: held back one antichain at a time by the critical path, or along
#: chains by each target's own window (see :class:`TargetedPicks`).
HELD, CHAINED = "targeted", "chained"


class _Tier:
    """Targets and their partners (bitsets) from one set of hazards, and which were picked."""

    def __init__(self, hazards: Iterable[Hazard]) -> None:
        self.partners: dict[int, int] = {}
        for h in hazards:
            self.partners[h.earlier] = self.partners.get(h.earlier, 0) | (1 << h.later)
        self.targets = sorted(self.partners)
        self.covered: set[int] = set()  # picked by a held draw
        self.chained: set[int] = set()  # picked by a chained draw

    @property
    def done(self) -> bool:
        return len(self.covered) == len(self.targets)


@dataclass(frozen=True)
class ChainCosts:
    """What a chained pick may spend: ``cost[t]`` ns of delay for target ``t``, at most
    ``budget[t]`` ns summed over the picks on one path of ``t``'s phase (``phase_of[t]``) per
    launch (:func:`pick_chained`)."""

    cost: Sequence[int]
    budget: Sequence[int]
    phase_of: Sequence[int]


class Pick(NamedTuple):
    """One launch's targets (ascending) and how long each waits: ``delays_ns[i]`` for
    ``tasks[i]`` in a chained pick, None in a held one (the caller's heavy delay)."""

    kind: str
    tasks: list[int]
    delays_ns: list[int] | None


class TargetedPicks:
    """Seeded sets of targets to hold back, one set per launch (see the module docstring).

    Two tiers: the *direct* hazards (``direct``; default: those whose two tasks an edge of
    ``edges`` joins, a synchronization of the schedule whose removal leaves exactly that pair
    unordered; :func:`direct_hazards` adds the pairs whose earlier task precedes the edge's
    source on its stream), and every hazard.  The picks go in stages, each until every target of its tier was picked once that
    way, the direct tier first:

    1. with ``chain`` costs (one :class:`ChainCosts` per tier), *chained* picks
       (:func:`pick_chained`): a pick may sit below another as long as every pick above a
       partner is above its target too, so the delays add up along paths and a target still
       ends later than its partners by its own delay; each target waits its own cost (a few
       times its natural lead over its partners), so one launch holds back one target of
       every block of a deep network;
    2. *held* picks (:func:`pick`), an antichain each, for the heavy delay: the safe way, where
       a lead was underestimated.

    After the last stage, fresh held sets over every hazard.  :meth:`next` returns the next
    launch's :class:`Pick`.
    """

    def __init__(self, n: int, hazards: Sequence[Hazard], edges: Sequence[tuple[int, int]],
                 seed: int = 0, chain: Sequence[ChainCosts] | None = None,
                 direct: Sequence[Hazard] | None = None) -> None:
        edges = list(edges)
        reach = reachability(dag_from_edges(n, edges, ordered=False))  # late edges go back
        #: bit q of ``down[p]``: q is p or a descendant of p
        self.down = [r | (1 << t) for t, r in enumerate(reach)]
        if direct is None:  # the pairs an edge joins itself
            joined = set(edges)
            direct = [h for h in hazards if (h.earlier, h.later) in joined]
        self.tiers = [_Tier(direct), _Tier(hazards)]
        #: The targets (distinct earlier tasks of the hazards), ascending.
        self.targets = self.tiers[-1].targets
        self.chain = None if chain is None else list(chain)
        kinds = (CHAINED, HELD) if chain is not None else (HELD,)
        self.stages = [(kind, k) for k in range(len(self.tiers)) for kind in kinds]
        self.launches = 0  # sets picked so far
        self._rng = random.Random(seed)

    def _seen(self, kind: str, k: int) -> set[int]:
        tier = self.tiers[k]
        return tier.chained if kind == CHAINED else tier.covered

    def _done(self, stage: tuple[str, int]) -> bool:
        return len(self._seen(*stage)) == len(self.tiers[stage[1]].targets)

    @property
    def stage(self) -> tuple[str, int]:
        """The kind of the next pick and the index of the tier it covers."""
        return next((s for s in self.stages if not self._done(s)), (HELD, len(self.tiers) - 1))

    @property
    def tier(self) -> _Tier:
        """The tier the next pick covers."""
        return self.tiers[self.stage[1]]

    @property
    def chaining(self) -> bool:
        """Whether the next pick is a chained one."""
        return self.stage[0] == CHAINED

    @property
    def direct_done(self) -> bool:
        """Whether every direct target was picked every way."""
        return all(self._done(s) for s in self.stages if s[1] == 0)

    @property
    def all_covered(self) -> bool:
        """Whether every target of every tier was picked every way."""
        return all(self._done(s) for s in self.stages)

    def next(self) -> Pick:
        """The next launch's pick (no tasks only where there are no targets)."""
        kind, k = self.stage
        tier, seen = self.tiers[k], self._seen(kind, k)
        uncovered = [t for t in tier.targets if t not in seen]
        rest = [t for t in tier.targets if t in seen]
        self._rng.shuffle(uncovered)
        self._rng.shuffle(rest)
        self.launches += 1
        if kind == CHAINED:
            chain = self.chain[k]
            tasks = pick_chained(uncovered + rest, tier.partners, self.down, chain)
            chosen = Pick(CHAINED, tasks, [chain.cost[t] for t in tasks])
        else:
            chosen = Pick(HELD, pick(uncovered + rest, tier.partners, self.down), None)
        for j, other in enumerate(self.tiers):
            # a pick counts for another tier where the target has no other partners there
            # (its lead, and so its chained cost, is then the same too)
            self._seen(kind, j).update(t for t in chosen.tasks if t in other.partners and
                                       not other.partners[t] & ~tier.partners[t])
        return chosen


def pick(order: Iterable[int], partners: Mapping[int, int], down: Sequence[int]) -> list[int]:
    """Greedily, in ``order``, every target that keeps the rule (:func:`keeps_rule`), ascending.
    ``partners[t]`` and ``down[t]`` are bitsets: ``t``'s partners, and ``t`` with its
    descendants."""
    picked: list[int] = []
    below = 0  # the picks and their descendants
    held = 0  # the partners of the picks
    for t in order:
        if partners[t] & below or held & down[t]:
            continue
        picked.append(t)
        below |= down[t]
        held |= partners[t]
    return sorted(picked)


def keeps_rule(picked: Sequence[int], partners: Mapping[int, int], down: Sequence[int]) -> bool:
    """Whether no partner of any of ``picked`` is another pick or one's descendant."""
    for t in picked:
        others = 0
        for p in picked:
            if p != t:
                others |= down[p]
        if partners[t] & others:
            return False
    return True


def _delays_partner_alone(p: int, t: int, partners: Mapping[int, int],
                          down: Sequence[int]) -> bool:
    """Whether holding ``p`` back holds back a partner of ``t`` but not ``t`` itself."""
    return bool(partners[t] & down[p]) and not down[p] >> t & 1


def pick_chained(order: Iterable[int], partners: Mapping[int, int], down: Sequence[int],
                 chain: ChainCosts) -> list[int]:
    """Greedily, in ``order``, every target that keeps the chained rule
    (:func:`keeps_chained_rule`) and its phase's budget, ascending.  The budget bounds the
    delays one path of the phase's DAG can meet: a pick's cost plus the costs of the picks
    above it (all of them, as if on one path) stays within it, for the new pick and for every
    pick below it; picks on separate branches do not add up, since a launch waits for its
    slowest path, not for the sum.  The first pick of a phase always fits."""
    picked: list[int] = []
    load: dict[int, int] = {}  # a pick's cost plus those of the picks above it in its phase
    for t in order:
        phase, cost, budget = chain.phase_of[t], chain.cost[t], chain.budget[t]
        mine = [p for p in picked if chain.phase_of[p] == phase]
        here = cost + sum(chain.cost[p] for p in mine if down[p] >> t & 1)
        below = [p for p in mine if down[t] >> p & 1]
        if mine and (here > budget or any(load[p] + cost > budget for p in below)):
            continue
        if any(_delays_partner_alone(p, t, partners, down)
               or _delays_partner_alone(t, p, partners, down) for p in picked):
            continue
        picked.append(t)
        load[t] = here
        for p in below:
            load[p] += cost
    return sorted(picked)


def keeps_chained_rule(picked: Sequence[int], partners: Mapping[int, int],
                       down: Sequence[int]) -> bool:
    """Whether every pick that is or lies above a partner of a pick lies above that pick too:
    then every chain of picks above a partner continues to the pick, whose own delay keeps it
    behind the partner."""
    return not any(_delays_partner_alone(p, t, partners, down)
                   for t in picked for p in picked if p != t)


def lead_us(n: int, hazards: Iterable[Hazard], edges: Sequence[tuple[int, int]],
            durations: Sequence[float]) -> dict[int, float]:
    """Per target, its natural lead over its partners: the longest gap (µs) between its
    earliest start and a partner's, on the longest paths over ``durations`` (isolated µs per
    task) in the DAG of ``edges``."""
    before = path_lengths(dag_from_edges(n, edges, ordered=False), durations).before
    lead: dict[int, float] = {}
    for h in hazards:
        lead[h.earlier] = max(lead.get(h.earlier, 0.0), before[h.later] - before[h.earlier])
    return lead
