"""Gradients averaged across the ranks of a process group inside the recorded backward.

``prepare(x, training=True, average_gradients=...)`` is data-parallel training as
``DistributedDataParallel`` does it: every rank runs the same model on its own batch, and the
parameters' gradients are averaged over the ranks before anyone sees them.  Here the averaging
is part of the recorded backward (:func:`nimble.record.recorder.record_step`): after
``torch.autograd.grad``, the parameters' gradients are copied into buckets, last parameter
first (the order the backward makes them in), each bucket is divided by the world size and
all-reduced, and the gradients handed back are views of the buckets.  Each bucket's copy and
all-reduce depend only on its own gradients, so the schedule runs them beside the rest of the
backward; the all-reduces keep their recorded order (:func:`nimble.analysis.deps.build_dag`).

A bucket closes once it holds ``bucket_bytes`` (the first one ``first_bucket_bytes``, so that
the first all-reduce starts early), and holds gradients of one dtype: DDP's defaults.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

#: DDP's defaults: 25 MiB buckets, and a first one of 1 MiB.
BUCKET_BYTES = 25 * 2**20
FIRST_BUCKET_BYTES = 1 * 2**20


@dataclass(frozen=True)
class GradientAverage:
    """Which ranks the gradients are averaged over, and in what buckets."""

    #: A ``torch.distributed`` process group; None for the default (``WORLD``).
    group: Any = None
    bucket_bytes: int = BUCKET_BYTES
    first_bucket_bytes: int = FIRST_BUCKET_BYTES


def gradient_average(average) -> GradientAverage | None:
    """``prepare``'s ``average_gradients`` as a :class:`GradientAverage`: None or False for
    none, True for the default process group, a process group, or a GradientAverage."""
    if average is None or average is False:
        return None
    if average is True:
        return GradientAverage()
    if isinstance(average, GradientAverage):
        return average
    return GradientAverage(group=average)


def bucket_plan(sizes: Sequence[int], dtypes: Sequence[str], bucket_bytes: int = BUCKET_BYTES,
                first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Indices into ``sizes`` (bytes per gradient, in parameter order) per bucket, in the order
    the buckets are reduced: from the last gradient back, a bucket closing once it holds its
    cap, or where the dtype changes."""
    buckets: list[list[int]] = []
    current: list[int] = []
    held = 0
    for i in reversed(range(len(sizes))):
        if current and dtypes[i] != dtypes[current[0]]:
            buckets.append(current)
            current, held = [], 0
        current.append(i)
        held += sizes[i]
        if held >= (first_bucket_bytes if not buckets else bucket_bytes):
            buckets.append(current)
            current, held = [], 0
    if current:
        buckets.append(current)
    return buckets


def averaged_gradients(grads: Sequence, average: GradientAverage) -> list:
    """``grads`` (None where a parameter got no gradient) averaged over ``average.group``: one
    divide and one all-reduce per bucket; the gradients returned are views of the buckets."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(average.group)
    present = [i for i, g in enumerate(grads) if g is not None]
    plan = bucket_plan([grads[i].numel() * grads[i].element_size() for i in present],
                       [str(grads[i].dtype) for i in present],
                       average.bucket_bytes, average.first_bucket_bytes)
    out = list(grads)
    for bucket in plan:
        members = [present[k] for k in bucket]
        flat = torch.cat([grads[i].reshape(-1) for i in members])
        flat.div_(world)
        dist.all_reduce(flat, group=average.group)
        pieces = flat.split([grads[i].numel() for i in members])
        for i, piece in zip(members, pieces):
            out[i] = piece.view(grads[i].shape)
    return out
