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

The draws (which tasks wait, how long, launch by launch) are :mod:`nimble.analysis.delays`'s.
Before them come the serial orders (:mod:`nimble.analysis.orders`): each phase a chain of its
tasks, in a few linear extensions that together run every unordered pair the other way round.

The copies are built through :class:`~nimble.engine.rebuild.PhaseBuilder` from the served graph's
own nodes (same gathers, priorities, late edges, arena, inputs and outputs); the served graph has
no delay node.  :class:`FuzzCopies` owns them with the table, and is closed after the proof.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

import numpy as np

from .. import driver
from ..analysis.delays import Draws, delay_scale, plan_draws, scaled
from ..analysis.hazards import Hazard, cross_stream_hazards
from ..analysis.orders import pinned_pairs, reversing_orders
from .build import BuiltGraph, DelaySpec, chained_copy
from .launcher import CallOrder, Launcher, run_phases
from .proof import poison
from .rebuild import PhaseBuilder, PhaseOptions

#: Zero-delay launches that open the fuzz part and time each phase's copy as it really runs:
#: the isolated durations leave out the kernels beside each task and every node's launch, so
#: a copy's launch can outlast the critical path they give (googlenet fp16 on an H200: 396 us
#: against 363; docs/findings.md).  The last one's times are used (the first includes the
#: exec's upload).
CALIBRATION_LAUNCHES = 2
#: What readying the delay-noded copies costs (the draws planned, the first rows drawn, every
#: phase built with delay nodes and instantiated) over one serial order's build (each phase's
#: base and one clone of it): 2.4 to 6 times on the zoo with 32 rows drawn up front (H200,
#: docs/findings.md).  The budget counts this many before it readies them.
DELAY_STAGE_OVER_ORDER_BUILD = 4.0
#: The draw kind of a calibration launch (no delay).
CALIBRATION = "calibration"
#: The draw kind of a serial-order launch (:mod:`nimble.analysis.orders`).
ORDER = "order"



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
    #: Seconds spent building: the serial orders' edgeless bases, their chained clones, the
    #: delay-noded copies.
    build_seconds: dict[str, float] = field(default_factory=dict)

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
                "pairs_not_reversed": self.pairs_left, "pairs_pinned": self.pairs_pinned,
                "fuzz_build_s": {k: round(v, 4) for k, v in self.build_seconds.items()}}


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
       tasks the copy leaves unordered runs later-first in one of them (:attr:`required`
       counts them; each phase is built once with no edges, and a launch's chained clones are
       made as it is readied, the next launch's while the GPU runs the one before);
    2. ``calibration`` launches of the delay-noded copy with no delay, timing each phase
       (:class:`PhaseClock`); every drawn delay is then stretched (:func:`delay_scale`) and the
       rows uploaded with one copy;
    3. the drawn rows, one per launch (``rows`` drawn up front, later ones written as they
       come, after the GPU has caught up).

    Where there are serial orders, the delay-noded copy, its targets and its first rows are
    made when the first launch after the orders is drawn (:meth:`build_delays`), so a budget
    that ends with the orders costs none of it.  ``offsets`` (each planned buffer's arena offset
    in the copies) and ``stream_of`` give the targeted draws and the pairs the orders keep
    (:func:`~nimble.analysis.orders.pinned_pairs`).  ``options`` change the copies further (a power measurement's broken
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
        self._phase_bases: list[BuiltGraph | None] = []  # per phase, its base (None: no orders)
        self._order_copies: list[list[Launcher | None]] = []  # per phase and order, its copy
        self._finalizer = weakref.finalize(self, driver.close_all, self._owned,
                                           self.order_builts, self._bases, self.builts,
                                           self._memories, self._clocks)
        self._served = list(served)
        self.stats = FuzzStats()
        #: Per serial-order launch, its launcher of every phase (None until it is readied).
        self.order_launchers: list[list[Launcher] | None] = []
        options = options or PhaseOptions()
        self._builder, self._options, self._device = builder, options, device
        self._seed, self._rows, self._stream_of, self._offsets = seed, rows, stream_of, offsets
        self._hazards = cross_stream_hazards(builder.graph, offsets, list(stream_of),
                                             self.spans) \
            if delays and stream_of is not None and offsets is not None else []
        self.plan = reversing_orders(
            [e for k in range(len(self.spans)) for e in builder.edges_of(k, options)],
            self.spans, pins=pinned_pairs(builder.graph, self._hazards)) \
            if delays and orders else []
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
        """Each phase with serial orders built once with no edges
        (:func:`~nimble.engine.build.chained_copy` clones it per order, when the order's launch
        is readied: :meth:`_ready_order`)."""
        builder = self._builder
        for k, found in enumerate(self.plan):
            self._order_copies.append([None] * len(found.orders))
            if not found.orders:
                self._phase_bases.append(None)
                continue
            began = time.perf_counter()
            base = builder.build(k, replace(self._options, edgeless=True))
            self._bases.append(base)
            self._phase_bases.append(base)
            self._spent("order_bases", time.perf_counter() - began)
        self.order_launchers = [None] * self.required
        self.stats.orders = [len(p.orders) for p in self.plan]
        self.stats.unordered_pairs = sum(p.pairs for p in self.plan)
        self.stats.pairs_left = sum(p.left for p in self.plan)
        self.stats.pairs_pinned = sum(p.pinned for p in self.plan)

    def _ready_order(self, launch: int) -> None:
        """The copies serial-order launch ``launch`` runs, built if not yet: per phase, a clone
        of its base chained in its order ``launch`` (a phase with fewer orders repeats its
        last; one with none runs as served)."""
        if launch >= self.required or self.order_launchers[launch] is not None:
            return
        began = time.perf_counter()
        mine = []
        for k, found in enumerate(self.plan):
            if not found.orders:
                mine.append(self._served[k])
                continue
            i = min(launch, len(found.orders) - 1)
            if self._order_copies[k][i] is None:
                self.order_builts.append(chained_copy(self._phase_bases[k], found.orders[i]))
                self._order_copies[k][i] = self._launcher(k, self.order_builts[-1])
            mine.append(self._order_copies[k][i])
        self.order_launchers[launch] = mine
        self._spent("order_copies", time.perf_counter() - began)

    def build_delays(self) -> None:
        """The delay-noded copies, their targets, the first rows and the table (once)."""
        if self.draws is not None or not self._delays:
            return
        began = time.perf_counter()
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
        # For host launch, as the serial orders' copies: a copy launched a few times gains
        # less from a device-launchable exec than its upload costs.
        options = replace(self._options, delays=DelaySpec(self.table.address, tasks=tasks),
                          device_launch=False)
        for k in range(len(builder.spans)):
            self.builts.append(builder.build(k, options))
            self.launchers.append(self._launcher(k, self.builts[-1]))
        if not self.calibration:
            self._upload()
        self._spent("delay_copies", time.perf_counter() - began)

    def upcoming_seconds(self, launch: int) -> float:
        """What readying launch ``launch`` costs before it runs: for the first launch after the
        serial orders, readying the delay-noded copies, estimated from the orders' own builds
        (:data:`DELAY_STAGE_OVER_ORDER_BUILD`); nothing otherwise."""
        if not self._delays or self.draws is not None or launch < self.required:
            return 0.0
        built = self.stats.build_seconds
        copies = max(len(self.order_builts), 1)
        one_order = built.get("order_bases", 0.0) + built.get("order_copies", 0.0) / copies * \
            len(self.spans)
        return DELAY_STAGE_OVER_ORDER_BUILD * one_order

    def _spent(self, stage: str, seconds: float) -> None:
        self.stats.build_seconds[stage] = self.stats.build_seconds.get(stage, 0.0) + seconds

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
            self._ready_order(launch)
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
        outputs = run_phases(self._active or self.launchers, self._mark)(inputs)
        # The next order's copies are built on the host while the GPU runs this launch (the
        # caller's check of the outputs waits for it).
        self._ready_order(self.stats.draws)
        return outputs

    def close(self) -> None:
        """Free the copies, their launchers, the table, the rows and the clock (idempotent).
        The copies wrote the served input cells: the served launchers' next calls write every
        cell again."""
        self._finalizer()
        for launcher in self._served:
            launcher.forget_cells()


def _draws(builder: PhaseBuilder, stream_of: Sequence[int] | None,
           offsets: Mapping[int, int] | None, seed: int,
           hazards: Sequence[Hazard] | None = None) -> Draws:
    """The draws of copies built by ``builder``: :func:`plan_draws` over the served edges
    inside each phase, late ones included (each phase is a launch of its own: a delay in one
    never moves tasks of another apart)."""
    edges = [e for k in range(len(builder.spans)) for e in builder.edges_of(k)]
    return plan_draws(builder.graph, builder.spans, edges, stream_of, offsets, seed, hazards)
