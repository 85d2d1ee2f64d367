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

import time
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

from . import driver, ptx
from .build import BuiltGraph, InputGather, buffer_bases, build_graph, repoint
from .deps import build_dag
from .errors import InputError, NimbleError
from .launcher import CallOrder, InputSlot, Launcher, RngCells
from .memplan import MemPlan, check_plan, plan_memory
from .progress import say
from .resolve import RNG_OFFSET, RNG_SEED
from .schedule import Schedule, assign_phased, check_schedule, phase_spans
from .taskgraph import LIBRARY_MEMORY, BufferKind, TaskGraph, TensorRef
from .weights import EPOCH as WEIGHTS_EPOCH
from .weights import Weights, watch_modules

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


def single_stream_schedule(n: int, phases: list[int] | None = None) -> Schedule:
    """Every task on one stream in recorded order (Nimble with multi-stream off); a phased
    graph gets one stream per phase, each phase after the one before."""
    spans = [s for s in phase_spans(phases or [], n) if len(s)]
    streams = [list(s) for s in spans]
    stream_of = [k for k, s in enumerate(spans) for _ in s]
    barriers = [(a.stop - 1, b.start) for a, b in zip(spans, spans[1:])]
    return Schedule(stream_of, streams, [], max(n - len(streams), 0), 1 if n else 0,
                    phases=list(phases or []), barrier_edges=barriers)


def schedule_within(graph: TaskGraph, max_streams: int | None, arena_limit: int | None
                    ) -> tuple[Schedule, MemPlan]:
    """Nimble's schedule (at most ``max_streams`` streams per phase) and its memory plan.

    Where the plan needs more than ``arena_limit`` bytes, the stream cap is lowered step by step
    (by a quarter each time) until it fits or every phase is down to one stream: fewer
    concurrent branches keep fewer buffers alive at once.
    """
    dag = build_dag(graph)
    phases = graph.meta.get("phases") or []
    spans = phase_spans(phases, len(graph.tasks))
    cap = max_streams
    while True:
        schedule = assign_phased(dag, phases, max_streams=cap)
        check_schedule(dag, schedule)
        plan = plan_memory(graph, schedule.edges())
        widest = max((len({schedule.stream_of[t] for t in span}) for span in spans), default=0)
        if arena_limit is None or plan.arena_bytes <= arena_limit or widest <= 1:
            return schedule, plan
        cap = max(1, min(widest - 1, widest * 3 // 4))


@dataclass
class _Prepared:
    """One built, verified graph with everything it owns; replaced whole by the next prepare.

    A training step has two phases, each its own exec and launcher over one arena: the forward
    (``builts[0]``, ``launchers[0]``) and the backward; ``step`` joins them for autograd.
    """

    graph: TaskGraph
    schedule: Schedule
    memplan: MemPlan
    builts: list[BuiltGraph]
    arena: driver.DeviceMemory | None
    arena_base: int
    bases: list[int]  # where every buffer lives for the built graph (weights may move)
    launchers: list[Launcher]  # per phase: input slots, outputs, stream cache (one lock)
    weights: Weights
    seconds: dict
    recording: Any = None  # kept only with keep_recording=True (debugging)
    step: Any = None  # training.TrainingStep for a training step, else None
    recording_held: Any = None  # the recording, until prepare() decides whether to keep it

    @property
    def built(self) -> BuiltGraph:
        return self.builts[0]

    @property
    def launcher(self) -> Launcher:
        return self.launchers[0]

    def close(self) -> None:
        """Wait for the last call, free execs and graphs, let go of the arena (idempotent).

        The arena is freed once nothing refers to it any more: outputs the caller still holds
        and gradients autograd adopted as ``.grad`` are views that keep it alive, so closing never
        leaves a tensor pointing at freed memory.
        """
        for launcher in self.launchers:
            launcher.close()
        for built in self.builts:
            built.close()
        self.arena = None  # freed by its finalizer with the last view
        self.recording = None


def written_externals(graph: TaskGraph) -> list[int]:
    """Library-owned memory (never handed out by torch's allocator) that the graph writes.

    cuDNN's training batch norm keeps a partial-sum buffer and a grid semaphore of its own
    (per handle) that every such kernel writes; a graph that kept pointing there would share
    them with every other graph and eager call, and lose them if cuDNN reallocated.  Memory from
    torch's allocator that the graph writes may be a tensor the model updates on purpose (a
    cache held as a plain attribute), so it stays shared.
    """
    written = {a.buffer for t in graph.tasks for a in t.accesses if a.write and a.size > 0}
    return [b.id for b in graph.buffers if b.kind == BufferKind.EXTERNAL and b.id in written
            and b.size > 0 and b.name.startswith(LIBRARY_MEMORY)]


def _rng_cells(graph: TaskGraph, device, at: int) -> tuple[dict[int, int], RngCells | None]:
    """Bases of the graph's RNG buffers in two cells at ``at`` and ``at + 8``, and the cells."""
    import torch

    rng = graph.meta.get("rng")
    if not rng:
        return {}, None
    cell = {RNG_SEED: at, RNG_OFFSET: at + 8}
    bases = {b.id: cell[b.name] for b in graph.buffers if b.kind == BufferKind.RNG}
    generator = torch.cuda.default_generators[device.index or 0]
    return bases, RngCells(generator, at, at + 8, int(rng["increment"]))


def _plan(graph: TaskGraph, use_multi_stream: bool, max_streams: int | None,
          arena_limit: int | str | None) -> tuple[Schedule, MemPlan]:
    """The schedule and the arena plan it allows, checked."""
    limit = graph.meta.get("pool_bytes") if arena_limit == "pool" else arena_limit
    if use_multi_stream:
        schedule, plan = schedule_within(graph, max_streams, limit)
    else:
        schedule = single_stream_schedule(len(graph.tasks), graph.meta.get("phases"))
        plan = plan_memory(graph, schedule.edges())
    check_plan(graph, schedule.edges(), plan)
    return schedule, plan


def _build(model, rec, schedule: Schedule, plan: MemPlan, *, device_launch: bool,
           gather_inputs: bool, seconds: dict) -> _Prepared:
    """Arena, cells, explicit graph(s) and launchers for a planned recording (not verified).

    The arena holds the plan's buffers, then an 8-byte cell per gathered input (the source
    address the graph's gather node reads), then the generator's seed and offset cells, then a
    private copy of every library-owned buffer the graph writes (:func:`written_externals`),
    initialized from the library's bytes.  A
    phased recording (a training step) gets one graph and one launcher per phase, over the
    phase's own tasks, inputs and outputs.
    """
    import torch

    graph = rec.graph
    device = rec.static_inputs[0].device if rec.static_inputs else torch.device("cuda")
    spans = phase_spans(graph.meta.get("phases") or [], len(graph.tasks))
    in_counts = graph.meta.get("phase_inputs") or [len(graph.inputs)]
    out_counts = graph.meta.get("phase_outputs") or [len(graph.outputs)]
    cells_at = -(-plan.arena_bytes // 8) * 8
    rng_at = cells_at + 8 * len(graph.inputs)
    extra = 16 if graph.meta.get("rng") else 0
    private_at, private = rng_at + extra, {}
    for bid in written_externals(graph):
        private_at = -(-private_at // _ARENA_ALIGNMENT) * _ARENA_ALIGNMENT
        private[bid] = private_at
        private_at += graph.buffers[bid].size
    arena = driver.DeviceMemory.allocate(private_at + _ARENA_ALIGNMENT)
    builts: list[BuiltGraph] = []
    try:
        base = -(-arena.address // _ARENA_ALIGNMENT) * _ARENA_ALIGNMENT
        bases = buffer_bases(graph, plan, base)
        rng_bases, rng = _rng_cells(graph, device, base + rng_at)
        for bid, address in rng_bases.items():
            bases[bid] = address
        for bid, at in private.items():
            driver.copy_device(base + at, graph.buffers[bid].address, graph.buffers[bid].size)
            bases[bid] = base + at
        slots = [input_slot(bases[r.buffer] + r.offset, r, arena, device)
                 for r in graph.inputs]
        if gather_inputs and slots and driver.device_supports_stream_writes(device.index or 0):
            # A cell starts out naming its own slot: a C host that copies into the slot
            # and launches (without writing the cell) gets a harmless self-copy.
            slots = [s._replace(cell=base + cells_at + 8 * i) if s.dense else s
                     for i, s in enumerate(slots)]
            for s in slots:
                if s.cell:
                    driver.copy_to_device(s.cell, s.address.to_bytes(8, "little"))
        outputs = [device_tensor(bases[r.buffer] + r.offset, r, arena, device)
                   for r in graph.outputs]
        order = CallOrder()
        context = driver.current_context()
        upload = driver.stream(torch.cuda.current_stream().cuda_stream)
        launchers: list[Launcher] = []
        first_in = first_out = 0
        for k, span in enumerate(spans):
            mine = slots[first_in:first_in + in_counts[k]]
            gathers = [InputGather(s.cell, s.address, s.nbytes) for s in mine if s.cell]
            built = build_graph(graph, rec.nodes, bases, schedule.edges(),
                                device_launch=device_launch, upload_stream=upload,
                                gathers=gathers, span=span,
                                gather_module=ptx.load("gather_input.ptx") if gathers else None)
            builts.append(built)
            launchers.append(Launcher(
                built.exec.handle, mine, device, outputs[first_out:first_out + out_counts[k]],
                rec.output_spec if k == 0 else None, context, rng if k == 0 else None,
                order=order))
            first_in += in_counts[k]
            first_out += out_counts[k]
    except BaseException:
        for built in builts:
            built.close()
        arena.close()
        raise
    prepared = _Prepared(graph=graph, schedule=schedule, memplan=plan, builts=builts,
                         arena=arena, arena_base=base, bases=bases, launchers=launchers,
                         weights=Weights(model, graph), seconds=seconds)
    if rec.step is not None:
        from .training import TrainingStep

        names = [n for n, p in model.named_parameters() if p.requires_grad]
        prepared.step = TrainingStep(launchers[0], launchers[1], rec.step, names)
    return prepared


def _run_all(prepared: _Prepared):
    """Run every phase in order on its share of the inputs (for the proof)."""
    def run(inputs: list) -> list:
        out, first = [], 0
        for launcher in prepared.launchers:
            n = len(launcher.slots)
            out += launcher.run_flat(inputs[first:first + n])
            first += n
        return out
    return run


def _verify(prepared: _Prepared, rec, relaunches: int) -> None:
    """The proof: ``relaunches`` poisoned launches equal the recording bit for bit (a training
    step's gradients: within the tolerance :mod:`nimble.verify` states).

    A graph that draws random numbers is given the same generator state as the reference for
    each input set; the generator is restored afterwards.
    """
    import torch

    from .verify import verify_against_reference

    rng = prepared.launcher.rng
    saved = rng.generator.get_state() if rng else None
    outputs = len(prepared.graph.outputs)
    gradients = range(prepared.step.layout.forward_outputs, outputs) if prepared.step else ()
    start = rng.generator.get_offset() if rng else 0

    def rng_at(k: int) -> None:
        rng.generator.set_offset(start + 4096 * k * max(rng.increment, 4))
    try:
        spread = verify_against_reference(
            prepared.graph, rec.replay_reference, _run_all(prepared), rec.static_inputs,
            [(prepared.arena_base, prepared.memplan.arena_bytes)], prepared.launcher.stream(),
            relaunches=relaunches, rng_at=rng_at if rng else None,
            repeats=4 if prepared.step is not None else 3, gradients=gradients)
        torch.cuda.synchronize()
        prepared.graph.meta["verified"] = {
            "launches": max(relaunches, 1), "outputs": len(prepared.graph.outputs),
            "not_bitwise": {str(i): d for i, d in sorted(spread.items())}}
    finally:
        if saved is not None:
            rng.generator.set_state(saved)


class PhaseView(NamedTuple):
    """One separately launched graph of a prepared model (see :attr:`Nimble.phases`)."""

    name: str
    tasks: range  # its tasks in :attr:`Nimble.graph`
    exec_handle: int
    input_cells: list[int]
    input_addresses: list[int]
    output_addresses: list[int]


def _saved_state(model, training: bool):
    """A function that puts back what preparing changes: the default CUDA generator's state,
    and for a training step the module buffers (batch-norm running statistics, which warm-up,
    capture and the proof update as training forwards do)."""
    import torch

    generator = torch.cuda.default_generators[torch.cuda.current_device()] \
        if torch.cuda.is_available() else None
    rng = generator.get_state() if generator is not None else None
    buffers = [(b, b.detach().clone()) for b in model.buffers()] \
        if training and isinstance(model, torch.nn.Module) else []

    def restore() -> None:
        with torch.no_grad():
            for live, saved in buffers:
                live.copy_(saved)
        if rng is not None:
            generator.set_state(rng)
    return restore


class Nimble:
    """A PyTorch module run as one ahead-of-time scheduled, multi-stream CUDA graph.

    After :meth:`prepare`, calling the object hands the inputs to the graph and launches it on
    the current stream; nothing else happens per call.  Calls may come from any thread; they are
    serialized (see :mod:`nimble.launcher`).

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
                verify: bool = True, relaunches: int | None = None,
                return_copies: bool = False, keep_recording: bool = False,
                recording=None, quiet: bool = True) -> "Nimble":
        """Record, schedule, plan, build and verify the model on ``example_inputs``.

        ``example_inputs`` is a tensor or a tuple of tensors on the GPU; every later call must
        pass tensors of the same shapes and dtypes.  For inference (``training=False``) the model
        must be in ``eval()`` mode.  With ``training=True`` (model in ``train()`` mode) one
        training step is recorded instead: the forward and its backward, each scheduled on
        several streams and rebuilt, sharing one arena; calls then return outputs that carry a
        ``grad_fn``, and ``backward()`` through them launches the backward graph and fills
        ``param.grad`` as eager does (see :mod:`nimble.training`).  Batch-norm running
        statistics and the random generator are left as they were before ``prepare``.
        ``use_multi_stream=False`` runs the tasks in recorded order on one stream;
        ``max_streams`` caps the streams.  ``arena_limit`` (bytes, or ``"pool"``: the memory
        torch's own graph of the model takes) caps the arena: where full concurrency would need
        more, streams are merged until the plan fits (never below one stream); ``None`` lifts
        the cap.  ``device_launch`` instantiates the graph for launch from the device as well,
        which makes each host launch a short constant-cost submission; where the driver refuses,
        the plain graph is used, with a ``RuntimeWarning`` saying why (:attr:`launch_mode` tells
        which).  ``gather_inputs`` makes the graph copy each (contiguous-slot) input in itself
        from an address the call writes into a cell (:attr:`input_cells`), so a call costs one
        small stream write per input instead of a driver memcpy.  With ``verify`` (the default)
        the built graph is run ``relaunches`` times (default 100; 20 training steps) against
        the recording with its old buffers
        poisoned, and must match bit for bit (:class:`~nimble.errors.VerificationError`
        otherwise).  ``return_copies`` makes each call return fresh tensors instead of views
        into the arena.  ``recording`` reuses a live :class:`~nimble.record.Recording` of this
        model (from :func:`nimble.record.record` or an earlier ``keep_recording=True``) instead
        of recording again.  Progress goes to stderr unless ``quiet``.

        Preparing again is transactional: the graph prepared before keeps serving calls until
        the new one is proven, and stays if the new prepare fails.
        """
        self._check_mode(training)
        watch_modules()
        if relaunches is None:
            relaunches = 20 if training else 100
        restore = _saved_state(self.model, training)
        try:
            candidate = self._prepare(example_inputs, training, recording, quiet, use_multi_stream,
                                      max_streams, arena_limit, device_launch, gather_inputs,
                                      verify, relaunches)
        finally:
            restore()
        candidate.launcher.return_copies = return_copies
        candidate.graph.meta["prepare_seconds"] = dict(candidate.seconds)
        if keep_recording:
            candidate.recording = candidate.recording_held
        candidate.recording_held = None
        previous, self._prepared = self._prepared, candidate
        if previous is not None:
            previous.close()
        return self

    def _prepare(self, example_inputs, training, recording, quiet, use_multi_stream, max_streams,
                 arena_limit, device_launch, gather_inputs, verify, relaunches) -> _Prepared:
        seconds: dict[str, float] = {}
        rec = recording if recording is not None else self._record(example_inputs, training,
                                                                    quiet)
        if bool(rec.step) != training:
            raise InputError("the recording passed to prepare() is of "
                             f"{'a training step' if rec.step else 'inference'}, but "
                             f"training={training}")
        seconds.update(rec.seconds)

        t0 = time.perf_counter()
        say(f"scheduling {len(rec.graph.tasks)} tasks", quiet)
        schedule, plan = _plan(rec.graph, use_multi_stream, max_streams, arena_limit)
        seconds["schedule_and_memplan"] = time.perf_counter() - t0
        say(f"{len(schedule.streams)} streams, {len(schedule.sync_edges)} syncs; arena "
            f"{plan.arena_bytes / 2**20:.1f} MiB", quiet)

        t0 = time.perf_counter()
        candidate = _build(self.model, rec, schedule, plan, device_launch=device_launch,
                           gather_inputs=gather_inputs, seconds=seconds)
        seconds["build"] = time.perf_counter() - t0
        try:
            refusal = next((b.device_launch_refusal for b in candidate.builts
                            if b.device_launch_refusal), "")
            if refusal:
                warnings.warn(
                    "the graph could not be made device-launchable, so each call pays the "
                    f"driver's full host launch cost: {refusal}", RuntimeWarning, stacklevel=3)
            if verify:
                t0 = time.perf_counter()
                say(f"verifying: {relaunches} launches against the single-stream recording",
                    quiet)
                _verify(candidate, rec, relaunches)
                seconds["verify"] = time.perf_counter() - t0
        except BaseException:
            candidate.close()
            raise
        candidate.recording_held = rec
        return candidate

    def _check_mode(self, training: bool) -> None:
        import torch

        if training:
            if not isinstance(self.model, torch.nn.Module):
                raise InputError("prepare(training=True) needs a torch.nn.Module (its "
                                 "parameters are what the backward computes gradients for)")
            if not self.model.training:
                raise InputError(
                    "the model is in eval() mode, but prepare(training=True) records a training "
                    "step: call model.train() first (or prepare(training=False) for inference)")
            return
        if isinstance(self.model, torch.nn.Module):
            in_training = [name or type(m).__name__ for name, m in self.model.named_modules()
                           if m.training]
            if in_training:
                raise InputError(
                    f"the model is in training mode ({len(in_training)} module(s), e.g. "
                    f"'{in_training[0]}'), but prepare(training=False) records inference: call "
                    "model.eval() first (batch norm and dropout behave differently in training)")

    def _record(self, example_inputs, training: bool, quiet: bool):
        import torch

        from .record import record, record_step

        if training:
            return record_step(self.model, example_inputs, quiet=quiet)
        with torch.no_grad():
            return record(self.model, example_inputs, quiet=quiet)

    # ---- calls ------------------------------------------------------------------------------
    def _state(self) -> _Prepared:
        if self._prepared is None:
            raise NimbleError("call prepare(example_inputs) before running the model")
        return self._prepared

    def __call__(self, *inputs):
        """Run the prepared graph on ``inputs`` (same shapes and dtypes as in prepare()).

        The outputs are views into the arena, overwritten by the next call (as with CUDA graphs):
        clone them to keep them, or prepare with ``return_copies=True``.  The work is queued on
        the current stream; the call returns without waiting for it.  Weights that moved since
        the last call (``load_state_dict(assign=True)``, ``model.to(...)``) are followed first
        (see :meth:`refresh`).
        """
        state = self._state()
        if state.weights.epoch != WEIGHTS_EPOCH[0]:
            self._follow_weights(state)
        if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)):
            inputs = inputs[0]
        if state.step is not None:
            return state.step(inputs, state.launcher.unflatten)
        return state.launcher.run(inputs)

    def refresh(self) -> bool:
        """Re-read the model's weights; re-point the graph at any that moved.  True if any did.

        Calls do this by themselves after torch's module machinery moved weights (parameter or
        buffer assignment, ``load_state_dict(assign=True)``, ``.to()``, ``.half()``...); call it
        after changes that go around it (``param.data = t``, ``torch.utils.swap_tensors``).  A
        weight that changed dtype, shape, strides or device, or is gone, raises
        :class:`~nimble.errors.WeightsChangedError`: prepare again.  In-place updates need
        nothing: the graph reads the weights' memory as it is.
        """
        return self._follow_weights(self._state())

    def _follow_weights(self, state: _Prepared) -> bool:
        weights, launcher = state.weights, state.launcher
        with launcher.lock:
            moves = weights.moves()
            if not moves:
                weights.accept({})
                return False
            weights.check_inside(state.bases, moves)
            bases = list(state.bases)
            for bid, (delta, _) in moves.items():
                bases[bid] += delta
            for built in state.builts:
                repoint(built, state.graph, bases, set(moves),
                        launcher.last_stream or launcher.stream())
            state.bases = bases
            if state.step is not None:
                state.step.follow_parameters(self.model)
            released = weights.accept(moves)
            # Launches queued before the re-pointing may still read the old storages.
            if launcher.last_stream is not None:
                driver.stream_synchronize(launcher.last_stream)
            del released
        return True

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
    def output_addresses(self) -> list[int]:
        """Per output (flattened), the device address the graph writes it at."""
        return [o.data_ptr() for o in self._state().launcher.outputs]

    @property
    def rng_cells(self) -> RngCells | None:
        """Where a graph that draws random numbers reads the generator's seed and offset.

        None for a graph without random ops.  Python calls fill both cells; a C or C++ host
        writes the seed and the current offset (then advances its offset by ``increment``)
        before each launch, as it writes the input cells.
        """
        return self._state().launcher.rng

    @property
    def input_addresses(self) -> list[int]:
        """Per input, the device address of its slot in the arena."""
        return [s.address for s in self._state().launcher.slots]

    @property
    def phases(self) -> list["PhaseView"]:
        """Each separately launched graph: one (``"inference"``), or ``"forward"`` and
        ``"backward"`` for a training step, with its tasks and its handles for a C host."""
        state = self._state()
        names = ["forward", "backward"] if state.step is not None else ["inference"]
        return [PhaseView(name, built.span, int(built.exec.handle),
                          [s.cell for s in launcher.slots], [s.address for s in launcher.slots],
                          [o.data_ptr() for o in launcher.outputs])
                for name, built, launcher in zip(names, state.builts, state.launchers)]

    @property
    def launch_mode(self) -> str:
        """``"device-launchable"`` (uploaded once, cheap host launches) or ``"host"``."""
        return "device-launchable" if self._state().built.device_launch else "host"

    @property
    def prepare_seconds(self) -> dict:
        """Seconds each step of the last prepare() took."""
        return dict(self._state().seconds)

    def close(self) -> None:
        """Free the graph and its exec now, and the arena once the outputs and gradients handed
        out are gone (idempotent)."""
        if self._prepared is not None:
            self._prepared.close()
            self._prepared = None
