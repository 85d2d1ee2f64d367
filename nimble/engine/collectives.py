"""What ``prepare`` does differently where NCCL's collectives are involved, and what it refuses.

A graph that holds collectives is prepared on every rank in step (every rank launches its graphs
the same number of times: :mod:`nimble.engine.preparation`, :mod:`nimble.engine.proving`).  A
training step holds collectives only where it is data-parallel: the all-reduces of
``average_gradients`` (:mod:`nimble.record.gradient_average`) in its backward, and in its
forward DDP's buffer broadcast (:mod:`nimble.record.buffer_broadcast`) and ``SyncBatchNorm``'s
own.  A ``DistributedDataParallel`` model is unwrapped before recording
(:mod:`nimble.engine.data_parallel`); one nested inside a model, and FSDP, are refused.
Measured on two H200s: docs/findings.md, "Collectives inside prepared graphs".
"""
from __future__ import annotations

from ..analysis.deps import communicates, communication_task
from ..errors import InputError
from ..ir.taskgraph import TaskKind


#: Wrappers whose gradient averaging a prepared training step would lose.
_DATA_PARALLEL = ("DistributedDataParallel", "FullyShardedDataParallel")


def check_data_parallel(model) -> None:
    """Raise :class:`~nimble.errors.InputError` for a training step of a model that holds a
    data-parallel wrapper (a DDP given to ``Nimble`` itself is unwrapped before this)."""
    wrapper = next((type(m).__name__ for m in model.modules()
                    if any(c.__name__ in _DATA_PARALLEL for c in type(m).__mro__)), None)
    if wrapper == "DistributedDataParallel":
        raise InputError(
            "prepare(training=True) of a model that holds a DistributedDataParallel inside "
            "it: DDP averages the gradients from bookkeeping its forward does on the host, "
            "which a prepared forward skips.  Give the DistributedDataParallel itself to "
            "Nimble (nimble.Nimble(ddp)), which prepares the module it wraps with its "
            "settings")
    if wrapper:
        raise InputError(
            f"prepare(training=True) does not support {wrapper}: it shards and gathers the "
            "parameters from hooks on the host, which a prepared step skips.  Wrap the model "
            "in DistributedDataParallel instead (nimble.Nimble(ddp)), or pass "
            "average_gradients=True")


def _sync_batch_norm(model) -> bool:
    """Whether ``model`` holds a ``SyncBatchNorm`` in training mode."""
    modules = getattr(model, "modules", None)
    return modules is not None and any(
        m.training and any(c.__name__ == "SyncBatchNorm" for c in type(m).__mro__)
        for m in modules())


def check_training_collectives(graph, training: bool, averaging: bool = False,
                               model=None) -> None:
    """Raise :class:`~nimble.errors.InputError` for a training step whose graphs hold NCCL
    collectives where it is not data-parallel (``averaging``, the all-reduces of
    ``average_gradients`` in its backward), or in its forward for any reason but DDP's buffer
    broadcast and ``SyncBatchNorm`` (a ``model`` that says so): not proven across steps.  A
    parameter's gradient hook that all-reduces is not recorded, and runs at the hand-off, as
    in eager."""
    if not training or not communicates(graph):
        return
    forward = range(graph.meta.get("phases", [len(graph.tasks)])[0])
    in_forward = any(communication_task(graph.tasks[t]) for t in forward)
    sync_bn = _sync_batch_norm(model)
    if averaging and (not in_forward or sync_bn
                      or getattr(model, "nimble_forward_collectives", False)):
        return
    if sync_bn:
        raise InputError(
            "this training step's SyncBatchNorm shares batch statistics across the ranks, but "
            "its gradients are not averaged over them: wrap the model in "
            "DistributedDataParallel (nimble.Nimble(ddp)) or pass average_gradients=True.  "
            "For statistics of each rank's own, build the model with nn.BatchNorm* layers "
            "instead (torch has no SyncBatchNorm revert)")
    raise InputError(
        "this training step runs NCCL collectives inside its forward or backward (an "
        "all-reduce in forward), which prepare(training=True) does not support yet.  Train "
        "it eagerly; inference graphs with collectives are supported (prepare with "
        "training=False)")


def check_instances(graph, instances: int) -> None:
    """Raise :class:`~nimble.errors.InputError` for several instances of a graph that holds
    collectives: callers on several streams would launch its collectives in an order no other
    rank shares, and the ranks would wait on each other."""
    if instances > 1 and communicates(graph):
        raise InputError(f"instances={instances} of a model whose graph holds collectives: "
                         "each rank must launch its collectives in one order, which callers on "
                         "several streams cannot keep; prepare one instance (instances=1)")


def check_average(average, training: bool, instances: int, examples: list,
                  recording=None) -> None:
    """Raise :class:`~nimble.errors.InputError` where ``average_gradients`` cannot apply (a
    ``recording`` passed in must have been made with it)."""
    if average is None:
        return
    if recording is not None and not communicates(recording.graph):
        raise InputError("average_gradients was passed with a recording made without it (its "
                         "backward averages nothing): leave PrepareOptions(recording=...) out "
                         "to record again")
    if not training:
        raise InputError("average_gradients averages a training step's gradients: pass "
                         "training=True with it (inference has no gradients)")
    if instances != 1 or len(examples) != 1:
        raise InputError("average_gradients prepares one training step: leave out buckets, "
                         "batch_sizes and instances")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise InputError("average_gradients averages over a torch.distributed process group: "
                         "call torch.distributed.init_process_group('nccl') on every rank "
                         "first (torchrun sets the rank and world size)")


#: Why a graph with NCCL's event nodes is host-launched, and what a user can do about it.
NCCL_EVENTS_REFUSED = (
    "NCCL brackets each collective with an event wait and an event record (its guard for "
    "graphs and eager calls on one communicator), and the driver launches no event node from "
    "the device.  NCCL_GRAPH_MIXING_SUPPORT=0, set before the process group is created, "
    "leaves them out; NCCL then does not support an eager collective on that communicator "
    "while a launch of a graph that uses it is still running")


def refusal_reason(graph, refusal: str) -> str:
    """The driver's refusal of a device-launchable instantiation, with the cause a user can act
    on where the graph holds NCCL's event nodes."""
    if refusal and any(t.kind in TaskKind.EVENTS for t in graph.tasks):
        return f"{NCCL_EVENTS_REFUSED} ({refusal})"
    return refusal
