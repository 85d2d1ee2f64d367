"""The object users hold: ``nimble.Nimble(model)``, ``prepare()`` once, then one launch a call.

::

    import nimble
    nm = nimble.Nimble(model)                 # model on the GPU, in eval() mode
    nm.prepare(dummy_input, training=False)   # record, schedule, plan, build, verify
    out = nm(real_input)                      # input copy + one graph launch

``prepare()`` does all the scheduling work: it records one forward on a single stream, builds the
happens-before DAG, assigns streams (Nimble's algorithm), plans the static arena, builds and
instantiates one explicit CUDA graph, and proves it bit-exact against the recording.
"""
from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

from . import driver, ptx
from .build import BuiltGraph, InputGather, buffer_bases, build_graph
from .deps import build_dag, transitive_reduction
from .errors import NimbleError
from .launcher import InputSlot, Launcher
from .memplan import MemPlan, check_plan, plan_memory
from .schedule import Schedule, assign_streams, check_schedule
from .taskgraph import TaskGraph, TensorRef

_ARENA_ALIGNMENT = 512  # the planner's alignment; the arena base gets at least as much


class _DeviceBytes:
    """``__cuda_array_interface__`` over raw device memory, keeping its owner alive."""

    def __init__(self, address: int, size: int, owner: Any) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (size,), "typestr": "|u1", "data": (address, False), "version": 3,
            "strides": None, "stream": None}


def device_tensor(address: int, ref: TensorRef, owner: Any, device):
    """A torch tensor (shape, strides, dtype of ``ref``) over the device memory at ``address``."""
    import torch

    dtype = getattr(torch, ref.dtype)
    element = torch.empty((), dtype=dtype).element_size()
    extent = 1 + sum((s - 1) * st for s, st in zip(ref.shape, ref.strides)) if all(ref.shape) \
        else 0
    raw = torch.as_tensor(_DeviceBytes(address, max(extent, 1) * element, owner), device=device)
    return raw.view(dtype).as_strided(ref.shape, ref.strides)


def input_slot(address: int, ref: TensorRef, owner: Any, device) -> InputSlot:
    """The arena slot of one graph input, at ``address``."""
    tensor = device_tensor(address, ref, owner, device)
    return InputSlot(tensor, address, tensor.numel() * tensor.element_size(), tuple(ref.shape),
                     tensor.dtype, tensor.is_contiguous())


def stream_writes_supported(device) -> bool:
    """Whether the GPU takes 64-bit stream memory writes (``cuStreamWriteValue64``)."""
    drv = driver.bindings()
    attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
    return bool(driver.call("cuDeviceGetAttribute", attr,
                            driver.call("cuDeviceGet", device.index or 0)))


def single_stream_schedule(n: int) -> Schedule:
    """Every task on one stream in recorded order (Nimble with multi-stream off)."""
    return Schedule([0] * n, [list(range(n))] if n else [], [], max(n - 1, 0), 1 if n else 0)


def schedule_within(graph: TaskGraph, max_streams: int | None, arena_limit: int | None
                    ) -> tuple[Schedule, MemPlan]:
    """Nimble's schedule (at most ``max_streams`` streams) and its memory plan.

    Where the plan needs more than ``arena_limit`` bytes, the stream cap is lowered step by step
    (by a quarter each time) until it fits or one stream is left: fewer concurrent branches keep
    fewer buffers alive at once.
    """
    dag = build_dag(graph)
    reduced = transitive_reduction(dag)
    cap = max_streams
    while True:
        schedule = assign_streams(dag, max_streams=cap, reduced=reduced)
        check_schedule(dag, schedule)
        plan = plan_memory(graph, schedule.edges())
        streams = len(schedule.streams)
        if arena_limit is None or plan.arena_bytes <= arena_limit or streams <= 1:
            return schedule, plan
        cap = max(1, min(streams - 1, streams * 3 // 4))


@dataclass
class _Prepared:
    graph: TaskGraph
    schedule: Schedule
    memplan: MemPlan
    built: BuiltGraph
    arena: driver.DeviceMemory
    arena_base: int
    launcher: Launcher  # the per-call path: input slots, outputs, stream cache
    device: Any
    seconds: dict
    recording: Any = None  # kept only with keep_recording=True (debugging)

    def close(self) -> None:
        self.launcher.close()
        self.built.close()
        self.arena.close()
        self.recording = None


class Nimble:
    """A PyTorch module run as one ahead-of-time scheduled, multi-stream CUDA graph.

    After :meth:`prepare`, calling the object copies the inputs into the arena and launches the
    graph on the current stream; nothing else happens per call.

    Inspection: :attr:`graph` (the recorded TaskGraph), :attr:`schedule`, :attr:`memplan`,
    :attr:`exec_handle` (the raw ``CUgraphExec`` as an int, for a C or C++ host).
    """

    def __init__(self, model) -> None:
        self.model = model
        self._prepared: _Prepared | None = None

    # ---- preparation ------------------------------------------------------------------------
    def prepare(self, example_inputs, *, training: bool = False, use_multi_stream: bool = True,
                max_streams: int | None = None, arena_limit: int | str | None = "pool",
                device_launch: bool = True, gather_inputs: bool = True,
                verify: bool = True, relaunches: int = 100,
                return_copies: bool = False, keep_recording: bool = False,
                recording=None, quiet: bool = True) -> "Nimble":
        """Record, schedule, plan, build and verify the model on ``example_inputs``.

        ``example_inputs`` is a tensor or a tuple of tensors on the GPU; every later call must
        pass tensors of the same shapes and dtypes.  ``use_multi_stream=False`` runs the tasks in
        recorded order on one stream; ``max_streams`` caps the streams.  ``arena_limit`` (bytes,
        or ``"pool"``: the memory torch's own graph of the model takes) caps the arena: where
        full concurrency would need more, streams are merged until the plan fits (never below
        one stream); ``None`` lifts the cap.  ``device_launch`` instantiates the graph for
        launch from the device as well, which makes each host launch a short constant-cost
        submission; where the driver refuses, the plain graph is used, with a
        ``RuntimeWarning`` saying why (:attr:`launch_mode` tells which).  ``gather_inputs`` makes
        the graph copy each (contiguous-slot) input in itself from an address the call writes
        into a cell (:attr:`input_cells`), so a call costs one small stream write per input
        instead of a driver memcpy.  With ``verify`` (the
        default) the built graph is run ``relaunches`` times against the recording with its old
        buffers poisoned, and must match bit for bit (:class:`~nimble.errors.VerificationError`
        otherwise).  ``return_copies`` makes each call return fresh tensors instead of views into
        the arena.  ``recording`` reuses a live :class:`~nimble.record.Recording` of this model
        (from :func:`nimble.record.record` or an earlier ``keep_recording=True``) instead of
        recording again.  Progress goes to stderr unless ``quiet``.
        """
        import torch

        from .record import record
        from .verify import verify_against_reference

        if training:
            raise NimbleError(
                "prepare(training=True) is not supported yet: Nimble records inference only. "
                "Prepare the model in eval() mode with training=False.")
        self.close()
        seconds: dict[str, float] = {}
        say = (lambda msg: None) if quiet else \
            (lambda msg: print(f"[nimble] {msg}", file=sys.stderr, flush=True))
        if recording is None:
            with torch.no_grad():
                rec = record(self.model, example_inputs, quiet=quiet)
            seconds.update(rec.seconds)
        else:
            rec = recording
        graph = rec.graph
        n = len(graph.tasks)

        t0 = time.perf_counter()
        limit = graph.meta.get("pool_bytes") if arena_limit == "pool" else arena_limit
        if use_multi_stream:
            say(f"scheduling {n} tasks")
            schedule, plan = schedule_within(graph, max_streams, limit)
        else:
            schedule = single_stream_schedule(n)
            plan = plan_memory(graph, schedule.edges())
        edges = schedule.edges()
        check_plan(graph, edges, plan)
        seconds["schedule_and_memplan"] = time.perf_counter() - t0
        say(f"{len(schedule.streams)} streams, {len(schedule.sync_edges)} syncs; arena "
            f"{plan.arena_bytes / 2**20:.1f} MiB")

        t0 = time.perf_counter()
        device = rec.static_inputs[0].device if rec.static_inputs else torch.device("cuda")
        cells_at = -(-plan.arena_bytes // 8) * 8
        arena = driver.DeviceMemory.allocate(cells_at + 8 * len(graph.inputs) + _ARENA_ALIGNMENT)
        built = None
        try:
            base = -(-arena.address // _ARENA_ALIGNMENT) * _ARENA_ALIGNMENT
            bases = buffer_bases(graph, plan, base)
            slots = [input_slot(bases[r.buffer] + r.offset, r, arena, device)
                     for r in graph.inputs]
            if gather_inputs and slots and stream_writes_supported(device):
                # A cell starts out naming its own slot: a C host that copies into the slot
                # and launches (without writing the cell) gets a harmless self-copy.
                slots = [s._replace(cell=base + cells_at + 8 * i) if s.dense else s
                         for i, s in enumerate(slots)]
                for s in slots:
                    if s.cell:
                        driver.call("cuMemcpyHtoD", s.cell, s.address.to_bytes(8, "little"), 8)
            gathers = [InputGather(s.cell, s.address, s.nbytes) for s in slots if s.cell]
            upload_stream = driver.bindings().CUstream(torch.cuda.current_stream().cuda_stream)
            built = build_graph(graph, rec.nodes, bases, edges, schedule.stream_of,
                                device_launch=device_launch, upload_stream=upload_stream,
                                gathers=gathers,
                                gather_module=ptx.load("gather_input.ptx") if gathers else None)
            launcher = Launcher(
                built.exec.handle, slots, device,
                [device_tensor(bases[r.buffer] + r.offset, r, arena, device)
                 for r in graph.outputs], rec.output_spec)
        except BaseException:
            if built is not None:
                built.close()
            arena.close()
            raise
        seconds["build"] = time.perf_counter() - t0
        if built.device_launch_refusal:
            warnings.warn(
                "the graph could not be made device-launchable, so each call pays the driver's "
                f"full host launch cost: {built.device_launch_refusal}", RuntimeWarning,
                stacklevel=2)
        prepared = _Prepared(
            graph=graph, schedule=schedule, memplan=plan, built=built, arena=arena,
            arena_base=base, launcher=launcher, device=device, seconds=seconds)
        self._prepared = prepared
        try:
            if verify:
                t0 = time.perf_counter()
                say(f"verifying: {relaunches} launches against the single-stream recording")
                stream = launcher.stream()
                verify_against_reference(
                    graph, rec.replay_reference, self._run_flat, rec.static_inputs,
                    [(base, plan.arena_bytes)], stream, relaunches=relaunches)
                torch.cuda.synchronize()
                seconds["verify"] = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise
        launcher.return_copies = return_copies
        graph.meta["prepare_seconds"] = dict(seconds)
        if keep_recording:
            prepared.recording = rec
        return self

    # ---- calls ------------------------------------------------------------------------------
    def _state(self) -> _Prepared:
        if self._prepared is None:
            raise NimbleError("call prepare(example_inputs) before running the model")
        return self._prepared

    def _run_flat(self, inputs) -> list:
        return self._state().launcher.run_flat(inputs)

    def __call__(self, *inputs):
        """Run the prepared graph on ``inputs`` (same shapes and dtypes as in prepare()).

        The outputs are views into the arena, overwritten by the next call (as with CUDA graphs):
        clone them to keep them, or prepare with ``return_copies=True``.  The work is queued on
        the current stream; the call returns without waiting for it.
        """
        launcher = self._state().launcher
        if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)):
            inputs = inputs[0]
        return launcher.run(inputs)

    # ---- inspection -------------------------------------------------------------------------
    @property
    def graph(self) -> TaskGraph:
        """The recorded TaskGraph (tasks, buffers, accesses)."""
        return self._state().graph

    @property
    def schedule(self) -> Schedule:
        """The stream assignment and synchronization edges the built graph runs."""
        return self._state().schedule

    @property
    def memplan(self) -> MemPlan:
        """The arena plan: an offset per relocatable buffer."""
        return self._state().memplan

    @property
    def exec_handle(self) -> int:
        """The raw ``CUgraphExec`` as an int: launch it from C with ``cuGraphLaunch``."""
        return int(self._state().built.exec.handle)

    @property
    def arena_address(self) -> int:
        """The device address of the arena (buffer ``b`` lives at this + ``memplan.offsets[b]``)."""
        return self._state().arena_base

    @property
    def recording(self):
        """The live recording, when prepare() was told ``keep_recording=True`` (else None)."""
        return self._state().recording

    @property
    def input_cells(self) -> list[int]:
        """Per input, the device address of the 8-byte cell the graph reads its source address
        from before anything else (0 where that input is copied into its slot instead).

        A C or C++ host driving :attr:`exec_handle` itself writes the input tensor's address
        into each cell on the launch stream (``cuStreamWriteValue64``), then calls
        ``cuGraphLaunch``; or it copies the input to the slot and writes the slot's own address.
        """
        return [s.cell for s in self._state().launcher.slots]

    @property
    def input_addresses(self) -> list[int]:
        """Per input, the device address of its slot in the arena."""
        return [s.address for s in self._state().launcher.slots]

    @property
    def launch_mode(self) -> str:
        """``"device-launchable"`` (uploaded once, cheap host launches) or ``"host"``."""
        return "device-launchable" if self._state().built.device_launch else "host"

    @property
    def prepare_seconds(self) -> dict:
        """Seconds each step of the last prepare() took."""
        return dict(self._state().seconds)

    def close(self) -> None:
        """Free the graph, its exec and the arena now (idempotent); outputs become invalid."""
        if self._prepared is not None:
            self._prepared.close()
            self._prepared = None
