"""Launching a built phase for the measured choices at prepare (tail backfill, priorities,
weight prefetch, programmatic edges): each timed launch after the phases before it, on the
recording's inputs."""
from __future__ import annotations

from typing import Callable, Sequence

from .. import driver
from .build import BuiltGraph
from .launcher import InputSlot


def recorded_inputs_into(slots: Sequence[InputSlot], values: Sequence) -> Callable[[], None]:
    """A ``refresh`` for :func:`after_phases`: the recording's inputs copied into the slots
    (in stream order), so that every timed launch reads real inputs.  An input's bytes are
    planned for reuse once its last reader ran (gpt2's token ids share theirs with later
    activations), and a launch with no call behind it gathers each slot onto itself: the
    second launch would read those activations as token ids, an embedding's index out of
    range and a device-side assert."""
    pairs = [(s.tensor, v) for s, v in zip(slots, values)
             if tuple(s.shape) == tuple(v.shape) and s.dtype == v.dtype]

    def refresh() -> None:
        import torch

        with torch.no_grad():
            for slot, value in pairs:
                slot.copy_(value)
    return refresh


#: Whether a phase with no phase before it is timed behind one untimed launch of itself, so that
#: the GPU is busy when the host queues the timed launch and the timing starts as the last one
#: ends, as in a loop of calls; without it the GPU is idle when the timing starts, and the
#: launch's way from the host to the GPU is timed with it (docs/results.md: a decode step
#: timed at prepare against the same step in a token loop).  A phase after others is always
#: timed behind them.  Off: a decode step prepared with it made the same choices and ran no
#: faster (``tools/experiments/decode_levers.py``'s ``lead-timing``, docs/results.md).
LEAD_LAUNCH = False


def after_phases(before: Sequence[BuiltGraph], stream, refresh: Callable[[], None]
                  ) -> Callable[[BuiltGraph, int], float]:
    """``launch(built, count) -> ms``: ``count`` launches of ``built``, each after one launch of
    every phase of ``before`` (so it reads what they write: a backward reads the forward's
    saved max-pool indices, and its own writes may reuse their bytes), timing ``built`` only;
    ``refresh()`` runs before each (:func:`recorded_inputs_into`); with :data:`LEAD_LAUNCH`
    and no phase before, each after an untimed launch of ``built`` itself (refreshed again
    after it: a launch may reuse its inputs' bytes)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    lead = LEAD_LAUNCH and not before

    def launch(built: BuiltGraph, count: int) -> float:
        total = 0.0
        for _ in range(count):
            if lead:
                refresh()
                driver.launch(built.exec.handle, stream)
            refresh()
            for b in before:
                driver.launch(b.exec.handle, stream)
            start.record()
            driver.launch(built.exec.handle, stream)
            end.record()
            end.synchronize()
            total += start.elapsed_time(end)
        return total
    return launch
