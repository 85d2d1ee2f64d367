"""Fitting a multi-stream schedule into an arena limit: workspace chains, then stream caps.

Concurrency costs memory: tasks that may run at once cannot share bytes.  When the widest
schedule's arena is over the limit, two ways of giving concurrency up are tried:

* **Stream caps** (:func:`capped_schedule`): fewer streams per phase keep fewer branches, and so
  fewer buffers, alive at once.  A cap is blunt: it serializes small kernels that would have run
  beside the big ones as well.
* **Workspace chains** (:func:`chain_workspaces`): the tasks whose library workspaces (scratch
  buffers) reach a threshold run one at a time, in recorded order, within their phase, so their
  workspaces can share bytes.  Those are the big convolutions and matrix products, which fill the
  GPU on their own; everything else keeps its concurrency, so a chain that fits usually keeps
  more streams and a shorter critical path than a cap alone (docs/findings.md has a training
  step that shows it).

:func:`schedule_within` tries the cap alone and then chains at halving thresholds, each followed
by the cap search, until a chain fits without a cap, and keeps the candidate whose schedule has
the shortest critical path (task durations where known, else task counts).
"""
from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Sequence

from .deps import Dag, build_dag, critical_path, dag_from_edges
from .memplan import MemPlan, plan_memory
from .schedule import Schedule, assign_phased, check_schedule, induced, phase_spans
from ..ir.taskgraph import BufferKind, TaskGraph

SMALLEST_CHAINED_WORKSPACE = 1 << 20  # below this a workspace is not worth a serialization
PATIENCE = 2  # thresholds in a row that may fail to shorten the schedule before the search stops


class Fitted(NamedTuple):
    """One schedule tried against the arena limit."""

    schedule: Schedule
    plan: MemPlan
    fits: bool  # the plan is within the limit
    lowered: frozenset  # the phases (by index) whose stream cap had to be lowered


def workspace_bytes(graph: TaskGraph) -> list[int]:
    """Per task, the bytes of the scratch buffers it touches (library workspaces)."""
    scratch = {b.id: b.size for b in graph.buffers if b.kind == BufferKind.SCRATCH}
    return [sum(scratch.get(b, 0) for b in {a.buffer for a in t.accesses}) for t in graph.tasks]


def chain_workspaces(graph: TaskGraph, dag: Dag, threshold: int,
                     workspaces: Sequence[int] | None = None,
                     phases: Iterable[int] | None = None) -> tuple[Dag, int]:
    """``dag`` with the tasks of ``threshold`` workspace bytes or more ordered one after another
    in recorded order within each phase (each of ``phases``, by index: None for all);
    ``(dag, tasks chained)``.

    Recorded order is a topological order, so the added edges keep the DAG acyclic, and they only
    add ordering: every schedule of the result is a schedule of ``dag``.
    """
    workspaces = workspace_bytes(graph) if workspaces is None else workspaces
    extra: list[tuple[int, int]] = []
    chained = 0
    spans = phase_spans(graph.meta.get("phases") or [], len(graph.tasks))
    for k in range(len(spans)) if phases is None else sorted(set(phases)):
        big = [t for t in spans[k] if workspaces[t] >= threshold]
        chained += len(big)
        extra += zip(big, big[1:])
    if not extra:
        return dag, chained
    return dag_from_edges(dag.n, dag.edges() + extra), chained


def capped_schedule(graph: TaskGraph, dag: Dag, max_streams: int | None,
                    arena_limit: int | None) -> Fitted:
    """Nimble's schedule of ``dag`` (at most ``max_streams`` streams per phase) and its memory
    plan, with the stream cap lowered until the plan fits ``arena_limit``.

    Where the plan needs more than ``arena_limit`` bytes, the cap is lowered step by step (by a
    quarter each time) until it fits or every phase is down to one stream: fewer concurrent
    branches keep fewer buffers alive at once.  The widest cap that fits is then sought between
    the last cap that fitted and the one before it (bisecting to within an eighth), since each
    stream given up can cost concurrency.  Last, each phase of a phased graph gets its cap back
    alone where the plan still fits: a training step's memory is the backward's to save (the
    forward's activations are all kept for it anyway), and capping the forward too would cost
    its concurrency for nothing.
    """
    phases = graph.meta.get("phases") or []
    spans = phase_spans(phases, len(graph.tasks))

    def attempt(caps: list) -> tuple[Schedule, MemPlan, int, bool]:
        schedule = assign_phased(dag, phases, max_streams=caps)
        check_schedule(dag, schedule)
        plan = plan_memory(graph, schedule.edges())
        widest = max((len({schedule.stream_of[t] for t in span}) for span in spans), default=0)
        return schedule, plan, widest, arena_limit is None or plan.arena_bytes <= arena_limit

    def uniform(cap: int | None) -> list:
        return [cap] * max(len(spans), 1)

    schedule, plan, widest, fits = attempt(uniform(max_streams))
    too_wide = None  # the narrowest cap known not to fit
    cap = max_streams
    while not fits and widest > 1:
        too_wide = widest
        cap = max(1, min(widest - 1, widest * 3 // 4))
        schedule, plan, widest, fits = attempt(uniform(cap))
    if too_wide is None:
        return Fitted(schedule, plan, fits, frozenset())
    if not fits:
        return Fitted(schedule, plan, fits, frozenset(range(len(spans))))
    while too_wide - cap > max(1, cap // 8):
        middle = (cap + too_wide) // 2
        wider = attempt(uniform(middle))
        if wider[3]:
            schedule, plan, cap = wider[0], wider[1], middle
        else:
            too_wide = middle
    caps = uniform(cap)
    for k in range(len(spans) if len(spans) > 1 else 0):
        relaxed = caps[:k] + [max_streams] + caps[k + 1:]
        wider = attempt(relaxed)
        if wider[3]:
            schedule, plan, caps = wider[0], wider[1], relaxed
    return Fitted(schedule, plan, True,
                  frozenset(k for k, c in enumerate(caps) if c != max_streams))


def schedule_length(schedule: Schedule, n: int, durations: Sequence[float] | None) -> float:
    """The critical path of ``schedule``'s edges: µs of ``durations``, or tasks without them.
    Phases are launched one after another, so their critical paths add up."""
    dag = dag_from_edges(n, schedule.edges())
    return sum(critical_path(induced(dag, span), None if durations is None
                             else list(durations[span.start:span.stop])).length
               for span in phase_spans(schedule.phases, n) if len(span))


def schedule_within(graph: TaskGraph, max_streams: int | None, arena_limit: int | None,
                    durations: Sequence[float] | Callable[[], Sequence[float]] | None = None
                    ) -> tuple[Schedule, MemPlan]:
    """Nimble's schedule (at most ``max_streams`` streams per phase) and its memory plan, fitted
    into ``arena_limit`` bytes (None: no limit).

    The cap search alone first (:func:`capped_schedule`).  In the phases where it had to lower
    the cap, the tasks with the largest workspaces are chained (:func:`chain_workspaces`) at
    thresholds halving from the largest workspace down to :data:`SMALLEST_CHAINED_WORKSPACE`,
    each followed by the cap search, until a chain fits with no cap lowered (or :data:`PATIENCE` thresholds in a
    row gave nothing shorter: each try costs a cap search).  Of the candidates that fit, the
    one with the shortest critical path on its schedule's edges wins (``durations``: each task's
    isolated µs, or a callable giving them, called only when the limit binds; without them each
    task counts one), the cap alone on a tie.
    """
    dag = build_dag(graph)
    best = capped_schedule(graph, dag, max_streams, arena_limit)
    if not best.lowered:
        return best.schedule, best.plan
    phases = best.lowered
    if callable(durations):
        durations = durations()  # timing the tasks costs seconds: only where there is a choice
    n = len(graph.tasks)
    workspaces = workspace_bytes(graph)
    best_length = schedule_length(best.schedule, n, durations) if best.fits else float("inf")
    threshold = max(workspaces, default=0)
    chained_before, misses = 0, 0
    while threshold >= SMALLEST_CHAINED_WORKSPACE and misses < PATIENCE:
        chained_dag, chained = chain_workspaces(graph, dag, threshold, workspaces, phases)
        threshold //= 2
        if chained == chained_before or chained_dag.num_edges == dag.num_edges:
            continue  # no new ordering at this threshold
        chained_before = chained
        tried = capped_schedule(graph, chained_dag, max_streams, arena_limit)
        length = schedule_length(tried.schedule, n, durations) if tried.fits else float("inf")
        if length < best_length:
            best, best_length, misses = tried, length, 0
        else:
            misses += 1
        if tried.fits and not tried.lowered:
            break  # a lower threshold only serializes more
    return best.schedule, best.plan
