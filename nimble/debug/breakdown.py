"""Where a step's time goes (issue 53): a measured timeline (:func:`nimble.Nimble.trace`) read
against the recording's bytes.

A batch-1 decode step is memory-bound: the GPU's job is to stream the weights once.  Its time
splits into kernels running and the gaps between dependent kernels, when nothing streams.
:func:`step_breakdown` says, for one phase of a :class:`~nimble.debug.timeline.Timeline`:

- **busy** time (some task running: the union of the tasks' spans) and **idle** time (none);
- the **gaps between dependent tasks**: each task's start less the end of the predecessor it
  waited for last (stream order, syncs and late edges: what the run enforced), over every
  dependent boundary and along the executed critical path, where they add up to the makespan's
  part that no kernel of the path fills;
- each kernel's **bytes and bandwidth while it runs**: the bytes its recorded accesses name
  (byte ranges of each buffer, overlaps counted once; the weights a GEMM reads, the cache an
  attention reads), over its measured time, against the device's copy bandwidth where given.
  A kernel's accesses are what its op's schema names: an embedding lookup names its whole
  table and reads a row, so its rate is an upper bound (marked where above the copy rate);
- the **achieved concurrency** (task time over makespan), and the step's unique weight bytes
  over its makespan: the bandwidth the step as a whole gets out of the weights it streams.

A task's start is a timestamp kernel's beside it (:mod:`nimble.debug.timeline`), and beside a
kernel that fills every multiprocessor that stamp can wait for a free one until the kernel's
last blocks: the start lands late, the kernel looks short and the gap before it long.  Where
the device's L2 size is given, a kernel whose weights are larger than the L2 and whose stamped
time would have them stream faster than the copy bandwidth cannot have started when stamped:
its start is taken as its ready time (the end of the predecessor it waited for last), the
earliest it could start, and the breakdown counts it (``late_starts``).

Plain data, no GPU: the CPU tests run it on recorded fixtures with simulated times.
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

from ..ir.taskgraph import BufferKind, TaskGraph, TaskKind
from .repeats import RepeatedBlock, format_repeated_block, phase_block, task_label
from .timeline import Timeline, _union_length, executed_critical_path, touched_bytes


@dataclass(frozen=True)
class Spread:
    """Count, total and quantiles (µs) of a set of durations."""

    count: int
    total_us: float
    median_us: float
    p90_us: float
    max_us: float

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        if not values:
            return cls(0, 0.0, 0.0, 0.0, 0.0)
        ordered = sorted(values)
        return cls(len(ordered), sum(ordered), statistics.median(ordered),
                   ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], ordered[-1])


@dataclass(frozen=True)
class KernelTime:
    """One task's measured time and the bytes its accesses name."""

    task: int
    name: str
    us: float
    weight_bytes: int  # of parameter buffers
    bytes: int  # every buffer it touches, weights and state included

    @property
    def bytes_per_s(self) -> float | None:
        return self.bytes / (self.us / 1e6) if self.us > 0 else None


@dataclass(frozen=True)
class NameGroup:
    """The tasks of one kernel name, together."""

    name: str
    count: int
    us: float
    bytes: int

    @property
    def bytes_per_s(self) -> float | None:
        return self.bytes / (self.us / 1e6) if self.us > 0 else None


@dataclass(frozen=True)
class Gap:
    """A task's wait: its start less the end of ``after``, the predecessor that ended last."""

    task: int
    name: str
    after: int
    after_name: str
    us: float


@dataclass(frozen=True)
class SlowSmall:
    """A kernel that touches little yet runs long: where it starts in the step, what it waited
    for, and whether the executed critical path runs through it."""

    task: int
    name: str
    op: str  # the op that launched it
    start_us: float  # from the step's first start
    us: float
    bytes: int
    after: int | None  # the predecessor that ended last
    on_path: bool


#: A kernel touching at most this many bytes is small, and slow where it runs at least
#: :data:`SLOW_SMALL_US`: latency, not bytes, makes its time.
SMALL_BYTES = 64 * 1024
SLOW_SMALL_US = 3.0
#: The slow small kernels a report names, the longest first.
SLOW_SMALL_SHOWN = 6


@dataclass
class StepBreakdown:
    """One phase's time, gaps, bytes and concurrency (:func:`step_breakdown`)."""

    tasks: int
    makespan_us: float
    busy_us: float  # some task running
    work_us: float  # the tasks' times summed
    gaps: Spread  # start less the ready time, over every task with a predecessor
    path_tasks: int
    path_busy_us: float
    path_gaps: Spread  # between consecutive tasks of the executed critical path
    weight_bytes: int  # unique bytes of parameter buffers the phase touches
    step_bytes: int  # unique bytes of every buffer it touches
    kernels: list[KernelTime] = field(default_factory=list)
    copy_bytes_per_s: float | None = None
    largest_gaps: list[Gap] = field(default_factory=list)  # the longest waits, longest first
    late_starts: list[int] = field(default_factory=list)  # starts taken as ready times
    #: kernels whose accesses name no byte: ``(task, kernel name, op name)``
    nameless: list[tuple[int, str, str]] = field(default_factory=list)
    slow_small: list[SlowSmall] = field(default_factory=list)  # the longest first
    repeated: RepeatedBlock | None = None  # the block the phase repeats (its layers)

    @property
    def idle_us(self) -> float:
        return self.makespan_us - self.busy_us

    @property
    def concurrency(self) -> float:
        return self.work_us / self.makespan_us if self.makespan_us > 0 else 0.0

    @property
    def weights_per_s(self) -> float | None:
        """The weights' bytes over the makespan: the rate the step streams them at."""
        return self.weight_bytes / (self.makespan_us / 1e6) if self.makespan_us > 0 else None

    def of_copy(self, rate: float | None) -> float | None:
        return rate / self.copy_bytes_per_s if rate is not None and self.copy_bytes_per_s \
            else None

    def groups(self) -> list[NameGroup]:
        """The kernels grouped by name, the most time first."""
        by: dict[str, list[KernelTime]] = {}
        for k in self.kernels:
            by.setdefault(k.name, []).append(k)
        groups = [NameGroup(name, len(ks), sum(k.us for k in ks), sum(k.bytes for k in ks))
                  for name, ks in by.items()]
        return sorted(groups, key=lambda g: -g.us)

    def summary(self, top: int = 10) -> dict:
        """The numbers as JSON-ready data, with the ``top`` kernel names by time."""
        spread = lambda s: {"count": s.count, "total_us": s.total_us,  # noqa: E731
                            "median_us": s.median_us, "p90_us": s.p90_us, "max_us": s.max_us}
        return {
            "tasks": self.tasks, "makespan_us": self.makespan_us, "busy_us": self.busy_us,
            "idle_us": self.idle_us, "work_us": self.work_us, "concurrency": self.concurrency,
            "gaps": spread(self.gaps), "path_tasks": self.path_tasks,
            "path_busy_us": self.path_busy_us, "path_gaps": spread(self.path_gaps),
            "weight_bytes": self.weight_bytes, "step_bytes": self.step_bytes,
            "weights_per_s": self.weights_per_s,
            "weights_of_copy": self.of_copy(self.weights_per_s),
            "largest_gaps": [dataclasses.asdict(g) for g in self.largest_gaps],
            "late_starts": list(self.late_starts),
            "nameless": [list(k) for k in self.nameless],
            "slow_small": [dataclasses.asdict(k) for k in self.slow_small],
            "repeated_block": self.repeated.summary() if self.repeated else None,
            "copy_bytes_per_s": self.copy_bytes_per_s,
            "by_name": [{"name": g.name, "count": g.count, "us": g.us, "bytes": g.bytes,
                         "bytes_per_s": g.bytes_per_s, "of_copy": self.of_copy(g.bytes_per_s)}
                        for g in self.groups()[:top]]}


_WEIGHTS = frozenset({BufferKind.PARAM})


def _kernel_times(graph: TaskGraph, times, span: range) -> list[KernelTime]:
    out = []
    for t in span:
        task = graph.tasks[t]
        if task.kind != TaskKind.KERNEL:
            continue
        out.append(KernelTime(t, task.short_name or task.name, times[t][1] - times[t][0],
                              touched_bytes(graph, [t], _WEIGHTS), touched_bytes(graph, [t])))
    return out


def _waits(last: dict[int, int], times) -> dict[int, tuple[int, float]]:
    """Per task with a predecessor (``last``:
    :meth:`~nimble.debug.timeline.Timeline.last_predecessors`): that predecessor of the latest
    end, and the task's start less that end."""
    return {v: (u, times[v][0] - times[u][1]) for v, u in last.items()}


def _late_starts(graph: TaskGraph, span: range, times, last: dict[int, int],
                 copy_bytes_per_s, l2_bytes) -> dict[int, float]:
    """Per kernel of ``span`` whose stamped start cannot be (the module's text), its ready
    time; none without both rates."""
    if not copy_bytes_per_s or not l2_bytes:
        return {}
    late = {}
    for t in span:
        if graph.tasks[t].kind != TaskKind.KERNEL or t not in last:
            continue
        weights = touched_bytes(graph, [t], _WEIGHTS)
        start, end = times[t]
        if weights > l2_bytes and (end - start) * 1e-6 * copy_bytes_per_s < weights:
            late[t] = min(start, times[last[t]][1])
    return late


#: The longest waits a breakdown names, with the tasks on each side.
LARGEST_GAPS = 5


def _largest_gaps(graph: TaskGraph, waits: dict[int, tuple[int, float]]) -> list[Gap]:
    longest = sorted(waits.items(), key=lambda kv: -kv[1][1])[:LARGEST_GAPS]
    return [Gap(v, task_label(graph.tasks[v]), u, task_label(graph.tasks[u]), us)
            for v, (u, us) in longest if us > 0]


def _op_name(graph: TaskGraph, t: int) -> str:
    op = graph.tasks[t].op
    return graph.ops[op].name if 0 <= op < len(graph.ops) else ""


def _nameless(graph: TaskGraph, span: range) -> list[tuple[int, str, str]]:
    """The kernels of ``span`` whose recorded accesses name no byte, with their ops' names."""
    out = []
    for t in span:
        task = graph.tasks[t]
        if task.kind == TaskKind.KERNEL and not any(a.size for a in task.accesses):
            out.append((t, task.short_name or task.name, _op_name(graph, t)))
    return out


def _slow_small(graph: TaskGraph, kernels: list[KernelTime], times, begin: float,
                last: dict[int, int], path) -> list[SlowSmall]:
    """The kernels of at most :data:`SMALL_BYTES` that ran :data:`SLOW_SMALL_US` or more, the
    longest first."""
    on_path = set(path)
    slow = [k for k in kernels if k.bytes <= SMALL_BYTES and k.us >= SLOW_SMALL_US]
    return [SlowSmall(k.task, k.name, _op_name(graph, k.task), times[k.task][0] - begin, k.us,
                      k.bytes, last.get(k.task), k.task in on_path)
            for k in sorted(slow, key=lambda k: -k.us)]


def step_breakdown(timeline: Timeline, graph: TaskGraph | None = None, phase: int = 0,
                   copy_bytes_per_s: float | None = None,
                   l2_bytes: int | None = None) -> StepBreakdown:
    """Phase ``phase`` of a measured ``timeline`` broken down (see the module's text), its bytes
    read from ``graph`` (the recording the timeline ran: ``nm.graph``; the timeline's own by
    default), held against ``copy_bytes_per_s`` where given; with ``l2_bytes`` (the device's
    L2 size) too, a start that cannot be is taken as its task's ready time."""
    graph = graph if graph is not None else timeline.graph
    if len(graph.tasks) != len(timeline.times):
        raise ValueError(f"the graph has {len(graph.tasks)} tasks and the timeline "
                         f"{len(timeline.times)}: give the graph the timeline measured")
    spans = timeline.phases()
    if not 0 <= phase < len(spans) or not len(spans[phase]):
        raise ValueError(f"no phase {phase} with tasks in the timeline ({len(spans)} phases)")
    span, times = spans[phase], list(timeline.times)
    # the predecessor that ended last is the same after a start is moved (ends stay)
    last = timeline.last_predecessors(span, times)
    late = _late_starts(graph, span, times, last, copy_bytes_per_s, l2_bytes)
    for t, ready in late.items():
        times[t] = (ready, times[t][1])
    begin = min(times[t][0] for t in span)
    makespan = max(times[t][1] for t in span) - begin
    waits = _waits(last, times)
    path = executed_critical_path(timeline.schedule, times, span, timeline.late_edges)
    path_gaps = [times[v][0] - times[u][1] for u, v in zip(path, path[1:])]
    kernels = _kernel_times(graph, times, span)
    return StepBreakdown(
        tasks=len(span), makespan_us=makespan,
        busy_us=_union_length([times[t] for t in span]),
        work_us=sum(times[t][1] - times[t][0] for t in span),
        gaps=Spread.of([us for _, us in waits.values()]), path_tasks=len(path),
        path_busy_us=sum(times[t][1] - times[t][0] for t in path),
        path_gaps=Spread.of(path_gaps),
        weight_bytes=touched_bytes(graph, span, _WEIGHTS), step_bytes=touched_bytes(graph, span),
        kernels=kernels, copy_bytes_per_s=copy_bytes_per_s,
        largest_gaps=_largest_gaps(graph, waits), late_starts=sorted(late),
        nameless=_nameless(graph, span),
        slow_small=_slow_small(graph, kernels, times, begin, last, path),
        repeated=_repeated(graph, span, times, last))


def _repeated(graph: TaskGraph, span: range, times, last: dict[int, int]
              ) -> RepeatedBlock | None:
    """The phase's repeated block, over the times as corrected, with each place's bytes where
    the recording names any."""
    return phase_block(span, [task_label(graph.tasks[t]) for t in span], times, last,
                       lambda t: touched_bytes(graph, [t]) if graph.tasks[t].accesses else None)


def _rate(rate: float | None, share: float | None) -> str:
    if rate is None:
        return "-"
    text = f"{rate / 1e9:.0f} GB/s"
    if share is not None:
        text += f" ({100 * share:.0f}% of copy" + (", names more than it reads)" if share > 1
                                                    else ")")
    return text


def format_breakdown(b: StepBreakdown, top: int = 10) -> str:
    """The text report of a :class:`StepBreakdown`, with the ``top`` kernel names by time."""
    lines = [
        f"{b.tasks} tasks in {b.makespan_us:.1f} µs: busy {b.busy_us:.1f} µs, idle "
        f"{b.idle_us:.1f} µs; achieved concurrency {b.concurrency:.2f}",
        f"  gaps between dependent tasks: {b.gaps.count}, {b.gaps.total_us:.1f} µs in all, "
        f"median {b.gaps.median_us:.2f} µs, p90 {b.gaps.p90_us:.2f} µs, max "
        f"{b.gaps.max_us:.2f} µs",
        f"  executed critical path: {b.path_tasks} tasks, {b.path_busy_us:.1f} µs busy, "
        f"{b.path_gaps.total_us:.1f} µs in {b.path_gaps.count} gaps (median "
        f"{b.path_gaps.median_us:.2f} µs)",
        f"  weights {b.weight_bytes / 1e6:.1f} MB over the makespan: "
        f"{_rate(b.weights_per_s, b.of_copy(b.weights_per_s))}; every buffer touched "
        f"{b.step_bytes / 1e6:.1f} MB"]
    lines[2:2] = [f"    {g.us:7.2f} µs before task {g.task} ({g.name[:40]}), after task "
                  f"{g.after} ({g.after_name[:40]})" for g in b.largest_gaps]
    if b.late_starts:
        lines.insert(1, f"  {len(b.late_starts)} kernel(s) stamped as starting too late to "
                        "have read their weights (larger than the L2) by their end: their "
                        "starts taken as their ready times")
    if b.copy_bytes_per_s:
        lines.append(f"  at the copy bandwidth ({b.copy_bytes_per_s / 1e12:.2f} TB/s) those "
                     f"bytes take {b.step_bytes / b.copy_bytes_per_s * 1e6:.1f} µs")
    if b.nameless:
        shown = ", ".join(f"task {t} {name[:40]}" + (f" ({op[:40]})" if op else "")
                          for t, name, op in b.nameless[:6])
        more = f" and {len(b.nameless) - 6} more" if len(b.nameless) > 6 else ""
        lines.append(f"  {len(b.nameless)} kernel(s) whose accesses name no byte: {shown}{more}")
    if b.slow_small:
        lines.append(f"  {len(b.slow_small)} small kernel(s) (at most {SMALL_BYTES // 1024} KiB "
                     f"touched) running {SLOW_SMALL_US:g} µs or more:")
        for k in b.slow_small[:SLOW_SMALL_SHOWN]:
            after = f"after task {k.after}" if k.after is not None else "no predecessor"
            lines.append(f"    task {k.task} {k.name[:40]}" + (f" ({k.op[:40]})" if k.op else "")
                         + f": {k.us:.2f} µs from {k.start_us:.1f} µs, {k.bytes} B, {after}"
                         + (", on the critical path" if k.on_path else ""))
    lines.append(f"  kernels by time (top {top}): count, µs, MB touched, rate while running")
    for g in b.groups()[:top]:
        lines.append(f"    {g.count:4d} x {g.name[:60]:<60} {g.us:8.1f} {g.bytes / 1e6:9.2f}  "
                     f"{_rate(g.bytes_per_s, b.of_copy(g.bytes_per_s))}")
    if b.repeated is not None:
        lines.append(format_repeated_block(b.repeated.summary(), b.copy_bytes_per_s)
                     .rstrip("\n"))
    return "\n".join(lines) + "\n"
