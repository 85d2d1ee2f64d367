"""How close a decode step comes to the memory's limit (issue 53): the bytes a step must read,
and the device's measured copy bandwidth to hold them against.

A batch-1 decode step is memory-bound: it must stream every weight once, and the keys and
values the attention reads at its position.  Bytes per step over seconds per step is the
bandwidth a decoder achieves; over the bandwidth of a large device-to-device copy (the most a
plain copy gets out of this memory, measured, not the datasheet's) it is the fraction used.
"""
from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

#: The copy measured for the bandwidth: large enough that launch and tail effects vanish and
#: no L2 holds it.
COPY_BYTES = 1 << 30
COPY_REPEATS = 10


@dataclass(frozen=True)
class StepBytes:
    """What one decode step of a whole batch must read."""

    weights: int  # every parameter's bytes once (a tied embedding and head: one tensor)
    kv_per_slot: int  # keys and values of one cache slot, every layer and sequence of the batch
    slots_read: float  # cache slots the attention needs per step, averaged over the timed steps

    @property
    def kv(self) -> float:
        return self.kv_per_slot * self.slots_read

    @property
    def total(self) -> float:
        return self.weights + self.kv


def weight_bytes(model) -> int:
    """Bytes of ``model``'s parameters, each tensor once (``parameters()`` yields a tied
    tensor once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_slot(cache) -> int:
    """Bytes of one slot of an initialized static cache: every layer's keys and values
    ``(B, heads, slots, head_dim)`` over their slot count."""
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            total += t.numel() * t.element_size() // t.shape[-2]
    return total


def mean_slots_read(prompt: int, short: int, long: int) -> float:
    """Cache slots a decode step attends to, averaged over the tokens a timing of ``long`` new
    tokens less one of ``short`` counts: tokens ``short + 1 .. long`` of a generation after a
    prompt of ``prompt`` tokens.  Token ``i >= 2`` comes from the step at position
    ``prompt + i - 2``, which reads slots ``0 .. prompt + i - 2``."""
    if not 1 <= short < long:
        raise ValueError(f"need 1 <= short < long, got short={short}, long={long}")
    # slots read by token i: prompt + i - 1, for i = short + 1 .. long
    return prompt + (short + long - 1) / 2


def used(step: StepBytes, ms_per_step: float, copy_bytes_per_s: float | None) -> dict:
    """Bytes per second a step time of ``ms_per_step`` achieves, and its fraction of the
    measured copy bandwidth (None where there is none, or no positive time)."""
    if not ms_per_step or ms_per_step <= 0:
        return {"bytes_per_s": None, "of_copy": None}
    rate = step.total / (ms_per_step / 1e3)
    return {"bytes_per_s": rate, "of_copy": rate / copy_bytes_per_s if copy_bytes_per_s else None}


@functools.lru_cache(maxsize=None)
def copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = COPY_REPEATS) -> float:
    """Bytes per second of a device-to-device copy of ``nbytes`` on the current GPU, read and
    write both counted (what a copy moves through the memory), the median of ``repeats``
    timed copies after one untimed; measured once per process."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = []
    for _ in range(repeats):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(seconds)
