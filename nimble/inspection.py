"""What a prepared :class:`~nimble.api.Nimble` shows: its graph, schedule, arena plan and
handles for a C host, the per-phase and per-bucket views, what prepare measured and chose, and
the debugging tools (a trace, a step-through, the first divergence from eager).  A mixin of the
``Nimble`` object, reading its ``engine`` (the primary prepared graph) and its serving."""
from __future__ import annotations

from .analysis.memplan import MemPlan
from .analysis.schedule import Schedule
from .engine.launcher import RngCells
from .engine.serving import BucketView, MemoryReport, PhaseView, PrepareReport, phase_views
from .errors import InputError
from .ir.taskgraph import TaskGraph
from .progress import say


class GraphViews:
    """The inspection side of :class:`~nimble.api.Nimble` (see the module docstring)."""

    @property
    def graph(self) -> TaskGraph:
        """The recorded TaskGraph (tasks, buffers, accesses)."""
        return self.engine.graph

    @property
    def schedule(self) -> Schedule:
        """The stream assignment and synchronization edges the built graph runs."""
        return self.engine.schedule

    @property
    def memplan(self) -> MemPlan:
        """The arena plan: an offset per relocatable buffer."""
        return self.engine.memplan

    @property
    def exec_handle(self) -> int:
        """The raw ``CUgraphExec`` as an int: launch it from C with ``cuGraphLaunch``."""
        return int(self.engine.built.exec.handle)

    @property
    def arena_address(self) -> int:
        """The device address of the arena (buffer ``b`` lives at this + ``memplan.offsets[b]``)."""
        return self.engine.arena_base

    @property
    def recording(self):
        """The live recording, when prepared with ``PrepareOptions(keep_recording=True)`` (else
        None)."""
        return self.engine.recording

    @property
    def input_cells(self) -> list[int]:
        """Per input, the device address of the 8-byte cell the graph reads its source address
        from before anything else (0 where that input is copied into its slot instead).

        A C or C++ host driving :attr:`exec_handle` itself writes the input tensor's address
        into each cell on the launch stream (``cuStreamWriteValue64``), then calls
        ``cuGraphLaunch``; or it copies the input to the slot and writes the slot's own address.
        A Python call skips writing a cell that already holds its input's address, so a host
        that writes cells between Python calls calls :meth:`host_writes_cells` before handing
        back to Python.  With several buckets or instances: the primary graph's
        (:attr:`engine`); :attr:`buckets` has every graph's.
        """
        return [s.cell for s in self.engine.launcher.slots]

    def host_writes_cells(self) -> None:
        """Say that something other than a Python call (a C or C++ host, see
        :attr:`input_cells` and :attr:`phases`) wrote or will write the input cells: the next
        Python call of every phase (of every bucket and instance) writes each of its cells
        again instead of trusting the address it wrote last."""
        for state in self._serving.preparations() if self._serving else [self.engine]:
            for launcher in state.launchers:
                with launcher.lock:
                    launcher.forget_cells()

    @property
    def buffer_addresses(self) -> list[int]:
        """Per buffer of :attr:`graph`, the device address the built graph reads and writes it
        at (in the arena, or a weight's own memory as the weights are now)."""
        return list(self.engine.bases)

    @property
    def output_addresses(self) -> list[int]:
        """Per output (flattened), the device address the graph writes it at."""
        return [o.data_ptr() for o in self.engine.launcher.outputs]

    @property
    def rng_cells(self) -> RngCells | None:
        """Where a graph that draws random numbers reads the generator's seed and offset.

        None for a graph without random ops.  Python calls fill both cells; a C or C++ host
        writes the seed and the current offset (then advances its offset by ``increment``)
        before each launch, as it writes the input cells.
        """
        return self.engine.launcher.rng

    @property
    def input_addresses(self) -> list[int]:
        """Per input, the device address of its slot in the arena."""
        return [s.address for s in self.engine.launcher.slots]

    def trace(self, *inputs, runs: int = 5, start_stamps: bool = True, groups: int = 1):
        """Measure every task's start and end inside a real multi-stream run of the prepared
        graph(s); returns a :class:`~nimble.debug.timeline.Timeline` (``nimble.Timeline``:
        ``.summary()``, ``.to_chrome()``).

        ``inputs`` are the flat inputs of every phase (random ones when none are given).  The
        graph is rebuilt with timestamp nodes for the measurement; the prepared graph itself is
        not changed and keeps serving calls.  ``start_stamps=False`` halves the timestamp nodes
        (each start is then its task's ready time; see
        :func:`nimble.debug.timeline.record_timeline`).
        ``groups=k`` measures a ``k``-th of the tasks in each of ``k`` instrumented runs and joins
        them, so each run is disturbed less.
        """
        from .debug.timeline import record_timeline

        return record_timeline(self.engine, list(inputs) if inputs else None, runs=runs,
                               start_stamps=start_stamps, groups=groups)

    def run_until(self, *, task: int | None = None, op: int | None = None,
                  module: str | None = None, inputs=None):
        """Step-through: run the prepared graph up to a task, an ATen op (its index in
        :attr:`graph`) or a module (its path), on ``inputs`` (the flat inputs of every phase;
        random when None), and return a :class:`~nimble.debug.step_through.Snapshot`
        (``nimble.Snapshot``) of every buffer the run touched (``.buffer(b)``,
        ``.tensor(b, dtype, shape)``, ``.op_outputs(k)``).  The outputs of earlier calls and the
        model's state are put back afterwards."""
        from .debug.step_through import run_until, select_tasks

        state = self.engine
        targets = select_tasks(state.graph, task=task, op=op, module=module)
        return run_until(state, targets, inputs)

    def first_divergence(self, *inputs, nonfinite: bool = False, quiet: bool = False):
        """The first ATen op whose output in the prepared graph differs from eager's on
        ``inputs`` (dtype-aware tolerance), or with ``nonfinite`` the first to write NaN or Inf;
        a :class:`~nimble.debug.divergence.Divergence` (``nimble.Divergence``: op, module,
        tasks, difference) or None.

        Walks the ops in recorded order with step-through runs (:meth:`run_until`), one for
        several ops wherever their outputs all outlast it (:mod:`nimble.debug.stop_groups`),
        and stops at the first that goes wrong; a long walk reports its progress on stderr unless
        ``quiet``.  An op that differs from the eager chain counts only if it also differs from
        its eager twin run on the graph's own inputs to it, so rounding that builds up over a
        deep network is not taken for a fault
        (:func:`nimble.debug.divergence.isolated_difference`).
        Inference graphs only; the model must dispatch the same ops eagerly as when recorded.
        """
        from .debug.divergence import WalkCost, first_divergence, first_nonfinite
        from .debug.eager_twins import align, eager_ops
        from .debug.step_through import StepThrough, run_before, run_until, select_tasks
        from .debug.stop_groups import walk_groups

        state = self.engine
        if state.step is not None:
            raise InputError("first_divergence compares inference graphs with eager; prepare "
                             "with training=False to search the forward")
        if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)):
            inputs = tuple(inputs[0])
        aligned = align(state.graph, eager_ops(self._target.module, inputs,
                                               keep_inputs=not nonfinite))
        stepper = StepThrough(state, 0)

        def run(op: int):
            read = {a.buffer for a in state.graph.ops[op].accesses if a.write}
            read |= {a.buffer for a in aligned[op].sources if a is not None}
            return run_until(state, select_tasks(state.graph, op=op), list(inputs), read,
                             stepper, on_device=True)

        def before(op: int, read: set[int]):
            return run_before(state, op, list(inputs), read, stepper, on_device=True)

        def run_group(ops: list[int]):
            tasks = [t for op in ops for t in select_tasks(state.graph, op=op)]
            read = {a.buffer for op in ops for a in state.graph.ops[op].accesses if a.write}
            return run_until(state, tasks, list(inputs), read, stepper, on_device=True)
        cost = WalkCost()
        run = cost.counted("stops of one op", run)
        before = cost.counted("runs before an op", before)
        grouped = walk_groups(state, aligned, cost.counted("runs of a group", run_group))
        progress = lambda line: say(line, quiet)  # noqa: E731
        try:
            if nonfinite:
                return first_nonfinite(run, state.graph, aligned, progress, grouped)
            return first_divergence(run, state.graph, aligned, progress, run_before=before,
                                    grouped=grouped, cost=cost)
        finally:
            stepper.close()
            say(cost.summary(), quiet)

    @property
    def phases(self) -> list[PhaseView]:
        """Each separately launched graph: one (``"inference"``), or ``"forward"`` and
        ``"backward"`` for a training step, with its tasks and its handles for a C host (which
        calls :meth:`host_writes_cells` before handing back to Python)."""
        return phase_views(self.engine)

    @property
    def buckets(self) -> list[BucketView]:
        """Every shape bucket, in the order prepared, with each model instance's graph: its
        exec handle, input cells, input and output addresses, for a C host (write a cell on
        the launch stream, launch the exec; one launch at a time per instance, since an
        instance's buckets share its arena; call :meth:`host_writes_cells` before handing back
        to Python)."""
        self.engine  # noqa: B018 - raises before prepare()
        return self._serving.views()

    @property
    def instances(self) -> int:
        """How many copies of the graphs run at once (``prepare(..., instances=k)``)."""
        self.engine  # noqa: B018 - raises before prepare()
        return self._serving.instances

    @property
    def device_bytes(self) -> MemoryReport:
        """The device memory the prepared graphs take beyond the weights: per instance one
        arena (the shared plans' region and every bucket's state), and any buffers placed
        beside the arenas (:class:`~nimble.engine.serving.MemoryReport`)."""
        self.engine  # noqa: B018 - raises before prepare()
        return self._serving.memory()

    @property
    def kernel_priorities(self) -> list[int] | None:
        """Per task, the driver priority number its kernel node runs at (lower numbers run
        first, see :mod:`nimble.analysis.priorities`), or None when the graph runs without
        priorities (``PrepareOptions(priorities=False)`` or one stream)."""
        got = self.engine.priorities
        return None if got is None else list(got)

    @property
    def backfill_trials(self) -> list:
        """Per phase whose tail backfill was tried at prepare (:mod:`nimble.analysis.backfill`),
        a :class:`~nimble.analysis.backfill.Picked`: the phase's median ms per launch without
        late edges and with each candidate, and the candidate kept (None: the plain graph was
        faster).  Empty where none was tried (``PrepareOptions(backfill=False)``, one stream,
        inference by default, no narrow tail)."""
        return list(self.engine.backfill)

    @property
    def late_edges(self) -> list[tuple[int, int]]:
        """The built graphs' dependency edges beyond :attr:`schedule`'s, ``(anchor, task)``:
        the tail backfill kept (:attr:`backfill_trials`); empty without one."""
        return self.engine.late_edges

    @property
    def programmatic_edges(self) -> list[tuple[int, int]]:
        """The dependency edges built programmatic, ``(u, v)``: ``v`` (one of Nimble's own
        kernels, which waits for ``u`` in its code) may start while ``u`` ends.  Empty unless
        ``PrepareOptions(programmatic_launch=...)`` asked and they were kept
        (:func:`nimble.analysis.programmatic.waiting_edges`); a load builds the file's edges into
        those kernels so (:data:`nimble.engine.loading.LOAD_WAITING_EDGES`), every other edge
        a full dependency."""
        return sorted(self.engine.programmatic)

    @property
    def launch_mode(self) -> str:
        """``"device-launchable"`` (uploaded once, cheap host launches) or ``"host"``."""
        return "device-launchable" if self.engine.built.device_launch else "host"

    @property
    def prepare_seconds(self) -> dict:
        """Seconds each step of the last prepare() took (of the primary bucket, see
        :attr:`engine`; :attr:`prepare_report` has every bucket and instance)."""
        return dict(self.engine.seconds)

    @property
    def prepare_report(self) -> PrepareReport:
        """Where the last prepare() spent its time: per bucket and stage, each further
        instance's build and short proof, the arenas' allocation, and the total
        (:class:`~nimble.engine.serving.PrepareReport`)."""
        self.engine  # noqa: B018 - raises before prepare()
        return self._serving.report
