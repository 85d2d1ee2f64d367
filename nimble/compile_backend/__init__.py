"""``torch.compile(model, backend="nimble")``: every graph Dynamo compiles, on Nimble.

::

    compiled = torch.compile(model, backend="nimble")           # no import of nimble needed
    out = compiled(x)       # first call: Inductor's kernels recorded, scheduled, proven
    out = compiled(x)       # later calls: one launch of the prepared graph

Each graph Dynamo hands over is compiled by Inductor and prepared by Nimble at its first call
(:mod:`~nimble.compile_backend.region`): a graph break gives two graphs, each prepared; each
shape Dynamo compiles for, and each concrete shape of a graph compiled for dynamic shapes, a
graph of its own (``share_arena``: the shapes of a dynamic graph as buckets of one arena).  The
model's parameters and buffers, which Dynamo passes as inputs, are the prepared graph's weights,
read in place; static tensors no module owns (transformers' static cache) its state, updated in
place (:mod:`~nimble.compile_backend.holder`).  Under grad
mode, with parameters that require grad, a graph is prepared as a training step: forward and
backward, Inductor's, as ``Nimble.prepare(training=True)`` prepares one.  ``options={...}``
takes :class:`~nimble.engine.options.PrepareOptions` fields and the backend's own
(:mod:`~nimble.compile_backend.options`).  What a graph cannot hold raises Nimble's typed
errors; ``options={"fallback": True}`` runs such a graph on Inductor's code alone, logged and
counted.
"""
from __future__ import annotations

from ..engine.weights import EPOCH
from .backend import NimbleBackend
from .options import BackendOptions, parse_options

#: The backend the ``torch_dynamo_backends`` entry point ``nimble`` names.
backend = NimbleBackend()


def weights_moved() -> None:
    """Say that weights may have new memory by a way torch's module machinery does not see
    (``param.data = t``, ``torch.utils.swap_tensors``): every prepared graph checks its
    weights' addresses at its next call and follows those that moved."""
    EPOCH[0] += 1


__all__ = ["backend", "NimbleBackend", "BackendOptions", "parse_options", "weights_moved"]
