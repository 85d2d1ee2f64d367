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

A bucket closes once it holds ``bucket_bytes`` (the first one of each dtype
``first_bucket_bytes``, so that the first all-reduce starts early), and holds gradients of one
dtype: DDP's defaults and its rules (:func:`bucket_plan`).  DDP rebuilds its buckets after the
first backward in the order the gradients became ready; the plan here takes them in the reverse
of the parameters' order, which is that order wherever the backward makes the last parameter's
gradient first.  Which bucket a gradient goes to changes what is computed for it in no way
(each element is divided, then summed over the ranks); only the rounding of a sum over more
than two ranks, where NCCL picks its algorithm by the bucket's size.

The gradients handed back are views of the buckets, as DDP gives with
``gradient_as_bucket_view=True``; the bytes are the graph's arena, which autograd's glue moves
each ``.grad`` out of before the next forward (:mod:`nimble.engine.autograd`), so either setting
of DDP's gives the same values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

#: DDP's defaults: 25 MiB buckets, and a first one of 1 MiB.
BUCKET_BYTES = 25 * 2**20
FIRST_BUCKET_BYTES = 1 * 2**20
#: The most bytes the last part of the bucket reduced last holds, for Nimble's own averaging:
#: that all-reduce waits for the backward's end with nothing beside it, so the less it holds,
#: the less of the averaging is left exposed (measured: docs/results.md, "Two GPUs, four ways
#: to end the backward").
LAST_BUCKET_BYTES = 4 * 2**20


@dataclass(frozen=True)
class GradientAverage:
    """Which ranks the gradients are averaged over, and in what buckets."""

    #: A ``torch.distributed`` process group; None for the default (``WORLD``).
    group: Any = None
    bucket_bytes: int = BUCKET_BYTES
    first_bucket_bytes: int = FIRST_BUCKET_BYTES
    #: The parameters' gradient-accumulation nodes are kept alive from outside the step (a
    #: ``DistributedDataParallel``'s reducer holds them), so the step is captured on stand-ins
    #: for the parameters (:mod:`nimble.record.stand_ins`).
    held_accumulators: bool = False
    #: The division by the world size done inside NCCL's all-reduce (``ReduceOp.AVG``: each
    #: rank's values multiplied by 1/world as they are summed) in place of a pass of its own
    #: over each bucket: DDP's reducer multiplies by 1/world too, as it copies a gradient into
    #: its bucket, so the bits are DDP's in float32, and in every dtype where the world size is
    #: a power of two (as dividing gives them).
    average_in_all_reduce: bool = False
    #: Where set, the bucket reduced last is split so that its last part holds at most this
    #: many bytes: it holds the first parameters' gradients, made when the backward ends, and
    #: its all-reduce is the one nothing runs beside (:func:`split_last_bucket`); None keeps
    #: DDP's buckets as they are (a ``DistributedDataParallel`` given to Nimble does).
    last_bucket_bytes: int | None = LAST_BUCKET_BYTES


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
    the buckets are reduced, as DDP's reducer buckets them once it has seen a backward
    (``compute_bucket_assignment_by_size`` over the gradients from the last parameter back):
    each dtype fills a bucket of its own, which closes once it holds its cap (a dtype's first
    bucket ``first_bucket_bytes``, its later ones ``bucket_bytes``); buckets go in the order
    they close, then those left open in the order of their first gradient (an order DDP leaves
    to a hash map)."""
    buckets: list[list[int]] = []
    open_buckets: dict[str, list[int]] = {}  # insertion order: the order of first gradients
    held: dict[str, int] = {}
    closed: set[str] = set()
    for i in reversed(range(len(sizes))):
        dtype = dtypes[i]
        open_buckets.setdefault(dtype, []).append(i)
        held[dtype] = held.get(dtype, 0) + sizes[i]
        if held[dtype] >= (bucket_bytes if dtype in closed else first_bucket_bytes):
            buckets.append(open_buckets.pop(dtype))
            held[dtype] = 0
            closed.add(dtype)
    buckets.extend(open_buckets.values())
    return buckets


def split_last_bucket(plan: list[list[int]], sizes: Sequence[int],
                      cap: int | None) -> list[list[int]]:
    """``plan`` with its last bucket split in two where it holds more than ``cap`` bytes
    (``sizes[i]``: gradient ``i``'s): the second part the gradients made last (those at the
    bucket's end, the lowest parameters), as many as fit ``cap``, at least one."""
    if cap is None or not plan:
        return plan
    last = plan[-1]
    held, keep = 0, len(last)
    while keep > 0 and (keep == len(last) or held + sizes[last[keep - 1]] <= cap):
        keep -= 1
        held += sizes[last[keep]]
    if keep == 0:
        return plan
    return plan[:-1] + [last[:keep], last[keep:]]


def averaged_gradients(grads: Sequence, average: GradientAverage) -> list:
    """``grads`` (None where a parameter got no gradient) averaged over ``average.group``: one
    divide and one all-reduce per bucket; the gradients returned are views of the buckets."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(average.group)
    present = [i for i, g in enumerate(grads) if g is not None]
    sizes = [grads[i].numel() * grads[i].element_size() for i in present]
    plan = split_last_bucket(bucket_plan(sizes, [str(grads[i].dtype) for i in present],
                                         average.bucket_bytes, average.first_bucket_bytes),
                             sizes, average.last_bucket_bytes)
    out = list(grads)
    for bucket in plan:
        members = [present[k] for k in bucket]
        flat = torch.cat([grads[i].reshape(-1) for i in members])
        if average.average_in_all_reduce:
            dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=average.group)
        else:
            flat.div_(world)
            dist.all_reduce(flat, group=average.group)
        pieces = flat.split([grads[i].numel() for i in members])
        for i, piece in zip(members, pieces):
            out[i] = piece.view(grads[i].shape)
    return out
