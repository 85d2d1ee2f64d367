"""Nimble's stream assignment (paper, section 4.2): maximum concurrency, fewest synchronizations.

The algorithm, for a happens-before DAG ``G``:

1. take the transitive reduction ``G'`` (the minimum equivalent graph);
2. build the bipartite graph with a left copy of ``u`` and a right copy of ``v`` for each edge
   ``u -> v`` of ``G'`` and find a maximum matching ``M`` (Hopcroft–Karp);
3. each matched edge ``u -> v`` puts ``v`` right after ``u`` on one chain: the chains are a cover
   of the tasks by vertex-disjoint paths of ``G'``;
4. chains are concatenated into streams where the last task of one reaches the first task of the
   next in ``G``.  The concatenation is itself a maximum matching on the (transitive) "chain A
   can precede chain B" relation, so it uses the fewest streams any concatenation of these chains
   can; every stream stays a chain of ``G``;
5. the synchronizations are the edges of ``G'`` whose ends lie on different streams, less any
   that the stream order and the other synchronizations already imply.

Claim (tested by brute force in ``tests/test_schedule.py``): call an assignment *maximally
concurrent* when every stream is a chain of ``G`` (two tasks share a stream only if ``G`` orders
them), and let its synchronizations be the fewest cross-stream pairs that, with stream order,
enforce exactly ``G``'s happens-before relation.  An edge of ``G'`` has no other path, so it must
be a stream edge or a synchronization; and inside a chain only consecutive tasks can be joined by
an edge of ``G'``, so those edges form a matching.  Hence every maximally concurrent assignment
needs at least ``|E'| - |M|`` synchronizations, and the assignment built here has exactly that
many: step 4 cannot lower it below the bound, and step 5 removes nothing without ``max_streams``.

With ``max_streams`` streams are merged further (see :func:`assign_streams`), trading
concurrency for fewer streams; step 5 then does remove implied synchronizations.
"""
from __future__ import annotations

import heapq
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from .deps import Dag, dag_from_edges, forward_edges, reachability, transitive_reduction
from ..errors import NimbleError


class ScheduleError(NimbleError, ValueError):
    """A schedule that does not enforce its DAG (or is not a schedule at all)."""


@dataclass(slots=True)
class Schedule:
    """Tasks assigned to streams, and the cross-stream edges that must be synchronized."""

    stream_of: list[int]
    streams: list[list[int]]
    sync_edges: list[tuple[int, int]]
    reduced_edges: int
    width: int
    #: Task counts of the phases (forward, backward) launched one after another as separate
    #: graphs; one phase (every task) when empty.
    phases: list[int] = field(default_factory=list)
    #: Edges from the last task of every stream of one phase to the first of every stream of the
    #: next: the order that launching the phases one after another gives, with no event.
    barrier_edges: list[tuple[int, int]] = field(default_factory=list)

    def stream_edges(self) -> list[tuple[int, int]]:
        """Consecutive pairs on each stream: the order a stream imposes by itself."""
        return [(s[i], s[i + 1]) for s in self.streams for i in range(len(s) - 1)]

    def edges(self) -> list[tuple[int, int]]:
        """Every happens-before edge the execution gives: stream edges, synchronizations and
        phase barriers, sorted, without duplicates."""
        return sorted(set(self.stream_edges()) | set(self.sync_edges) | set(self.barrier_edges))


# ---- bipartite matching --------------------------------------------------------------------

def set_bits(x: int) -> list[int]:
    """The positions of the set bits of ``x``, ascending."""
    if x.bit_count() > 64:  # dense: let numpy unpack the bytes instead of peeling bit by bit
        raw = np.frombuffer(x.to_bytes((x.bit_length() + 7) // 8, "little"), dtype=np.uint8)
        return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()
    out = []
    while x:
        low = x & -x
        out.append(low.bit_length() - 1)
        x ^= low
    return out


def bitset(positions: Iterable[int]) -> int:
    """The int whose set bits are ``positions`` (the inverse of :func:`set_bits`)."""
    x = 0
    for p in positions:
        x |= 1 << p
    return x


def _match_bits(n_left: int, n_right: int, adj: Sequence[int]) -> tuple[list[int], list[int]]:
    """Hopcroft–Karp on bitset adjacency: ``(match_of_left, match_of_right)``, -1 if unmatched.

    Both phases work on whole sets of right vertices at once: the BFS ORs a layer's adjacency
    and masks off what it has seen, and the DFS takes a layer's still-untried vertices with one
    AND.  Each right vertex is tried at most once per phase, as Hopcroft–Karp requires.
    """
    match_l = [-1] * n_left
    match_r = [-1] * n_right
    free_r = (1 << n_right) - 1
    for u in range(n_left):  # a greedy start leaves few augmenting phases to do
        c = adj[u] & free_r
        if c:
            low = c & -c
            v = low.bit_length() - 1
            match_l[u], match_r[v] = v, u
            free_r ^= low
    while free_r:
        free_l = [u for u in range(n_left) if match_l[u] < 0 and adj[u]]
        if not free_l:
            break
        # BFS: layers[k] holds the right vertices first seen from left layer k
        layers: list[int] = []
        frontier, seen = free_l, 0
        while frontier:
            nxt = 0
            for u in frontier:
                nxt |= adj[u]
            nxt &= ~seen
            if not nxt:
                break
            seen |= nxt
            hit = nxt & free_r
            if hit:  # the shortest augmenting paths end here, at free vertices only
                layers.append(hit)
                break
            layers.append(nxt)
            frontier = [match_r[v] for v in set_bits(nxt)]
        if not layers or not layers[-1] & free_r:
            break  # no augmenting path: the matching is maximum
        last = len(layers) - 1
        augmented = False
        for u0 in free_l:
            c0 = adj[u0] & layers[0]
            if not c0:
                continue
            us, vs, cands = [u0], [], [c0]  # iterative DFS: paths can be thousands long
            while us:
                k = len(us) - 1
                c = cands[k] & layers[k]
                if not c:
                    us.pop()
                    cands.pop()
                    if vs:
                        vs.pop()
                    continue
                low = c & -c
                v = low.bit_length() - 1
                layers[k] ^= low  # tried once per phase, whether it leads anywhere or not
                cands[k] = c ^ low
                if k == last:
                    vs.append(v)
                    for uu, vv in zip(us, vs):
                        match_l[uu], match_r[vv] = vv, uu
                    free_r ^= low
                    augmented = True
                    break
                w = match_r[v]
                vs.append(v)
                us.append(w)
                cands.append(adj[w] & layers[k + 1])
        if not augmented:
            break
    return match_l, match_r


def hopcroft_karp(n_left: int, n_right: int, adj: list[list[int]]) -> list[int]:
    """A maximum matching of the bipartite graph with ``adj[u]`` the right neighbours of ``u``.

    Returns ``match_of_left``: the right vertex matched to each left vertex, -1 if unmatched.
    """
    if len(adj) != n_left:
        raise ValueError(f"adjacency has {len(adj)} rows for {n_left} left vertices")
    masks = []
    for u, row in enumerate(adj):
        m = 0
        for v in row:
            if not 0 <= v < n_right:
                raise ValueError(f"left vertex {u} names right vertex {v}, out of range")
            m |= 1 << v
        masks.append(m)
    return _match_bits(n_left, n_right, masks)[0]


def max_antichain_width(dag: Dag, reach: list[int] | None = None) -> int:
    """The maximum logical concurrency: the size of the largest set of pairwise unordered tasks.

    By Dilworth's theorem it equals the fewest chains covering the DAG, which is ``n`` minus a
    maximum matching of the bipartite graph of the transitive closure (Fulkerson).
    """
    if reach is None:
        reach = reachability(dag)
    match_l, _ = _match_bits(dag.n, dag.n, reach)
    return dag.n - sum(1 for v in match_l if v >= 0)


# ---- stream assignment ---------------------------------------------------------------------

def _walk(heads: list[int], nxt: list[int]) -> list[list[int]]:
    paths = []
    for h in heads:
        path = [h]
        while nxt[path[-1]] >= 0:
            path.append(nxt[path[-1]])
        paths.append(path)
    return paths


def _path_cover(reduced: Dag) -> tuple[list[list[int]], int]:
    """Steps 2-3: chains along matched edges of ``G'``, and the matching's size."""
    n = reduced.n
    match_l, match_r = _match_bits(n, n, [bitset(vs) for vs in reduced.succs])
    heads = [v for v in range(n) if match_r[v] < 0]
    return _walk(heads, match_l), n - len(heads)


def _concatenate(chains: list[list[int]], reach: list[int]) -> list[list[int]]:
    """Step 4: join chains end to start where the DAG orders them, in as few streams as possible.

    "Chain A may precede chain B" (last(A) reaches first(B)) is transitive, so a fewest-paths
    cover of it is ``#chains`` minus a maximum matching.  Vertices are named by task: a chain's
    last task on the left, its first task on the right.
    """
    n = len(reach)
    firsts = bitset(c[0] for c in chains)
    adj = [0] * n
    for c in chains:
        adj[c[-1]] = reach[c[-1]] & firsts
    match_l, match_r = _match_bits(n, n, adj)
    chain_at = {c[0]: c for c in chains}
    streams = []
    for c in chains:
        if match_r[c[0]] >= 0:
            continue  # some other chain runs into this one
        stream = list(c)
        nxt = match_l[c[-1]]
        while nxt >= 0:
            following = chain_at[nxt]
            stream.extend(following)
            nxt = match_l[following[-1]]
        streams.append(stream)
    return streams


def _false_edges(a: list[int], b: list[int], reach: list[int]) -> int:
    """How many new stream edges interleaving ``a`` and ``b`` by id adds that the DAG lacks.

    Only the ends of each run of ``b`` between two tasks of ``a`` make new edges, so the cost is
    O(|b| log |a|) bigint tests rather than a walk over both streams.
    """
    if len(a) < len(b):
        a, b = b, a
    count = 0
    i, nb = 0, len(b)
    while i < nb:
        pos = bisect_left(a, b[i])
        j = i
        # the run of b's tasks that falls into the same gap of a
        while j + 1 < nb and (pos == len(a) or b[j + 1] < a[pos]):
            j += 1
        if pos > 0 and not (reach[a[pos - 1]] >> b[i]) & 1:
            count += 1
        if pos < len(a) and not (reach[b[j]] >> a[pos]) & 1:
            count += 1
        i = j + 1
    return count


_MERGE_WINDOW = 32  # merge partners considered on either side, in order of first task


def _merge_down(streams: list[list[int]], k: int, reach: list[int]) -> list[list[int]]:
    """Merge streams until ``k`` remain, greedily.

    Each step merges the pair whose interleaving by task id adds the fewest stream edges the DAG
    does not already imply (false dependencies, i.e. concurrency given up); ties go to the pair
    with fewer tasks, then the lower stream ids.  Interleaving by id is a topological order, so a
    merged stream can never close a cycle.  A stream's candidate partners are the
    ``_MERGE_WINDOW`` streams on either side of it in order of first task (every pair while
    there are few streams): thousands of streams would otherwise cost millions of pairs.
    """
    alive = dict(enumerate(streams))
    keys = sorted((s[0], i) for i, s in alive.items())
    next_id = len(streams)
    heap: list[tuple[int, int, int, int]] = []

    def push(i: int, j: int) -> None:
        a, b = alive[i], alive[j]
        heapq.heappush(heap, (_false_edges(a, b, reach), len(a) + len(b), min(i, j), max(i, j)))

    for p, (_, i) in enumerate(keys):
        for _, j in keys[p + 1:p + 1 + _MERGE_WINDOW]:
            push(i, j)
    while len(alive) > k:
        _, _, i, j = heapq.heappop(heap)
        if i not in alive or j not in alive:
            continue  # a pair one of whose streams has been merged away already
        a, b = alive.pop(i), alive.pop(j)
        keys.remove((a[0], i))
        keys.remove((b[0], j))
        merged = sorted(a + b)
        alive[next_id] = merged
        p = bisect_left(keys, (merged[0], next_id))
        keys.insert(p, (merged[0], next_id))
        for _, other in keys[max(0, p - _MERGE_WINDOW):p] + keys[p + 1:p + 1 + _MERGE_WINDOW]:
            push(other, next_id)
        next_id += 1
    return sorted(alive.values(), key=lambda s: s[0])


def _drop_implied(n: int, streams: list[list[int]], syncs: list[tuple[int, int]]
                  ) -> list[tuple[int, int]]:
    """Step 5: the synchronizations that the stream order and the other syncs do not imply.

    The final graph is a DAG, so all its redundant edges can go at once (its transitive
    reduction is unique); keeping every stream edge and only the non-redundant syncs leaves a
    superset of that reduction, hence the same reachability.
    """
    stream_edges = [(s[i], s[i + 1]) for s in streams for i in range(len(s) - 1)]
    final = dag_from_edges(n, stream_edges + syncs)
    needed = transitive_reduction(final)
    return [(u, v) for u, v in syncs if v in needed.succs[u]]


def assign_streams(dag: Dag, max_streams: int | None = None, reduced: Dag | None = None
                   ) -> Schedule:
    """Assign every task of ``dag`` to a stream (Nimble's algorithm; see the module docstring).

    Without ``max_streams`` every stream is a chain of ``dag`` (no concurrency is lost) and the
    synchronizations are as few as any such assignment allows: ``reduced_edges - |matching|``.
    With ``max_streams = k`` streams are then merged down to at most ``k`` by the greedy of
    :func:`_merge_down`; the schedule still enforces every dependency, but tasks that the DAG
    leaves unordered may be serialized.  ``reduced`` may pass in ``dag``'s transitive reduction
    if the caller already has it.
    """
    if max_streams is not None and max_streams < 1:
        raise ValueError(f"max_streams must be at least 1, not {max_streams}")
    n = dag.n
    if reduced is None:
        reduced = transitive_reduction(dag)
    elif reduced.n != n:
        raise ValueError(f"the reduced DAG has {reduced.n} tasks, the DAG {n}")
    reach = reachability(reduced)  # the reduction has fewer edges and the same closure
    chains, _ = _path_cover(reduced)
    streams = _concatenate(chains, reach)
    if max_streams is not None and len(streams) > max_streams:
        streams = _merge_down(streams, max_streams, reach)
    streams.sort(key=lambda s: s[0])
    stream_of = [-1] * n
    for sid, tasks in enumerate(streams):
        for t in tasks:
            stream_of[t] = sid
    syncs = [(u, v) for u in range(n) for v in reduced.succs[u] if stream_of[u] != stream_of[v]]
    syncs = _drop_implied(n, streams, syncs)
    return Schedule(stream_of, streams, syncs, reduced.num_edges,
                    max_antichain_width(dag, reach))


def check_schedule(dag: Dag, schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is a valid schedule of ``dag``.

    Valid: every task is on exactly one stream, each stream lists its tasks by increasing id,
    every synchronization joins two streams from a lower id to a higher one (so the final graph
    is acyclic), and the final graph's transitive closure contains every edge of ``dag``.
    """
    n = dag.n
    if len(schedule.stream_of) != n:
        raise ScheduleError(f"stream_of has {len(schedule.stream_of)} entries for {n} tasks")
    placed = [False] * n
    for sid, tasks in enumerate(schedule.streams):
        for i, t in enumerate(tasks):
            if not 0 <= t < n:
                raise ScheduleError(f"stream {sid} holds task {t}, out of range")
            if placed[t]:
                raise ScheduleError(f"task {t} is on more than one stream (or twice on one)")
            placed[t] = True
            if schedule.stream_of[t] != sid:
                raise ScheduleError(
                    f"task {t} is on stream {sid} but stream_of says {schedule.stream_of[t]}")
            if i and tasks[i - 1] >= t:
                raise ScheduleError(f"stream {sid} runs task {tasks[i - 1]} before task {t}")
    missing = [t for t in range(n) if not placed[t]]
    if missing:
        raise ScheduleError(f"{len(missing)} tasks are on no stream, e.g. task {missing[0]}")
    if schedule.sync_edges != sorted(set(schedule.sync_edges)):
        raise ScheduleError("sync_edges are not sorted and free of duplicates")
    for u, v in forward_edges(n, schedule.sync_edges, ScheduleError, "sync edge"):
        if schedule.stream_of[u] == schedule.stream_of[v]:
            raise ScheduleError(f"sync edge ({u}, {v}) joins a stream to itself")
    try:
        spans = phase_spans(schedule.phases, n)
    except ValueError as e:
        raise ScheduleError(str(e)) from None
    phase_of = [k for k, span in enumerate(spans) for _ in span]
    for u, v in forward_edges(n, schedule.sync_edges, ScheduleError, "sync edge"):
        if phase_of[u] != phase_of[v]:
            raise ScheduleError(f"sync edge ({u}, {v}) crosses from one phase into another; "
                                "phases are separate graphs")
    for u, v in forward_edges(n, schedule.barrier_edges, ScheduleError, "barrier edge"):
        if phase_of[v] <= phase_of[u]:
            raise ScheduleError(f"barrier edge ({u}, {v}) does not join one phase to a later one")
    reach = reachability(dag_from_edges(n, schedule.edges()))
    for u in range(n):
        lost = bitset(dag.succs[u]) & ~reach[u]
        if lost:
            v = lost.bit_length() - 1
            raise ScheduleError(f"the schedule does not order task {u} before task {v}")


# ---- phases ---------------------------------------------------------------------------------

def phase_spans(phases: Sequence[int], n: int) -> list[range]:
    """The task range of each phase; one span of all ``n`` tasks when ``phases`` is empty.

    Raises ``ValueError`` when the counts do not add up to ``n``.
    """
    if not phases:
        return [range(n)]
    if any(c < 0 for c in phases) or sum(phases) != n:
        raise ValueError(f"phases {list(phases)} do not cover the {n} tasks")
    spans, start = [], 0
    for count in phases:
        spans.append(range(start, start + count))
        start += count
    return spans


def induced(dag: Dag, span: range) -> Dag:
    """The sub-DAG on the contiguous tasks ``span``, renumbered from 0 (of an ordered DAG: an
    edge against task order could leave the span below)."""
    if not dag.ordered:
        raise ValueError("only a DAG whose edges go from lower to higher ids has induced spans")
    a, b = span.start, span.stop
    succs = [[v - a for v in dag.succs[u] if v < b] for u in span]
    preds = [[u - a for u in dag.preds[v] if u >= a] for v in span]
    return Dag(b - a, succs, preds)


def assign_phased(dag: Dag, phases: Sequence[int],
                  max_streams: int | None | Sequence[int | None] = None) -> Schedule:
    """Streams for a graph run as consecutive phases (a forward graph, then a backward graph).

    Each phase is scheduled by itself (:func:`assign_streams` on its sub-DAG): the phases are
    separate CUDA graphs, and everything of one is done before the next starts, so an edge from
    one phase into the next needs no synchronization.  The barrier between phases is kept in
    :attr:`Schedule.barrier_edges`, so that memory planning sees the order.  Streams are
    numbered on through the phases.  ``max_streams`` caps every phase, or is a cap per phase.
    """
    spans = phase_spans(phases, dag.n)
    caps = list(max_streams) if isinstance(max_streams, (list, tuple)) else \
        [max_streams] * len(spans)
    if len(caps) != len(spans):
        raise ValueError(f"{len(caps)} stream caps for {len(spans)} phases")
    if len(spans) == 1:
        return assign_streams(dag, caps[0])
    stream_of: list[int] = []
    streams: list[list[int]] = []
    syncs: list[tuple[int, int]] = []
    barriers: list[tuple[int, int]] = []
    reduced_edges = width = 0
    previous: list[list[int]] = []
    for span, cap in zip(spans, caps):
        part = assign_streams(induced(dag, span), cap)
        a = span.start
        stream_of += [len(streams) + s for s in part.stream_of]
        mine = [[a + t for t in tasks] for tasks in part.streams]
        barriers += [(p[-1], m[0]) for p in previous for m in mine]
        streams += mine
        syncs += [(a + u, a + v) for u, v in part.sync_edges]
        reduced_edges += part.reduced_edges
        width = max(width, part.width)
        previous = mine or previous
    return Schedule(stream_of, streams, sorted(syncs), reduced_edges, width,
                    phases=list(phases), barrier_edges=sorted(barriers))
