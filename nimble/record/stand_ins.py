"""Stand-ins for a module's parameters while its training step is captured.

The autograd engine ends a backward by making the caller's stream wait on the stream of every
gradient-accumulation node it took a gradient at, where the two differ.  A node is tied to the
stream that was current when it was made: made inside the capture (the first use of a parameter
in the captured forward), it is the capture's stream and nothing is waited on.  A node that
something made earlier and keeps alive, such as the reducer of a ``DistributedDataParallel``
built on the default stream (torch's CUDA-graph notes ask for DDP to be built on a side stream
for this reason), ties the capture to a stream outside it, and the capture breaks ("operation
failed due to a previous error during capture").  While the step is captured each parameter is
replaced, on every module that holds it, by a new leaf that shares its storage: the same
addresses for the recording, and nodes made inside the capture.  Importing this module imports
torch: it is loaded lazily.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch


@contextlib.contextmanager
def parameter_stand_ins(module: torch.nn.Module, params: Sequence) -> Iterator[list]:
    """Each of ``params`` replaced on every module of ``module`` that holds it (tied
    parameters by one stand-in) by a new leaf parameter on the same storage; the stand-ins are
    yielded in ``params``' order, and the originals put back after, by attribute assignment
    both ways, so that a module that keeps its own list of its weights (an RNN's flat weights)
    follows."""
    fresh = {id(p): torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad)
             for p in params}
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    try:
        for owner in module.modules():
            for name, p in list(owner._parameters.items()):
                if p is not None and id(p) in fresh:
                    swapped.append((owner, name, p))
                    setattr(owner, name, fresh[id(p)])
        yield [fresh[id(p)] for p in params]
    finally:
        for owner, name, p in reversed(swapped):
            setattr(owner, name, p)
