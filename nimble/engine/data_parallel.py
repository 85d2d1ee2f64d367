"""A model wrapped in ``DistributedDataParallel``, prepared as DDP would train it.

``Nimble(ddp).prepare(x, training=True)`` records the module DDP wraps, as if
``average_gradients=`` had been passed with the wrapper's settings
(:mod:`nimble.record.gradient_average`): its process group, its bucket caps
(``bucket_cap_mb``, and DDP's small first bucket where ``bucket_cap_mb`` was left out), its
buffer broadcast (``broadcast_buffers=True``: :mod:`nimble.record.buffer_broadcast`, inside the
forward graph).  ``static_graph`` holds by construction (a prepared step is one fixed graph),
and either ``gradient_as_bucket_view`` gives the same values (the gradients handed back are
views of the buckets in both cases).  What DDP does on the host between or after the
collectives has no place in a graph and is refused with a typed error that says what to use
(:func:`check_ddp_settings`).  The DDP object itself is never called: its reducer's hooks stay
idle, since they wait for a forward of DDP's own.  The reducer does keep the parameters'
gradient-accumulation nodes alive, tied to the stream current when the DDP was built, which
would tie the captured backward to a stream outside the capture: the step is captured on
stand-ins for the parameters (``held_accumulators``, :mod:`nimble.record.stand_ins`).  Inference (``training=False``) records the
wrapped module, which is what DDP's forward runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from ..record.gradient_average import FIRST_BUCKET_BYTES, GradientAverage, gradient_average


@dataclass(frozen=True)
class DataParallelTarget:
    """What ``prepare`` records for a model, and how its gradients are averaged."""

    #: The module recorded: the model, or the module a DDP wraps (with its buffer broadcast).
    module: Any
    average: GradientAverage | None
    #: The ``DistributedDataParallel`` the module came from; None for a model that is none.
    wrapper: Any = None


def is_ddp(model) -> bool:
    """Whether ``model`` is a ``DistributedDataParallel`` (by class name, so that this module
    imports no torch)."""
    return any(c.__name__ == "DistributedDataParallel" for c in type(model).__mro__)


def data_parallel_target(model, training: bool, average_gradients=None) -> DataParallelTarget:
    """The module ``prepare`` records for ``model`` and the averaging of its training step:
    ``average_gradients`` for a plain model, the wrapper's settings for a DDP.  Raises
    :class:`~nimble.errors.InputError` for a DDP setting a graph cannot hold, or for a DDP
    given ``average_gradients`` as well."""
    if not is_ddp(model):
        return DataParallelTarget(model, gradient_average(average_gradients))
    if average_gradients is not None:
        raise InputError("average_gradients was passed with a DistributedDataParallel model, "
                         "whose own settings (process group, bucket_cap_mb) say how its "
                         "gradients are averaged: leave average_gradients out")
    if not training:
        return DataParallelTarget(model.module, None, model)
    check_ddp_settings(model)
    module = model.module
    if _broadcasts_buffers(model):
        from ..record.buffer_broadcast import BufferBroadcast

        module = BufferBroadcast(module, model.process_group)
    return DataParallelTarget(module, ddp_average(model), model)


def ddp_average(ddp) -> GradientAverage:
    """The averaging a DDP's settings ask for: its process group and bucket caps (the first
    bucket 1 MiB only where ``bucket_cap_mb`` was left out, as DDP's reducer has it), and its
    buckets as the reducer makes them (the last one not split)."""
    cap = int(ddp.bucket_bytes_cap)
    config = getattr(ddp, "_bucket_config", None)
    if config is not None:
        first = int(config.first_bucket_bytes_cap)
    else:
        first = FIRST_BUCKET_BYTES if getattr(ddp, "bucket_bytes_cap_default", True) else cap
    return GradientAverage(group=ddp.process_group, bucket_bytes=cap, first_bucket_bytes=first,
                           held_accumulators=True, last_bucket_bytes=None)


def _broadcasts_buffers(ddp) -> bool:
    """Whether DDP's forward would broadcast buffers: asked for, and something to broadcast
    to another rank."""
    import torch.distributed as dist

    asked = getattr(ddp, "forward_sync_buffers", None)
    if asked is None:  # torch before forward_sync_buffers
        asked = getattr(ddp, "broadcast_buffers", False)
    return bool(asked) and any(True for _ in ddp.module.buffers()) \
        and dist.get_world_size(ddp.process_group) > 1


def _comm_hook(ddp) -> str | None:
    """The name of a communication hook registered on ``ddp``, None where there is none."""
    hooks = getattr(ddp, "_comm_hooks", None)
    if hooks:
        return getattr(hooks[0][0], "__qualname__", repr(hooks[0][0]))
    logging = getattr(ddp, "_get_ddp_logging_data", None)
    named = logging().get("comm_hook") if logging is not None else None
    return named or None  # a built-in hook (FP16_COMPRESS...) is only in DDP's logging data


def check_ddp_settings(ddp) -> None:
    """Raise :class:`~nimble.errors.InputError` for a DDP setting a prepared training step
    cannot hold, saying what to use instead."""
    if ddp.find_unused_parameters:
        raise InputError(
            "DistributedDataParallel(find_unused_parameters=True) searches the autograd graph "
            "on the host after every forward, which a prepared step cannot do, and needs "
            "not: its graph is fixed, and only the parameters that get a gradient in it are "
            "averaged.  Construct the DistributedDataParallel with "
            "find_unused_parameters=False (the default)")
    hook = _comm_hook(ddp)
    if hook:
        raise InputError(
            f"the DistributedDataParallel has a communication hook ({hook}, from "
            "register_comm_hook or a built-in hook): it runs Python on each bucket during "
            "the backward, which a graph cannot hold.  Construct the DistributedDataParallel "
            "without it (the prepared step then averages as DDP's default all-reduce does), "
            "or train eagerly")
    if hasattr(ddp, "buffer_hook"):
        raise InputError("the DistributedDataParallel has a buffer communication hook, which "
                         "runs Python in the forward: construct it without one (buffers are "
                         "then broadcast from rank 0, as broadcast_buffers asks), or train "
                         "eagerly")
    _check_host_settings(ddp)


def _check_host_settings(ddp) -> None:
    """The rest of :func:`check_ddp_settings`: settings whose work DDP does on the host."""
    if getattr(ddp, "mixed_precision", None) is not None:
        raise InputError("DistributedDataParallel(mixed_precision=...) casts the parameters "
                         "on the host around each forward and backward: construct it without "
                         "mixed_precision (cast the model itself, e.g. model.half(), before "
                         "wrapping it), or train eagerly")
    if getattr(ddp, "parameters_to_ignore", None):
        raise InputError("the DistributedDataParallel ignores some parameters or buffers "
                         "(_ddp_params_and_buffers_to_ignore), which a prepared step would "
                         "average all the same: set requires_grad=False on parameters that "
                         "must stay each rank's own, or train eagerly")
    if getattr(ddp, "bucket_bytes_cap_list", None):
        raise InputError("DistributedDataParallel(bucket_cap_mb_list=...): a prepared step "
                         "takes one bucket size; pass bucket_cap_mb instead")
    if getattr(ddp, "_delay_all_reduce_params", None):
        raise InputError("the DistributedDataParallel all-reduces some parameters from hooks "
                         "of their own (param_to_hook_all_reduce), on the host: construct it "
                         "without them")
    if not getattr(ddp, "require_backward_grad_sync", True):
        raise InputError("prepare(training=True) was called inside ddp.no_sync(): call it "
                         "outside (the prepared backward averages every step's gradients, so "
                         "calls inside no_sync() are refused too)")


def check_grad_sync(wrapper) -> None:
    """Raise :class:`~nimble.errors.InputError` for a training call inside the DDP's
    ``no_sync()``: the prepared backward averages every step's gradients."""
    if wrapper is not None and not wrapper.require_backward_grad_sync:
        raise InputError(
            "a training call inside ddp.no_sync(): the prepared backward graph averages "
            "every step's gradients over the ranks, which no_sync() asks to skip.  Leave "
            "no_sync() out: the averaged gradients of the micro-batches add up in .grad to "
            "the average of their sum, which is what no_sync() gives, at one all-reduce per "
            "micro-batch")
