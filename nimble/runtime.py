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
from dataclasses import dataclass
from typing import Any

from . import driver
from .build import BuiltGraph, buffer_bases, build_graph
from .deps import build_dag, transitive_reduction
from .errors import InputError, NimbleError
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
    inputs: list  # tensors over the arena's input slots
    input_specs: list  # (shape, dtype) per input, checked on every call
    outputs: list  # tensors over the arena's output bytes
    output_spec: Any
    device: Any
    seconds: dict
    recording: Any = None  # kept only with keep_recording=True (debugging)

    def close(self) -> None:
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
        self._return_copies = False

    # ---- preparation ------------------------------------------------------------------------
    def prepare(self, example_inputs, *, training: bool = False, use_multi_stream: bool = True,
                max_streams: int | None = None, arena_limit: int | str | None = "pool",
                verify: bool = True, relaunches: int = 100,
                return_copies: bool = False, keep_recording: bool = False,
                recording=None, quiet: bool = True) -> "Nimble":
        """Record, schedule, plan, build and verify the model on ``example_inputs``.

        ``example_inputs`` is a tensor or a tuple of tensors on the GPU; every later call must
        pass tensors of the same shapes and dtypes.  ``use_multi_stream=False`` runs the tasks in
        recorded order on one stream; ``max_streams`` caps the streams.  ``arena_limit`` (bytes,
        or ``"pool"``: the memory torch's own graph of the model takes) caps the arena: where
        full concurrency would need more, streams are merged until the plan fits (never below
        one stream); ``None`` lifts the cap.  With ``verify`` (the
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
        arena = driver.DeviceMemory.allocate(plan.arena_bytes + _ARENA_ALIGNMENT)
        try:
            base = -(-arena.address // _ARENA_ALIGNMENT) * _ARENA_ALIGNMENT
            bases = buffer_bases(graph, plan, base)
            built = build_graph(graph, rec.nodes, bases, edges, schedule.stream_of)
        except BaseException:
            arena.close()
            raise
        seconds["build"] = time.perf_counter() - t0
        device = rec.static_inputs[0].device if rec.static_inputs else torch.device("cuda")
        prepared = _Prepared(
            graph=graph, schedule=schedule, memplan=plan, built=built, arena=arena,
            arena_base=base,
            inputs=[device_tensor(bases[r.buffer] + r.offset, r, arena, device)
                    for r in graph.inputs],
            input_specs=[(tuple(r.shape), getattr(torch, r.dtype)) for r in graph.inputs],
            outputs=[device_tensor(bases[r.buffer] + r.offset, r, arena, device)
                     for r in graph.outputs],
            output_spec=rec.output_spec, device=device, seconds=seconds)
        self._prepared = prepared
        self._return_copies = False
        try:
            if verify:
                t0 = time.perf_counter()
                say(f"verifying: {relaunches} launches against the single-stream recording")
                stream = driver.bindings().CUstream(torch.cuda.current_stream().cuda_stream)
                verify_against_reference(
                    graph, rec.replay_reference, self._run_flat, rec.static_inputs,
                    [(base, plan.arena_bytes)], stream, relaunches=relaunches)
                torch.cuda.synchronize()
                seconds["verify"] = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise
        self._return_copies = return_copies
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
        import torch

        p = self._prepared
        if len(inputs) != len(p.inputs):
            raise InputError(f"the model was prepared with {len(p.inputs)} input(s), got "
                             f"{len(inputs)}")
        for i, (x, slot, (shape, dtype)) in enumerate(zip(inputs, p.inputs, p.input_specs)):
            if not isinstance(x, torch.Tensor):
                raise InputError(f"input {i} is a {type(x).__name__}, not a tensor")
            if x.shape != shape or x.dtype != dtype or x.device != p.device:
                raise InputError(
                    f"input {i} is {tuple(x.shape)} {x.dtype} on {x.device}; the model was "
                    f"prepared for {shape} {dtype} on {p.device}: call prepare() again for "
                    "another shape")
            slot.copy_(x)
        stream = torch.cuda.current_stream(p.device).cuda_stream
        driver.call("cuGraphLaunch", p.built.exec.handle, driver.bindings().CUstream(stream))
        return [o.clone() for o in p.outputs] if self._return_copies else p.outputs

    def __call__(self, *inputs):
        """Run the prepared graph on ``inputs`` (same shapes and dtypes as in prepare()).

        The outputs are views into the arena, overwritten by the next call (as with CUDA graphs):
        clone them to keep them, or prepare with ``return_copies=True``.
        """
        from torch.utils._pytree import tree_unflatten

        p = self._state()
        if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)):
            inputs = tuple(inputs[0])
        return tree_unflatten(self._run_flat(inputs), p.output_spec)

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
    def prepare_seconds(self) -> dict:
        """Seconds each step of the last prepare() took."""
        return dict(self._state().seconds)

    def close(self) -> None:
        """Free the graph, its exec and the arena now (idempotent); outputs become invalid."""
        if self._prepared is not None:
            self._prepared.close()
            self._prepared = None
