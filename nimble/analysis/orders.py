"""Serial orders that run every unordered pair of a schedule's tasks the other way round.

The proof's reference is the single-stream recording: every task in recorded (id) order.  A
multi-stream schedule leaves many pairs of tasks unordered; if one of them must be ordered after
all (a dependency the analysis missed, a synchronization lost in the build, scratch no tensor
names), the schedule is right only while the GPU happens to run the pair in recorded order.  A
delay makes the other order likely; a *serial order* makes it certain: a launch of a copy whose
tasks are chained one after another in a linear extension of the schedule's DAG in which the
later task of the pair comes first.  If the pair conflicts, the later task reads what the
earlier one has not written yet (the arena is poisoned before each launch) or the earlier one
overwrites it, and the outputs differ from the recording's.

:func:`reversing_orders` finds, per phase, a few linear extensions that together put the later
task of *every* unordered pair first (with recorded order, which puts it second, every such
pair then runs both ways): a *realizer* of the schedule's partial order, less the recorded order
itself.  Two extensions do it for series-parallel DAGs (an inception block's branches between a
split and a join), and are tried first: Kahn's walk taking the latest-recorded ready task, and
the walk from the sinks placing the earliest-recorded finished task last (each task as late as
its consumers allow: a batch norm's first kernel, which needs only the weights, right before its
reader).  Where pairs are left, each further extension is the best of a few walks that defer
the earlier tasks of the pairs left and bring their later tasks forward (the one that runs
the most of them later-first), up to ``limit`` orders.  Pairs are Python-int bitsets, as in
:mod:`nimble.analysis.deps`.

*Pinned* pairs stay in recorded order: a memset or memcpy and a later task that touches the
bytes it writes, where no path orders them (a schedule that misses that dependency, as the
proof's power tool makes on purpose).  Library kernels wait on semaphores a memset node before
them zeroes (cuDNN's split-K convolutions); a chain that ran such a kernel first would spin
for ever on the poisoned bytes (seen on googlenet fp32 with that synchronization removed),
where the concurrent schedule runs the memset late but runs it.  Those pairs are counted
apart (``pinned``); the delay draws still reorder them.  A kernel that spins on bytes no
recorded access names, or on another kernel's output, would hang a chain the same way; the
captured libraries zero their semaphores with memset nodes, which the recording sees.

numpy-free and GPU-free: the proof's copies are built from it (:mod:`nimble.engine.fuzz`), and
the tests check it on recorded fixtures.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from .deps import dag_from_edges, reachability
from .hazards import Hazard
from ..ir.taskgraph import TaskGraph, TaskKind

#: The most serial orders per phase: the recorded nasnetalarge and pnasnet5large (over a
#: thousand tasks in tangled cells) take 5, and up to 11 under stream caps
#: (tests/test_orders.py); their live schedules on the H200 took 6 to 14, and once more than
#: 16 (docs/findings.md).  Each order is one cloned graph and one serial launch.
MAX_ORDERS = 24


@dataclass
class PhaseOrders:
    """One phase's serial orders (task ids, each a linear extension of the phase's DAG), its
    unordered pairs, and how many of them no order runs later-first."""

    orders: list[list[int]] = field(default_factory=list)
    pairs: int = 0
    left: int = 0
    #: Of ``pairs``, those a pin orders (itself or through other edges): never run
    #: later-first, and not in ``left``.
    pinned: int = 0


def _walk(n: int, succs: Sequence[Sequence[int]], preds: Sequence[Sequence[int]],
          key: Callable[[int], tuple]) -> list[int]:
    """Kahn's walk over ``succs`` taking the ready task of the smallest ``key`` first."""
    waiting = [len(p) for p in preds]
    ready = [(key(t), t) for t in range(n) if not waiting[t]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, u = heapq.heappop(ready)
        order.append(u)
        for v in succs[u]:
            waiting[v] -= 1
            if not waiting[v]:
                heapq.heappush(ready, (key(v), v))
    if len(order) != n:
        raise ValueError(f"the edges form a cycle ({n - len(order)} of {n} tasks never "
                         "become ready)")
    return order


def forward_order(n, succs, preds, key) -> list[int]:
    """A linear extension built from the sources, the ready task of the smallest key first."""
    return _walk(n, succs, preds, key)


def backward_order(n, succs, preds, key) -> list[int]:
    """A linear extension built from the sinks: the finished task (every successor placed) of
    the smallest key goes last of those left."""
    return _walk(n, preds, succs, key)[::-1]


def _before(order: Sequence[int]) -> list[int]:
    """Per task, the bitset of the tasks ``order`` places before it."""
    before = [0] * len(order)
    seen = 0
    for t in order:
        before[t] = seen
        seen |= 1 << t
    return before


def _unordered_later(n: int, reach: Sequence[int], anc: Sequence[int]) -> list[int]:
    """Per task ``a``, the bitset of the tasks after it in id order that no path joins to it."""
    everything = (1 << n) - 1
    return [everything & ~((2 << a) - 1) & ~(reach[a] | anc[a]) for a in range(n)]


def phase_orders(n: int, edges: Sequence[tuple[int, int]], limit: int = MAX_ORDERS,
                 pins: Sequence[tuple[int, int]] = ()) -> PhaseOrders:
    """The serial orders of one phase of ``n`` tasks (ids ``0 .. n-1``) with ``edges`` (either
    direction: late edges go against id order), each of ``pins`` ``(earlier, later)`` kept in
    that order where no path orders it, as the module docstring says."""
    dag = dag_from_edges(n, edges, ordered=False)
    reach = reachability(dag)
    anc = reachability(dag_from_edges(n, [(v, u) for u, v in edges], ordered=False))
    unordered = _unordered_later(n, reach, anc)
    result = PhaseOrders(pairs=sum(bin(u).count("1") for u in unordered))
    # Only pins that go forward in one linear extension, so that they close no cycle (every
    # one of them where no late edge goes against id order).
    at = {t: k for k, t in enumerate(forward_order(n, dag.succs, dag.preds, lambda t: t))}
    kept = sorted({(a, b) for a, b in pins if unordered[a] >> b & 1 and at[a] < at[b]})
    if kept:  # the pairs a pin orders, itself or through the other edges, count as pinned
        edges = list(edges) + kept
        dag = dag_from_edges(n, edges, ordered=False)
        reach = reachability(dag)
        anc = reachability(dag_from_edges(n, [(v, u) for u, v in edges], ordered=False))
        unordered = _unordered_later(n, reach, anc)
        result.pinned = result.pairs - sum(bin(u).count("1") for u in unordered)
    succs, preds = dag.succs, dag.preds
    covered = [0] * n
    left = list(unordered)
    candidates = [lambda: forward_order(n, succs, preds, lambda t: -t),
                  lambda: backward_order(n, succs, preds, lambda t: t)]
    while len(result.orders) < limit and any(left):
        if candidates:
            order = candidates.pop(0)()
        else:
            order = _order_for(n, succs, preds, left, reach, anc)
        result.orders.append(order)
        for t, b in enumerate(_before(order)):
            covered[t] |= b
        left = [u & ~c for u, c in zip(unordered, covered)]
    result.left = sum(bin(u).count("1") for u in left)
    return result


def _order_for(n, succs, preds, left: Sequence[int], reach: Sequence[int],
               anc: Sequence[int]) -> list[int]:
    """An extension aimed at the pairs ``left`` (bitset per earlier task): of a few walks that
    put their earlier tasks late and their later tasks early, the one that runs the most of
    them later-first."""
    deferred = [bin(u).count("1") for u in left]
    wanted = [0] * n
    for u in left:
        while u:
            low = u & -u
            wanted[low.bit_length() - 1] += 1
            u ^= low
    below = 0  # the earlier tasks left and everything after them
    early = 0  # the later tasks left and everything before them
    for a in range(n):
        if left[a]:
            below |= reach[a] | (1 << a)
            u = left[a]
            while u:
                low = u & -u
                early |= anc[low.bit_length() - 1] | low
                u ^= low
    together = _compatible(left, anc)
    walks = [
        forward_order(n, succs, preds, lambda t: (deferred[t] > 0, -wanted[t], -t)),
        backward_order(n, succs, preds, lambda t: (-deferred[t], wanted[t], t)),
        forward_order(n, succs, preds, lambda t: (deferred[t] - wanted[t], -t)),
        backward_order(n, succs, preds, lambda t: (wanted[t] - deferred[t], t)),
        forward_order(n, succs, preds, lambda t: (below >> t & 1, -wanted[t], -t)),
        backward_order(n, succs, preds, lambda t: (-(below >> t & 1), wanted[t], t)),
        forward_order(n, succs, preds, lambda t: (not early >> t & 1, deferred[t] > 0, -t)),
        # pairs that one walk surely reverses: their later tasks and all they need first
        forward_order(n, succs, preds, lambda t: (not together >> t & 1, -t))]

    def reversed_pairs(order: list[int]) -> int:
        return sum(bin(u & b).count("1") for u, b in zip(left, _before(order)))
    return max(walks, key=reversed_pairs)


def _compatible(left: Sequence[int], anc: Sequence[int], most: int = 4096) -> int:
    """A set of tasks closed under ancestors that holds the later task of pairs left and none
    of their earlier ones, grown greedily over (up to ``most``) pairs from the first: a walk
    that takes its tasks before any other runs every such pair later-first, so each further
    order reverses at least one pair."""
    together = 0
    earlier = 0  # the earlier tasks of the pairs taken
    seen = 0
    for a, u in enumerate(left):
        while u and seen < most:
            low = u & -u
            u ^= low
            seen += 1
            grown = together | anc[low.bit_length() - 1] | low
            if not (grown >> a & 1) and not grown & earlier:
                together, earlier = grown, earlier | (1 << a)
    return together


def reversing_orders(edges: Sequence[tuple[int, int]], spans: Sequence[range],
                     limit: int = MAX_ORDERS, pins: Sequence[tuple[int, int]] = ()
                     ) -> list[PhaseOrders]:
    """Per phase (``spans``: each phase's task ids; tasks of different phases are ordered by
    their launches), :func:`phase_orders` of the edges and pins inside it, in task ids."""
    out = []
    for span in spans:
        inside = [(u - span.start, v - span.start) for u, v in edges
                  if u in span and v in span]
        found = phase_orders(len(span), inside, limit,
                             [(a - span.start, b - span.start) for a, b in pins
                              if a in span and b in span])
        found.orders = [[span.start + t for t in order] for order in found.orders]
        out.append(found)
    return out


def pinned_pairs(graph: TaskGraph, hazards: Iterable[Hazard]) -> list[tuple[int, int]]:
    """The pairs the serial orders keep in recorded order (see the module docstring): of the
    cross-stream ``hazards``, a memset or memcpy writing bytes a later task touches."""
    return [(h.earlier, h.later) for h in hazards if h.kind.startswith("write")
            and graph.tasks[h.earlier].kind != TaskKind.KERNEL]


def chain(order: Sequence[int]) -> list[tuple[int, int]]:
    """The edges that run ``order`` one task after another."""
    return list(zip(order, order[1:]))
