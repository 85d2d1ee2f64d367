"""A prepared graph: its schedule and arena plan, its explicit graph(s), launchers and proof.

:func:`plan_graph` schedules a recording and plans its arena; :func:`build_prepared` allocates the
arena (the planned buffers, the input cells, the random generator's cells, private copies of
library scratch), builds one explicit graph and one launcher per phase (one for inference; forward
and backward for a training step).  :class:`Prepared` owns the result and is what
:class:`nimble.Nimble` swaps in whole; :mod:`nimble.engine.proving` proves it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

from ..analysis import backfill
from .. import driver
from .arena_layout import StateLayout, low_word_buffers, own_layout
from .build import BuiltGraph, InputGather, buffer_bases
from .launcher import CallOrder, InputSlot, Launcher, RngCells
from .phase_timing import after_phases as _after_phases
from .phase_timing import recorded_inputs_into as _recorded_inputs_into
from .prefetch import pick_prefetch
from .programmatic_pick import ProgrammaticPlan, pick_programmatic
from .priority_trials import PriorityTrial, pick_priorities
from .rebuild import PhaseBuilder, PhaseOptions
from ..analysis.memplan import MemPlan, plan_memory
from ..analysis.plan_check import check_plan
from ..analysis.priorities import driver_priorities, priority_levels
from ..record.resolve import RNG_OFFSET, RNG_SEED
from ..analysis.arena_fit import schedule_within
from ..analysis.schedule import Schedule, phase_spans
from ..ir.alignment import align_up
from ..ir.taskgraph import BufferKind, TaskGraph, TaskKind, TensorRef
from .weights import Weights


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


def gathers_of(slots) -> list[InputGather]:
    """One gather per input slot a call writes through a cell (the slots of one phase)."""
    return [InputGather(s.cell, s.address, s.nbytes) for s in slots if s.cell]


@dataclass
class Prepared:
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
    #: The driver priority number of each task's node (None: the graph ignores priorities).
    priorities: list[int] | None = None
    #: Per phase whose tail backfill was measured, what was
    #: (:class:`nimble.analysis.backfill.Picked`).
    backfill: list = field(default_factory=list)
    #: Per phase, the weight prefetches its graph serves (:mod:`nimble.engine.prefetch`;
    #: empty: none).
    prefetch: list = field(default_factory=list)
    #: The edges built programmatic (:mod:`nimble.analysis.programmatic`; empty: none).
    programmatic: frozenset = frozenset()
    recording: Any = None  # kept only with keep_recording=True (debugging)
    step: Any = None  # training.TrainingStep for a training step, else None
    #: The buffers kept at their recorded low address bits, each in memory of its own
    #: (:func:`~nimble.engine.arena_layout.low_word_buffers`, found once at the build).
    low_bits: tuple[int, ...] = ()
    #: What a graph loaded from a file runs on besides its arena (its kernels' libraries, the
    #: file's weights and external memory): kept as long as the graph is.
    owned_memory: list = field(default_factory=list)
    #: The Python objects whose modules hold the Triton kernels a graph recorded here launches
    #: (:mod:`nimble.engine.kernel_owners`): kept as long as the graph is.
    kernel_owners: list = field(default_factory=list, repr=False)
    #: What a save needs of each of those kernels, taken while the prepare held them loaded
    #: (``{CUfunction handle: LiveKernel}``, :func:`nimble.engine.kernel_owners.kernel_facts`).
    kernel_facts: dict = field(default_factory=dict, repr=False)

    @property
    def built(self) -> BuiltGraph:
        return self.builts[0]

    @property
    def late_edges(self) -> list[tuple[int, int]]:
        """The built graphs' edges beyond the schedule's: the tail backfill kept
        (:mod:`nimble.analysis.backfill`); a copy of a phase needs them to run as the served
        one does."""
        return [e for p in self.backfill if p.kept is not None for e in p.kept.edges()]

    @property
    def launcher(self) -> Launcher:
        return self.launchers[0]

    def built_nodes(self, phase: int) -> list:
        """Per task, its node in phase ``phase``'s built graph (None outside the phase): what a
        copy of the phase is built from (:meth:`phase_builder`)."""
        built = self.builts[phase]
        nodes: list = [None] * len(self.graph.tasks)
        for t, node in zip(built.span, built.nodes):
            nodes[t] = node
        return nodes

    def gathers(self, phase: int) -> list[InputGather]:
        """The input gathers phase ``phase``'s graph starts with: a copy of the graph rebuilt
        with them (and the same priorities) runs as the served one does, single entry and all."""
        return gathers_of(self.launchers[phase].slots)

    def phase_builder(self, upload_stream=None) -> PhaseBuilder:
        """The builder of copies of the served phases
        (:class:`~nimble.engine.rebuild.PhaseBuilder`): from the built graphs' own nodes, over
        the same arena, with the current schedule's edges, the served gathers, priorities and
        late edges, each phase device-launchable where the served one is; ``upload_stream``
        uploads each copy at instantiation."""
        phases = range(len(self.builts))
        return PhaseBuilder(self.graph, [self.built_nodes(k) for k in phases], self.bases,
                            self.schedule.edges(), [b.span for b in self.builts],
                            [self.gathers(k) for k in phases], self.priorities,
                            [b.device_launch for b in self.builts], upload_stream,
                            late_edges=self.late_edges, nodes_relocated=True,
                            prefetch=list(self.prefetch) or None,
                            programmatic=self.programmatic)

    def cells_to_own_slots(self) -> None:
        """Point every input cell at its own slot, so that a launch without a call (a debugging
        run with the inputs copied into the slots) gathers each slot onto itself."""
        for launcher in self.launchers:
            for slot in launcher.slots:
                if slot.cell:
                    driver.copy_to_device(slot.cell, slot.address.to_bytes(8, "little"))
            launcher.forget_cells()

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


def arena_limit_bytes(graph: TaskGraph, arena_limit: int | str | None) -> int | None:
    """``PrepareOptions.arena_limit`` in bytes: ``"pool"`` is what the capture's memory pool
    held."""
    return graph.meta.get("pool_bytes") if arena_limit == "pool" else arena_limit


def plan_graph(graph: TaskGraph, use_multi_stream: bool, max_streams: int | None,
               arena_limit: int | str | None,
               durations: Sequence[float] | Callable[[], Sequence[float]] | None = None
               ) -> tuple[Schedule, MemPlan]:
    """The schedule and the arena plan it allows, checked.  ``durations`` (each task's
    isolated µs, or a callable that measures them when the limit binds) pick among the
    schedules that fit the arena (:func:`nimble.analysis.arena_fit.schedule_within`).
    """
    limit = arena_limit_bytes(graph, arena_limit)
    if use_multi_stream:
        schedule, plan = schedule_within(graph, max_streams, limit, durations)
    else:
        schedule = single_stream_schedule(len(graph.tasks), graph.meta.get("phases"))
        plan = plan_memory(graph, schedule.edges())
    check_plan(graph, schedule.edges(), plan)
    return schedule, plan


def task_times(rec) -> list[float]:
    """Each task's isolated µs: carried by the recording, or measured now on it (live)."""
    from ..analysis.deps import task_durations
    from .task_timing import time_recording

    return task_durations(rec.graph) or time_recording(rec)


def kernel_priorities(schedule: Schedule, durations: Sequence[float],
                      priority_range: tuple[int, int] | None = None) -> list[int]:
    """Driver priority numbers per task from its slack in ``schedule``
    (:mod:`nimble.analysis.priorities`), each task weighted by its isolated duration;
    ``priority_range`` is the device's ``(least, greatest)`` where the caller asked once."""
    least, greatest = priority_range or driver.stream_priority_range()
    n = len(durations)
    levels = priority_levels(n, schedule.edges(), durations, least - greatest + 1,
                             phase_spans(schedule.phases, n))
    return driver_priorities(levels, least, greatest)


def backfill_trials(graph: TaskGraph, schedule: Schedule,
                    durations: Sequence[float]) -> dict[int, list[backfill.Backfill]]:
    """The tail backfills worth timing per phase (:func:`nimble.analysis.backfill.plan_trials`),
    from each kernel's block count and the current device's SM count."""
    import torch

    n = len(graph.tasks)
    blocks = [t.grid[0] * t.grid[1] * t.grid[2] if t.kind == TaskKind.KERNEL else 1
              for t in graph.tasks]
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return backfill.plan_trials(n, schedule.edges(), phase_spans(schedule.phases, n),
                                durations, blocks, sms)


@dataclass(frozen=True)
class Placement:
    """Where a graph loaded from a file finds what a recording's process had in place: the
    memory outside the arena it reads (weights, external memory), and the bytes each private
    copy of library memory starts from (:mod:`nimble.engine.loading`)."""

    #: Buffer -> its address now, for every buffer outside the arena the graph points into.
    outside: dict[int, int]
    #: Private copy -> its saved bytes; a copy without bytes starts zeroed.
    private_bytes: dict[int, bytes]


def _place_buffers(graph: TaskGraph, plan: MemPlan, layout: StateLayout,
                   arena: driver.DeviceMemory, device, low_bits: Sequence[int],
                   placement: Placement | None = None
                   ) -> tuple[int, list[int], RngCells | None]:
    """``(aligned arena base, where every buffer lives, the generator's cells)``; copies the
    library's bytes into the private copies (zeroes those of workspaces) and gives each
    low-word buffer its own memory.  With ``placement`` (a loaded graph) the buffers outside
    the arena are where it says, and the private copies start from its bytes."""
    import torch

    base = align_up(arena.address)
    bases = buffer_bases(graph, plan, base)
    for bid, address in (placement.outside.items() if placement else ()):
        bases[bid] = address
    rng_bases, rng = _rng_cells(graph, device, base + layout.rng_at)
    for bid, address in rng_bases.items():
        bases[bid] = address
    low = {}
    for bid in low_bits:
        b = graph.buffers[bid]
        memory = driver.LowBitsMemory.allocate(b.size, b.address, device.index or 0)
        arena.companions.append(memory)
        low[bid] = memory.address
    stream = driver.stream(torch.cuda.current_stream().cuda_stream)
    for bid, at in layout.private.items():
        size = graph.buffers[bid].size
        copy = low.get(bid, base + at)  # a low-word copy leaves its arena slot unused
        saved = placement.private_bytes.get(bid) if placement else None
        if bid in layout.zeroed or (placement is not None and saved is None):
            # a workspace: nothing to carry over, and torch may have freed it
            driver.fill_bytes_async(copy, 0, size, stream)
        elif placement is not None:
            driver.copy_to_device(copy, saved)
        else:
            driver.copy_device(copy, graph.buffers[bid].address, size)
        bases[bid] = copy
    for bid, address in low.items():
        bases[bid] = address
    return base, bases, rng


def _input_slots(graph: TaskGraph, bases: Sequence[int], cells: int, arena, device,
                 gather_inputs: bool) -> list[InputSlot]:
    """The graph inputs' slots; with ``gather_inputs`` (where the GPU allows) each dense one
    gets its cell at ``cells + 8 * i``, written to name the slot itself."""
    slots = [input_slot(bases[r.buffer] + r.offset, r, arena, device) for r in graph.inputs]
    if gather_inputs and slots and driver.device_supports_stream_writes(device.index or 0):
        # A cell starts out naming its own slot: a C host that copies into the slot
        # and launches (without writing the cell) gets a harmless self-copy.
        slots = [s._replace(cell=cells + 8 * i) if s.dense else s for i, s in enumerate(slots)]
        for s in slots:
            if s.cell:
                driver.copy_to_device(s.cell, s.address.to_bytes(8, "little"))
    return slots


def _counts(graph: TaskGraph, key: str, total: int) -> list[int]:
    return graph.meta.get(key) or [total]


def _build_phases(builder: PhaseBuilder, rec, slots: list[InputSlot], outputs: list,
                  device, rng: RngCells | None, backfill_trials: dict[int, list] | None,
                  builts: list[BuiltGraph], order: CallOrder | None = None,
                  priority_trials: Sequence[PriorityTrial] = (),
                  prefetch_trials: dict[int, tuple] | None = None,
                  programmatic_trials: dict[int, frozenset] | None = None
                  ) -> tuple[list[Launcher], list[backfill.Picked]]:
    """Each phase built as served (appended to ``builts``, which the caller frees on an error),
    its resource-aware priorities (``priority_trials``; what was measured goes to
    ``graph.meta["resource_order"]``), then its tail backfill trials, its weight prefetch
    (``prefetch_trials``; ``graph.meta["prefetch_l2"]``) and its programmatic edges
    (``programmatic_trials``; ``graph.meta["programmatic"]``) timed, and its launcher over its
    share of inputs and outputs (sharing ``order``: a new one when None)."""
    graph = rec.graph
    order = order if order is not None else CallOrder()
    in_counts = _counts(graph, "phase_inputs", len(graph.inputs))
    out_counts = _counts(graph, "phase_outputs", len(graph.outputs))
    context = driver.current_context()
    launchers: list[Launcher] = []
    picked: list[backfill.Picked] = []
    ordered: list[dict] = []
    first_in = first_out = 0
    refresh = _recorded_inputs_into(slots, rec.static_inputs)
    for k in range(len(builder.spans)):
        built = builder.build(k)
        if priority_trials:
            try:
                built, report = pick_priorities(
                    builder, k, built, priority_trials,
                    _after_phases(builts, builder.upload_stream, refresh))
            except BaseException:
                built.close()  # the plain build is this loop's until a pick returns
                raise
            if report is not None:
                ordered.append(report.as_meta())
        if backfill_trials and backfill_trials.get(k):
            try:
                built, report = backfill.pick(
                    built, backfill_trials[k],
                    lambda late, k=k: builder.build(k, PhaseOptions(late_edges=late)),
                    _after_phases(builts, builder.upload_stream, refresh))
            except BaseException:
                built.close()  # pick frees the graphs it built, not this one
                raise
            picked.append(report)
        if prefetch_trials and prefetch_trials.get(k):
            built = pick_prefetch(builder, k, built, prefetch_trials[k],
                                  _after_phases(builts, builder.upload_stream, refresh), graph)
        if programmatic_trials and programmatic_trials.get(k):
            built = pick_programmatic(builder, k, built, programmatic_trials[k],
                                      _after_phases(builts, builder.upload_stream, refresh),
                                      graph)
        builts.append(built)
        launchers.append(Launcher(
            built.exec.handle, slots[first_in:first_in + in_counts[k]], device,
            outputs[first_out:first_out + out_counts[k]],
            rec.output_spec if k == 0 else None, context, rng if k == 0 else None,
            order=order))
        first_in += in_counts[k]
        first_out += out_counts[k]
    if priority_trials:
        graph.meta["resource_order"] = ordered
    return launchers, picked


class ArenaRegion(NamedTuple):
    """Where a graph is built in an arena it does not own (one of several shape buckets of a
    model instance, :mod:`nimble.engine.arena_layout`): the arena, this graph's layout in it,
    and the lock and stream order of every graph in it."""

    arena: driver.DeviceMemory
    layout: StateLayout
    order: CallOrder


def build_prepared(model, rec, schedule: Schedule, plan: MemPlan, *, device_launch: bool,
                   gather_inputs: bool, seconds: dict,
                   priorities: list[int] | None = None,
                   backfill_trials: dict[int, list] | None = None,
                   region: ArenaRegion | None = None,
                   late_edges: Sequence[tuple[int, int]] = (),
                   priority_trials: Sequence[PriorityTrial] = (),
                   placement: Placement | None = None,
                   prefetch_trials: dict[int, tuple] | None = None,
                   prefetch: Sequence | None = None,
                   programmatic: ProgrammaticPlan | None = None) -> Prepared:
    """Arena, cells, explicit graph(s) and launchers for a planned recording (not verified).

    The arena holds the plan's buffers, then an 8-byte cell per gathered input (the source
    address the graph's gather node reads), then the generator's seed and offset cells, then a
    private copy of every library-owned buffer the graph writes (:func:`written_externals`),
    initialized from the library's bytes.  Each buffer of
    :func:`~nimble.engine.arena_layout.low_word_buffers` (an arena buffer or a private copy)
    gets memory of its own at its recorded address plus a multiple of 4 GiB
    (:class:`~nimble.driver.LowBitsMemory`), owned with the arena; its arena slot stays unused.
    A phased recording (a training step) gets one graph and one launcher per phase, over the
    phase's own tasks, inputs and outputs.  ``priorities`` (driver priority numbers per task,
    :func:`kernel_priorities`) go to the kernel nodes.  ``backfill_trials`` (per phase,
    :func:`nimble.analysis.backfill.plan_trials`) are built and timed against the phase built
    without them (:func:`nimble.analysis.backfill.pick`), each after the phases before it, and
    the fastest kept; so are ``priority_trials``
    (:func:`nimble.engine.priority_trials.resource_trials`), before them, and the kept
    priorities are the result's, and after them ``prefetch_trials`` (per phase, the weight
    prefetches of :func:`nimble.engine.prefetch.plan_phases`); ``prefetch`` (per phase) is
    built in as it is (a copy of a graph whose prefetch was picked already); ``programmatic``
    (:func:`~nimble.engine.programmatic_pick.planned_programmatic`) says which programmatic
    edges are served from the start and which each phase times against none.

    With ``region`` the graph is built in an arena shared with other graphs (its plan from the
    arena's base, its state where ``region.layout`` says), which the caller owns and frees on
    an error, and its launchers share ``region.order``; ``late_edges`` are built in as they are
    (a copy of a graph whose backfill was picked already).  ``placement`` places a graph
    loaded from a file (:class:`Placement`), whose ``rec`` holds stored nodes.
    """
    import torch

    graph = rec.graph
    device = rec.static_inputs[0].device if rec.static_inputs else torch.device("cuda")
    spans = phase_spans(graph.meta.get("phases") or [], len(graph.tasks))
    if region is None:
        layout = own_layout(graph, plan)
        arena, order = driver.DeviceMemory.allocate(layout.size), CallOrder()
    else:
        arena, layout, order = region
    builts: list[BuiltGraph] = []
    try:
        low_bits = tuple(low_word_buffers(graph))
        base, bases, rng = _place_buffers(graph, plan, layout, arena, device, low_bits,
                                          placement)
        slots = _input_slots(graph, bases, base + layout.cells_at, arena, device, gather_inputs)
        outputs = [device_tensor(bases[r.buffer] + r.offset, r, arena, device)
                   for r in graph.outputs]
        in_counts = _counts(graph, "phase_inputs", len(graph.inputs))
        starts = [sum(in_counts[:k]) for k in range(len(spans))]
        builder = PhaseBuilder(
            graph, [rec.nodes] * len(spans), bases, schedule.edges(), spans,
            [gathers_of(slots[at:at + count]) for at, count in zip(starts, in_counts)],
            priorities, [device_launch] * len(spans),
            upload_stream=driver.stream(torch.cuda.current_stream().cuda_stream),
            late_edges=late_edges, prefetch=list(prefetch) if prefetch else None,
            programmatic=programmatic.served if programmatic else frozenset())
        launchers, picked = _build_phases(builder, rec, slots, outputs, device, rng,
                                          backfill_trials, builts, order, priority_trials,
                                          prefetch_trials,
                                          programmatic.trials if programmatic else None)
    except BaseException:
        for built in builts:
            built.close()
        if region is None:
            arena.close()
        raise
    prepared = Prepared(graph=graph, schedule=schedule, memplan=plan, builts=builts,
                        arena=arena, arena_base=base, bases=bases, launchers=launchers,
                        weights=Weights(model, graph, placement.outside if placement
                                        else None), seconds=seconds,
                        priorities=builder.priorities, backfill=picked,
                        prefetch=list(builder.prefetch),
                        programmatic=frozenset().union(*(b.programmatic for b in builts)),
                        low_bits=low_bits)
    if rec.step is not None:
        from .autograd import TrainingStep

        names = [n for n, p in model.named_parameters() if p.requires_grad]
        prepared.step = TrainingStep(launchers[0], launchers[1], rec.step, names)
    return prepared
