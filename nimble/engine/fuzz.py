"""The proof's race fuzzer: verification-only copies of every phase with a delay node per task.

A race in a schedule (two tasks that touch the same bytes, at least one writing, with no path
between them) gives a wrong answer only when the GPU runs the two in the wrong order, which a
few launches of the served graph may never do.  The fuzz copies drive the interleavings: each
task of a copy waits for a ``nimble_delay`` node (``kernels/delay.ptx``) that waits for the
task's predecessors, and before every launch the host writes a fresh draw into the delay table.

Before every fuzz launch the arena is poisoned again (``repoison``), so every launch of a copy
reads only what it wrote itself.  Two kinds of draw take turns, two heavy draws to one per-task draw (:func:`draw_delays`,
:func:`draw_stream_delays`).

* **Per task**: each task is delayed with probability one half, by a time drawn log-uniformly
  between :data:`MIN_DELAY_NS` and a cap of twice the longest isolated duration of the phase's
  tasks (``Task.duration_us``; :data:`UNTIMED_CAP_NS` where none is known), at most
  :data:`MAX_DELAY_NS`.  This reorders tasks whose natural start times lie close together.
* **Per stream, heavy**: each stream is slow with probability :data:`SLOW_STREAM_CHANCE`, and on
  a slow stream one task, picked at random, waits between half and all of the graph's critical
  path (:func:`heavy_delay_ns`).  A missing synchronization from a writer on stream A to a
  reader on stream B usually has slack of whole kernels: the reader also waits for B's own
  work (a convolution, say), which the small writer beats every time.  Only a delay larger
  than that slack on the writer, and none on the reader's side, shows the race; delays of a
  task's own size on both sides cancel out.  With the writer's stream slow, its pick at or
  before the writer, and the few streams on the reader's side fast, the writer ends after the
  reader reads.

Why the heavy kind exists, with the catch rates of each kind: docs/findings.md.

The copies are built through :class:`~nimble.engine.rebuild.PhaseBuilder` from the served graph's
own nodes (same gathers, priorities, late edges, arena, inputs and outputs); the served graph has
no delay node.  :class:`FuzzCopies` owns them with the table, and is closed after the proof.
"""
from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from .. import driver
from ..ir.taskgraph import TaskGraph
from .build import BuiltGraph, DelaySpec
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


def heavy_delay_ns(graph: TaskGraph, edges: Sequence[tuple[int, int]]) -> int:
    """The heavy delay's scale: the critical path of the tasks' known durations (ns), within
    :data:`HEAVY_DELAY_NS`; its upper bound where no duration is known."""
    from ..analysis.deps import critical_path, dag_from_edges

    durations = [t.duration_us or 0.0 for t in graph.tasks]
    if not any(durations):
        return HEAVY_DELAY_NS[1]
    length = critical_path(dag_from_edges(len(graph.tasks), edges), durations).length
    return int(min(max(1000 * length, HEAVY_DELAY_NS[0]), HEAVY_DELAY_NS[1]))


def draw_stream_delays(rng: np.random.Generator, stream_of: np.ndarray,
                       heavy_ns: int) -> np.ndarray:
    """A heavy draw: on each slow stream one random task waits between half and all of
    ``heavy_ns``; every other task not at all (see the module docstring)."""
    delays = np.zeros(len(stream_of), dtype=np.uint32)
    for stream in np.unique(stream_of[stream_of >= 0]):
        if rng.random() >= SLOW_STREAM_CHANCE:
            continue
        tasks = np.flatnonzero(stream_of == stream)
        delays[rng.choice(tasks)] = int(heavy_ns * (0.5 + 0.5 * rng.random()))
    return delays


@dataclass
class FuzzStats:
    """What the fuzz launches ran (recorded in ``graph.meta["verified"]``)."""

    launches: int = 0
    draws: int = 0
    delayed: int = 0  # tasks delayed, summed over the draws
    max_delay_ns: int = 0
    first_draw_at: float | None = None  # time.perf_counter() at the first draw

    def as_meta(self) -> dict:
        return {"fuzz_launches": self.launches, "delay_draws": self.draws,
                "tasks_delayed_per_draw": self.delayed / self.draws if self.draws else 0.0,
                "max_delay_us": self.max_delay_ns / 1000}


def _free(memory: driver.DeviceMemory | None, builts: list[BuiltGraph],
          launchers: list) -> None:
    for launcher in launchers:
        launcher.close()
    for built in builts:
        built.close()
    if memory is not None:
        memory.close()


class FuzzCopies:
    """A delay-noded copy of every phase, its launchers over the served slots and outputs, and
    the delay table: owned together, freed by :meth:`close` (idempotent) or when collected.

    ``run(inputs)`` runs every phase in order like the served launchers; :meth:`draw` writes a
    fresh draw into the table first (after the previous launch has finished reading it).
    ``options`` change the copies further (a power measurement's broken copies); with
    ``delays=False`` they get no delay nodes and no table, and :meth:`draw` draws nothing.
    """

    def __init__(self, builder: PhaseBuilder, served: Sequence[Launcher], device,
                 seed: int = 0, options: PhaseOptions | None = None,
                 delays: bool = True, stream_of: Sequence[int] | None = None,
                 repoison: Sequence[tuple[int, int]] = ()) -> None:
        n = len(builder.graph.tasks)
        #: ``(address, size)`` ranges poisoned again before every fuzz launch (the arena).
        self.repoison = list(repoison)
        #: The stream of every task, for the per-stream draws (None: per-task draws only).
        self.stream_of = None if stream_of is None else np.asarray(stream_of, dtype=np.int64)
        self.heavy_ns = heavy_delay_ns(builder.graph, builder.edges)
        self.caps_ns = delay_caps_ns(builder.graph, builder.spans)
        self.table = driver.DeviceMemory.allocate(max(4 * n, 4)) if delays else None
        self.builts: list[BuiltGraph] = []
        self.launchers: list[Launcher] = []
        self._finalizer = weakref.finalize(self, _free, self.table, self.builts, self.launchers)
        self._rng = np.random.default_rng(seed)
        self._served = list(served)
        self.stats = FuzzStats()
        options = options or PhaseOptions()
        if delays:
            options = replace(options, delays=DelaySpec(self.table.address))
        try:
            if delays:
                driver.copy_to_device(self.table.address, bytes(4 * n))
            order = CallOrder()
            context = driver.current_context()
            for k in range(len(builder.spans)):
                built = builder.build(k, options)
                self.builts.append(built)
                self.launchers.append(Launcher(
                    built.exec.handle, served[k].slots, device, served[k].outputs, None,
                    context, served[k].rng, order=order))
        except BaseException:
            self.close()
            raise

    def draw(self) -> None:
        """Write a fresh draw into the delay table, once the work queued so far has run."""
        import torch

        if self.table is None:
            return
        if self.stats.first_draw_at is None:
            self.stats.first_draw_at = time.perf_counter()
        if self.stream_of is not None and self.stats.draws % 3:
            delays = draw_stream_delays(self._rng, self.stream_of, self.heavy_ns)
        else:
            delays = draw_delays(self._rng, self.caps_ns)
        torch.cuda.synchronize()
        driver.copy_to_device(self.table.address, delays.tobytes())
        # Every launch starts from a poisoned arena: a read that a race moves before its write
        # then sees NaNs, even where the write puts the same bytes every launch (a buffer that
        # depends on the weights alone), which the previous launch would have left in place.
        if self.repoison:
            poison(self.repoison, self.launchers[0].stream())
        self.stats.draws += 1
        self.stats.delayed += int(np.count_nonzero(delays))
        self.stats.max_delay_ns = max(self.stats.max_delay_ns, int(delays.max(initial=0)))

    def run(self, inputs: list) -> list:
        """Every phase's copy in order on its share of ``inputs``: the flat outputs."""
        self.stats.launches += 1
        return run_phases(self.launchers)(inputs)

    def close(self) -> None:
        """Free the copies, their launchers and the table (idempotent).  The copies wrote the
        served input cells: the served launchers' next calls write every cell again."""
        self._finalizer()
        for launcher in self._served:
            launcher.forget_cells()
