"""Summaries and exports of a TaskGraph: the clearest window into a model's GPU work.

Everything here takes a :class:`~nimble.ir.taskgraph.TaskGraph` (a loaded recording or a live one)
and returns plain data (dicts of numbers, strings and lists, ready for ``json.dumps``) or text:

* :func:`summarize` counts tasks, kernels, buffers and bytes;
* :func:`analyze` runs the scheduler (dependencies, transitive reduction, stream assignment,
  critical path and, on request, the memory plan) once, so that summaries and exports can share it;
* :func:`schedule_summary` and :func:`memplan_summary` report on that analysis;
* :func:`export_plan`, :func:`to_dot` and :func:`to_chrome_trace` write it out for other tools;
* :func:`format_summary` renders the summaries as the text ``nimble inspect`` prints.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import NamedTuple, Sequence

from .deps import (CriticalPath, Dag, build_dag, critical_path, dag_from_edges, path_lengths,
                   task_durations, transitive_reduction)
from .memplan import MemPlan, plan_memory
from .schedule import Schedule, assign_phased
from ..ir.taskgraph import BufferKind, TaskGraph, TaskKind

PLAN_FORMAT = "nimble.plan"
PLAN_VERSION = 1

_MIB = 1 << 20
_TOP = 10
# Tasks with no recorded duration still need a visible extent in a timeline.
_DEFAULT_DURATION_US = 1.0
# ColorBrewer Set3: pale enough that black labels stay readable; streams beyond 12 wrap around.
_STREAM_COLOURS = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462",
                   "#b3de69", "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f")


class Analysis(NamedTuple):
    """The scheduler's results for one graph, computed once by :func:`analyze`.

    ``dag`` is the full dependency DAG, ``reduced`` its transitive reduction, ``durations`` the
    per-task durations in µs (``None`` unless every task has one), ``seconds`` the time the
    scheduling steps took; ``plan`` and ``plan_seconds`` are set when the memory plan was asked for.
    """

    dag: Dag
    reduced: Dag
    schedule: Schedule
    critical: CriticalPath
    durations: list[float] | None
    max_streams: int | None
    seconds: float
    plan: MemPlan | None = None
    plan_seconds: float | None = None


# ---- summaries ------------------------------------------------------------------------------

def _label(name: str, short_name: str) -> str:
    return short_name or name or "?"


def summarize(graph: TaskGraph) -> dict:
    """Counts that describe a recording, as a JSON-able dict.

    Keys: ``model``, ``tasks``, ``kernel_tasks``, ``tasks_by_kind``, ``ops``, ``top_ops``,
    ``unattributed_tasks`` (tasks with no op), ``buffers``, ``buffers_by_kind``, ``bytes_by_kind``,
    ``total_bytes``, ``relocatable_bytes``, ``inputs``, ``outputs``, ``accesses``, ``pointers``,
    ``unresolved_pointers`` (with up to five ``unresolved_examples``), ``top_kernels`` (the ten
    most frequent kernels as ``{short_name, count}``), ``tasks_with_duration``,
    ``total_duration_us`` (sum of the known durations, ``None`` if none is known) and ``meta``.
    """
    tasks_by_kind = Counter(t.kind for t in graph.tasks)
    # Every known kind is listed, even at zero, so that consumers can rely on the keys.
    buffers_by_kind = {k: 0 for k in BufferKind.ALL}
    bytes_by_kind = {k: 0 for k in BufferKind.ALL}
    for b in graph.buffers:
        buffers_by_kind[b.kind] = buffers_by_kind.get(b.kind, 0) + 1
        bytes_by_kind[b.kind] = bytes_by_kind.get(b.kind, 0) + b.size
    kernels = Counter(_label(t.name, t.short_name) for t in graph.tasks
                      if t.kind == TaskKind.KERNEL)
    unresolved = graph.unresolved_pointers()
    durations = [t.duration_us for t in graph.tasks if t.duration_us is not None]
    return {
        "model": graph.meta.get("model"),
        "tasks": len(graph.tasks),
        "kernel_tasks": tasks_by_kind.get(TaskKind.KERNEL, 0),
        "tasks_by_kind": dict(tasks_by_kind.most_common()),
        "ops": len(graph.ops),
        "top_ops": [{"name": n, "count": c}
                    for n, c in Counter(o.name for o in graph.ops).most_common(_TOP)],
        "unattributed_tasks": sum(1 for t in graph.tasks if t.op == -1),
        "buffers": len(graph.buffers),
        "buffers_by_kind": buffers_by_kind,
        "bytes_by_kind": bytes_by_kind,
        "total_bytes": sum(bytes_by_kind.values()),
        "relocatable_bytes": sum(b.size for b in graph.buffers if b.relocatable),
        "inputs": len(graph.inputs),
        "outputs": len(graph.outputs),
        "accesses": sum(len(t.accesses) for t in graph.tasks),
        "pointers": sum(len(t.pointers) for t in graph.tasks),
        "unresolved_pointers": len(unresolved),
        "unresolved_examples": [{"task": tid, "location": p.location, "value": hex(p.value)}
                                for tid, p in unresolved[:5]],
        "top_kernels": [{"short_name": n, "count": c} for n, c in kernels.most_common(_TOP)],
        "tasks_with_duration": len(durations),
        "total_duration_us": sum(durations) if durations else None,
        "meta": dict(graph.meta),
    }


def analyze(graph: TaskGraph, max_streams: int | None = None, *,
            memplan: bool = False) -> Analysis:
    """Build the dependency DAG, reduce it, assign streams, find the critical path.

    With ``memplan=True`` also plan the arena for the schedule's final edges.
    """
    start = time.perf_counter()
    dag = build_dag(graph)
    reduced = transitive_reduction(dag)
    schedule = assign_phased(dag, graph.meta.get("phases") or [], max_streams)
    durations = task_durations(graph)
    # Reduction keeps reachability and longest paths, and is the smaller graph to walk.
    critical = critical_path(reduced, durations)
    a = Analysis(dag, reduced, schedule, critical, durations, max_streams,
                 time.perf_counter() - start)
    return _with_plan(graph, a) if memplan else a


def _with_plan(graph: TaskGraph, a: Analysis) -> Analysis:
    if a.plan is not None:
        return a
    start = time.perf_counter()
    plan = plan_memory(graph, a.schedule.edges())
    return a._replace(plan=plan, plan_seconds=time.perf_counter() - start)


def simulate(graph: TaskGraph, schedule: Schedule) -> list[tuple[float, float]]:
    """``(start, end)`` in µs per task on an idealised GPU that runs every stream at once.

    A task starts when its stream predecessor and its sync predecessors have ended, and lasts its
    ``duration_us`` (1 µs when unknown).  Launch overheads and contention are not modelled.
    Raises ``ValueError`` when the schedule's edges form a cycle.
    """
    durations = [_DEFAULT_DURATION_US if t.duration_us is None else float(t.duration_us)
                 for t in graph.tasks]
    # A malformed schedule's streams may run against task order: walked as a cycle check.
    dag = dag_from_edges(len(graph.tasks), schedule.edges(), ordered=False)
    lengths = path_lengths(dag, durations)
    return list(zip(lengths.before, lengths.through))


def schedule_summary(graph: TaskGraph, max_streams: int | None = None, *,
                     analysis: Analysis | None = None) -> dict:
    """The stream assignment in numbers.

    Keys: ``max_streams``, ``width`` (the DAG's maximum parallelism as the scheduler measured it),
    ``streams`` (count), ``stream_sizes``, ``sync_edges`` (count), ``dag_edges``,
    ``reduced_edges``, ``critical_path_tasks``, ``critical_path_us``, ``serial_us`` and
    ``simulated_us`` (the last three ``None`` unless every task has a duration) and
    ``analysis_seconds``.  A given ``analysis`` is reported as it is (``max_streams`` is then
    ignored).
    """
    a = analysis if analysis is not None else analyze(graph, max_streams)
    s = a.schedule
    known = a.durations is not None
    return {
        "max_streams": a.max_streams,
        "width": s.width,
        "streams": len(s.streams),
        "stream_sizes": [len(tasks) for tasks in s.streams],
        "sync_edges": len(s.sync_edges),
        "dag_edges": a.dag.num_edges,
        "reduced_edges": s.reduced_edges,
        "critical_path_tasks": len(a.critical.tasks),
        "critical_path_us": float(a.critical.length) if known else None,
        "serial_us": float(sum(a.durations)) if known else None,
        "simulated_us": max((e for _, e in simulate(graph, s)), default=0.0) if known else None,
        "analysis_seconds": a.seconds,
        "phases": _phase_rows(graph, s),
    }


def _phase_rows(graph: TaskGraph, schedule: Schedule) -> list[dict]:
    """Per phase of a phased graph (forward, backward), its tasks, streams and syncs."""
    if not schedule.phases:
        return []
    names = ["forward", "backward"] if len(schedule.phases) == 2 else \
        [f"phase {k}" for k in range(len(schedule.phases))]
    rows, start = [], 0
    for name, count in zip(names, schedule.phases):
        span = range(start, start + count)
        rows.append({"name": name, "tasks": count,
                     "streams": len({schedule.stream_of[t] for t in span}),
                     "sync_edges": sum(1 for u, _ in schedule.sync_edges if u in span)})
        start += count
    return rows


def memplan_summary(graph: TaskGraph, max_streams: int | None = None, *,
                    analysis: Analysis | None = None) -> dict:
    """The arena plan for the schedule's final edges, in numbers.

    Keys: ``arena_bytes``, ``buffer_bytes`` (relocatable bytes with no reuse),
    ``lower_bound_bytes``, ``planned_buffers``, ``alignment``, ``memplan_seconds``.
    """
    a = _with_plan(graph, analysis if analysis is not None else analyze(graph, max_streams))
    p = a.plan
    return {
        "arena_bytes": p.arena_bytes,
        "buffer_bytes": p.buffer_bytes,
        "lower_bound_bytes": p.lower_bound_bytes,
        "planned_buffers": len(p.offsets),
        "alignment": p.alignment,
        "memplan_seconds": a.plan_seconds,
    }


# ---- exports --------------------------------------------------------------------------------

def export_plan(graph: TaskGraph, schedule: Schedule, plan: MemPlan) -> dict:
    """The schedule and arena plan as JSON-able data (format ``nimble.plan``, version 1).

    ``streams[t]`` is task ``t``'s stream, ``edges`` the final happens-before edges (stream order,
    sync edges and, for a phased graph, the ``barrier_edges`` between its ``phases``), ``offsets``
    maps buffer ids (as strings, JSON keys being strings) to arena offsets.
    ``docs/taskgraph-format.md`` describes it.
    """
    return {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "model": graph.meta.get("model"),
        "tasks": len(graph.tasks),
        "num_streams": len(schedule.streams),
        "streams": [int(s) for s in schedule.stream_of],
        "edges": [[int(u), int(v)] for u, v in schedule.edges()],
        "sync_edges": [[int(u), int(v)] for u, v in schedule.sync_edges],
        "phases": [int(c) for c in schedule.phases],
        "barrier_edges": [[int(u), int(v)] for u, v in schedule.barrier_edges],
        "offsets": {str(b): int(o) for b, o in sorted(plan.offsets.items())},
        "arena_bytes": int(plan.arena_bytes),
        "alignment": int(plan.alignment),
    }


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _shorten(text: str, limit: int = 48) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def to_dot(graph: TaskGraph, schedule: Schedule | None = None) -> str:
    """Graphviz DOT of the task graph.

    Nodes are labelled with the short kernel name, the task id and the op.  With a schedule,
    nodes are coloured by stream, stream order is drawn solid and sync edges dashed; without one,
    the edges are the transitive reduction of the dependency DAG.
    """
    lines = ["digraph taskgraph {",
             f"  graph [rankdir=TB, label={_dot_quote(str(graph.meta.get('model') or ''))}];",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, '
             'fillcolor="#eeeeee"];']
    for t in graph.tasks:
        op = graph.op_of(t)
        title = _label(t.name, t.short_name) if t.kind == TaskKind.KERNEL else t.kind
        label = f"{_shorten(title)}\n#{t.id} {op.name if op else 'no op'}"
        attrs = [f"label={_dot_quote(label)}"]
        if t.name:
            attrs.append(f"tooltip={_dot_quote(_shorten(t.name, 400))}")
        if schedule is not None:
            s = schedule.stream_of[t.id]
            attrs.append(f'fillcolor="{_STREAM_COLOURS[s % len(_STREAM_COLOURS)]}"')
            attrs.append(f"xlabel={_dot_quote(f's{s}')}")
        lines.append(f"  t{t.id} [{', '.join(attrs)}];")
    if schedule is None:
        lines += [f"  t{u} -> t{v};" for u, v in transitive_reduction(build_dag(graph)).edges()]
    else:
        lines += [f"  t{u} -> t{v};" for u, v in schedule.stream_edges()]
        lines += [f'  t{u} -> t{v} [style=dashed, color="#d62728"];'
                  for u, v in schedule.sync_edges]
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_chrome_trace(graph: TaskGraph, schedule: Schedule,
                    times: Sequence[tuple[float, float]] | None = None,
                    late_edges: Sequence[tuple[int, int]] = ()) -> dict:
    """A Chrome trace (``{"traceEvents": [...]}``) of ``times`` (µs per task; default: the
    :func:`simulate` timeline; :mod:`nimble.debug.timeline` passes measured ones).

    One row (``tid``) per stream, one complete event per task (``ts``/``dur`` in µs), and a flow
    arrow per sync edge, and per late edge (named ``late``; :mod:`nimble.analysis.backfill`).  Open it in
    ``chrome://tracing`` or https://ui.perfetto.dev.
    """
    simulated = times is None
    times = simulate(graph, schedule) if simulated else times
    events: list[dict] = [{"ph": "M", "pid": 0, "tid": 0, "name": "process_name",
                           "args": {"name": f"nimble: {graph.meta.get('model') or 'model'}"}}]
    events += [{"ph": "M", "pid": 0, "tid": s, "name": "thread_name",
                "args": {"name": f"stream {s}"}} for s in range(len(schedule.streams))]
    for t in graph.tasks:
        begin, end = times[t.id]
        op = graph.op_of(t)
        events.append({
            "ph": "X", "pid": 0, "tid": schedule.stream_of[t.id], "ts": begin,
            "dur": end - begin, "cat": t.kind,
            "name": _label(t.name, t.short_name) if t.kind == TaskKind.KERNEL else t.kind,
            "args": {"task": t.id, "op": t.op, "op_name": op.name if op else None,
                     "module": op.module if op else None,
                     "duration_known": t.duration_us is not None},
        })
    arrows = [(u, v, "sync") for u, v in schedule.sync_edges] + \
        [(u, v, "late") for u, v in late_edges]
    for k, (u, v, kind) in enumerate(arrows):
        # Flow ends bind to the slice enclosing their timestamp, hence the start of each slice.
        events.append({"ph": "s", "pid": 0, "tid": schedule.stream_of[u], "ts": times[u][0],
                       "id": k, "name": kind, "cat": kind})
        events.append({"ph": "f", "bp": "e", "pid": 0, "tid": schedule.stream_of[v],
                       "ts": times[v][0], "id": k, "name": kind, "cat": kind})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"model": graph.meta.get("model"), "simulated": simulated}}


# ---- text -----------------------------------------------------------------------------------

def _mib(n: int | float) -> str:
    return f"{n / _MIB:,.2f} MiB"


def _us(x: float | None) -> str:
    return "unknown (no durations recorded)" if x is None else f"{x:,.1f} µs"


def _outside_arena_lines(outside: dict | None) -> list[str]:
    """The report's lines on the memory a prepared graph keeps beside its plan (the
    ``outside_arena`` rows ``nimble inspect`` adds): private copies of library memory, buffers
    kept at their recorded low address bits, each of the latter named."""
    if not outside or not (outside["private_copies"] or outside["low_bits"]):
        return []
    private = outside["private_copies"]
    out = [f"private copies of library memory: {len(private)}, "
           f"{_mib(sum(r['bytes'] for r in private))}"]
    if outside["low_bits"]:
        out.append("kept at their recorded low 32 address bits (a word into each may be an "
                   "integer under a stale top half):")
        out += [f"  buffer {r['buffer']} ({r['kind']}, {r['name']}): {_mib(r['bytes'])} "
                f"at {r['address']}" for r in outside["low_bits"]]
    return out


def format_summary(summary: dict, schedule: dict | None = None,
                   memplan: dict | None = None) -> str:
    """The human-readable report of ``nimble inspect``, from the dicts the summaries return."""
    s = summary
    out = [f"model: {s.get('model') or '(unnamed)'}"]
    kinds = ", ".join(f"{k} {c}" for k, c in s["tasks_by_kind"].items()) or "none"
    out.append(f"tasks: {s['tasks']} ({kinds})")
    out.append(f"ops: {s['ops']}; tasks with no op: {s['unattributed_tasks']}")
    if s.get("total_duration_us") is not None:
        out.append(f"recorded durations: {s['tasks_with_duration']}/{s['tasks']} tasks, "
                   f"{_us(s['total_duration_us'])} in total")
    if s["top_kernels"]:
        out.append("top kernels:")
        out += [f"  {k['count']:>6}  {k['short_name']}" for k in s["top_kernels"]]
    out.append(f"buffers: {s['buffers']}, {_mib(s['total_bytes'])}")
    for kind, count in s["buffers_by_kind"].items():
        if count:
            out.append(f"  {kind:<13}{count:>7}  {_mib(s['bytes_by_kind'][kind]):>14}")
    out.append(f"inputs: {s['inputs']}; outputs: {s['outputs']}")
    out.append(f"unresolved pointers: {s['unresolved_pointers']}")
    if s["meta"].get("words_not_pointers"):
        out.append(f"address-like words taken for integers, not pointers: "
                   f"{s['meta']['words_not_pointers']} (meta['not_pointer_words'])")
    for e in s.get("unresolved_examples", []):
        out.append(f"  task {e['task']} at {e['location']}: {e['value']}")
    out += _outside_arena_lines(s.get("outside_arena"))
    if schedule is not None:
        c = schedule
        limit = "unlimited" if c["max_streams"] is None else c["max_streams"]
        out.append(f"schedule (max streams: {limit}):")
        out.append(f"  streams: {c['streams']} (DAG width {c['width']}); "
                   f"sync edges: {c['sync_edges']}")
        for row in c.get("phases", []):
            out.append(f"  {row['name']}: {row['tasks']} tasks on {row['streams']} streams, "
                       f"{row['sync_edges']} sync edges (a graph of its own)")
        out.append(f"  dependency edges: {c['dag_edges']}, {c['reduced_edges']} after "
                   f"transitive reduction")
        out.append(f"  critical path: {c['critical_path_tasks']} tasks, "
                   f"{_us(c['critical_path_us'])}")
        if c.get("simulated_us") is not None:
            out.append(f"  simulated: {_us(c['simulated_us'])} on the schedule vs "
                       f"{_us(c['serial_us'])} serial")
        out.append(f"  analysis: {c['analysis_seconds']:.3f} s")
    if memplan is not None:
        m = memplan
        saved = 1 - m["arena_bytes"] / m["buffer_bytes"] if m["buffer_bytes"] else 0.0
        out.append("memory plan:")
        out.append(f"  arena: {_mib(m['arena_bytes'])} for {m['planned_buffers']} buffers of "
                   f"{_mib(m['buffer_bytes'])} ({saved:.0%} saved)")
        out.append(f"  lower bound: {_mib(m['lower_bound_bytes'])}")
    return "\n".join(out) + "\n"
