"""The per-call path of a prepared graph: check the inputs, hand them to the graph, launch.

This is the only code that runs on every call, so everything it can look up once it looks up in
``__init__``: the driver functions, each input slot's address, byte count and layout, the output
structure, and a ``CUstream`` per raw stream handle.

An input reaches its arena slot one of two ways.  Where the slot has a *cell*, the graph's first
node copies the input in itself (``kernels/gather_input.ptx``) from the address in the cell, and
the call only writes the tensor's address there with one stream-ordered
``cuStreamWriteValue64`` (less host time than a driver memcpy of the input; see
docs/findings.md), and only when it differs from the address the cell already holds (a serving loop
that fills one input buffer writes nothing).  Otherwise a contiguous input goes in with one
``cuMemcpyDtoDAsync``, and any other layout is copied by torch, which knows strides.

The graph's exec serializes its own launches, but the writes ahead of a launch do not: when a call
comes on another stream than the previous one, the new stream first waits for everything queued on
the old one.  Calls may come from any thread: the first call on a thread makes the graph's CUDA
context current there, and a lock makes each call's writes, launch and output copies one unit, so
calls from several threads are serialized in the order they take the lock (each on its caller's
stream, ordered after the previous call's).

After the first call, a plain call (tensors of the prepared shapes, contiguous, every slot a cell,
a thread that called before) runs :meth:`Launcher.fast_call`'s path, with everything it reads
bound once; any other call, and every error, goes the general way (:meth:`Launcher.run_flat`).

A graph that draws random numbers reads the generator's seed and offset from two cells of its
own; each call writes them from torch's CUDA generator and advances the generator's offset by what
one launch consumes, as ``torch.cuda.graph``'s replay does.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, NamedTuple, Sequence

from .. import driver
from ..errors import CudaError, InputError, NimbleError


#: What :meth:`Launcher.fast_call`'s call returns when the call needs the general path.
TAKE_GENERAL_PATH = object()


class InputSlot(NamedTuple):
    """Where one input lives in the arena, and what it must look like."""

    tensor: Any  # a torch tensor over the slot's bytes
    address: int
    nbytes: int
    shape: tuple
    dtype: Any
    dense: bool  # the slot is contiguous: a flat byte copy of a contiguous input fills it
    cell: int = 0  # device address the graph's gather node reads the source from (0: no gather)


class RngCells(NamedTuple):
    """Where a graph reads the random generator's seed and offset, and what a launch consumes."""

    generator: Any  # torch's CUDA generator of the device
    seed_cell: int
    offset_cell: int
    increment: int  # Philox offset one launch consumes


def _raw_stream_getter(device_index: int) -> Callable[[], int]:
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return functools.partial(raw, device_index)  # no Python frame per call
    return lambda: torch.cuda.current_stream(device_index).cuda_stream


class CallOrder:
    """What the launchers of one arena share: one lock, the latest call's stream, an event.

    The forward and backward graphs of a training step read and write the same arena, so a
    call of either must come after everything queued by the last call of both.
    """

    __slots__ = ("lock", "last_stream", "last_raw", "switch_event", "entered")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last_stream = None
        self.last_raw = None  # the raw handle of last_stream
        self.switch_event = driver.Event.create(timing=False)
        # Per thread, whether the graph's context was made current there.  A thread-local,
        # not a set of thread idents: a new thread may get the ident of one that ended, and
        # would then skip making the context current.
        self.entered = threading.local()
        self.entered.ok = True

    def close(self) -> None:
        """Wait for the last call's work, then free the event (idempotent)."""
        with self.lock:
            if self.last_stream is not None and not self.switch_event.closed:
                try:
                    driver.stream_synchronize(self.last_stream)
                except CudaError:  # the caller's stream is gone: wait for everything instead
                    driver.synchronize_context()
            self.switch_event.close()


class Launcher:
    """Runs one instantiated graph on the caller's current stream; see :meth:`run`."""

    __slots__ = ("_exec", "_slots", "_device", "_outputs", "_unflatten", "return_copies",
                 "_raw_stream", "_streams", "_api", "_tensor_type", "_order", "_context",
                 "_rng", "_in_cells", "_leaf", "_spec")

    def __init__(self, exec_handle, slots: Sequence[InputSlot], device, outputs: list,
                 output_spec, context, rng: RngCells | None = None,
                 return_copies: bool = False, order: CallOrder | None = None) -> None:
        import torch
        from torch.utils._pytree import tree_unflatten

        self._exec = exec_handle
        self._slots = tuple(slots)
        # Per slot, the address its cell holds once the writes queued so far have run (None:
        # not known).  A call passing the same tensor again writes nothing.
        self._in_cells: list = [None] * len(self._slots)
        self._device = device
        self._outputs = outputs
        self.return_copies = return_copies
        self._spec = output_spec
        self._leaf = output_spec is not None and output_spec.is_leaf()
        if output_spec is None:
            self._unflatten = list
        else:
            self._unflatten = (lambda flat: flat[0]) if output_spec.is_leaf() else \
                (lambda flat: tree_unflatten(flat, output_spec))
        self._raw_stream = _raw_stream_getter(device.index or 0)
        self._streams: dict[int, Any] = {}
        self._api = driver.CallPath()
        self._tensor_type = torch.Tensor
        self._order = order if order is not None else CallOrder()
        self._context = context
        self._rng = rng

    def close(self) -> None:
        """Wait for the last call's work, free the stream-switch event and drop the arena views
        (idempotent); a later call raises :class:`~nimble.errors.NimbleError`."""
        self._order.close()
        self._exec = None
        self._outputs = []
        self._slots = ()

    def set_exec(self, exec_handle) -> None:
        """Launch ``exec_handle`` from now on: a rebuilt copy of the same graph over the same
        arena.  Call holding :attr:`lock`; a :meth:`fast_call` closure made before still
        launches the old exec, so make it again."""
        self._exec = exec_handle

    @property
    def slots(self) -> tuple[InputSlot, ...]:
        """The input slots, in call order."""
        return self._slots

    @property
    def outputs(self) -> list:
        """The output tensors (views into the arena), flattened."""
        return self._outputs

    @property
    def output_spec(self):
        """The pytree structure of the model's outputs (None: a flat list)."""
        return self._spec

    @property
    def unflatten(self):
        """Flat outputs -> the structure the model returned."""
        return self._unflatten

    @property
    def rng(self) -> RngCells | None:
        """The generator cells the graph reads (None for a graph without random numbers)."""
        return self._rng

    @property
    def lock(self) -> threading.Lock:
        """Held during each call; hold it to change the graph between calls."""
        return self._order.lock

    @property
    def last_stream(self):
        """The stream of the latest call (None before the first)."""
        return self._order.last_stream

    def stream(self, raw: int | None = None):
        """The caller's current stream (or raw handle ``raw``) as a ``CUstream`` (one object per
        stream, kept)."""
        if raw is None:
            raw = self._raw_stream()
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = driver.stream(raw)
        return stream

    def _bad_input(self, i: int, x) -> InputError:
        slot = self._slots[i]
        if not isinstance(x, self._tensor_type):
            return InputError(f"input {i} is a {type(x).__name__}, not a tensor")
        return InputError(
            f"input {i} is {tuple(x.shape)} {x.dtype} on {x.device}; the model was prepared for "
            f"{slot.shape} {slot.dtype} on {self._device}: call prepare() again for another "
            "shape, or move the input with .to(...)")

    def _check(self, inputs: Sequence, rows: int | None = None) -> None:
        """Raise where ``inputs`` cannot be taken; ``rows``: the inputs fill only the first
        ``rows`` rows of each slot (a padded call)."""
        if self._exec is None:
            raise NimbleError("this prepared graph was closed (by Nimble.close() or a later "
                              "prepare()): call the model again through its Nimble object")
        slots = self._slots
        tensor, device = self._tensor_type, self._device
        for i, x in enumerate(inputs):  # nm([1, 2, 3]): one thing passed, and not a tensor
            if not isinstance(x, tensor):
                raise not_a_tensor(i, x, inputs)
        if len(inputs) != len(slots):
            raise InputError(f"the model was prepared with {len(slots)} input(s), got "
                             f"{len(inputs)}")
        for x, slot in zip(inputs, slots):
            shape = slot.shape if rows is None or not isinstance(x, tensor) else \
                (rows,) + tuple(slot.shape[1:])
            if not (isinstance(x, tensor) and x.shape == shape and x.dtype is slot.dtype
                    and x.device == device):
                raise self._bad_input(next(i for i, s in enumerate(slots) if s is slot), x)

    def run_flat(self, inputs: Sequence) -> list:
        """Copy ``inputs`` into their slots and launch; the flat list of outputs."""
        self._check(inputs)
        if not getattr(self._order.entered, "ok", False):
            self._enter_thread()
        with self._order.lock:
            return self._submit(inputs)

    def run_flat_held(self, inputs: Sequence, rows: int | None = None) -> list:
        """:meth:`run_flat` for a caller that holds :attr:`lock` already (a pool of model
        instances, which takes a free one's lock to pick it).  With ``rows``, each input fills
        the first ``rows`` rows of its slot (dim 0), the rest keep what they held, and each
        output is its first ``rows`` rows: a batch run in a larger bucket, right only where
        rows do not mix."""
        self._check(inputs, rows)
        if not getattr(self._order.entered, "ok", False):
            self._enter_thread()
        if rows is None:
            return self._submit(inputs)
        return self._submit_rows(inputs, rows)

    def _submit_rows(self, inputs: Sequence, rows: int) -> list:
        """Copy each input into the first rows of its slot, point the cells at their own slots,
        launch, and return the outputs' first rows.  Call it holding :attr:`lock`."""
        stream = self._stream_of_call()  # torch copies on the caller's stream, as this launch
        for i, (x, slot) in enumerate(zip(inputs, self._slots)):
            slot.tensor.narrow(0, 0, rows).copy_(x)
            if slot.cell and self._in_cells[i] != slot.address:
                self._api.write64(stream, slot.cell, slot.address, 0)
                self._in_cells[i] = slot.address
        if self._rng is not None:
            self._draw(stream)
        self._api.launch(self._exec, stream)
        outputs = [o.narrow(0, 0, rows) for o in self._outputs]
        return [o.clone() for o in outputs] if self.return_copies else outputs

    def _submit(self, inputs: Sequence) -> list:
        """Hand the checked ``inputs`` to the graph and launch.  Call it holding :attr:`lock`."""
        slots, api = self._slots, self._api
        stream = self._stream_of_call()
        in_cells = self._in_cells
        for i, x in enumerate(inputs):
            slot = slots[i]
            if slot.cell:
                # A strided input is made contiguous first; torch frees the copy in stream
                # order, after the graph has read it.
                source = x if x.is_contiguous() else x.contiguous()
                address = source.data_ptr()
                if address != in_cells[i] or source is not x:
                    api.write64(stream, slot.cell, address, 0)
                    in_cells[i] = address if source is x else None
            elif slot.dense and x.is_contiguous():
                api.copy(slot.address, x.data_ptr(), slot.nbytes, stream)
            else:
                slot.tensor.copy_(x)
        if self._rng is not None:
            self._draw(stream)
        api.launch(self._exec, stream)
        if self.return_copies:
            return [o.clone() for o in self._outputs]
        return self._outputs

    def forget_cells(self) -> None:
        """Make the next call write every input cell: something other than a call (a C host, a
        debugging run) may have written them.  Takes no lock: call it holding :attr:`lock` or
        between calls."""
        self._in_cells[:] = [None] * len(self._in_cells)

    def fast_call(self, weights) -> Callable[[tuple], Any] | None:
        """The common call, with everything it reads bound once: the inputs are tensors (exactly
        ``torch.Tensor``) of the prepared shapes and dtypes, contiguous, on the prepared device,
        on a thread that called before, every slot has a cell, no random numbers, views
        returned.  It returns :data:`TAKE_GENERAL_PATH` for any other call (and when ``weights``
        moved), for :meth:`run_flat` to handle; None where the graph has no such call.

        On an idle GPU every attribute read, Python frame and torch getter here costs several
        times its warm cost (the caches went cold during the wait for the previous call; see
        docs/findings.md), so the path reads as little as it can: the device index rather than
        a ``torch.device``, the stream's raw handle compared with the last call's, and the
        launch's status read inline rather than through a checking frame.
        """
        slots = self._slots
        if self._rng is not None or self.return_copies or not slots \
                or not all(s.cell for s in slots):
            return None
        from .weights import EPOCH

        n = len(slots)
        expected = tuple((s.shape, s.dtype) for s in slots)
        cells = tuple(s.cell for s in slots)
        device_index = slots[0].tensor.get_device()  # what an input's get_device() must say
        in_cells, order = self._in_cells, self._order
        lock, entered, raw_stream = order.lock, order.entered, self._raw_stream
        launch, failed, write64 = self._api.graph_launch, driver.raise_status, self._api.write64
        exec_handle, outputs, tensor = self._exec, self._outputs, self._tensor_type
        general, leaf = TAKE_GENERAL_PATH, self._leaf
        finish = self._unflatten
        join_stream = self._stream_of_call
        # One input (every zoo model) gets a closure of its own, without the loops, which cost
        # a one-input call measurable host time (docs/findings.md, "Host time per call").
        if n == 1:
            (shape, dtype), = expected
            cell = cells[0]

            def call(inputs: tuple):
                if len(inputs) != 1 or weights.epoch != EPOCH[0] \
                        or not getattr(entered, "ok", False) or self._exec is None:
                    return general
                x = inputs[0]
                if x.__class__ is not tensor or x.dtype is not dtype or x.shape != shape \
                        or x.get_device() != device_index or not x.is_contiguous():
                    return general
                with lock:
                    if raw_stream() != order.last_raw:
                        join_stream()
                    stream = order.last_stream
                    address = x.data_ptr()
                    if address != in_cells[0]:
                        write64(stream, cell, address, 0)
                        in_cells[0] = address
                    code = launch(exec_handle, stream)[0]
                    if code:  # CUresult is an int; CUDA_SUCCESS is 0
                        failed("cuGraphLaunch", code)
                return outputs[0] if leaf else finish(outputs)
            return call

        def call_many(inputs: tuple):
            if len(inputs) != n or weights.epoch != EPOCH[0] \
                    or not getattr(entered, "ok", False) or self._exec is None:
                return general
            for x, (shape, dtype) in zip(inputs, expected):
                if x.__class__ is not tensor or x.dtype is not dtype or x.shape != shape \
                        or x.get_device() != device_index or not x.is_contiguous():
                    return general
            with lock:
                if raw_stream() != order.last_raw:
                    join_stream()
                stream = order.last_stream
                for i, x in enumerate(inputs):
                    address = x.data_ptr()
                    if address != in_cells[i]:
                        write64(stream, cells[i], address, 0)
                        in_cells[i] = address
                code = launch(exec_handle, stream)[0]
                if code:
                    failed("cuGraphLaunch", code)
            return finish(outputs)
        return call_many

    def _draw(self, stream) -> None:
        """Hand this launch the generator's seed and offset, and advance the offset past it."""
        rng = self._rng
        gen = rng.generator
        offset = gen.get_offset()
        gen.set_offset(offset + rng.increment)
        self._api.write64(stream, rng.seed_cell, gen.initial_seed(), 0)
        self._api.write64(stream, rng.offset_cell, offset, 0)

    def _enter_thread(self) -> None:
        """Make the graph's context current on a thread that has not called before."""
        self._api.set_context(self._context)
        self._order.entered.ok = True

    def _stream_of_call(self):
        """The caller's current stream, ordered after the previous call's when it is another
        one.  Call it holding :attr:`lock`."""
        raw = self._raw_stream()
        order = self._order
        if raw != order.last_raw:
            self._join(self.stream(raw), raw)
        return order.last_stream

    def _join(self, stream, raw: int) -> None:
        """Order ``stream`` (raw handle ``raw``) after all work queued so far on the previous
        call's stream."""
        order = self._order
        if order.last_stream is not None:
            self._api.record(order.switch_event.handle, order.last_stream)
            self._api.wait(stream, order.switch_event.handle, 0)
        order.last_stream, order.last_raw = stream, raw


def not_a_tensor(i: int, x, inputs: Sequence) -> InputError:
    """The error of a call whose input ``i`` (of ``inputs``) is ``x``, not a tensor."""
    within = f" (of the {type(inputs).__name__} passed)" if isinstance(inputs, list) else ""
    return InputError(f"input {i}{within} is a {type(x).__name__}, not a tensor: call the model "
                      "with tensors of the prepared shapes and dtypes, on its GPU (several inputs "
                      "as several arguments or one tuple)")


def run_phases(launchers: Sequence[Launcher], mark: Callable[[int], None] | None = None):
    """``run(inputs) -> outputs``: each launcher in order on its share of the flat inputs.
    ``mark(k)``, where given, is called before launcher ``k`` and, with ``len(launchers)``,
    after the last (the fuzzer times its phases by it)."""
    def run(inputs: list) -> list:
        out, first = [], 0
        for k, launcher in enumerate(launchers):
            if mark is not None:
                mark(k)
            n = len(launcher.slots)
            out += launcher.run_flat(inputs[first:first + n])
            first += n
        if mark is not None:
            mark(len(launchers))
        return out
    return run
