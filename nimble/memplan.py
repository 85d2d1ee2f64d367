"""Static memory planning: every relocatable buffer gets a fixed offset in one arena.

The rebuilt graph runs tasks concurrently on several streams, so two buffers may share bytes only
if *every* access of one happens-before *every* access of the other in the transitive closure of
the executed graph's edges.  Recorded order is not enough: tasks on parallel branches are
unordered even when their recorded lifetimes are disjoint.

The host takes part at both ends.  An INPUT buffer is written by the host before the graph starts
(a virtual *source* task that precedes every task), an OUTPUT buffer is read by the host after it
ends (a virtual *sink* task that follows every task).  So nothing may precede an input and nothing
may follow an output.  Inputs and outputs never share bytes at all: the engine copies the next
call's inputs into the arena while the caller may still hold, or even pass in, the previous
call's outputs, and a copy between overlapping ranges is undefined.

Task sets are handled as reachability bitsets over ``n + 2`` positions: tasks ``0..n-1``, the
sink at ``n`` and the source at ``n + 1``.  ``plan_memory`` and ``check_plan`` compute
reachability separately (numpy rows and Python ints) so that the checker does not inherit the
planner's mistakes.

``check_plan`` also checks the edges themselves, on every buffer whatever its kind (parameters and
external memory included, which the plan does not move): two accesses of overlapping bytes, at
least one a write, must come from tasks a path of edges orders.
"""
from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, NoReturn

import numpy as np

from .deps import forward_edges
from .taskgraph import BufferKind, TaskGraph


class MemPlanError(ValueError):
    """A memory plan that is malformed or lets two live byte ranges collide."""


@dataclass(slots=True)
class MemPlan:
    """Arena offsets for the relocatable buffers of one TaskGraph.

    ``buffer_bytes`` is what the arena would take with no reuse at all; ``lower_bound_bytes`` is
    the peak of live bytes in recorded order (see :func:`lower_bound_bytes`), which no plan that
    shares whole buffers only can beat.
    """

    offsets: dict[int, int]
    arena_bytes: int
    buffer_bytes: int
    lower_bound_bytes: int
    alignment: int

    def address_of(self, buffer_id: int, arena_base: int) -> int:
        """The device address of ``buffer_id`` in an arena allocated at ``arena_base``."""
        try:
            return arena_base + self.offsets[buffer_id]
        except KeyError:
            raise KeyError(f"buffer {buffer_id} has no arena offset: only relocatable buffers "
                           f"(input, output, intermediate, scratch) are planned") from None


def _round_up(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


def _planned(graph: TaskGraph) -> list[int]:
    return [b.id for b in graph.buffers if b.kind in BufferKind.RELOCATABLE]


def _edge_list(n: int, edges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    # Reachability is built in one backward pass over the ids, which needs every edge forward.
    return forward_edges(n, edges, MemPlanError)


def _task_sets(graph: TaskGraph) -> dict[int, set[int]]:
    """Positions (tasks, sink ``n``, source ``n + 1``) that access each relocatable buffer.

    Zero-byte accesses count too: the planner errs on the side of keeping buffers apart.
    """
    n = len(graph.tasks)
    sets: dict[int, set[int]] = {bid: set() for bid in _planned(graph)}
    for t in graph.tasks:
        for a in t.accesses:
            if a.buffer in sets:
                sets[a.buffer].add(t.id)
    for b in graph.buffers:
        if b.id in sets:
            if b.kind == BufferKind.INPUT:
                sets[b.id].add(n + 1)
            elif b.kind == BufferKind.OUTPUT:
                sets[b.id].add(n)
    return sets


def lower_bound_bytes(graph: TaskGraph, alignment: int = 512) -> int:
    """Peak over recorded time of the aligned sizes of live relocatable buffers.

    A buffer is live from its first accessing task to its last; inputs from before the first task,
    outputs until after the last.  Two buffers live at the same point can never share bytes (their
    accesses interleave in recorded order, and any happens-before order is a sub-order of it), so
    every plan that shares whole buffers only (as :func:`plan_memory` does) needs at least this
    much, whatever the edges: it is what a single-stream allocator could reach.  Zero-byte
    accesses touch nothing and do not count.
    """
    n = len(graph.tasks)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for t in graph.tasks:
        for a in t.accesses:
            if a.size > 0:
                first.setdefault(a.buffer, t.id)
                last[a.buffer] = t.id
    # Time points -1 (host writes inputs) .. n (host reads outputs), shifted by one.
    delta = np.zeros(n + 3, dtype=np.int64)
    for b in graph.buffers:
        if b.kind not in BufferKind.RELOCATABLE:
            continue
        lo, hi = first.get(b.id), last.get(b.id)
        if b.kind == BufferKind.INPUT:
            lo, hi = -1, (-1 if hi is None else hi)
        if b.kind == BufferKind.OUTPUT:
            lo, hi = (n if lo is None else lo), n
        if lo is None:
            continue  # never touched: occupies nothing at any point
        size = _round_up(b.size, alignment)
        delta[lo + 1] += size
        delta[hi + 2] -= size
    return int(np.cumsum(delta).max(initial=0))


# ---- planning -------------------------------------------------------------------------------

def _strict_reach_rows(n: int, edges: list[tuple[int, int]]) -> np.ndarray:
    """Packed rows (``bitorder='little'``): row ``p`` holds the positions strictly after ``p``."""
    width = n + 2
    nbytes = (width + 7) // 8
    succs: list[list[int]] = [[] for _ in range(n)]
    for u, v in edges:
        succs[u].append(v)
    strict = np.zeros((width, nbytes), dtype=np.uint8)
    closed = np.zeros((width, nbytes), dtype=np.uint8)  # strict plus the position itself
    sink_byte, sink_bit = n >> 3, np.uint8(1 << (n & 7))
    for t in range(n - 1, -1, -1):
        if succs[t]:
            strict[t] = np.bitwise_or.reduce(closed[succs[t]], axis=0)
        strict[t, sink_byte] |= sink_bit
        closed[t] = strict[t]
        closed[t, t >> 3] |= np.uint8(1 << (t & 7))
    # The sink row stays empty; the source precedes every task and the sink.
    strict[n + 1] = np.packbits(np.arange(width) < n + 1, bitorder="little")
    return strict


def _conflicts(graph: TaskGraph, ids: list[int], edges: list[tuple[int, int]]) -> np.ndarray:
    """``C[i, j]``: planned buffers ``ids[i]`` and ``ids[j]`` must not overlap."""
    n = len(graph.tasks)
    width = n + 2
    strict = _strict_reach_rows(n, edges)
    sets = _task_sets(graph)
    index = [np.fromiter(sorted(sets[b]), dtype=np.int64, count=len(sets[b])) for b in ids]
    # after[i]: positions strictly after every access of buffer i (everything if it has none).
    after_packed = np.full((len(ids), strict.shape[1]), 0xFF, dtype=np.uint8)
    for i, rows in enumerate(index):
        if len(rows):
            after_packed[i] = np.bitwise_and.reduce(strict[rows], axis=0)
    after_t = np.ascontiguousarray(
        np.unpackbits(after_packed, axis=1, bitorder="little")[:, :width].T.astype(bool))
    # precedes_t[j, i]: buffer i precedes buffer j, i.e. every access of j is after all of i's.
    precedes_t = np.ones((len(ids), len(ids)), dtype=bool)
    for j, rows in enumerate(index):
        if len(rows):
            precedes_t[j] = np.logical_and.reduce(after_t[rows], axis=0)
    conflict = ~(precedes_t | precedes_t.T)
    np.fill_diagonal(conflict, False)
    kinds = np.array([graph.buffers[b].kind for b in ids], dtype=object)
    is_in, is_out = kinds == BufferKind.INPUT, kinds == BufferKind.OUTPUT
    conflict[np.ix_(is_in, is_out)] = True
    conflict[np.ix_(is_out, is_in)] = True
    return conflict


def _place(order: np.ndarray, sizes: np.ndarray, conflict: np.ndarray) -> np.ndarray:
    """Lowest-fit placement in ``order``: each buffer at the lowest offset free of its conflicts."""
    offsets = np.zeros(len(sizes), dtype=np.int64)
    placed = np.zeros(len(sizes), dtype=bool)
    for i in order:
        if sizes[i] == 0:
            continue  # occupies no bytes; left out of placed so it never splits a free gap
        others = np.flatnonzero(conflict[i] & placed)
        if len(others):
            starts = offsets[others]
            by_start = np.argsort(starts, kind="stable")
            starts = starts[by_start]
            ends = np.maximum.accumulate(starts + sizes[others][by_start])
            # Gap k runs from the furthest end among the first k intervals to start k; sizes and
            # offsets are aligned, so every gap start is an aligned offset.
            gap_starts = np.concatenate(([0], ends[:-1]))
            fits = np.flatnonzero(starts - gap_starts >= sizes[i])
            offsets[i] = gap_starts[fits[0]] if len(fits) else ends[-1]
        placed[i] = True
    return offsets


def plan_memory(graph: TaskGraph, edges: Iterable[tuple[int, int]],
                alignment: int = 512) -> MemPlan:
    """Give every relocatable buffer an aligned arena offset, reusing bytes where ``edges`` allow.

    ``edges`` are the executed graph's happens-before edges (low task id to high).  Two greedy
    placements are tried (largest buffer first; first-accessed first) and the smaller arena kept.
    """
    if alignment <= 0:
        raise MemPlanError(f"alignment must be positive, not {alignment}")
    n = len(graph.tasks)
    edge_list = _edge_list(n, edges)
    ids = _planned(graph)
    sizes = np.array([_round_up(graph.buffers[b].size, alignment) for b in ids], dtype=np.int64)
    bound = lower_bound_bytes(graph, alignment)
    if not ids:
        return MemPlan({}, 0, 0, bound, alignment)
    conflict = _conflicts(graph, ids, edge_list)
    first_access = np.full(len(ids), n + 1, dtype=np.int64)
    pos = {b: i for i, b in enumerate(ids)}
    for t in reversed(graph.tasks):
        for a in t.accesses:
            if a.buffer in pos:
                first_access[pos[a.buffer]] = t.id
    for i, b in enumerate(ids):
        if graph.buffers[b].kind == BufferKind.INPUT:
            first_access[i] = -1
    best_offsets, best_arena = None, None
    for order in (np.lexsort((first_access, -sizes)), np.lexsort((-sizes, first_access))):
        offsets = _place(order, sizes, conflict)
        arena = int((offsets + sizes).max())
        if best_arena is None or arena < best_arena:
            best_offsets, best_arena = offsets, arena
    return MemPlan({b: int(o) for b, o in zip(ids, best_offsets)}, best_arena,
                   int(sizes.sum()), bound, alignment)


# ---- checking -------------------------------------------------------------------------------

def _strict_reach_ints(n: int, edges: list[tuple[int, int]]) -> list[int]:
    """Python-int bitsets: bit ``q`` of entry ``p`` is set when position ``q`` is after ``p``."""
    succs: list[list[int]] = [[] for _ in range(n)]
    for u, v in edges:
        succs[u].append(v)
    sink = 1 << n
    reach = [0] * (n + 2)
    for t in range(n - 1, -1, -1):
        r = sink
        for s in succs[t]:
            r |= reach[s] | (1 << s)
        reach[t] = r
    reach[n + 1] = (1 << (n + 1)) - 1
    return reach


def _who(p: int, n: int) -> str:
    if p == n:
        return "the host (reading outputs after the graph)"
    if p == n + 1:
        return "the host (writing inputs before the graph)"
    return f"task {p}"


def _check_layout(graph: TaskGraph, plan: MemPlan) -> None:
    if plan.alignment <= 0:
        raise MemPlanError(f"alignment must be positive, not {plan.alignment}")
    wanted = set(_planned(graph))
    missing, extra = wanted - plan.offsets.keys(), plan.offsets.keys() - wanted
    if missing:
        raise MemPlanError(f"relocatable buffers {sorted(missing)[:10]} have no arena offset")
    if extra:
        raise MemPlanError(f"buffers {sorted(extra)[:10]} have an offset but are not relocatable")
    for b, off in plan.offsets.items():
        size = graph.buffers[b].size
        if off < 0 or off % plan.alignment or off + size > plan.arena_bytes:
            raise MemPlanError(f"buffer {b} at offset {off} ({size} bytes) is misaligned or "
                               f"outside the {plan.arena_bytes}-byte arena")


def _collect_accesses(graph: TaskGraph, offsets: dict[int, int]
                      ) -> tuple[dict[int, list[tuple[int, int, int, bool]]],
                                 list[tuple[int, int, int, int, bool]]]:
    """Every access that touches a byte, in one pass over the tasks.

    Returns ``(by_buffer, arena)``: ``by_buffer[b]`` lists ``(lo, hi, task, write)`` in bytes of
    buffer ``b`` itself, for every buffer of any kind, in task order; ``arena`` lists
    ``(lo, hi, task, buffer, write)`` in arena bytes for the planned buffers (those in
    ``offsets``).
    """
    by_buffer: defaultdict[int, list[tuple[int, int, int, bool]]] = defaultdict(list)
    for t in graph.tasks:
        tid = t.id
        for a in t.accesses:
            if a.size > 0:
                by_buffer[a.buffer].append((a.offset, a.offset + a.size, tid, a.write))
    arena = [(base + lo, base + hi, task, buf, write) for buf, accs in by_buffer.items()
             if (base := offsets.get(buf)) is not None for lo, hi, task, write in accs]
    return by_buffer, arena


def _check_races(graph: TaskGraph, offsets: dict[int, int],
                 by_buffer: dict[int, list[tuple[int, int, int, bool]]], reach: list[int]) -> None:
    """Overlapping accesses to one buffer, at least one a write, must come from ordered tasks.

    Every buffer is checked, whatever its kind: planned ones and the ones that stay where the
    model has them (parameters, external memory, and any kind a recorder adds).  This is a
    property of the edges more than of the plan: a missing dependency shows up here.  Buffers
    that are only ever read, or only by one task, cannot race and are skipped.
    """
    for buf, accs in by_buffer.items():
        if accs[0][2] != accs[-1][2] and any(acc[3] for acc in accs):
            _check_buffer_races(graph, offsets, buf, sorted(accs), reach)


def _check_buffer_races(graph: TaskGraph, offsets: dict[int, int], buf: int,
                        accs: list[tuple[int, int, int, bool]], reach: list[int]) -> None:
    """One buffer's ``(lo, hi, task, write)`` accesses, sorted, swept by start byte.

    The *active* accesses (those still covering the sweep's byte) all overlap one another, and
    every conflicting pair among them has been checked when the later one arrived.  So the
    active writes form a chain in happens-before order, which is task-id order, and every active
    read is ordered against every active write.  A new access of task ``t`` then needs only:
    the nearest active writes below and above ``t`` (transitivity covers the rest of the chain)
    and, if it writes, the active reads of tasks strictly between those two writes (a read
    below the lower one precedes it, which precedes ``t``; symmetrically above).  Each check that
    fails names a real pair of overlapping accesses; when none fails every pair is ordered.  The
    cost stays near-linear where many tasks write one buffer (one check per access) instead of
    growing with the number of overlapping pairs.
    """
    expiry: list[tuple[int, int, bool]] = []  # heap of (hi, task, write) of the active accesses
    writes: list[tuple[int, int]] = []  # active writes as (task, hi), sorted
    reads: list[tuple[int, int]] = []  # active reads as (task, hi), sorted
    # ids are topological, so of two tasks only the lower one can reach the other
    for lo, hi, task, write in accs:
        while expiry and expiry[0][0] <= lo:  # half-open: an access ending at lo is gone
            h, t, w = heapq.heappop(expiry)
            active = writes if w else reads
            del active[bisect.bisect_left(active, (t, h))]
        if writes:
            i = bisect.bisect_left(writes, (task,))
            j = bisect.bisect_left(writes, (task + 1,), i)  # writes[i:j]: this task's own
            below = writes[i - 1][0] if i else -1
            above = writes[j][0] if j < len(writes) else -1
            if below >= 0 and not reach[below] >> task & 1:
                _race(graph, offsets, buf, (below, True), (task, write), lo,
                      min(hi, writes[i - 1][1]))
            if above >= 0 and not reach[task] >> above & 1:
                _race(graph, offsets, buf, (task, write), (above, True), lo,
                      min(hi, writes[j][1]))
        else:
            below = above = -1
        if write:
            if reads:
                r_lo = bisect.bisect_left(reads, (below + 1,)) if below >= 0 else 0
                r_hi = bisect.bisect_left(reads, (above,)) if above >= 0 else len(reads)
                for other, ohi in reads[r_lo:r_hi]:
                    if other < task:
                        if not reach[other] >> task & 1:
                            _race(graph, offsets, buf, (other, False), (task, True), lo,
                                  min(hi, ohi))
                    elif other > task and not reach[task] >> other & 1:
                        _race(graph, offsets, buf, (task, True), (other, False), lo,
                              min(hi, ohi))
            bisect.insort(writes, (task, hi))
        else:
            bisect.insort(reads, (task, hi))
        heapq.heappush(expiry, (hi, task, write))


def _race(graph: TaskGraph, offsets: dict[int, int], buf: int, first: tuple[int, bool],
          second: tuple[int, bool], lo: int, hi: int) -> NoReturn:
    """Raise for accesses of tasks ``first`` and ``second`` (``(task, write)``, lower id first)
    that share bytes ``[lo, hi)`` of buffer ``buf`` with no path between them."""
    info = graph.buffers[buf]
    what = info.kind + (f" {info.name!r}" if info.name else "")
    where = f"bytes [{lo}, {hi})"
    if buf in offsets:
        where += f" (arena bytes [{offsets[buf] + lo}, {offsets[buf] + hi}))"
    (a, wa), (b, wb) = first, second
    verb = {True: "writes", False: "reads"}
    raise MemPlanError(
        f"tasks {a} and {b} both access buffer {buf} ({what}) at {where}: task {a} {verb[wa]}, "
        f"task {b} {verb[wb]}, and neither happens-before the other")


def _merged_ranges(items: list[tuple[int, int, int, int, bool]]) -> list[tuple[int, int, int]]:
    """``(lo, hi, buffer)``: the union of each buffer's accessed arena bytes, as disjoint runs."""
    by_buffer: dict[int, list[tuple[int, int]]] = {}
    for lo, hi, _, buf, _ in items:
        by_buffer.setdefault(buf, []).append((lo, hi))
    runs = []
    for buf, spans in by_buffer.items():
        spans.sort()
        cur_lo, cur_hi = spans[0]
        for lo, hi in spans[1:]:
            if lo > cur_hi:
                runs.append((cur_lo, cur_hi, buf))
                cur_lo = lo
            cur_hi = max(cur_hi, hi)
        runs.append((cur_lo, cur_hi, buf))
    return runs


def _check_lifetimes(graph: TaskGraph, items: list[tuple[int, int, int, int, bool]],
                     reach: list[int]) -> None:
    """Buffers touching common arena bytes must have disjoint lifetimes.

    For buffers ``p`` and ``q`` whose accessed bytes overlap, every access of one must
    happen-before every access of the other; otherwise a task of one can land between two tasks
    of the other (a clobber even when every pair of tasks is ordered, as in a serial chain) or run
    beside it.  The buffers covering any one byte must therefore form a chain in that order.  The
    order is transitive and implies recorded order, so a sweep keeps the buffers covering the
    current byte sorted by first task and checks a new buffer against its two neighbours only.
    """
    n = len(graph.tasks)
    tasks: dict[int, int] = {}
    after: dict[int, int] = {}
    first: dict[int, int] = {}
    for _, _, task, buf, _ in items:
        tasks[buf] = tasks.get(buf, 0) | (1 << task)
        after[buf] = after.get(buf, -1) & reach[task]
        first[buf] = min(first.get(buf, n + 1), -1 if task == n + 1 else task)
    kind = {b: graph.buffers[b].kind for b in tasks}

    def order(p: int, q: int, lo: int, hi: int) -> None:
        if tasks[q] & ~after[p] == 0:
            return
        late = next(t for t in range(n + 2) if tasks[q] >> t & 1 and not after[p] >> t & 1)
        early = next(t for t in range(n + 2) if tasks[p] >> t & 1 and not reach[t] >> late & 1)
        raise MemPlanError(
            f"buffers {p} and {q} share arena bytes [{lo}, {hi}) but {_who(early, n)} (on "
            f"buffer {p}) does not happen-before {_who(late, n)} (on buffer {q}): their "
            f"lifetimes overlap")

    events = []
    for lo, hi, buf in _merged_ranges(items):
        events.append((lo, 1, buf, hi))
        events.append((hi, 0, buf, lo))  # removals sort first: ranges are half-open
    events.sort()
    active: list[tuple[int, int]] = []
    span: dict[int, tuple[int, int]] = {}
    host_io: dict[int, str] = {}
    for pos, insert, buf, other in events:
        key = (first[buf], buf)
        if not insert:
            active.pop(bisect.bisect_left(active, key))
            del span[buf]
            host_io.pop(buf, None)
            continue
        lo, hi = pos, other
        if kind[buf] in (BufferKind.INPUT, BufferKind.OUTPUT):
            clash = next((b for b, k in host_io.items() if k != kind[buf]), None)
            if clash is not None:
                c_lo, c_hi = span[clash]
                raise MemPlanError(
                    f"input/output buffers {clash} and {buf} share arena bytes "
                    f"[{max(lo, c_lo)}, {min(hi, c_hi)}): the host copies inputs in while "
                    f"the previous outputs may still be in use")
            host_io[buf] = kind[buf]
        at = bisect.bisect_left(active, key)
        if at > 0:
            prev = active[at - 1][1]
            order(prev, buf, max(lo, span[prev][0]), min(hi, span[prev][1]))
        if at < len(active):
            nxt = active[at][1]
            order(buf, nxt, max(lo, span[nxt][0]), min(hi, span[nxt][1]))
        active.insert(at, key)
        span[buf] = (lo, hi)


def check_plan(graph: TaskGraph, edges: Iterable[tuple[int, int]], plan: MemPlan) -> None:
    """Raise :class:`MemPlanError` unless ``plan`` is safe for the graph run with ``edges``.

    Checked independently of how :func:`plan_memory` reasons, on the tasks' actual byte ranges in
    the arena (``offsets[b] + access.offset`` for ``access.size`` bytes):

    * the layout: every relocatable buffer (and nothing else) has an aligned offset inside the
      arena;
    * races: two accesses to the same bytes of one buffer, at least one a write, come from tasks
      ordered by ``edges`` (a missing edge, not a bad offset, makes this fail).  This holds for
      every buffer, whatever its kind: parameters and external memory, which keep their
      recorded addresses, race just as planned buffers do;
    * lifetimes: when accesses of two different buffers touch common arena bytes, every access of
      one happens-before every access of the other.  This covers unordered tasks on parallel
      branches and also ordered clobbers (buffer B written between two accesses of A).  The host
      counts as an access: it writes an input's whole range before the first task, so only
      buffers whose tasks all follow the input's tasks may reuse its bytes, and it reads an
      output's whole range after the last task, so only buffers whose tasks all precede the
      output's may share them.  Inputs and outputs never share bytes.
    """
    n = len(graph.tasks)
    edge_list = _edge_list(n, edges)
    _check_layout(graph, plan)
    reach = _strict_reach_ints(n, edge_list)
    relocatable = plan.offsets
    # items: (lo, hi, position, buffer, write) in arena bytes, the planned buffers only
    by_buffer, items = _collect_accesses(graph, relocatable)
    _check_races(graph, relocatable, by_buffer, reach)
    for b in graph.buffers:
        if b.id in relocatable and b.size > 0 and b.kind in (BufferKind.INPUT, BufferKind.OUTPUT):
            host = n + 1 if b.kind == BufferKind.INPUT else n
            base = relocatable[b.id]
            items.append((base, base + b.size, host, b.id, b.kind == BufferKind.INPUT))
    _check_lifetimes(graph, items, reach)
