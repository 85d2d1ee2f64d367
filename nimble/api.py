"""The object users hold: ``nimble.Nimble(model)``, ``prepare()`` once, then one launch a call.

::

    import nimble
    nm = nimble.Nimble(model)                 # model on the GPU, in eval() mode
    nm.prepare(dummy_input, training=False)   # record, schedule, plan, build, verify
    out = nm(real_input)                      # input copy + one graph launch

For serving, one object takes several input shapes (``batch_sizes=[1, 8, 32]`` or
``buckets=[...]``, all in one arena) and runs several callers at once (``instances=4``); see
:mod:`nimble.engine.serving`.

``prepare()`` does all the scheduling work: it records one forward on a single stream, builds the
happens-before DAG, assigns streams (Nimble's algorithm), plans the static arena, builds and
instantiates one explicit CUDA graph, and proves it bit-exact against the recording
(:mod:`nimble.engine.preparation`).  How it builds and checks is a
:class:`~nimble.engine.options.PrepareOptions`.
"""
from __future__ import annotations

from . import driver
from .engine.build import repoint
from .errors import InputError, NimbleError
from .engine.launcher import TAKE_GENERAL_PATH, RngCells
from .analysis.memplan import MemPlan
from .engine.options import PrepareOptions
from .engine.options import options_with as _options_with
from .engine.collectives import check_average
from .engine.data_parallel import DataParallelTarget, check_grad_sync, data_parallel_target
from .engine.preparation import check_mode, model_state_kept, prepare_serving
from .engine.prepared import Prepared
from .engine.serving import (BucketView, MemoryReport, PhaseView, PrepareReport, Serving,
                             bucket_examples, phase_views)
from .analysis.schedule import Schedule
from .ir.taskgraph import TaskGraph
from .progress import say
from .engine.weights import EPOCH as WEIGHTS_EPOCH
from .engine.weights import watch_modules
from .engine.profiler_guard import host_launch_if_profiled, watch_profiler


class Nimble:
    """A PyTorch module run as one ahead-of-time scheduled, multi-stream CUDA graph.

    After :meth:`prepare`, calling the object hands the inputs to the graph and launches it on
    the current stream; nothing else happens per call.  Calls may come from any thread; they are
    serialized (see :mod:`nimble.engine.launcher`).

    Inspection: :attr:`graph` (the recorded TaskGraph), :attr:`schedule`, :attr:`memplan`,
    :attr:`exec_handle` (the raw ``CUgraphExec`` as an int, for a C or C++ host), :attr:`phases`,
    :attr:`kernel_priorities`, :attr:`late_edges`; :attr:`engine` for everything else.
    """

    def __init__(self, model) -> None:
        self.model = model
        watch_profiler()
        self._prepared: Prepared | None = None
        self._serving: Serving | None = None
        # What prepare recorded: the model, or the module a DistributedDataParallel wraps.
        self._target = DataParallelTarget(model, None)
        # The current graph's common call (Launcher.fast_call): None until a call made it,
        # False where the graph has none.
        self._fast = None

    # ---- preparation ------------------------------------------------------------------------
    def prepare(self, example_inputs=None, *, buckets=None, batch_sizes=None,
                instances: int = 1, pad: bool = False, training: bool = False,
                use_multi_stream: bool = True, max_streams: int | None = None,
                return_copies: bool = False, quiet: bool = True,
                options: PrepareOptions | None = None, average_gradients=None,
                **switches) -> "Nimble":
        """Record, schedule, plan, build and verify the model on ``example_inputs`` (or on each
        shape bucket's example).

        Preparing again is transactional: the graph prepared before keeps serving calls until
        the new one is proven, and stays if the new prepare fails.  Batch-norm running
        statistics and the random generator are left as they were before ``prepare``.

        Parameters
        ----------
        example_inputs : torch.Tensor or tuple of torch.Tensor
            Inputs on the GPU; every later call must pass tensors of the same shapes and dtypes
            (or of a bucket's shapes).
        buckets : list of examples, optional
            Instead of ``example_inputs``: one example (tensor or tuple) per input shape the
            model serves.  Each call runs in the graph of its shapes; all buckets share one
            arena, sized by the largest.  Inference only.
        batch_sizes : list of int, optional
            With ``example_inputs``: one bucket per batch size, dim 0 of every input resized
            (rows taken cyclically).
        instances : int, default 1
            Copies of every graph, each with its own arena and cells, so that up to this many
            callers (each on its own stream) run at once; memory is that many arenas
            (:attr:`device_bytes`).  Inference only.
        pad : bool, default False
            A call whose batch (dim 0 of every input) has no bucket runs in the next larger
            one and gets the first rows of each output: right only for models whose rows are
            independent (batch norm in eval mode is).  Every input and output must have the
            batch on dim 0.
        training : bool, default False
            False: record inference (the model must be in ``eval()`` mode).  True (model in
            ``train()`` mode): record one training step, the forward and its backward, each
            scheduled on several streams and rebuilt, sharing one arena; calls then return
            outputs that carry a ``grad_fn``, and ``backward()`` through them launches the
            backward graph and fills ``param.grad`` as eager does
            (see :mod:`nimble.engine.autograd`).
        use_multi_stream : bool, default True
            False runs the tasks in recorded order on one stream.
        max_streams : int, optional
            Caps the streams.
        return_copies : bool, default False
            Each call returns fresh tensors instead of views into the arena (which the next
            call overwrites).  With several instances or buckets called from several threads,
            this is the way to keep outputs: a view is overwritten by its instance's next call
            of any bucket.
        quiet : bool, default True
            False reports progress on stderr.
        average_gradients : bool, process group or GradientAverage, optional
            With ``training=True`` under ``torch.distributed`` (one process per GPU): the
            parameters' gradients are averaged over the ranks of this process group (True: the
            default group) inside the backward graph, in buckets all-reduced beside the rest
            of the backward, as ``DistributedDataParallel`` averages them.  Every rank prepares
            and calls in the same order.  See :mod:`nimble.record.gradient_average`.  A model
            wrapped in ``DistributedDataParallel`` needs none: the wrapper's settings are
            used, and the module it wraps is recorded (:mod:`nimble.engine.data_parallel`).
        options : PrepareOptions, optional
            How the graph is built and checked: the arena's cap, device launch, input cells,
            the proof, kernel priorities, the tail backfill, keeping or reusing the recording
            (see :class:`~nimble.engine.options.PrepareOptions`; its defaults when None).
        **switches
            Any field of :class:`PrepareOptions` as a keyword (``relaunches=4``): deprecated,
            kept for one release with a ``DeprecationWarning``.

        Returns
        -------
        Nimble
            This object, ready to call.

        Raises
        ------
        InputError
            The model's mode does not match ``training``, an input cannot be taken, or the
            serving arguments do not fit (both or neither of ``example_inputs`` and
            ``buckets``, two buckets of one shape, ``instances < 1``, serving a training step,
            ``pad`` where a batch is not on dim 0).
        VerificationError
            The built graph did not reproduce the recording bit for bit: its ``recording``
            names the file the recording was saved to for a bug report
            (``$NIMBLE_FAULT_DIR``, else the temporary folder).
        GraphFaultError
            A kernel faulted on the GPU during the proof and took the process's CUDA context
            with it: the recording is saved for a bug report (``$NIMBLE_FAULT_DIR``, else the
            temporary folder), and the process must be restarted.
        NimbleError
            Any other failure to record, build or launch (its subclasses say which).
        """
        options = _options_with(options, switches)
        examples = bucket_examples(example_inputs, buckets, batch_sizes, instances=instances,
                                   pad=pad, training=training)
        target = data_parallel_target(self.model, training, average_gradients)
        check_average(target.average, training, instances, examples, options.recording)
        check_mode(target.module, training)
        watch_modules()
        with model_state_kept(target.module, training):
            serving = prepare_serving(target.module, examples, instances=instances, pad=pad,
                                      training=training, use_multi_stream=use_multi_stream,
                                      max_streams=max_streams, options=options, quiet=quiet,
                                      average=target.average)
        self._target = target
        return self._adopt(serving, return_copies)

    # ---- saving and loading -----------------------------------------------------------------
    def save(self, path, *, weights: bool = True, quiet: bool = True):
        """Write everything :meth:`prepare` decided to one file at ``path``, which
        :func:`nimble.load` rebuilds in another process without recording, scheduling or timing
        anything (:mod:`nimble.engine.saving`; the format: ``docs/saved-format.md``).

        ``weights=False`` leaves the model's named weights out of the file (a load must then
        pass the model; a training step's load always does).  Every bucket and the instance
        count are saved.  Raises :class:`~nimble.errors.SaveError` for a graph that cannot be
        written down (NCCL collectives, random numbers, a kernel whose binary is on no disk in a
        process that did not call :func:`nimble.keep_kernel_binaries` first) before anything is
        written; returns the file's path.  Saving launches the graph of every bucket on
        instance 0 to record the reference outputs a load is proven against: call it while no
        other thread calls the model.
        """
        from .engine.saving import save_serving

        self.engine  # noqa: B018 - raises before prepare()
        return save_serving(self._serving, path, weights=weights, quiet=quiet)

    def _adopt(self, serving: Serving, return_copies: bool) -> "Nimble":
        """Serve ``serving`` (prepared, or loaded from a file) from now on, and let go of what
        served before."""
        for prepared in serving.preparations():
            prepared.launcher.return_copies = return_copies
        previous, self._serving = self._serving, serving
        self._prepared = serving.primary
        self._fast = None
        if previous is not None:
            previous.close()
        return self

    # ---- calls ------------------------------------------------------------------------------
    @property
    def engine(self) -> Prepared:
        """The prepared graph behind this object (:class:`~nimble.engine.prepared.Prepared`):
        the built graph and its exec (``engine.built``), the per-call launcher, the arena's
        buffer addresses (``engine.bases``), the weights it reads and the late edges it kept.
        With several buckets or instances: the *primary* graph, the bucket with the largest
        arena plan on instance 0, which every single-graph property and debugging tool below
        means (:attr:`buckets` has them all).

        For tools, tests and embedding hosts that need more than the properties below; its
        fields belong to the engine and may change between versions.  Raises
        :class:`~nimble.errors.NimbleError` before prepare().
        """
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
        fast = self._fast
        if fast:
            out = fast(inputs)
            if out is not TAKE_GENERAL_PATH:
                return out
        return self._call(inputs)

    def _call(self, inputs: tuple):
        """A call by the general path: any input form, followed weights, training steps."""
        state = self.engine
        if state.weights.epoch != WEIGHTS_EPOCH[0]:
            self._follow_weights(state)
        if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)):
            inputs = inputs[0]
        if state.step is not None:
            check_grad_sync(self._target.wrapper)
            return state.step(inputs, state.launcher.unflatten)
        launcher, serving = state.launcher, self._serving
        if serving.plain:
            if self._fast is None:
                self._fast = launcher.fast_call(state.weights) or False
            return launcher.unflatten(launcher.run_flat(inputs))
        if self._fast is None:
            self._fast = serving.fast_call(state.weights)
        return serving.call(inputs)

    def refresh(self) -> bool:
        """Re-read the model's weights; re-point the graph at any that moved.  True if any did.

        Calls do this by themselves after torch's module machinery moved weights (parameter or
        buffer assignment, ``load_state_dict(assign=True)``, ``.to()``, ``.half()``...); call it
        after changes that go around it (``param.data = t``, ``torch.utils.swap_tensors``).  A
        weight that changed dtype, shape, strides or device, or is gone, raises
        :class:`~nimble.errors.WeightsChangedError`: prepare again.  In-place updates need
        nothing: the graph reads the weights' memory as it is.
        """
        return self._follow_weights(self.engine)

    def _follow_weights(self, primary: Prepared) -> bool:
        """Re-point every bucket's graph of every instance (``primary`` only before prepare
        finished)."""
        every = self._serving.preparations() if self._serving is not None else [primary]
        return any([self._follow_graph_weights(state) for state in every])

    def _follow_graph_weights(self, state: Prepared) -> bool:
        weights, launcher = state.weights, state.launcher
        with launcher.lock:
            if host_launch_if_profiled(state):
                self._fast = None  # its closure holds the exec replaced
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
                state.step.follow_parameters(self._target.module)
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

        Walks the ops in recorded order with a step-through run (:meth:`run_until`) per op and
        stops at the first that goes wrong; a long walk reports its progress on stderr unless
        ``quiet``.  An op that differs from the eager chain counts only if it also differs from
        its eager twin run on the graph's own inputs to it, so rounding that builds up over a
        deep network is not taken for a fault
        (:func:`nimble.debug.divergence.isolated_difference`).
        Inference graphs only; the model must dispatch the same ops eagerly as when recorded.
        """
        from .debug.divergence import align, eager_ops, first_divergence, first_nonfinite
        from .debug.step_through import StepThrough, run_before, run_until, select_tasks

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
                             stepper)

        def before(op: int, read: set[int]):
            return run_before(state, op, list(inputs), read, stepper)
        progress = lambda line: say(line, quiet)  # noqa: E731
        try:
            if nonfinite:
                return first_nonfinite(run, state.graph, aligned, progress)
            return first_divergence(run, state.graph, aligned, progress, run_before=before)
        finally:
            stepper.close()

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

    def close(self) -> None:
        """Free the graph and its exec now, and the arena once the outputs and gradients handed
        out are gone (idempotent)."""
        self._fast = None
        if self._serving is not None:
            self._serving.close()
            self._serving = None
        self._prepared = None



def load(path, model=None, *, instances: int | None = None, return_copies: bool = False,
         verify: bool = True, quiet: bool = True) -> Nimble:
    """A :class:`Nimble` serving the graph saved at ``path`` by :meth:`Nimble.save`, built in
    this process without recording anything, and proven bit for bit against the outputs saved
    with it (:mod:`nimble.engine.loading`).

    With ``model`` (the module the graph was saved from, on the GPU), the graph reads that
    module's weights by name and follows them when they move, as a prepared graph does;
    without, the weights come from the file.  ``instances`` builds that many copies of every
    bucket's graph (each proven) instead of the count saved, for a server that runs more or
    fewer callers at once than the saving process did.  A saved file is code: its kernels run
    with its arguments.  Load only files you trust, as with ``torch.load``.

    Raises :class:`~nimble.errors.LoadError` for a file that cannot be loaded here (damaged,
    truncated, another format version, GPU architecture or driver, a library or kernel not
    found, weights that do not fit), :class:`~nimble.errors.VerificationError` where the
    rebuilt graph does not reproduce the saved outputs; nothing stays allocated after either.
    """
    from .engine.loading import load_serving

    nm = Nimble(model)
    if model is not None:
        watch_modules()
    return nm._adopt(load_serving(path, model, instances=instances, verify=verify, quiet=quiet),
                     return_copies)


def keep_kernel_binaries() -> None:
    """Keep the code of every kernel module loaded from now on, so that graphs prepared later in
    this process can be saved (:meth:`Nimble.save`): cuBLASLt's GEMMs and kernels compiled at
    run time are in no file a loading process could read.  Call it at the start of the process
    that prepares and saves, before the model first runs.  It attaches NVIDIA's CUPTI, so
    graphs in this process launch from the host and ``torch.profiler`` cannot run here; the
    processes that load the saved graph need none of it.  Raises
    :class:`~nimble.errors.NimbleError` where CUPTI cannot be attached."""
    from .engine.kernel_binaries import keep_kernel_binaries as keep

    keep()
