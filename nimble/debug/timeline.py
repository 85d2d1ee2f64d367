"""The real multi-stream timeline: each task's start and end, measured inside the real run.

:func:`record_timeline` rebuilds every phase of a prepared graph once more, over the same arena,
with two ``nimble_timestamp`` nodes per task (``kernels/timestamp.ptx``: the GPU's
``%globaltimer``, in ns): one beside the task, after the same predecessors (its start, held
between its last predecessor's end and its own end: see :func:`times_from_stamps`), and one
after it (its end).  Neither precedes anything, so the schedule's chains are not lengthened; the
cost is the extra nodes the GPU's front end schedules, which :class:`Timeline` reports as the
instrumentation's overhead (the instrumented run against the plain one).  The prepared exec is
not touched.

:class:`Timeline` is plain data and answers the questions on any machine: how many tasks were in
flight on average (achieved concurrency), how long each stream sat idle inside its active span,
the critical path the run really took (from the last task to finish, back through the
predecessor that finished last) beside the planned one (the DAG's longest path with the measured
durations), and a Chrome/Perfetto trace with one track per stream and the syncs as arrows.  A
training step's late edges (:mod:`nimble.analysis.backfill`) order tasks as the syncs do: both paths
follow them, and the trace draws them as arrows of their own.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Sequence

from ..analysis.deps import critical_path, dag_from_edges
from ..analysis.schedule import Schedule, phase_spans
from ..engine.build import StampSpec
from ..engine.rebuild import PhaseOptions
from ..ir import json_fields as jf
from ..ir.taskgraph import Task, TaskGraph


@dataclass
class Timeline:
    """Measured ``(start, end)`` in µs per task, each phase from its own first start."""

    graph: TaskGraph
    schedule: Schedule
    times: list[tuple[float, float]]
    #: Median µs of one plain and one instrumented run of every phase (0 where not measured).
    plain_us: float = 0.0
    instrumented_us: float = 0.0
    meta: dict = field(default_factory=dict)
    #: The built graphs' late edges (:attr:`nimble.engine.prepared.Prepared.late_edges`), which
    #: the run enforced beside the schedule's.
    late_edges: list[tuple[int, int]] = field(default_factory=list)
    #: Per task, the unique bytes its recorded accesses name (None: none named), where the
    #: graph no longer says: a timeline read back from a trace (:meth:`from_chrome`).
    task_bytes: list[int | None] | None = None

    def edges(self) -> list[tuple[int, int]]:
        """Every ordering the run enforced: the schedule's edges and the late edges."""
        return self.schedule.edges() + [tuple(e) for e in self.late_edges]

    def phases(self) -> list[range]:
        return phase_spans(self.schedule.phases, len(self.graph.tasks))

    def bytes_of(self, t: int) -> int | None:
        """The unique bytes task ``t``'s recorded accesses name; None where none are named."""
        if self.task_bytes is not None:
            return self.task_bytes[t]
        return touched_bytes(self.graph, [t]) if self.graph.tasks[t].accesses else None

    def last_predecessors(self, span: range, times=None) -> dict[int, int]:
        """Per task of ``span`` with a predecessor there: that predecessor of the latest end
        (in ``times``, the timeline's own by default), the one the task waited for last."""
        times = self.times if times is None else times
        last: dict[int, int] = {}
        for u, v in self.edges():
            if u in span and v in span and (v not in last or times[u][1] > times[last[v]][1]):
                last[v] = u
        return last

    def summary(self) -> dict:
        """Per phase: makespan, busy and idle µs per stream, achieved concurrency, the executed
        and the planned critical path; and the instrumentation's overhead."""
        names = ["forward", "backward"] if len(self.phases()) == 2 else \
            [f"phase {k}" for k in range(len(self.phases()))]
        rows = [self._phase(name, span) for name, span in zip(names, self.phases()) if len(span)]
        overhead = (self.instrumented_us / self.plain_us - 1.0) if self.plain_us else None
        return {"phases": rows, "plain_us": self.plain_us,
                "instrumented_us": self.instrumented_us, "overhead": overhead}

    def _phase(self, name: str, span: range) -> dict:
        times, stream_of = self.times, self.schedule.stream_of
        begin = min(times[t][0] for t in span)
        end = max(times[t][1] for t in span)
        makespan = end - begin
        work = sum(times[t][1] - times[t][0] for t in span)
        streams: dict[int, list[tuple[float, float]]] = {}
        for t in span:
            streams.setdefault(stream_of[t], []).append(times[t])
        busy = {s: _union_length(iv) for s, iv in streams.items()}
        idle = {s: (max(e for _, e in iv) - min(b for b, _ in iv)) - busy[s]
                for s, iv in streams.items()}
        executed = executed_critical_path(self.schedule, times, span, self.late_edges)
        edges = [(u - span.start, v - span.start) for u, v in self.edges()
                 if u in span and v in span]
        durations = [times[t][1] - times[t][0] for t in span]
        # late edges run against task order: the path follows a topological order
        planned = critical_path(dag_from_edges(len(span), edges, ordered=False), durations)
        return {"name": name, "tasks": len(span), "streams": len(streams),
                "makespan_us": makespan, "work_us": work,
                "concurrency": work / makespan if makespan > 0 else 0.0,
                "busy_us": busy, "idle_us": idle,
                "executed_path_tasks": len(executed),
                "executed_path_busy_us": sum(times[t][1] - times[t][0] for t in executed),
                "executed_path": executed,
                "planned_path_us": planned.length,
                "planned_path_tasks": len(planned.tasks),
                "late_edges": sum(1 for u, v in self.late_edges if u in span and v in span),
                "repeated_block": self._repeated(span)}

    def _repeated(self, span: range) -> dict | None:
        """The phase's repeated block (:mod:`nimble.debug.repeats`) as JSON-ready data."""
        from .repeats import phase_block, task_label

        block = phase_block(span, [task_label(self.graph.tasks[t]) for t in span], self.times,
                            self.last_predecessors(span), self.bytes_of)
        return block.summary() if block is not None else None

    def overlapped(self, edges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """The dependencies ``(u, v)`` among ``edges`` (the DAG's,
        :func:`nimble.analysis.deps.build_dag`) that the run broke: ``v`` started before ``u``
        ended.  A schedule that enforces its DAG gives none; a missing synchronization shows up
        here."""
        return [(u, v) for u, v in edges if self.times[v][0] < self.times[u][1]]

    def to_chrome(self) -> dict:
        """A Chrome/Perfetto trace of the measured run (see
        :func:`nimble.analysis.report.to_chrome_trace`)."""
        from ..analysis.report import to_chrome_trace

        trace = to_chrome_trace(self.graph, self.schedule, times=self.times,
                                late_edges=self.late_edges)
        s = self.schedule
        trace["otherData"].update(simulated=False, plain_us=self.plain_us,
                                  instrumented_us=self.instrumented_us)
        # Enough to analyse the run again offline (``nimble inspect TRACE``).
        trace["otherData"]["nimble_timeline"] = {
            "times": [[b, e] for b, e in self.times], "stream_of": list(s.stream_of),
            "sync_edges": [list(e) for e in s.sync_edges], "phases": list(s.phases),
            "barrier_edges": [list(e) for e in s.barrier_edges],
            "late_edges": [list(e) for e in self.late_edges],
            "plain_us": self.plain_us, "instrumented_us": self.instrumented_us,
            "task_bytes": [self.bytes_of(t) for t in range(len(self.times))]}
        return trace

    @classmethod
    def from_chrome(cls, trace: dict) -> "Timeline":
        """The timeline a :meth:`to_chrome` trace carries (raises ``ValueError`` for a trace
        that is not a measured Nimble timeline; :class:`~nimble.ir.json_fields.FieldError`, a
        ``ValueError``, naming the first field of the wrong type)."""
        other = trace.get("otherData") or {}
        data = other.get("nimble_timeline") if isinstance(other, dict) else None
        if not data:
            raise ValueError("not a measured Nimble timeline (written by nm.trace() or "
                             "nimble debug --trace)")
        where = "otherData.nimble_timeline"
        data = jf.obj(data, where)
        get = lambda key, read, default=...: jf.member(data, key, where, read, default)  # noqa
        stream_of = get("stream_of", _counts)
        streams: list[list[int]] = [[] for _ in range(max(stream_of, default=-1) + 1)]
        for t, sid in enumerate(stream_of):
            streams[sid].append(t)
        graph = TaskGraph(meta={"model": jf.member(other, "model", "otherData",
                                                   jf.optional(jf.text), None)})
        names = _task_names(trace.get("traceEvents", []), len(stream_of))
        graph.tasks = [Task(t, "kernel", short_name=names.get(t, "")) for t in
                       range(len(stream_of))]
        schedule = Schedule(stream_of, streams, get("sync_edges", _pairs), 0, 0,
                            phases=get("phases", _counts, None) or [],
                            barrier_edges=get("barrier_edges", _pairs, None) or [])
        times = get("times", _spans)
        if len(times) != len(stream_of):
            raise jf.FieldError(f"{where}.times has {len(times)} spans for {len(stream_of)} "
                                "tasks")
        task_bytes = get("task_bytes", _optional_counts, None)  # traces before it: none
        if task_bytes is not None and len(task_bytes) != len(stream_of):
            raise jf.FieldError(f"{where}.task_bytes has {len(task_bytes)} entries for "
                                f"{len(stream_of)} tasks")
        return cls(graph, schedule, times,
                   plain_us=get("plain_us", jf.optional(jf.number), None) or 0.0,
                   instrumented_us=get("instrumented_us", jf.optional(jf.number), None) or 0.0,
                   late_edges=get("late_edges", _pairs, None) or [],
                   task_bytes=task_bytes if task_bytes is not None else [None] * len(stream_of))


def _counts(value, where: str) -> list[int]:
    """An array of integers of at least 0 (streams, task counts)."""
    counts = jf.items(value, where, jf.integer)
    if any(c < 0 for c in counts):
        raise jf.FieldError(f"{where} holds a negative number")
    return counts


def _optional_counts(value, where: str) -> list[int | None]:
    """An array of integers of at least 0, or nulls."""
    def count(v, w):
        if v is None:
            return None
        n = jf.integer(v, w)
        if n < 0:
            raise jf.FieldError(f"{w} is negative")
        return n
    return jf.items(value, where, count)


def _pairs(value, where: str) -> list[tuple[int, int]]:
    return [tuple(p) for p in jf.items(value, where, lambda v, w: _counts(jf.array(v, w, 2), w))]


def _spans(value, where: str) -> list[tuple[float, float]]:
    def span(v, w):
        b, e = jf.array(v, w, 2)
        return float(jf.number(b, f"{w}[0]")), float(jf.number(e, f"{w}[1]"))
    return jf.items(value, where, span)


def _task_names(events, tasks: int) -> dict[int, str]:
    """Each task's name, from the trace's complete events (``args.task``)."""
    names = {}
    for i, e in enumerate(jf.array(events, "traceEvents")):
        where = f"traceEvents[{i}]"
        e = jf.obj(e, where)
        args = jf.member(e, "args", where, jf.obj, {})
        if e.get("ph") == "X" and "task" in args:
            names[jf.member(args, "task", f"{where}.args", jf.integer)] = \
                jf.member(e, "name", where, jf.text, "")
    return names


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for b, e in sorted(intervals):
        if e <= reach:
            continue
        total += e - max(b, reach)
        reach = e
    return total


def touched_bytes(graph: TaskGraph, tasks, kinds: frozenset[str] | None = None) -> int:
    """Unique bytes the accesses of ``tasks`` (ids) name, in buffers of ``kinds`` (every kind
    when None); a range named twice counts once."""
    ranges: dict[int, list[tuple[int, int]]] = {}
    for t in tasks:
        for a in graph.tasks[t].accesses:
            if kinds is None or graph.buffers[a.buffer].kind in kinds:
                ranges.setdefault(a.buffer, []).append((a.offset, a.end))
    # whole bytes: the float union of integer ranges is exact
    return sum(int(_union_length(r)) for r in ranges.values())


def executed_critical_path(schedule: Schedule, times: Sequence[tuple[float, float]],
                           span: range | None = None,
                           late_edges: Sequence[tuple[int, int]] = ()) -> list[int]:
    """The chain the run really waited on: from the task of ``span`` that ended last, back
    through the predecessor (stream order, sync or late edge) that ended last, to a task with
    none."""
    span = range(len(times)) if span is None else span
    preds: dict[int, list[int]] = {}
    for u, v in schedule.edges() + [tuple(e) for e in late_edges]:
        if u in span and v in span:
            preds.setdefault(v, []).append(u)
    t = max(span, key=lambda k: times[k][1])
    path, seen = [t], {t}
    while preds.get(t):
        t = max(preds[t], key=lambda k: times[k][1])
        if t in seen:
            raise ValueError("the timeline's edges have a cycle")
        seen.add(t)
        path.append(t)
    path.reverse()
    return path


def times_from_stamps(raw: bytes, span: range,
                      edges: Sequence[tuple[int, int]] = ()) -> list[tuple[float, float]]:
    """``(start, end)`` µs per task of ``span`` from 16 stamp bytes per task (ns, start then
    end), relative to the span's earliest stamp.

    A start stamp runs beside its task (after the same predecessors), so the GPU may run it
    after the task has begun, even after it has ended.  A task cannot start before its last
    predecessor (``edges``, task ids) ended, nor after it ended itself: its start is the start
    stamp held between those two bounds (a root's lower bound is the span's earliest stamp).
    """
    values = struct.unpack(f"<{2 * len(span)}Q", raw[:16 * len(span)])
    if not any(values):
        return [(0.0, 0.0)] * len(span)
    first = min(v for v in values if v)
    preds: dict[int, list[int]] = {}
    for u, v in edges:
        if u in span and v in span:
            preds.setdefault(v - span.start, []).append(u - span.start)
    ends = [(values[2 * k + 1] - first) / 1e3 for k in range(len(span))]
    times = []
    for k in range(len(span)):
        ready = max((ends[u] for u in preds.get(k, ())), default=0.0)
        # 0: no start stamp (record_timeline(start_stamps=False)): the ready time stands
        stamp = (values[2 * k] - first) / 1e3 if values[2 * k] else ready
        times.append((min(max(stamp, ready), ends[k]), ends[k]))
    return times


def format_timeline(summary: dict) -> str:
    """The text report of a :meth:`Timeline.summary`."""
    out = []
    for p in summary["phases"]:
        idle = sorted(p["idle_us"].items(), key=lambda kv: -kv[1])[:3]
        out.append(f"{p['name']}: {p['tasks']} tasks on {p['streams']} streams in "
                   f"{p['makespan_us']:.1f} µs; achieved concurrency {p['concurrency']:.2f} "
                   f"(task time {p['work_us']:.1f} µs)")
        out.append(f"  executed critical path: {p['executed_path_tasks']} tasks, "
                   f"{p['executed_path_busy_us']:.1f} µs busy of {p['makespan_us']:.1f} µs; "
                   f"planned: {p['planned_path_tasks']} tasks, {p['planned_path_us']:.1f} µs"
                   + (f" (both through {p['late_edges']} late edges)" if p.get("late_edges")
                      else ""))
        out.append("  most idle streams: " + ", ".join(
            f"stream {s} {us:.1f} µs" for s, us in idle))
        if p.get("repeated_block"):
            from .repeats import format_repeated_block

            out.append(format_repeated_block(p["repeated_block"]).rstrip("\n"))
    if summary.get("overhead") is not None:
        out.append(f"instrumentation: {summary['instrumented_us']:.1f} µs per run against "
                   f"{summary['plain_us']:.1f} µs plain ({summary['overhead']:+.0%})")
    return "\n".join(out) + "\n"


def stamp_groups(schedule: Schedule, groups: int) -> list[set[int]]:
    """The tasks split into ``groups`` sets by their place on their stream: every
    ``groups``-th task of each stream falls in one set, so each set's stamps are spread evenly
    over the streams and over the run."""
    if groups < 1:
        raise ValueError(f"groups must be at least 1, got {groups}")
    out: list[set[int]] = [set() for _ in range(groups)]
    for stream in schedule.streams:
        for position, t in enumerate(stream):
            out[position % groups].add(t)
    return out


def merge_group_stamps(raws: Sequence[bytes], members: Sequence[set[int]], span: range,
                       roots: set[int]) -> bytes:
    """One stamp block for ``span`` from the runs of several stamp groups.

    Run ``g`` stamped the tasks in ``members[g]`` and the start of the root in ``roots``
    (every run does: it dates the run).  Each run's stamps are taken relative to that root's
    start, so runs at different times line up; each task's stamps come from the run that
    stamped it.
    """
    base = 1 << 40  # a positive origin: a stamp of 0 means "not stamped"
    out = [0] * (2 * len(span))
    for raw, group in zip(raws, members):
        values = struct.unpack(f"<{2 * len(span)}Q", raw[:16 * len(span)])
        starts = [values[2 * (t - span.start)] for t in roots if t in span]
        origin = min((v for v in starts if v), default=0)
        if not origin:
            continue
        for t in span:
            if t not in group:
                continue
            k = t - span.start
            for slot in (2 * k, 2 * k + 1):
                if values[slot]:
                    out[slot] = values[slot] - origin + base
    return struct.pack(f"<{len(out)}Q", *out)


def instrumented_options(stamps: int, span: range, start_stamps: bool,
                         tasks: set[int] | None) -> PhaseOptions:
    """How an instrumented copy differs from the served phase: timestamp nodes for the tasks of
    ``span`` (``tasks`` only, when given) in a stamp buffer at ``stamps`` (16 bytes per task of
    the graph, from task 0), and nothing else.  It keeps the served gathers: without them its
    roots would be many graph roots, a shape the driver runs slower than the served one."""
    return PhaseOptions(stamps=StampSpec(stamps + 16 * span.start, start_stamps, tasks))


def record_timeline(prepared, inputs: Sequence | None = None, runs: int = 5,
                    start_stamps: bool = True, groups: int = 1) -> Timeline:
    """Measure every task of ``prepared`` (a :class:`nimble.engine.prepared.Prepared`) in a real
    run.

    ``inputs`` (the flat inputs of every phase, as :func:`nimble.engine.proving.run_all` takes
    them; random ones when None) are copied into the arena's slots; each phase's instrumented
    graph (:func:`instrumented_options`) runs ``runs`` times after the plain graphs ran as
    often, and the last run's stamps are kept.  ``start_stamps=False`` stamps only the ends
    (and the first root's start, which dates the run): half the extra nodes, each start then
    being its ready time (its last predecessor's end; the launch for a root).  ``groups=k``
    spreads the stamps over ``k`` instrumented graphs (:func:`stamp_groups`), each run ``runs``
    times, so each measured run carries a ``k``-th of them and is disturbed that much less; the
    timeline joins the runs (:func:`merge_group_stamps`) and the overhead reported is the
    largest of theirs.  The instrumented graphs are launched as the prepared ones are
    (device-launchable where those are).  Needs the GPU; the prepared graph keeps serving calls
    unchanged.
    """
    from .. import driver
    from ..engine.proof import random_like

    n = len(prepared.graph.tasks)
    slots = [s for launcher in prepared.launchers for s in launcher.slots]
    inputs = list(inputs) if inputs is not None else [random_like(s.tensor) for s in slots]
    members = stamp_groups(prepared.schedule, groups) if groups > 1 else [set(range(n))]
    stamps = driver.DeviceMemory.allocate(16 * max(n, 1))
    try:
        with prepared.launchers[0].lock:
            # A gather node reads its source from the input cell, which still names the last
            # call's tensor: the plain runs must gather each slot onto itself instead.
            prepared.cells_to_own_slots()
            runner = _Runner(prepared.launchers[0].stream(), slots, inputs)
            plain = sorted(runner.run([b.exec.handle for b in prepared.builts])
                           for _ in range(runs))
            builder = prepared.phase_builder(runner.stream)
            measured = [_run_stamped(prepared, builder, runner, stamps, runs, start_stamps,
                                     group if groups > 1 else None) for group in members]
    finally:
        stamps.close()
    times = _joined_times(prepared, [raw for _, raw in measured], members, groups)
    return Timeline(prepared.graph, prepared.schedule, times, plain_us=plain[len(plain) // 2],
                    instrumented_us=max(us for us, _ in measured),
                    meta={"runs": runs, "timer": "%globaltimer", "start_stamps": start_stamps,
                          "groups": groups}, late_edges=list(prepared.late_edges))


class _Runner:
    """Timed launches on the prepared graph's stream, each after the inputs are copied in."""

    def __init__(self, stream, slots: Sequence, inputs: Sequence) -> None:
        import torch

        self.stream, self.slots, self.inputs = stream, slots, inputs
        self.torch_stream = torch.cuda.ExternalStream(int(stream)) \
            if int(stream) else torch.cuda.current_stream()

    def run(self, execs: Sequence) -> float:
        """µs from before the first of ``execs`` to after the last, launched in turn."""
        import torch

        from .. import driver

        with torch.cuda.stream(self.torch_stream):
            for slot, x in zip(self.slots, self.inputs):
                slot.tensor.copy_(x)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for exec_handle in execs:
                driver.launch(exec_handle, self.stream)
            end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3


def _run_stamped(prepared, builder, runner: _Runner, stamps, runs: int, start_stamps: bool,
                 tasks: set[int] | None) -> tuple[float, bytes]:
    """``(median µs, stamp bytes)`` of ``runs`` runs of every phase instrumented for ``tasks``
    (every task when None); the copies are freed afterwards."""
    from .. import driver

    n = len(prepared.graph.tasks)
    driver.copy_to_device(stamps.address, bytes(16 * max(n, 1)))  # 0: not stamped
    instrumented = []
    try:
        for phase, built in enumerate(prepared.builts):
            instrumented.append(builder.build(phase, instrumented_options(
                stamps.address, built.span, start_stamps, tasks)))
        times = sorted(runner.run([b.exec.handle for b in instrumented]) for _ in range(runs))
        return times[len(times) // 2], driver.copy_to_host(stamps.address, 16 * n)
    finally:
        for built in instrumented:
            built.close()


def _joined_times(prepared, raws: Sequence[bytes], members: Sequence[set[int]],
                  groups: int) -> list[tuple[float, float]]:
    """Each task's ``(start, end)`` µs from the stamp bytes of the runs of every group."""
    from ..engine.build import predecessors

    schedule = prepared.schedule
    n = len(prepared.graph.tasks)
    preds = predecessors(n, schedule.edges())
    roots = {next(t for t in b.span if all(u < b.span.start for u in preds[t]))
             for b in prepared.builts if len(b.span)}  # the stamp dating each run
    times: list[tuple[float, float]] = [(0.0, 0.0)] * n
    for built in prepared.builts:
        span = built.span
        if groups > 1:
            chunk = merge_group_stamps([r[16 * span.start:16 * span.stop] for r in raws],
                                       members, span, roots)
        else:
            chunk = raws[0][16 * span.start:16 * span.stop]
        for t, pair in zip(span, times_from_stamps(chunk, span,
                                                   schedule.edges() + prepared.late_edges)):
            times[t] = pair
    return times
