"""The model's weights as a prepared graph reads them: held, watched, and followed when they move.

A prepared graph reads parameters and module buffers where they were when it was recorded.
In-place updates (an optimizer step, ``load_state_dict`` copying into the tensors) change the bytes
there, and the next launch reads them as they are.  Anything that gives a weight *new memory*
(``load_state_dict(assign=True)``, assigning a new ``Parameter``, ``model.to(...)``, ``.half()``,
``.double().float()``) would leave the graph reading the old memory.  So:

* every storage the graph reads is held for as long as the graph reads it, so a launch never reads
  memory that was freed and handed to someone else;
* a process-wide *epoch* counts the events that can move weights: parameter and buffer
  registration (torch's global module hooks) and ``Module._apply`` (behind ``.to()``, ``.half()``
  and friends, which has no hook: it is wrapped once, when the first graph is prepared).  A call
  compares one integer; only when the epoch moved does it compare every bound tensor's address;
* a weight that moved but kept its dtype, shape and strides is followed: the graph's kernel nodes
  are re-pointed at its new memory in place (``cuGraphExecKernelNodeSetParams``, no re-recording);
  one whose dtype, shape or layout changed raises :class:`~nimble.errors.WeightsChangedError`,
  since the recorded kernels were chosen for the old one.

Changes that go around torch's module machinery (``param.data = t``, ``torch.utils.swap_tensors``)
raise no event: :meth:`nimble.Nimble.refresh` checks on demand.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ..errors import WeightsChangedError
from ..ir.taskgraph import BufferKind, TaskGraph
from ..record.module_weights import module_weights

#: Bumped by every event that may give a module's weights new memory.  A list, so that the
#: per-call check is one subscript with no global rebinding.
EPOCH = [0]
_watching = [False]


def _bump(*_args, **_kwargs) -> None:
    EPOCH[0] += 1


def watch_modules() -> None:
    """Install the process-wide watch (idempotent): registration hooks and the ``_apply`` wrap."""
    if _watching[0]:
        return
    import torch
    from torch.nn.modules import module as torch_module

    torch_module.register_module_parameter_registration_hook(_bump)
    torch_module.register_module_buffer_registration_hook(_bump)
    original = torch.nn.Module._apply
    if not getattr(original, "_nimble_watch", False):
        @functools.wraps(original)
        def _apply(self, *args, **kwargs):
            try:
                return original(self, *args, **kwargs)
            finally:
                EPOCH[0] += 1
        _apply._nimble_watch = True  # type: ignore[attr-defined]
        torch.nn.Module._apply = _apply
    _watching[0] = True


@dataclass(slots=True)
class Binding:
    """One named parameter or buffer, living in the graph's ``param`` buffer ``buffer``."""

    name: str
    buffer: int
    address: int  # where its data is now (where the graph reads it)
    shape: tuple
    strides: tuple
    dtype: Any
    device: Any


def named_weights(module) -> dict[str, Any]:
    """Every parameter and buffer of ``module`` by qualified name, shared ones under each name,
    a tensor subclass (a tensor-parallel model's DTensor) as the tensors inside it
    (:func:`~nimble.record.module_weights.module_weights`)."""
    import torch

    if not isinstance(module, torch.nn.Module):
        return {}
    return module_weights(module)


class Weights:
    """The weights one prepared graph reads: their bindings, the storages held, the epoch seen."""

    def __init__(self, module, graph: TaskGraph, addresses: dict[int, int] | None = None
                 ) -> None:
        """``addresses``: where each buffer the graph reads lives now, where that is not where
        it was recorded (a graph loaded from a file into another process)."""
        self.module = module
        self.epoch = EPOCH[0]
        by_address = {(addresses or {}).get(b.id, b.address): b.id for b in graph.buffers
                      if b.kind == BufferKind.PARAM}
        self.bindings: list[Binding] = []
        self.held: dict[int, Any] = {}  # buffer id -> the storage the graph reads
        for name, t in named_weights(module).items():
            storage = t.untyped_storage()
            buffer = by_address.get(storage.data_ptr())
            if buffer is None or not storage.nbytes():
                continue
            self.bindings.append(Binding(name, buffer, t.data_ptr(), tuple(t.shape),
                                         tuple(t.stride()), t.dtype, t.device))
            self.held[buffer] = storage
        self._sizes = {b.id: b.size for b in graph.buffers}

    def stale(self) -> bool:
        """Whether something may have moved a weight since the last look (one int compare)."""
        return self.epoch != EPOCH[0]

    def moves(self) -> dict[int, tuple[int, Any]]:
        """``{buffer: (byte delta, new storage)}`` for every buffer whose tensors moved.

        Raises :class:`WeightsChangedError` for a weight that is gone, changed dtype, shape,
        strides or device, or no longer lies inside one storage with the others it shared bytes
        with.
        """
        current = named_weights(self.module)
        moves: dict[int, tuple[int, Any]] = {}
        for b in self.bindings:
            t = current.get(b.name)
            if t is None:
                raise WeightsChangedError(
                    f"the model no longer has '{b.name}', which the prepared graph reads: call "
                    "prepare() again")
            if (t.dtype, tuple(t.shape), tuple(t.stride()), t.device) != \
                    (b.dtype, b.shape, b.strides, b.device):
                raise WeightsChangedError(
                    f"'{b.name}' is now {t.dtype} {tuple(t.shape)} (strides {tuple(t.stride())}) "
                    f"on {t.device}; the graph was prepared for {b.dtype} {b.shape} (strides "
                    f"{b.strides}) on {b.device}, and its kernels were chosen for that: call "
                    "prepare() again with inputs to match")
            delta = t.data_ptr() - b.address
            storage = t.untyped_storage()
            previous = moves.get(b.buffer)
            if previous is not None and previous[0] != delta:
                raise WeightsChangedError(
                    f"'{b.name}' moved apart from the weights it shared memory with when the "
                    "graph was prepared: call prepare() again")
            moves[b.buffer] = (delta, storage)
        return {bid: m for bid, m in moves.items() if m[0]}

    def check_inside(self, bases: list[int], moves: dict[int, tuple[int, Any]]) -> None:
        """Raise unless every moved buffer's bytes lie inside its new storage."""
        for bid, (delta, storage) in moves.items():
            start = bases[bid] + delta
            if not (storage.data_ptr() <= start
                    and start + self._sizes[bid] <= storage.data_ptr() + storage.nbytes()):
                raise WeightsChangedError(
                    f"a weight moved into a storage too small for what the graph reads of it "
                    f"(buffer {bid}): call prepare() again")

    def accept(self, moves: dict[int, tuple[int, Any]]) -> list[Any]:
        """Record the moves as done; return the storages no longer read (to release later)."""
        released = []
        for b in self.bindings:
            if b.buffer in moves:
                b.address += moves[b.buffer][0]
        for bid, (_, storage) in moves.items():
            released.append(self.held[bid])
            self.held[bid] = storage
        self.epoch = EPOCH[0]
        return released
