"""The dispatch-level op tracer used during capture.

For every ATen op that runs while capturing, the tracer notes: the op's name, the module that ran
it, which graph nodes it created (node count before and after), which allocations it made (the
caching allocator's allocation counter before and after), and the byte ranges its schema says it
reads and writes: every tensor argument is read, arguments the schema marks mutable (``Tensor(a!)``)
are written, fresh returns are written, and returns that alias an input without ``!`` (views) touch
nothing.

Kernels that Inductor generates (``torch.compile``) launch without an ATen op: the tracer also
wraps the launch of Inductor's Triton kernels and records each launch as an op of its own, named by
the kernel, with its tensor arguments read or written as Inductor's argument names say
(``in_ptr*`` read, ``out_ptr*`` written, ``in_out_ptr*`` both, and any other tensor, or one listed
as mutated, written).  The library kernels a compiled model calls (cuBLAS, cuDNN) still go through
ATen and are traced as ops.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .raw import OpRecord, TensorSpan


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
    return TensorSpan(t.data_ptr() + lo * el, (hi - lo + 1) * el, write, el)


def tensors_of(value) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def op_name(func) -> str:
    schema = func._schema
    overload = schema.overload_name
    return schema.name + (f".{overload}" if overload and overload != "default" else "")


class ModulePaths:
    """Tracks the qualified name of the module whose forward is running (global module hooks)."""

    def __init__(self, root: torch.nn.Module | None, enabled: bool = True) -> None:
        self._names = {id(m): n for n, m in root.named_modules()} if root is not None else {}
        self._stack: list[str] = []
        self._handles: list = []
        self._enabled = enabled

    def __enter__(self) -> "ModulePaths":
        if not self._enabled:
            return self
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


#: Inductor's names for a Triton kernel's pointer arguments: prefix -> written.
TRITON_ARG_ROLES = (("in_out_ptr", True), ("out_ptr", True), ("in_ptr", False))


def triton_arg_writes(name: str, mutated: frozenset = frozenset()) -> bool:
    """Whether a Triton kernel of Inductor's writes its tensor argument called ``name``.

    Unknown names are taken as written: ordering stays safe, only concurrency is lost.
    """
    if name in mutated:
        return True
    for prefix, write in TRITON_ARG_ROLES:
        if name.startswith(prefix):
            return write
    return True


def triton_arg_names(kernel) -> list[str]:
    """The argument names of one of Inductor's Triton kernels (its ``CachingAutotuner``), in
    launch order; empty where they cannot be found."""
    names = list(getattr(getattr(kernel, "fn", None), "arg_names", None) or [])
    if not names:
        names = list((getattr(kernel, "triton_meta", None) or {}).get("signature", {}).keys())
    return names


def _inductor_autotuner():
    """Inductor's Triton launcher class, if Inductor is loaded (it is never imported here)."""
    module = sys.modules.get("torch._inductor.runtime.triton_heuristics")
    return getattr(module, "CachingAutotuner", None)


class OpTracer(TorchDispatchMode):
    """Records an :class:`OpRecord` per ATen op dispatched while active, and per Triton kernel
    Inductor launches."""

    def __init__(self, node_count: Callable[[], int], alloc_count: Callable[[], int],
                 modules: ModulePaths) -> None:
        super().__init__()
        self._node_count = node_count
        self._alloc_count = alloc_count
        self._modules = modules
        self.ops: list[OpRecord] = []
        self._in_kernel = False
        self._patched: tuple | None = None

    def __enter__(self):
        autotuner = _inductor_autotuner()
        if autotuner is not None:
            original = autotuner.run
            tracer = self

            def run(kernel, *args, **kwargs):
                return tracer._launch(original, kernel, args, kwargs)
            autotuner.run = run
            self._patched = (autotuner, original)
        try:
            return super().__enter__()
        except BaseException:
            self._unpatch()
            raise

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let ``torch.compile``'d code run compiled under the tracer.

        Dynamo runs a frame eagerly while a dispatch mode without this is active, and the
        recording would then hold the eager kernels, not Inductor's.  The compiled code's own ATen
        calls (the library kernels) still reach the tracer at run time.
        """
        return True

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._unpatch()

    def _unpatch(self) -> None:
        if self._patched is not None:
            autotuner, original = self._patched
            autotuner.run = original
            self._patched = None

    def _launch(self, original, kernel, args, kwargs):
        """One Triton kernel launch from Inductor's code, recorded as an op of its own."""
        if self._in_kernel:
            return original(kernel, *args, **kwargs)
        names = triton_arg_names(kernel)
        mutated = frozenset(getattr(kernel, "mutated_arg_names", None) or ())
        spans: list[TensorSpan] = []
        for i, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                name = names[i] if i < len(names) else ""
                span = tensor_span(value, triton_arg_writes(name, mutated))
                if span is not None:
                    spans.append(span)
        fn = getattr(kernel, "fn", None)
        record = OpRecord(name=getattr(fn, "__name__", None) or "triton_kernel",
                          module=self._modules.current, node_begin=self._node_count(),
                          node_end=0, alloc_begin=self._alloc_count(), alloc_end=0, spans=spans)
        # ATen ops inside the launch (a scratch allocation for the kernel) belong to it.
        self._in_kernel = True
        try:
            out = original(kernel, *args, **kwargs)
        finally:
            self._in_kernel = False
        record.node_end, record.alloc_end = self._node_count(), self._alloc_count()
        self.ops.append(record)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._in_kernel:
            return func(*args, **kwargs)
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
