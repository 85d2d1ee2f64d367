"""The per-call path of a prepared graph: check the inputs, hand them to the graph, launch.

This is the only code that runs on every call, so everything it can look up once it looks up in
``__init__``: the driver functions, each input slot's address, byte count and layout, the output
structure, and a ``CUstream`` per raw stream handle.

An input reaches its arena slot one of two ways.  Where the slot has a *cell*, the graph's first
node copies the input in itself (``kernels/gather_input.ptx``) from the address in the cell, and
the call only writes the tensor's address there with one stream-ordered
``cuStreamWriteValue64`` (about 5 µs of host time on an H100, against 8-22 µs for a driver memcpy
of an image).  Otherwise a contiguous input goes in with one ``cuMemcpyDtoDAsync``, and any other
layout is copied by torch, which knows strides.

The graph's exec serializes its own launches, but the writes ahead of a launch do not: when a call
comes on another stream than the previous one, the new stream first waits for everything queued on
the old one.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

from . import driver
from .errors import InputError


class InputSlot(NamedTuple):
    """Where one input lives in the arena, and what it must look like."""

    tensor: Any  # a torch tensor over the slot's bytes
    address: int
    nbytes: int
    shape: tuple
    dtype: Any
    dense: bool  # the slot is contiguous: a flat byte copy of a contiguous input fills it
    cell: int = 0  # device address the graph's gather node reads the source from (0: no gather)


def _raw_stream_getter(device_index: int) -> Callable[[], int]:
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return lambda: raw(device_index)
    return lambda: torch.cuda.current_stream(device_index).cuda_stream


class Launcher:
    """Runs one instantiated graph on the caller's current stream; see :meth:`run`."""

    __slots__ = ("_exec", "_slots", "_device", "_outputs", "_unflatten", "return_copies",
                 "_raw_stream", "_streams", "_launch", "_copy", "_write", "_tensor_type",
                 "_last_stream", "_switch_event", "_record", "_wait")

    def __init__(self, exec_handle, slots: Sequence[InputSlot], device, outputs: list,
                 output_spec, return_copies: bool = False) -> None:
        import torch
        from torch.utils._pytree import tree_unflatten

        self._exec = exec_handle
        self._slots = tuple(slots)
        self._device = device
        self._outputs = outputs
        self.return_copies = return_copies
        self._unflatten = (lambda flat: flat[0]) if output_spec.is_leaf() else \
            (lambda flat: tree_unflatten(flat, output_spec))
        self._raw_stream = _raw_stream_getter(device.index or 0)
        self._streams: dict[int, Any] = {}
        self._launch = driver.checked("cuGraphLaunch")
        self._copy = driver.checked("cuMemcpyDtoDAsync")
        self._write = driver.checked("cuStreamWriteValue64")
        self._record = driver.checked("cuEventRecord")
        self._wait = driver.checked("cuStreamWaitEvent")
        self._tensor_type = torch.Tensor
        self._last_stream = None
        self._switch_event = driver.Event.create(timing=False)

    def close(self) -> None:
        """Free the stream-switch event (idempotent)."""
        self._switch_event.close()

    @property
    def slots(self) -> tuple[InputSlot, ...]:
        """The input slots, in call order."""
        return self._slots

    def stream(self):
        """The caller's current stream as a ``CUstream`` (one object per stream, kept)."""
        raw = self._raw_stream()
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = driver.bindings().CUstream(raw)
        return stream

    def _bad_input(self, i: int, x) -> InputError:
        slot = self._slots[i]
        if not isinstance(x, self._tensor_type):
            return InputError(f"input {i} is a {type(x).__name__}, not a tensor")
        return InputError(
            f"input {i} is {tuple(x.shape)} {x.dtype} on {x.device}; the model was prepared for "
            f"{slot.shape} {slot.dtype} on {self._device}: call prepare() again for another "
            "shape, or move the input with .to(...)")

    def run_flat(self, inputs: Sequence) -> list:
        """Copy ``inputs`` into their slots and launch; the flat list of outputs."""
        slots = self._slots
        if len(inputs) != len(slots):
            raise InputError(f"the model was prepared with {len(slots)} input(s), got "
                             f"{len(inputs)}")
        stream = self.stream()
        if stream is not self._last_stream:
            self._join(stream)
        for i, x in enumerate(inputs):
            slot = slots[i]
            if not (isinstance(x, self._tensor_type) and x.shape == slot.shape
                    and x.dtype == slot.dtype and x.device == self._device):
                raise self._bad_input(i, x)
            if slot.cell:
                # A strided input is made contiguous first; torch frees the copy in stream
                # order, after the graph has read it.
                source = x if x.is_contiguous() else x.contiguous()
                self._write(stream, slot.cell, source.data_ptr(), 0)
            elif slot.dense and x.is_contiguous():
                self._copy(slot.address, x.data_ptr(), slot.nbytes, stream)
            else:
                slot.tensor.copy_(x)
        self._launch(self._exec, stream)
        if self.return_copies:
            return [o.clone() for o in self._outputs]
        return self._outputs

    def _join(self, stream) -> None:
        """Order ``stream`` after all work queued so far on the previous call's stream."""
        if self._last_stream is not None:
            self._record(self._switch_event.handle, self._last_stream)
            self._wait(stream, self._switch_event.handle, 0)
        self._last_stream = stream

    def run(self, inputs: Sequence):
        """:meth:`run_flat`, with the outputs in the structure the model returned."""
        return self._unflatten(self.run_flat(inputs))
