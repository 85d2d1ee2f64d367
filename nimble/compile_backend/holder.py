"""A region's signature prepared by Nimble: Inductor's code as a module whose weights are the
model's.

Dynamo lifts the model's parameters and buffers as graph inputs, and passes the model's own
tensors at every call.  :class:`RegionModule` registers those very tensors as its parameters
and buffers and calls Inductor's code with them and the call's tensors, so that
:class:`nimble.Nimble` records it as any module: its weights are read where they lie, never
copied per call, updated in place as the model is (an optimizer step), held while the graph
reads them and followed when they move (:mod:`nimble.engine.weights`); a training step
differentiates with respect to them, so ``param.grad`` fills as eager fills it.

Static tensors no module owns (``torch._dynamo.mark_static_address``: transformers' static
cache, its keys, values and counters) stay plain attributes: Nimble takes them for state the graph
updates in place, restores them before every launch of its proof and leaves them as it found
them.  A call whose state Dynamo passes as other tensors (a new cache) makes the region prepare
that signature again.  Preparing runs the graph many times (warm-up, captures, proof): the
buffers and the state are put back afterwards, so the call that prepares finds them as the call
before left them.

A parameter re-assigned in the model (``model.fc.weight = nn.Parameter(...)``,
``load_state_dict(assign=True)``) comes as another tensor in Dynamo's next call: every such
assignment moves the weights' epoch, and only then does a call compare the tensors Dynamo
passes with those bound, re-binds any that changed (which the graph then follows as
``Nimble`` does), so a call costs one integer compare otherwise.
"""
from __future__ import annotations

from typing import Any

import torch

from ..api import Nimble
from ..engine.preparation import restored_after
from ..engine.weights import EPOCH, watch_modules
from ..errors import InputError
from .region import STALE, GraphInput, PrepareRequest, close_run


class RegionModule(torch.nn.Module):
    """One signature of a Dynamo graph as a module: the lifted weights are its own, the numbers
    of the signature fixed, the call's tensors its inputs."""

    def __init__(self, compiled, inputs: list[GraphInput], args: tuple, training: bool) -> None:
        super().__init__()
        # Kept out of the module's registry: a compiled GraphModule would become a child.
        self.__dict__["_compiled"] = compiled
        # The call's arguments with its tensors left out: its numbers stay as they are.
        self._template = [None if isinstance(x, torch.Tensor) else x for x in args]
        self._tensors = [i for i, g in enumerate(inputs)
                         if not g.static and isinstance(args[i], torch.Tensor)]
        self._static = [(i, g.name) for i, g in enumerate(inputs) if g.static and not g.state]
        # State no module owns (a static cache) stays a plain attribute: Nimble then takes it
        # for memory outside the graph that the graph may update on purpose, restored before
        # every launch of the proof and left as it was found.
        self.__dict__["state"] = [(i, args[i]) for i, g in enumerate(inputs) if g.state]
        # Numbers that are sizes of the call's tensors are read off them, so that one module
        # serves every shape of a graph compiled for dynamic shapes (``share_arena``).
        self._sizes = [(i, g.size_of) for i, g in enumerate(inputs)
                       if g.number and g.size_of is not None]
        for i, name in self._static:
            self.bind(name, args[i], training)
        self.train(training)

    @property
    def tensor_positions(self) -> list[int]:
        """Where the call's tensors (this module's inputs) are among the graph's inputs."""
        return list(self._tensors)

    def bind(self, name: str, tensor, training: bool | None = None) -> None:
        """Make ``tensor`` this module's weight ``name`` (a parameter if it is one)."""
        training = self.training if training is None else training
        if training and tensor.requires_grad and not isinstance(tensor, torch.nn.Parameter):
            raise InputError(
                f"graph input {name} is a tensor Dynamo lifted out of the model that requires "
                "grad but is no nn.Parameter, so a prepared training step would compute no "
                "gradient for it: make it an nn.Parameter")
        self._parameters.pop(name, None)
        self._buffers.pop(name, None)
        if isinstance(tensor, torch.nn.Parameter):
            self.register_parameter(name, tensor)
        else:
            self.register_buffer(name, tensor)

    def follow(self, args: tuple) -> int:
        """Re-bind every weight Dynamo passes as another tensor than the one bound; how many."""
        moved = 0
        for i, name in self._static:
            if getattr(self, name) is not args[i]:
                self.bind(name, args[i])
                moved += 1
        return moved

    def forward(self, *tensors):
        full = list(self._template)
        for i, t in zip(self._tensors, tensors):
            full[i] = t
        for i, (t, dim) in self._sizes:
            full[i] = full[t].shape[dim]
        for i, name in self._static:
            full[i] = getattr(self, name)
        for i, t in self.state:
            full[i] = t
        return self._compiled(*full)

    def kept(self) -> list:
        """Every static tensor a prepare may write and must leave as it was: the buffers and
        the state (parameters are written by no forward)."""
        return [t for _, t in self.state] + [getattr(self, name) for _, name in self._static
                                             if name in self._buffers]


class NimbleRun:
    """Calls of one signature: the call's tensors handed to the prepared graph (``launch``, a
    :class:`nimble.Nimble`), the weights re-bound first where an assignment may have moved
    them."""

    def __init__(self, launch, module: RegionModule) -> None:
        self.launch = launch
        self.module = module
        self._tensors = module.tensor_positions
        self._state = module.state
        watch_modules()  # the epoch moves on every assignment from now on
        self._epoch = EPOCH[0]

    def __call__(self, args: tuple) -> Any:
        if self._state and any(args[i] is not t for i, t in self._state):
            return STALE
        if self._epoch != EPOCH[0]:
            self.module.follow(args)
            self._epoch = EPOCH[0]
        return self.launch(*[args[i] for i in self._tensors])

    def close(self) -> None:
        """Free the prepared graph (a graph serving these shapes replaced it)."""
        close_run(self.launch)


def prepare_with_nimble(request: PrepareRequest) -> NimbleRun:
    """The backend's prepare function: ``Nimble(RegionModule).prepare(...)`` on the call's
    tensors, as a training step where the call records one."""
    module = RegionModule(request.compiled, request.inputs, request.args, request.training)
    tensors = tuple(request.args[i] for i in module.tensor_positions)
    if not tensors:
        raise InputError(f"graph {request.region} takes no tensor but the model's weights: a "
                         "prepared graph needs an input to run on")
    options = request.options
    shape = {"buckets": request.buckets} if request.buckets else {"example_inputs": tensors}
    # Preparing runs the graph many times (warm-up, captures, the proof): the call that
    # prepares must find the cache and the buffers as the call before left them.
    with _kept(module.kept()):
        nm = Nimble(module).prepare(**shape, training=request.training,
                                    use_multi_stream=options.use_multi_stream,
                                    max_streams=options.max_streams,
                                    return_copies=options.return_copies, quiet=options.quiet,
                                    options=options.prepare)
    return NimbleRun(nm, module)


def _kept(tensors: list):
    """Put ``tensors``' values back when the block ends (:func:`restored_after`)."""
    saved = [t.detach().clone() for t in tensors]

    def restore() -> None:
        with torch.no_grad():
            for t, value in zip(tensors, saved):
                t.copy_(value)
    return restored_after(restore)
