"""The memory plan checker: :func:`check_plan` proves a plan safe for a graph and its edges.

This module owns the independent check of a :class:`~nimble.analysis.memplan.MemPlan` (it shares no
reasoning with :func:`~nimble.analysis.memplan.plan_memory`: reachability as Python-int bitsets instead of
numpy rows): the layout of the arena, races between accesses of one buffer that no path of edges
orders (on every buffer, whatever its kind), and buffers sharing arena bytes whose lifetimes
overlap, the host's input and output copies included.  A failure raises
:class:`~nimble.analysis.memplan.MemPlanError` naming the tasks, buffers and bytes.
"""
from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from typing import Iterable, Iterator, NamedTuple, NoReturn

from .deps import Dag, reachability
from .memplan import MemPlan, MemPlanError, _edge_dag, _planned
from ..ir.taskgraph import BufferKind, TaskGraph


def _strict_reach_ints(dag: Dag) -> list[int]:
    """Python-int bitsets: bit ``q`` of entry ``p`` is set when position ``q`` is after ``p``.

    The sink (``n``) follows every task and precedes nothing; the source (``n + 1``) precedes
    every task and the sink.
    """
    n = dag.n
    sink = 1 << n
    return [r | sink for r in reachability(dag)] + [0, (1 << (n + 1)) - 1]


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


def collect_accesses(graph: TaskGraph, offsets: dict[int, int]
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
            for pair in conflict_pairs(sorted(accs)):
                if not reach[pair.first] >> pair.second & 1:
                    _race(graph, offsets, buf, pair)


class ConflictPair(NamedTuple):
    """Two accesses of different tasks to common bytes ``[lo, hi)``, at least one a write;
    ``first`` is the lower task id."""

    first: int
    first_writes: bool
    second: int
    second_writes: bool
    lo: int
    hi: int


def conflict_pairs(accs: list[tuple[int, int, int, bool]]) -> Iterator[ConflictPair]:
    """The pairs of conflicting accesses that order every conflicting access, when ordered.

    ``accs`` are ``(lo, hi, task, write)`` in one byte space (one buffer's bytes, or the
    arena's), sorted, swept by start byte.  If every pair yielded is ordered (a path of edges
    from ``first`` to ``second``), every two overlapping accesses of different tasks with at
    least one write are; so a missing order shows in at least one pair yielded.

    The *active* accesses (those still covering the sweep's byte) all overlap one another, and
    every conflicting pair among them was yielded when the later one arrived.  So, when those
    are ordered, the active writes form a chain in happens-before order, which is task-id order,
    and every active read is ordered against every active write.  A new access of task ``t``
    then needs only: the nearest active writes below and above ``t`` (transitivity covers the
    rest of the chain) and, if it writes, the active reads of tasks strictly between those two
    writes (a read below the lower one precedes it, which precedes ``t``; symmetrically above).
    The count stays near-linear where many tasks write one buffer (one pair per access) instead
    of growing with the number of overlapping pairs.
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
            if below >= 0:
                yield ConflictPair(below, True, task, write, lo, min(hi, writes[i - 1][1]))
            if above >= 0:
                yield ConflictPair(task, write, above, True, lo, min(hi, writes[j][1]))
        else:
            below = above = -1
        if write:
            if reads:
                r_lo = bisect.bisect_left(reads, (below + 1,)) if below >= 0 else 0
                r_hi = bisect.bisect_left(reads, (above,)) if above >= 0 else len(reads)
                for other, ohi in reads[r_lo:r_hi]:
                    if other < task:
                        yield ConflictPair(other, False, task, True, lo, min(hi, ohi))
                    elif other > task:
                        yield ConflictPair(task, True, other, False, lo, min(hi, ohi))
            bisect.insort(writes, (task, hi))
        else:
            bisect.insort(reads, (task, hi))
        heapq.heappush(expiry, (hi, task, write))


def _race(graph: TaskGraph, offsets: dict[int, int], buf: int, pair: ConflictPair) -> NoReturn:
    """Raise for the accesses of ``pair`` to buffer ``buf`` with no path between them."""
    a, wa, b, wb, lo, hi = pair
    info = graph.buffers[buf]
    what = info.kind + (f" {info.name!r}" if info.name else "")
    where = f"bytes [{lo}, {hi})"
    if buf in offsets:
        where += f" (arena bytes [{offsets[buf] + lo}, {offsets[buf] + hi}))"
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

    Checked independently of how :func:`~nimble.analysis.memplan.plan_memory` reasons, on the tasks'
    actual byte ranges in the arena (``offsets[b] + access.offset`` for ``access.size`` bytes):

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
    dag = _edge_dag(n, edges)
    _check_layout(graph, plan)
    reach = _strict_reach_ints(dag)
    relocatable = plan.offsets
    # items: (lo, hi, position, buffer, write) in arena bytes, the planned buffers only
    by_buffer, items = collect_accesses(graph, relocatable)
    _check_races(graph, relocatable, by_buffer, reach)
    for b in graph.buffers:
        if b.id in relocatable and b.size > 0 and b.kind in (BufferKind.INPUT, BufferKind.OUTPUT):
            host = n + 1 if b.kind == BufferKind.INPUT else n
            base = relocatable[b.id]
            items.append((base, base + b.size, host, b.id, b.kind == BufferKind.INPUT))
    _check_lifetimes(graph, items, reach)
