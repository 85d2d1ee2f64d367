"""The proof's race fuzzer: verification-only copies of every phase with delay nodes before tasks.

A race in a schedule (two tasks that touch the same bytes, at least one writing, with no path
between them) gives a wrong answer only when the GPU runs the two in the wrong order, which a
few launches of the served graph may never do.  The fuzz copies drive the interleavings: a
delayable task of a copy waits for a ``nimble_delay`` node (``kernels/delay.ptx``) that waits
for the task's predecessors and spins for the nanoseconds its slot of the delay table holds.

Before every fuzz launch the arena is poisoned again (``repoison``), so every launch of a copy
reads only what it wrote itself, and the launch's row of delays is copied into the table.  All
rows are drawn when the copies are built and uploaded with one copy; each launch's row goes to
the table by a device-to-device copy in stream order, so the host never waits for a launch
before the next (only the bitwise check of each launch's outputs does).

Four kinds of draw (:data:`CHAINED`, :data:`TARGETED`, :data:`STREAM`, :data:`PER_TASK`):

* **Targeted** (where the copies know the arena offsets, ``offsets``): the cross-stream hazard
  pairs of the schedule (:mod:`nimble.analysis.hazards`) name the *targets*, each task E that
  touches bytes a later task L on another stream touches, one of them writing.  A missing
  synchronization from E to L usually has slack of whole kernels: L also waits for its own
  stream's work (a convolution, say), which a small E beats every time.  Only a delay longer
  than that slack on E, and none on L's side, shows the race; delays of a task's own size on
  both sides cancel out.  A targeted draw holds back an antichain of targets
  (:class:`~nimble.analysis.hazards.TargetedPicks`: none of a pick's partners is a pick or below
  another pick) by the phase's critical path each (:func:`heavy_delay_ns`), and nothing else.
  Only the targets get delay nodes: a delay node is a launch of its own on every path through
  it, so fewer of them keep the copy's launches and its build short.
* **Chained**: the same targets, but a pick may lie below another where that one is above its
  partners only through it (the delays add up along the path, and the pick still ends its own
  delay behind its partners), each held back by :data:`CHAIN_LEAD_FACTOR` times its natural
  lead over its partners (longest paths over the isolated durations) plus the heavy floor,
  within the critical path, at most :data:`CHAIN_BUDGET_FACTOR` critical paths per phase in
  all.  An antichain holds one target of a block of a deep network (every later block lies
  below it); a chain holds one of every block, so a cover takes far fewer launches where the
  leads are short (nasnetalarge: 18 chained launches against 179 antichains on the fixture).
* **Per stream, heavy**: each stream is slow with probability :data:`SLOW_STREAM_CHANCE`, and on
  a slow stream one delayable task, picked at random, waits between half and all of its
  phase's critical path.
* **Per task**: each delayable task is delayed with probability one half, by a time drawn
  log-uniformly between :data:`MIN_DELAY_NS` and a cap of twice the longest isolated duration of
  the phase's tasks (``Task.duration_us``; :data:`UNTIMED_CAP_NS` where none is known), at most
  :data:`MAX_DELAY_NS`.  This reorders tasks whose natural start times lie close together.

The mix: targeted draws only until every target of a *direct* hazard (a pair that one
synchronization edge of the schedule orders alone, the edge a missing sync would be: its two
tasks, or its target and a task before its source on the source's stream;
:func:`~nimble.analysis.hazards.direct_hazards`) was held back both ways, chained first (cheap where the leads are short), then as antichains (safe where a lead
was underestimated: the heavy delay exceeds any slack the isolated durations allow); a race
there needs its writer held back and nothing else, which the targeted draws do and the random
kinds seldom do (docs/findings.md).  After that, two targeted draws (every hazard's targets,
chained then held, then fresh held sets) to one random draw, the two random kinds in turn: a
race the targeted picks miss (the reader's side slowed by a delay elsewhere, a slack longer
than the critical path) may come up in a random order.  Without ``offsets`` there are no targets: every
task gets a delay node and the random kinds take turns, two heavy draws to one per-task draw.

Why the heavy, targeted and chained kinds exist, with the catch rates of each kind:
docs/findings.md.

The copies are built through :class:`~nimble.engine.rebuild.PhaseBuilder` from the served graph's
own nodes (same gathers, priorities, late edges, arena, inputs and outputs); the served graph has
no delay node.  :class:`FuzzCopies` owns them with the table, and is closed after the proof.
"""
from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

import numpy as np

from .. import driver
from ..analysis.orders import reversing_orders
from ..analysis.hazards import (CHAINED, HELD, ChainCosts, Hazard, Pick, TargetedPicks,
                               cross_stream_hazards, direct_hazards, lead_us)
from ..ir.taskgraph import TaskGraph, TaskKind
from .build import BuiltGraph, DelaySpec, chained_copy
from .launcher import CallOrder, Launcher, run_phases
from .proof import poison
from .rebuild import PhaseBuilder, PhaseOptions

#: The shortest delay drawn: below it the delay node's own launch dominates.
MIN_DELAY_NS = 500
#: The cap where no task of a phase has a known duration.
UNTIMED_CAP_NS = 8_000
#: No delay beyond this: a longer one only slows the proof down.
MAX_DELAY_NS = 500_000
#: The chance that a task is delayed in one draw (one half gives a pair of tasks the most
#: draws with one delayed and the other not).
DELAY_CHANCE = 0.5
#: The chance that a stream is slow in a heavy draw: a race needs the writer's stream slow and
#: the few streams on the reader's side fast.
SLOW_STREAM_CHANCE = 1 / 3
#: Bounds of the heavy delay (ns): a critical path shorter than the first still needs a delay
#: past the launch overheads; the second keeps a fuzz launch of a large model affordable.
HEAVY_DELAY_NS = (20_000, 5_000_000)


def delay_caps_ns(graph: TaskGraph, spans: Sequence[range]) -> np.ndarray:
    """Per task, the longest delay it may be drawn (nanoseconds): twice the longest known
    duration of its phase, :data:`UNTIMED_CAP_NS` where the phase has none, within
    ``[2 * MIN_DELAY_NS, MAX_DELAY_NS]``."""
    caps = np.full(len(graph.tasks), UNTIMED_CAP_NS, dtype=np.int64)
    for span in spans:
        known = [graph.tasks[t].duration_us for t in span
                 if graph.tasks[t].duration_us is not None]
        if known:
            caps[span.start:span.stop] = int(2_000 * max(known))
    return np.clip(caps, 2 * MIN_DELAY_NS, MAX_DELAY_NS)


def _log_uniform(rng: np.random.Generator, caps_ns: np.ndarray) -> np.ndarray:
    low = math.log(MIN_DELAY_NS)
    high = np.log(caps_ns.astype(np.float64))
    return np.exp(low + rng.random(len(caps_ns)) * (high - low))


def draw_delays(rng: np.random.Generator, caps_ns: np.ndarray) -> np.ndarray:
    """A per-task draw: a u32 of nanoseconds per task, 0 for the tasks not delayed (see the
    module docstring for the distribution)."""
    chosen = rng.random(len(caps_ns)) < DELAY_CHANCE
    return np.where(chosen, _log_uniform(rng, caps_ns), 0).astype(np.uint32)


def heavy_delay_ns(graph: TaskGraph, edges: Sequence[tuple[int, int]],
                   span: range | None = None) -> int:
    """The heavy delay's scale: the critical path of the known durations of the tasks of
    ``span`` (ns; None: every task), within :data:`HEAVY_DELAY_NS`; its upper bound where no
    duration is known."""
    from ..analysis.deps import critical_path, dag_from_edges

    span = range(len(graph.tasks)) if span is None else span
    durations = [(t.duration_us or 0.0) if t.id in span else 0.0 for t in graph.tasks]
    if not any(durations):
        return HEAVY_DELAY_NS[1]
    inside = [(u, v) for u, v in edges if u in span and v in span]
    # A backfill's late edges go against task order.
    length = critical_path(dag_from_edges(len(graph.tasks), inside, ordered=False),
                           durations).length
    return int(min(max(1000 * length, HEAVY_DELAY_NS[0]), HEAVY_DELAY_NS[1]))


def phase_heavy_ns(graph: TaskGraph, edges: Sequence[tuple[int, int]],
                   spans: Sequence[range]) -> np.ndarray:
    """Per task, the heavy delay of its phase (:func:`heavy_delay_ns`)."""
    heavy = np.full(len(graph.tasks), HEAVY_DELAY_NS[1], dtype=np.int64)
    for span in spans:
        heavy[span.start:span.stop] = heavy_delay_ns(graph, edges, span)
    return heavy


def draw_stream_delays(rng: np.random.Generator, stream_of: np.ndarray,
                       heavy_ns) -> np.ndarray:
    """A heavy draw: on each slow stream one random task waits between half and all of
    ``heavy_ns`` (one scale, or one per task); every other task not at all, nor any task whose
    stream is negative (see the module docstring)."""
    heavy = np.broadcast_to(np.asarray(heavy_ns, dtype=np.int64), stream_of.shape)
    delays = np.zeros(len(stream_of), dtype=np.uint32)
    for stream in np.unique(stream_of[stream_of >= 0]):
        if rng.random() >= SLOW_STREAM_CHANCE:
            continue
        task = rng.choice(np.flatnonzero(stream_of == stream))
        delays[task] = int(heavy[task] * (0.5 + 0.5 * rng.random()))
    return delays


def draw_targeted(n: int, picked: Pick, heavy_ns: np.ndarray) -> np.ndarray:
    """A targeted or chained draw of ``n`` tasks: the picked tasks wait their own delays (a
    chained pick) or their phase's heavy delay (a held one), no other task."""
    delays = np.zeros(n, dtype=np.uint32)
    tasks = np.asarray(picked.tasks, dtype=np.int64)
    delays[tasks] = heavy_ns[tasks] if picked.delays_ns is None else picked.delays_ns
    return delays


#: The kinds of draw (see the module docstring).
TARGETED, CHAINED, STREAM, PER_TASK = HELD, CHAINED, "stream", "per-task"
#: A chained pick waits this many times its natural lead over its partners (isolated durations
#: on the longest paths; kernels beside it stretch the real lead), plus the heavy delay's floor.
CHAIN_LEAD_FACTOR = 3.0
#: The chained picks of one launch wait at most this many critical paths of their phase in all.
CHAIN_BUDGET_FACTOR = 2.0
#: Zero-delay launches that open the fuzz part and time each phase's copy as it really runs:
#: the isolated durations leave out the kernels beside each task and every node's launch, so
#: a copy's launch can outlast the critical path they give (googlenet fp16 on an H200: 396 us
#: against 363; docs/findings.md).  The last one's times are used (the first includes the
#: exec's upload).
CALIBRATION_LAUNCHES = 2
#: After the calibration, a held pick waits at least this many times its phase's measured
#: launch, and every other delay is stretched by the same factor: a writer that may run at
#: the start of its phase (a batch norm's first kernel needs only the weights) must still be
#: running when its reader near the phase's end starts.
HEAVY_OVER_LAUNCH = 1.5
#: The draw kind of a calibration launch (no delay).
CALIBRATION = "calibration"
#: The draw kind of a serial-order launch (:mod:`nimble.analysis.orders`).
ORDER = "order"


def delay_scale(heavy_ns: np.ndarray, spans: Sequence[range],
                launch_ns: Sequence[float]) -> np.ndarray:
    """Per task, the factor (at least 1) that stretches its phase's heavy delay to
    :data:`HEAVY_OVER_LAUNCH` times the phase's measured launch ``launch_ns[k]``, within
    :data:`HEAVY_DELAY_NS`."""
    scale = np.ones(len(heavy_ns), dtype=np.float64)
    for span, measured in zip(spans, launch_ns):
        if not len(span):
            continue
        heavy = float(heavy_ns[span.start])
        wanted = min(max(heavy, HEAVY_OVER_LAUNCH * measured), HEAVY_DELAY_NS[1])
        scale[span.start:span.stop] = max(wanted / heavy, 1.0) if heavy > 0 else 1.0
    return scale


def scaled(delays: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``delays`` (ns per task) times ``scale``, at most the heavy delay's upper bound."""
    out = np.minimum(np.rint(delays.astype(np.float64) * scale), HEAVY_DELAY_NS[1])
    return out.astype(np.uint32)


class Draws:
    """The seeded sequence of draws of one set of fuzz copies, in the module docstring's mix.

    ``picks`` (None: no targets) chooses the targeted and chained draws (a held pick waits
    ``heavy_ns`` of its task); only ``delayable`` tasks are ever delayed.  :meth:`next`
    returns ``(kind, delays)``, a u32 of nanoseconds per task.
    """

    def __init__(self, caps_ns: np.ndarray, heavy_ns: np.ndarray, stream_of: np.ndarray | None,
                 picks: TargetedPicks | None, delayable: np.ndarray, seed: int = 0,
                 hazards: Sequence[Hazard] = ()) -> None:
        self.caps_ns, self.heavy_ns, self.picks = caps_ns, heavy_ns, picks
        #: The cross-stream hazard pairs the picks were made from (none without targets).
        self.hazards = list(hazards)
        self.delayable = delayable
        self.stream_of = None if stream_of is None else np.where(delayable, stream_of, -1)
        self._rng = np.random.default_rng(seed)
        self._random_draws = 0  # of the two random kinds, for their turns
        self.count = 0

    def _random_kind(self) -> str:
        picks = self.picks
        if self.stream_of is None:
            return PER_TASK
        if picks is None or not picks.targets:
            return STREAM if self.count % 3 else PER_TASK
        self._random_draws += 1
        return STREAM if self._random_draws % 2 else PER_TASK

    def next(self) -> tuple[str, np.ndarray]:
        picks = self.picks
        targeted = picks is not None and bool(picks.targets) and \
            (not picks.direct_done or self.count % 3 != 2)
        kind = None if targeted else self._random_kind()
        self.count += 1
        if kind is None:
            picked = picks.next()
            return picked.kind, draw_targeted(len(self.heavy_ns), picked, self.heavy_ns)
        if kind == STREAM:
            return kind, draw_stream_delays(self._rng, self.stream_of, self.heavy_ns)
        delays = draw_delays(self._rng, self.caps_ns)
        delays[~self.delayable] = 0
        return kind, delays


def chain_costs(graph: TaskGraph, hazards: Sequence[Hazard], edges: Sequence[tuple[int, int]],
                spans: Sequence[range], heavy_ns: np.ndarray) -> ChainCosts:
    """What the chained picks of ``hazards`` spend (:class:`~nimble.analysis.hazards.
    ChainCosts`): each target :data:`CHAIN_LEAD_FACTOR` times its lead over its partners plus
    the heavy floor, within the heavy delay (the heavy delay in a phase with no known
    duration), at most :data:`CHAIN_BUDGET_FACTOR` heavy delays per phase and launch."""
    n = len(graph.tasks)
    durations = [t.duration_us or 0.0 for t in graph.tasks]
    lead = lead_us(n, hazards, edges, durations)
    delay = heavy_ns.copy()
    phase_of = np.zeros(n, dtype=np.int64)
    for k, span in enumerate(spans):
        phase_of[span.start:span.stop] = k
        if not any(durations[t] for t in span):
            continue
        for t in span:
            if t in lead:
                delay[t] = min(int(CHAIN_LEAD_FACTOR * 1000 * lead[t]) + HEAVY_DELAY_NS[0],
                               int(heavy_ns[t]))
    budget = (CHAIN_BUDGET_FACTOR * heavy_ns).astype(np.int64)
    return ChainCosts(delay.tolist(), budget.tolist(), phase_of.tolist())


@dataclass
class FuzzStats:
    """What the fuzz launches ran (recorded in ``graph.meta["verified"]``)."""

    launches: int = 0
    draws: int = 0
    delayed: int = 0  # tasks delayed, summed over the draws
    max_delay_ns: int = 0
    first_draw_at: float | None = None  # time.perf_counter() at the first draw
    kinds: dict[str, int] = field(default_factory=dict)  # draws of each kind
    last_kind: str = ""  # the kind of the latest draw (the one a failing launch ran)
    targets: int = 0  # tasks the targeted draws may hold back
    targets_held: int = 0  # of them, held back by the draws run so far
    launch_ms: list[float] = field(default_factory=list)  # per phase, the calibrated launch
    delay_scale: list[float] = field(default_factory=list)  # per phase, what delays were scaled
    orders: list[int] = field(default_factory=list)  # per phase, its serial orders
    unordered_pairs: int = 0  # pairs of tasks of one phase that no path orders
    pairs_left: int = 0  # of them, run later-first by no serial order
    pairs_pinned: int = 0  # of them, a memset's or memcpy's, kept in recorded order on purpose

    def count(self, kind: str, delays: np.ndarray, targets_held: int) -> None:
        """Note one draw of ``kind``."""
        self.draws += 1
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.last_kind = kind
        self.delayed += int(np.count_nonzero(delays))
        self.max_delay_ns = max(self.max_delay_ns, int(delays.max(initial=0)))
        self.targets_held = max(self.targets_held, targets_held)

    def as_meta(self) -> dict:
        return {"fuzz_launches": self.launches, "delay_draws": self.draws,
                "tasks_delayed_per_draw": self.delayed / self.draws if self.draws else 0.0,
                "max_delay_us": self.max_delay_ns / 1000, "draw_kinds": dict(self.kinds),
                "fuzz_targets": self.targets, "fuzz_targets_held": self.targets_held,
                "fuzz_launch_ms": list(self.launch_ms), "delay_scale": list(self.delay_scale),
                "serial_orders": list(self.orders), "unordered_pairs": self.unordered_pairs,
                "pairs_not_reversed": self.pairs_left, "pairs_pinned": self.pairs_pinned}


class PhaseClock:
    """Device time of each phase of the fuzz copies' launches: an event recorded before every
    phase and after the last, on the launch stream; owns the events."""

    def __init__(self, phases: int) -> None:
        self.events = [driver.Event.create(timing=True) for _ in range(phases + 1)]
        self._stream = None

    def mark(self, stream) -> Callable[[int], None]:
        """The ``mark`` of :func:`~nimble.engine.launcher.run_phases` recording on ``stream``."""
        def mark(k: int) -> None:
            driver.record_event(self.events[k].handle, stream)
        return mark

    def read_ms(self) -> list[float]:
        """Each phase's milliseconds in the launch last marked (waits for it to end)."""
        driver.event_synchronize(self.events[-1].handle)
        return [driver.event_elapsed_ms(a.handle, b.handle)
                for a, b in zip(self.events, self.events[1:])]

    def close(self) -> None:
        for event in self.events:
            event.close()


class FuzzCopies:
    """Verification copies of every phase, their launchers over the served slots and outputs,
    the delay table and the rows of drawn delays: owned together, freed by :meth:`close`
    (idempotent) or when collected.

    ``run(inputs)`` runs every phase in order like the served launchers; :meth:`draw` readies
    the next launch first (and queues the arena's poison).  The launches go in three parts:

    1. with ``orders``, one launch per serial order (:mod:`nimble.analysis.orders`): each phase
       a chain of its tasks in a linear extension of the copy's own DAG, so that every pair of
       tasks the copy leaves unordered runs later-first in one of them (built with the
       copies; :attr:`required` counts them);
    2. ``calibration`` launches of the delay-noded copy with no delay, timing each phase
       (:class:`PhaseClock`); every drawn delay is then stretched (:func:`delay_scale`) and the
       rows uploaded with one copy;
    3. the drawn rows, one per launch (``rows`` drawn up front, later ones written as they
       come, after the GPU has caught up).

    Where there are serial orders, the delay-noded copy, its targets and its first rows are
    made when the first launch after the orders is drawn (:meth:`build_delays`), so a budget
    that ends with the orders costs none of it.  ``offsets`` (each planned buffer's arena offset
    in the copies) and ``stream_of`` give the targeted draws and the pairs the orders keep
    (:func:`_pins`).  ``options`` change the copies further (a power measurement's broken
    copies: the serial orders follow the copy's edges, not the served ones); with
    ``delays=False`` there are no orders, no delay nodes and no table, and :meth:`draw` draws
    nothing.
    """

    def __init__(self, builder: PhaseBuilder, served: Sequence[Launcher], device,
                 seed: int = 0, options: PhaseOptions | None = None,
                 delays: bool = True, stream_of: Sequence[int] | None = None,
                 repoison: Sequence[tuple[int, int]] = (),
                 offsets: Mapping[int, int] | None = None, rows: int = 100,
                 calibration: int = CALIBRATION_LAUNCHES, orders: bool = True) -> None:
        n = len(builder.graph.tasks)
        #: ``(address, size)`` ranges poisoned again before every fuzz launch (the arena).
        self.repoison = list(repoison)
        self.spans = list(builder.spans)
        self.table = self.rows = self.draws = None
        self.builts: list[BuiltGraph] = []  # the delay-noded copy's, one per phase
        self.order_builts: list[BuiltGraph] = []  # the serial orders' clones
        self.launchers: list[Launcher] = []  # the delay-noded copy's, one per phase
        self._owned: list[Launcher] = []  # every launcher made here
        self._memories: list = []
        self._clocks: list[PhaseClock] = []
        self._bases: list[BuiltGraph] = []  # the clones' originals
        self._finalizer = weakref.finalize(self, driver.close_all, self._owned,
                                           self.order_builts, self._bases, self.builts,
                                           self._memories, self._clocks)
        self._served = list(served)
        self.stats = FuzzStats()
        #: Per serial-order launch, its launcher of every phase.
        self.order_launchers: list[list[Launcher]] = []
        options = options or PhaseOptions()
        self._builder, self._options, self._device = builder, options, device
        self._seed, self._rows, self._stream_of, self._offsets = seed, rows, stream_of, offsets
        self._hazards = cross_stream_hazards(builder.graph, offsets, list(stream_of),
                                             self.spans) \
            if delays and stream_of is not None and offsets is not None else []
        self.plan = reversing_orders(
            [e for k in range(len(self.spans)) for e in builder.edges_of(k, options)],
            self.spans, pins=_pins(builder.graph, self._hazards)) if delays and orders else []
        self.calibration = calibration if delays else 0
        #: The serial-order launches: every one runs, whatever the budget.
        self.required = max((len(p.orders) for p in self.plan), default=0)
        self._kinds: list[str] = []
        self._held: list[int] = []
        self._drawn: list[np.ndarray] = []
        self._copy = None
        self._mark = None
        self._active: list[Launcher] | None = None
        self._order = CallOrder()
        self._context = driver.current_context()
        #: Per task, the factor every delay is stretched by (ones until the calibration ends).
        self.scale = np.ones(n, dtype=np.float64)
        #: The launches (serial orders and calibration included) whose draws hold back every
        #: target of a direct hazard (the writers of the schedule's synchronizations) at least
        #: once; None where the rows do not (or are not drawn yet).
        self.direct_cover: int | None = None
        self._delays = delays
        try:
            self._build_orders()
            if not delays:  # the phases as served, over the copy's changes
                for k in range(len(self.spans)):
                    self.builts.append(builder.build(k, options))
                    self.launchers.append(self._launcher(k, self.builts[-1]))
            elif not self.required:
                self.build_delays()
        except BaseException:
            self.close()
            raise

    def _launcher(self, k: int, built: BuiltGraph) -> Launcher:
        served = self._served[k]
        made = Launcher(built.exec.handle, served.slots, self._device, served.outputs, None,
                        self._context, served.rng, order=self._order)
        self._owned.append(made)
        return made

    def _build_orders(self) -> None:
        """One copy per phase and serial order (none with delays), each a clone of one build
        of the phase without edges (:func:`~nimble.engine.build.chained_copy`); a launch of a
        phase with fewer orders repeats its last, and one of a phase with none runs the
        phase as served."""
        builder = self._builder
        per_phase: list[list[Launcher]] = []
        for k, found in enumerate(self.plan):
            if not found.orders:
                per_phase.append([])
                continue
            base = builder.build(k, replace(self._options, order=()))
            self._bases.append(base)
            mine = []
            for o in found.orders:
                self.order_builts.append(chained_copy(base, o))
                mine.append(self._launcher(k, self.order_builts[-1]))
            per_phase.append(mine)
        self.order_launchers = [
            [mine[min(j, len(mine) - 1)] if mine else self._served[k]
             for k, mine in enumerate(per_phase)] for j in range(self.required)]
        self.stats.orders = [len(p.orders) for p in self.plan]
        self.stats.unordered_pairs = sum(p.pairs for p in self.plan)
        self.stats.pairs_left = sum(p.left for p in self.plan)
        self.stats.pairs_pinned = sum(p.pinned for p in self.plan)

    def build_delays(self) -> None:
        """The delay-noded copies, their targets, the first rows and the table (once)."""
        if self.draws is not None or not self._delays:
            return
        builder, n = self._builder, len(self.scale)
        self.draws = _draws(builder, self._stream_of, self._offsets, self._seed, self._hazards)
        self.stats.targets = len(self.draws.picks.targets) if self.draws.picks else 0
        self._draw_rows(self._rows)
        self.table = driver.DeviceMemory.allocate(max(4 * n, 4))
        self._memories.append(self.table)
        driver.copy_to_device(self.table.address, bytes(4 * n))
        if self.calibration:
            self._clocks.append(PhaseClock(len(builder.spans)))
        tasks = None if self.draws.picks is None else \
            set(np.flatnonzero(self.draws.delayable).tolist())
        options = replace(self._options, delays=DelaySpec(self.table.address, tasks=tasks))
        for k in range(len(builder.spans)):
            self.builts.append(builder.build(k, options))
            self.launchers.append(self._launcher(k, self.builts[-1]))
        if not self.calibration:
            self._upload()

    def _draw_rows(self, rows: int) -> None:
        """Draw ``rows`` rows (on the host) and find the direct cover among them."""
        picks = self.draws.picks
        for _ in range(max(rows, 0)):
            kind, delays = self.draws.next()
            self._kinds.append(kind)
            self._held.append(self._targets_held())
            self._drawn.append(delays)
            if self.direct_cover is None and picks is not None and picks.direct_done:
                self.direct_cover = self.required + self.calibration + len(self._drawn)

    def _upload(self) -> None:
        """The drawn rows, stretched by :attr:`scale`, to the device in one copy."""
        if not self._drawn:
            return
        n = len(self.scale)
        self._drawn = [scaled(d, self.scale) for d in self._drawn]
        self.rows = driver.DeviceMemory.allocate(max(4 * n * len(self._drawn), 4))
        self._memories.append(self.rows)
        driver.copy_to_device(self.rows.address, np.concatenate(self._drawn).tobytes())
        self._copy = driver.CallPath().copy

    def _calibrated(self) -> None:
        """After the calibration launches: the stretch from the last one's phase times, then
        the rows' upload."""
        ms = self._clocks[0].read_ms()
        self.scale = delay_scale(self.draws.heavy_ns, self.spans, [1e6 * t for t in ms])
        self.stats.launch_ms = [round(t, 4) for t in ms]
        self.stats.delay_scale = [round(float(self.scale[s.start]), 3) if len(s) else 1.0
                                  for s in self.spans]
        self._upload()

    def _targets_held(self) -> int:
        """How many targets a targeted or chained draw has held back so far."""
        picks = self.draws.picks
        if picks is None:
            return 0
        return len(set().union(*(t.covered | t.chained for t in picks.tiers)))

    def draw(self) -> None:
        """Ready the next launch: a serial order, a calibration, or the next row of delays
        queued into the table in stream order after the previous launch; and the arena's
        poison."""
        import torch

        if not self._delays:
            return
        if self.stats.first_draw_at is None:
            self.stats.first_draw_at = time.perf_counter()
        launch = self.stats.draws
        n = len(self.scale)
        self._mark, self._active = None, None
        if launch < self.required:
            kind, delays, held = ORDER, np.zeros(n, dtype=np.uint32), 0
            self._active = self.order_launchers[launch]
            stream = self._active[0].stream()
        else:
            self.build_delays()
            stream = self.launchers[0].stream()
            i = launch - self.required - self.calibration
            if i < 0:  # the table still holds no delay
                kind, delays, held = CALIBRATION, np.zeros(n, dtype=np.uint32), 0
                self._mark = self._clocks[0].mark(stream)
            else:
                if i == 0 and self.calibration:
                    self._calibrated()
                if i < len(self._drawn):
                    kind, delays, held = self._kinds[i], self._drawn[i], self._held[i]
                    self._copy(self.table.address, self.rows.address + 4 * n * i, 4 * n, stream)
                else:
                    kind, drawn = self.draws.next()
                    delays = scaled(drawn, self.scale)
                    held = self._targets_held()
                    torch.cuda.synchronize()  # the previous launch has read the table
                    driver.copy_to_device(self.table.address, delays.tobytes())
        # Every launch starts from a poisoned arena: a read that a race moves before its write
        # then sees NaNs, even where the write puts the same bytes every launch (a buffer that
        # depends on the weights alone), which the previous launch would have left in place.
        if self.repoison:
            poison(self.repoison, stream)
        self.stats.count(kind, delays, held)

    def run(self, inputs: list) -> list:
        """Every phase's copy in order on its share of ``inputs``: the flat outputs (a serial
        order's copies, or the delay-noded ones, a calibration launch timed phase by phase)."""
        self.stats.launches += 1
        return run_phases(self._active or self.launchers, self._mark)(inputs)

    def close(self) -> None:
        """Free the copies, their launchers, the table, the rows and the clock (idempotent).
        The copies wrote the served input cells: the served launchers' next calls write every
        cell again."""
        self._finalizer()
        for launcher in self._served:
            launcher.forget_cells()


def _pins(graph: TaskGraph, hazards: Sequence[Hazard]) -> list[tuple[int, int]]:
    """The pairs the serial orders keep in recorded order (:mod:`nimble.analysis.orders`): a
    memset or memcpy and a later task touching the bytes it writes."""
    return [(h.earlier, h.later) for h in hazards if h.kind.startswith("write")
            and graph.tasks[h.earlier].kind != TaskKind.KERNEL]


def _draws(builder: PhaseBuilder, stream_of: Sequence[int] | None,
           offsets: Mapping[int, int] | None, seed: int,
           hazards: Sequence[Hazard] | None = None) -> Draws:
    """The draws of copies built by ``builder``: :func:`plan_draws` over the served edges
    inside each phase, late ones included."""
    phase_of = np.zeros(len(builder.graph.tasks), dtype=np.int64)
    for k, span in enumerate(builder.spans):
        phase_of[span.start:span.stop] = k
    # Each phase is a launch of its own: a delay in one never moves tasks of another apart.
    edges = [(u, v) for u, v in list(builder.edges) + list(builder.late_edges)
             if phase_of[u] == phase_of[v]]
    return plan_draws(builder.graph, builder.spans, edges, stream_of, offsets, seed, hazards)


def plan_draws(graph: TaskGraph, spans: Sequence[range], edges: Sequence[tuple[int, int]],
               stream_of: Sequence[int] | None, offsets: Mapping[int, int] | None,
               seed: int, hazards: Sequence[Hazard] | None = None) -> Draws:
    """The draws of fuzz copies of ``graph`` run with ``edges`` (each inside its phase):
    targeted where ``offsets`` and ``stream_of`` are known (``hazards``: their cross-stream
    hazards, where already found), else random on every task.  No GPU:
    ``tools/fuzz_cover.py`` runs them on recorded fixtures."""
    n = len(graph.tasks)
    streams = None if stream_of is None else np.asarray(stream_of, dtype=np.int64)
    picks = None
    heavy = phase_heavy_ns(graph, edges, spans)
    delayable = np.ones(n, dtype=bool)
    if streams is not None and offsets is not None:
        if hazards is None:
            hazards = cross_stream_hazards(graph, offsets, streams.tolist(), spans)
        direct = direct_hazards(hazards, edges, streams.tolist())
        chain = [chain_costs(graph, tier, edges, spans, heavy) for tier in (direct, hazards)]
        picks = TargetedPicks(n, hazards, edges, seed, chain, direct)
        delayable[:] = False
        delayable[picks.targets] = True
    else:
        hazards = []
    return Draws(delay_caps_ns(graph, spans), heavy, streams, picks, delayable, seed, hazards)
