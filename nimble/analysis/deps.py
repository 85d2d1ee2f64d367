"""The happens-before DAG of a TaskGraph, and the graph algorithms the scheduler needs.

A TaskGraph's tasks are in recorded (single-stream) order, so every dependency goes from a lower
task id to a higher one and id order is a topological order.  The reduction, reachability and
ancestors rely on that: none of them sorts, and all of them reject an edge ``u -> v`` with
``u >= v``.  Only the longest paths (:func:`path_lengths`, :func:`critical_path`) also take a
DAG built with ``ordered=False``, whose edges may go against task order (a backfill's late
edges do): they walk it in :func:`topological_order`, which raises on a cycle.

Reachability is kept as Python ints used as bitsets (bit ``v`` of ``r[u]`` set when ``v`` is
reachable from ``u``): an OR of two ints of a few thousand bits is a handful of machine words,
which is what makes the transitive reduction and the closure cheap in pure Python.
"""
from __future__ import annotations

import heapq
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Sequence

from ..ir.kernel_names import collective_kernel
from ..ir.taskgraph import TaskGraph, TaskKind


@dataclass(slots=True)
class Dag:
    """A DAG on tasks ``0 .. n-1`` whose edges all go from a lower id to a higher one.

    ``succs[u]`` and ``preds[v]`` are sorted and hold no duplicates.  With ``ordered`` False the
    edges may go either way (and a cycle is found only by :func:`topological_order`); only the
    longest paths and :func:`reachability` accept such a graph.
    """

    n: int
    succs: list[list[int]]
    preds: list[list[int]]
    ordered: bool = True

    def edges(self) -> list[tuple[int, int]]:
        """Every edge ``(u, v)``, sorted."""
        return [(u, v) for u in range(self.n) for v in self.succs[u]]

    @property
    def num_edges(self) -> int:
        return sum(map(len, self.succs))


@dataclass(slots=True)
class CriticalPath:
    """The longest path: ``length`` is a task count or a sum of durations (µs)."""

    length: float
    tasks: list[int] = field(default_factory=list)


def dag_from_edges(n: int, edges: Iterable[tuple[int, int]], error: type[Exception] = ValueError,
                   what: str = "edge", *, ordered: bool = True) -> Dag:
    """A :class:`Dag` on ``n`` tasks from a list of edges ``(u, v)``; duplicates are merged.

    Raises ``error`` for an edge that is out of range or, when ``ordered``, does not go from a
    lower id to a higher one (:func:`forward_edges`).
    """
    if n < 0:
        raise ValueError(f"a DAG cannot have {n} tasks")
    succ_sets: list[set[int]] = [set() for _ in range(n)]
    checked = forward_edges(n, edges, error, what) if ordered else \
        _edges_in_range(n, edges, error, what)
    for u, v in checked:
        succ_sets[u].add(v)
    return _from_succs([sorted(s) for s in succ_sets], ordered)


def forward_edges(n: int, edges: Iterable[tuple[int, int]], error: type[Exception] = ValueError,
                  what: str = "edge") -> list[tuple[int, int]]:
    """``edges`` as a list of int pairs, each checked to go forward in recorded order.

    Every algorithm on a TaskGraph's DAG walks task ids once, in order, so an edge ``u -> v``
    must have ``0 <= u < v < n``; anything else raises ``error`` (the caller's own type).
    """
    out = []
    for u, v in edges:
        u, v = int(u), int(v)
        if not 0 <= u < v < n:
            raise error(f"{what} ({u}, {v}) does not go forward (from a lower task id to a "
                        f"higher one, both in [0, {n}))")
        out.append((u, v))
    return out


def _edges_in_range(n: int, edges: Iterable[tuple[int, int]], error: type[Exception],
                    what: str) -> list[tuple[int, int]]:
    out = []
    for u, v in edges:
        u, v = int(u), int(v)
        if not (0 <= u < n and 0 <= v < n):
            raise error(f"{what} ({u}, {v}) names a task outside [0, {n})")
        out.append((u, v))
    return out


def _from_succs(succs: list[list[int]], ordered: bool = True) -> Dag:
    n = len(succs)
    preds: list[list[int]] = [[] for _ in range(n)]
    for u in range(n):  # ascending u keeps every preds list sorted
        for v in succs[u]:
            preds[v].append(u)
    return Dag(n, succs, preds, ordered)


def topological_order(dag: Dag) -> list[int]:
    """The tasks in an order that every edge follows: id order for an ordered DAG, else the
    lowest id first among the tasks whose predecessors are all placed.

    Raises ``ValueError`` when the edges form a cycle.
    """
    n = dag.n
    if dag.ordered:
        return list(range(n))
    waiting = [len(p) for p in dag.preds]
    ready = [t for t in range(n) if not waiting[t]]
    heapq.heapify(ready)
    order = []
    while ready:
        u = heapq.heappop(ready)
        order.append(u)
        for v in dag.succs[u]:
            waiting[v] -= 1
            if not waiting[v]:
                heapq.heappush(ready, v)
    if len(order) != n:
        raise ValueError(f"the edges form a cycle ({n - len(order)} of {n} tasks never "
                         f"become ready)")
    return order


def _from_preds(preds: list[list[int]]) -> Dag:
    n = len(preds)
    succs: list[list[int]] = [[] for _ in range(n)]
    for v in range(n):  # ascending v keeps every succs list sorted
        for u in preds[v]:
            succs[u].append(v)
    return Dag(n, succs, preds)


class _Segments:
    """One buffer's bytes cut into segments at every boundary an access has used.

    Segment ``i`` is ``[starts[i], starts[i+1])`` (the last one is unbounded); it remembers its
    last writer (-1 for none) and the tasks that read it since that write.  Edges to those tasks
    are enough: an earlier access to the segment is ordered before them already, by induction.
    """

    __slots__ = ("starts", "writer", "readers")

    def __init__(self) -> None:
        self.starts = [0]
        self.writer = [-1]
        self.readers: list[list[int]] = [[]]

    def split(self, x: int) -> int:
        """Make ``x`` a boundary; return the index of the segment starting at ``x``."""
        i = bisect_right(self.starts, x) - 1
        if self.starts[i] == x:
            return i
        self.starts.insert(i + 1, x)
        self.writer.insert(i + 1, self.writer[i])
        self.readers.insert(i + 1, list(self.readers[i]))
        return i + 1


def build_dag(graph: TaskGraph, chain_ops: bool = True) -> Dag:
    """The happens-before DAG of ``graph`` from its tasks' byte-range accesses.

    Two tasks are ordered when they touch overlapping bytes of one buffer and at least one of them
    writes (read-after-write, write-after-read, write-after-write); reads never order reads.
    Overlap is exact to the byte.  A reading task gets an edge from the last writer of every
    segment it touches; a writing task from the segment's readers since that write, or from the
    writer if nobody has read it since.  The transitive closure of these edges orders every
    conflicting pair.

    With ``chain_ops`` consecutive tasks of one ATen op (``Task.op >= 0``) are also ordered:
    kernels of one op may communicate in ways their recorded accesses do not show.

    NCCL's collective kernels, and event record and wait nodes, are always ordered among
    themselves, in recorded order (:func:`communication_task`): each collective meets the same
    collective of every other rank, so every rank must launch them in one order (two of them
    run side by side could each wait for a peer that runs the other), and NCCL brackets each
    with a wait for, and a record of, an event that orders the communicator's launches in and
    out of graphs.
    """
    tasks = graph.tasks
    segments: dict[int, _Segments] = {}
    last_of_op: dict[int, int] = {}
    last_collective = -1
    preds: list[list[int]] = []
    for tid, task in enumerate(tasks):
        if task.id != tid:
            raise ValueError(f"task at position {tid} has id {task.id}; ids must be dense")
        p: set[int] = set()
        for a in task.accesses:
            if a.size <= 0:
                continue  # touches no byte
            seg = segments.get(a.buffer)
            if seg is None:
                seg = segments[a.buffer] = _Segments()
            i = seg.split(a.offset)
            j = seg.split(a.offset + a.size)
            writer, readers = seg.writer, seg.readers
            if a.write:
                for k in range(i, j):
                    if readers[k]:
                        p.update(readers[k])  # each reader already follows the writer
                    elif writer[k] >= 0:
                        p.add(writer[k])
                # the write hides everything before it, so its segments collapse into one
                seg.starts[i:j] = [a.offset]
                writer[i:j] = [tid]
                readers[i:j] = [[]]
            else:
                for k in range(i, j):
                    if writer[k] >= 0:
                        p.add(writer[k])
                    r = readers[k]
                    if not r or r[-1] != tid:
                        r.append(tid)
        if chain_ops and task.op >= 0:
            prev = last_of_op.get(task.op)
            if prev is not None:
                p.add(prev)
            last_of_op[task.op] = tid
        if communication_task(task):
            if last_collective >= 0:
                p.add(last_collective)
            last_collective = tid
        p.discard(tid)  # a task's own accesses never order it against itself
        preds.append(sorted(p))
    return _from_preds(preds)


def communication_task(task) -> bool:
    """A collective kernel of NCCL, or an event record or wait node (see :func:`build_dag`)."""
    if task.kind == TaskKind.KERNEL:
        return collective_kernel(task.name)
    return task.kind in TaskKind.EVENTS


def communicates(graph: TaskGraph) -> bool:
    """Whether ``graph`` holds a collective of NCCL: every rank must then launch its graphs the
    same number of times, or one rank's collective waits for a peer that never comes."""
    return any(t.kind == TaskKind.KERNEL and collective_kernel(t.name) for t in graph.tasks)


_NOT_ORDERED = "edges must go from a lower task id to a higher one"


def _require_ordered(dag: Dag) -> None:
    if not dag.ordered:
        raise ValueError(_NOT_ORDERED)


def _reduce(dag: Dag) -> tuple[list[list[int]], list[int]]:
    """``(kept successors, reach)``: the transitive reduction's edges and every task's reach."""
    _require_ordered(dag)
    n = dag.n
    reach = [0] * n
    kept: list[list[int]] = [[]] * n
    for u in range(n - 1, -1, -1):
        r = 0
        keep = []
        # In increasing id order any other path to v runs through a smaller successor w, whose
        # reach (or the reach of the kept successor that covers w) is already in r.
        for v in dag.succs[u]:
            if not (r >> v) & 1:
                keep.append(v)
                r |= reach[v] | (1 << v)
        reach[u] = r
        kept[u] = keep
    return kept, reach


def transitive_reduction(dag: Dag) -> Dag:
    """The minimum equivalent graph: edge ``u -> v`` kept iff no other path leads from u to v.

    A DAG has exactly one such graph; it has the same reachability as ``dag``.
    """
    if any(u >= v for u in range(dag.n) for v in dag.succs[u][:1]):
        raise ValueError(_NOT_ORDERED)
    kept, _ = _reduce(dag)
    return _from_succs(kept)


def reachability(dag: Dag) -> list[int]:
    """``r[u]``: bitset of every task reachable from ``u`` (``u`` itself excluded).

    A DAG built with ``ordered=False`` (a backfill's late edges go against task order) is walked
    backwards in :func:`topological_order`."""
    if dag.ordered:
        return _reduce(dag)[1]
    reach = [0] * dag.n
    for u in reversed(topological_order(dag)):
        r = 0
        for v in dag.succs[u]:
            r |= reach[v] | (1 << v)
        reach[u] = r
    return reach


def ancestors(dag: Dag) -> list[int]:
    """``a[v]``: bitset of every task from which ``v`` is reachable (``v`` itself excluded)."""
    _require_ordered(dag)
    anc = [0] * dag.n
    for v in range(dag.n):
        a = 0
        for u in dag.preds[v]:
            a |= anc[u] | (1 << u)
        anc[v] = a
    return anc


class PathLengths(NamedTuple):
    """The longest weighted path into every task (:func:`path_lengths`).

    ``before[t]`` ends just before ``t`` (0 for a task with no predecessor: its earliest start
    when weights are durations), ``through[t]`` is ``before[t]`` plus ``t``'s own weight, and
    ``via[t]`` is the predecessor the path comes through (-1 for none).  ``order`` is the
    topological order walked.
    """

    before: list[float]
    through: list[float]
    via: list[int]
    order: list[int]


def path_lengths(dag: Dag, weights: Sequence[float] | None = None, *,
                 reverse: bool = False) -> PathLengths:
    """The longest path into every task of ``dag``, each task weighing ``weights[t]`` (1 each
    without them); with ``reverse``, the longest path out of every task to the end, following
    the edges backwards (``via`` is then the successor).

    Ties go to the predecessor that comes first in the walked order.  Raises ``ValueError``
    for a weight count other than the task count, or when the edges form a cycle.
    """
    n = dag.n
    if weights is not None and len(weights) != n:
        raise ValueError(f"{len(weights)} durations for {n} tasks")
    order = topological_order(dag)
    into = dag.preds
    if reverse:
        order.reverse()
        into = dag.succs
    # into[v] is sorted by id; an unordered DAG's walk needs it in walked order instead.
    position = None if dag.ordered else {t: k for k, t in enumerate(order)}
    before = [0.0] * n
    through = [0.0] * n
    via = [-1] * n
    for v in order:
        sources: Iterable[int] = into[v]
        if position is not None:
            sources = sorted(sources, key=position.__getitem__)
        elif reverse:
            sources = reversed(into[v])
        b, arg = 0.0, -1
        for u in sources:
            if arg < 0 or through[u] > b:
                b, arg = through[u], u
        before[v] = b
        through[v] = b + (1.0 if weights is None else float(weights[v]))
        via[v] = arg
    return PathLengths(before, through, via, order)


def critical_path(dag: Dag, durations: Sequence[float] | None = None) -> CriticalPath:
    """The longest path through ``dag`` (:func:`path_lengths`).

    Without ``durations`` its length is the number of tasks on it; with them, the sum of its
    tasks' durations (µs).  Ties go to the path through the predecessor first in topological
    order (the lowest id in an ordered DAG), and end at the task first in that order.
    """
    lengths = path_lengths(dag, durations)
    if dag.n == 0:
        return CriticalPath(0.0, [])
    end = max(lengths.order, key=lengths.through.__getitem__)
    path = []
    while end >= 0:
        path.append(end)
        end = lengths.via[end]
    path.reverse()
    return CriticalPath(lengths.through[path[-1]], path)


def task_durations(graph: TaskGraph) -> list[float] | None:
    """Every task's recorded ``duration_us``, or None if any task lacks one."""
    out = []
    for t in graph.tasks:
        if t.duration_us is None:
            return None
        out.append(float(t.duration_us))
    return out
