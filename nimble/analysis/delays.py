"""The race fuzzer's delay draws: which tasks of a fuzz copy wait, and how long, per launch.

numpy only (no torch, no driver): :mod:`nimble.engine.fuzz` uploads the rows to its copies' delay
table, and ``tools/experiments/fuzz_cover.py`` runs the draws on recorded fixtures.

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
:func:`~nimble.analysis.hazards.direct_hazards`) was held back both ways, chained first
(cheap where the leads are short), then as antichains (safe where a lead was underestimated:
the heavy delay exceeds any slack the isolated durations allow); a race
there needs its writer held back and nothing else, which the targeted draws do and the random
kinds seldom do (docs/findings.md).  After that, two targeted draws (every hazard's targets,
chained then held, then fresh held sets) to one random draw, the two random kinds in turn: a
race the targeted picks miss (the reader's side slowed by a delay elsewhere, a slack longer
than the critical path) may come up in a random order.  Without ``offsets`` there are no
targets: every task gets a delay node and the random kinds take turns, two heavy draws to one
per-task draw.

Why the heavy, targeted and chained kinds exist, with the catch rates of each kind:
docs/findings.md.  Every delay drawn is stretched once the fuzz copies have timed a launch
(:func:`delay_scale`): the isolated durations leave out the kernels beside each task and every
node's launch.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from .deps import critical_path, dag_from_edges
from .hazards import (CHAINED, HELD, ChainCosts, Hazard, Pick, TargetedPicks,
                      cross_stream_hazards, direct_hazards, lead_us)
from ..ir.taskgraph import TaskGraph

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
#: After the calibration, a held pick waits at least this many times its phase's measured
#: launch, and every other delay is stretched by the same factor: a writer that may run at
#: the start of its phase (a batch norm's first kernel needs only the weights) must still be
#: running when its reader near the phase's end starts.
HEAVY_OVER_LAUNCH = 1.5

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
                 picks: TargetedPicks | None, delayable: np.ndarray, seed: int = 0) -> None:
        self.caps_ns, self.heavy_ns, self.picks = caps_ns, heavy_ns, picks
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


def plan_draws(graph: TaskGraph, spans: Sequence[range], edges: Sequence[tuple[int, int]],
               stream_of: Sequence[int] | None, offsets: Mapping[int, int] | None,
               seed: int, hazards: Sequence[Hazard] | None = None) -> Draws:
    """The draws of fuzz copies of ``graph`` run with ``edges`` (each inside its phase):
    targeted where ``offsets`` and ``stream_of`` are known (``hazards``: their cross-stream
    hazards, where already found), else random on every task.  No GPU:
    ``tools/experiments/fuzz_cover.py`` runs them on recorded fixtures."""
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
    return Draws(delay_caps_ns(graph, spans), heavy, streams, picks, delayable, seed)
