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


def after_phases(before: Sequence[BuiltGraph], stream, refresh: Callable[[], None]
                  ) -> Callable[[BuiltGraph, int], float]:
    """``launch(built, count) -> ms``: ``count`` launches of ``built``, each after one launch of
    every phase of ``before`` (so it reads what they write: a backward reads the forward's
    saved max-pool indices, and its own writes may reuse their bytes), timing ``built`` only;
    ``refresh()`` runs before each (:func:`recorded_inputs_into`)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def launch(built: BuiltGraph, count: int) -> float:
        total = 0.0
        for _ in range(count):
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
