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
takes are at least the largest such k.  Reachability is Python-int bitsets (:func:`~nimble.analysis.deps.
reachability`), which stays fast for thousands of tasks.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .deps import dag_from_edges, reachability
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


class _Tier:
    """Targets and their partners (bitsets) from one set of hazards, and which were picked."""

    def __init__(self, hazards: Iterable[Hazard]) -> None:
        self.partners: dict[int, int] = {}
        for h in hazards:
            self.partners[h.earlier] = self.partners.get(h.earlier, 0) | (1 << h.later)
        self.targets = sorted(self.partners)
        self.covered: set[int] = set()

    @property
    def done(self) -> bool:
        return len(self.covered) == len(self.targets)


class TargetedPicks:
    """Seeded sets of targets to hold back, one set per launch (see the module docstring).

    Two tiers: first the *direct* hazards, whose two tasks an edge of ``edges`` joins (a
    synchronization of the schedule: removing it leaves exactly that pair unordered), until
    every one of their targets was picked; then every hazard, until every target was picked;
    then fresh sets over every hazard, the targets picked least often first.  :meth:`next`
    returns the next launch's picks.
    """

    def __init__(self, n: int, hazards: Sequence[Hazard], edges: Sequence[tuple[int, int]],
                 seed: int = 0) -> None:
        edges = list(edges)
        reach = reachability(dag_from_edges(n, edges))
        #: bit q of ``down[p]``: q is p or a descendant of p
        self.down = [r | (1 << t) for t, r in enumerate(reach)]
        joined = set(edges)
        self.tiers = [_Tier(h for h in hazards if (h.earlier, h.later) in joined),
                      _Tier(hazards)]
        #: The targets (distinct earlier tasks of the hazards), ascending.
        self.targets = self.tiers[-1].targets
        self.launches = 0  # sets picked so far
        self._rng = random.Random(seed)

    @property
    def tier(self) -> _Tier:
        """The tier the next pick covers."""
        return next((t for t in self.tiers if not t.done), self.tiers[-1])

    @property
    def all_covered(self) -> bool:
        """Whether every target of every tier was picked at least once."""
        return all(t.done for t in self.tiers)

    def next(self) -> list[int]:
        """The next launch's targets, ascending (empty only where there are none)."""
        tier = self.tier
        uncovered = [t for t in tier.targets if t not in tier.covered]
        rest = [t for t in tier.targets if t in tier.covered]
        self._rng.shuffle(uncovered)
        self._rng.shuffle(rest)
        picked = pick(uncovered + rest, tier.partners, self.down)
        for each in self.tiers:
            each.covered.update(t for t in picked if t in each.partners)
        self.launches += 1
        return picked


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
