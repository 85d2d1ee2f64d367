"""The dispatch-level op tracer used during capture.

For every ATen op that runs while capturing, the tracer notes: the op's name, the module that ran
it, which graph nodes it created (node count before and after), which allocations it made (the
caching allocator's allocation counter before and after), and the byte ranges its schema says it
reads and writes: every tensor argument is read, arguments the schema marks mutable (``Tensor(a!)``)
are written, fresh returns are written, and returns that alias an input without ``!`` (views) touch
nothing.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .resolve import OpRecord, TensorSpan


def tensor_span(t: torch.Tensor, write: bool) -> TensorSpan | None:
    """The bytes a CUDA tensor's elements occupy (from its lowest to its highest element)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or t.numel() == 0:
        return None
    if t.layout != torch.strided:
        return None
    el = t.element_size()
    lo = hi = 0
    for size, stride in zip(t.shape, t.stride()):
        step = (size - 1) * stride
        if step < 0:
            lo += step
        else:
            hi += step
    return TensorSpan(t.data_ptr() + lo * el, (hi - lo + 1) * el, write)


def tensors_of(value) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def op_name(func) -> str:
    schema = func._schema
    overload = schema.overload_name
    return schema.name + (f".{overload}" if overload and overload != "default" else "")


class ModulePaths:
    """Tracks the qualified name of the module whose forward is running (global module hooks)."""

    def __init__(self, root: torch.nn.Module | None) -> None:
        self._names = {id(m): n for n, m in root.named_modules()} if root is not None else {}
        self._stack: list[str] = []
        self._handles: list = []

    def __enter__(self) -> "ModulePaths":
        hooks = torch.nn.modules.module
        self._handles = [hooks.register_module_forward_pre_hook(self._pre),
                         hooks.register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, module, args) -> None:
        self._stack.append(self._names.get(id(module), type(module).__name__))

    def _post(self, module, args, output) -> None:
        if self._stack:
            self._stack.pop()

    @property
    def current(self) -> str:
        return self._stack[-1] if self._stack else ""


class OpTracer(TorchDispatchMode):
    """Records an :class:`OpRecord` per ATen op dispatched while active."""

    def __init__(self, node_count: Callable[[], int], alloc_count: Callable[[], int],
                 modules: ModulePaths) -> None:
        super().__init__()
        self._node_count = node_count
        self._alloc_count = alloc_count
        self._modules = modules
        self.ops: list[OpRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        spans: list[TensorSpan] = []
        for i, arg in enumerate(schema.arguments):
            if i < len(args):
                value = args[i]
            elif arg.name in kwargs:
                value = kwargs[arg.name]
            else:
                continue
            write = arg.alias_info is not None and arg.alias_info.is_write
            for t in tensors_of(value):
                span = tensor_span(t, write)
                if span is not None:
                    spans.append(span)
        nodes_before, allocs_before = self._node_count(), self._alloc_count()
        out = func(*args, **kwargs)
        nodes_after, allocs_after = self._node_count(), self._alloc_count()
        returns = out if isinstance(out, (tuple, list)) and len(schema.returns) > 1 else (out,)
        fresh: list[TensorSpan] = []
        for ret, value in zip(schema.returns, returns):
            alias = ret.alias_info
            if alias is not None and not alias.is_write:
                continue  # a view of an input: no bytes touched
            for t in tensors_of(value):
                span = tensor_span(t, True)
                if span is not None:
                    (fresh if alias is None else spans).append(span)
        self.ops.append(OpRecord(
            name=op_name(func), module=self._modules.current,
            node_begin=nodes_before, node_end=nodes_after,
            alloc_begin=allocs_before, alloc_end=allocs_after,
            spans=spans + fresh))
        return out
