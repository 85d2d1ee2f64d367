"""A module's weights as its kernels see them: every parameter and buffer by qualified name, a
tensor subclass unwrapped into the plain tensors that hold its bytes.

A tensor-parallel model (transformers' ``tp_plan``, ``torch.distributed.tensor.parallel``) holds
each parameter as a ``DTensor``: a wrapper with no storage of its own around the rank's shard,
the tensor its kernels read.  Such a wrapper says what it wraps (``__tensor_flatten__``, the
protocol of torch's traceable wrapper subclasses), so the recorder sees the shard's memory as the
parameter it is, and a prepared graph binds and follows the shard by the parameter's name (a
wrapper around several tensors: ``name.attribute`` each).
"""
from __future__ import annotations

from typing import Any


def plain_tensors(name: str, t) -> list[tuple[str, Any]]:
    """``[(name, tensor)]`` for a plain tensor; for a traceable wrapper subclass, the plain
    tensors inside it (depth first), named ``name`` where it wraps one, ``name.attr`` each where
    it wraps several."""
    import torch
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [(name, t)]
    attrs, _ = t.__tensor_flatten__()
    # what it flattens to may name more than tensors (a DTensor's device mesh, in some torch)
    inner = [(a, getattr(t, a)) for a in attrs if isinstance(getattr(t, a), torch.Tensor)]
    out: list[tuple[str, Any]] = []
    for attr, value in inner:
        out += plain_tensors(name if len(inner) == 1 else f"{name}.{attr}", value)
    return out


def module_weights(module) -> dict[str, Any]:
    """Every parameter and buffer of ``module`` by qualified name (shared ones under each name),
    each as the plain tensor(s) holding its bytes (:func:`plain_tensors`)."""
    named = list(module.named_parameters(remove_duplicate=False)) + \
        list(module.named_buffers(remove_duplicate=False))
    return {n: p for name, t in named for n, p in plain_tensors(name, t)}
