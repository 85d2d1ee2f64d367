"""``DistributedDataParallel``'s buffer broadcast as part of a recorded forward.

With ``broadcast_buffers=True`` (DDP's default), DDP's forward first copies every module buffer
(batch-norm running statistics) from the process group's first rank to the others, so that all
ranks hold rank 0's statistics plus their own batch's update.  :class:`BufferBroadcast` does the
same in its forward, with ``torch.distributed.broadcast`` (one per dtype, the buffers coalesced
into one flat tensor as DDP coalesces them), so a training step recorded from it holds the
broadcast inside its forward graph.  Importing this module imports torch: it is loaded lazily.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class BufferBroadcast(torch.nn.Module):
    """``module``, its buffers broadcast from the group's first rank at the start of each
    forward.  The wrapped module is held as ``module``, so parameter and buffer names are the
    ``DistributedDataParallel``'s."""

    #: The forward holds collectives on purpose
    #: (:func:`nimble.engine.collectives.check_training_collectives`).
    nimble_forward_collectives = True

    def __init__(self, module: torch.nn.Module, group=None) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.training = module.training

    def forward(self, *args, **kwargs):
        broadcast_buffers(list(self.module.buffers()), self.group)
        return self.module(*args, **kwargs)


def source_rank(group) -> int:
    """The global rank of ``group``'s first rank, which DDP broadcasts buffers from."""
    if group is None or group is dist.group.WORLD:
        return 0
    return dist.get_global_rank(group, 0)


def broadcast_buffers(buffers: list, group=None) -> None:
    """Copy ``buffers`` from ``group``'s first rank to every rank of it, in place."""
    if not buffers:
        return
    src = source_rank(group)
    by_dtype: dict = {}
    for b in buffers:
        by_dtype.setdefault(b.dtype, []).append(b)
    with torch.no_grad():
        for same in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in same])
            dist.broadcast(flat, src=src, group=group)
            for b, piece in zip(same, flat.split([b.numel() for b in same])):
                b.copy_(piece.view_as(b))
