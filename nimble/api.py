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
from .errors import NimbleError
from .engine.launcher import TAKE_GENERAL_PATH
from .engine.options import PrepareOptions
from .engine.options import options_with as _options_with
from .engine.collectives import check_average
from .engine.data_parallel import DataParallelTarget, check_grad_sync, data_parallel_target
from .engine.preparation import check_mode, model_state_kept, prepare_serving
from .engine.prepared import Prepared
from .engine.serving import Serving, bucket_examples
from .engine.weights import EPOCH as WEIGHTS_EPOCH
from .engine.weights import watch_modules
from .inspection import GraphViews
from .engine.profiler_guard import host_launch_if_profiled, watch_profiler


class Nimble(GraphViews):
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
        other thread calls the model.  A graph whose sums over the ranks are
        :class:`nimble.peer_sum.PeerSum`'s is saved by every rank at once, each to a file of
        its own, which that rank loads with its model (``nimble.load(path, model=...)``).
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
