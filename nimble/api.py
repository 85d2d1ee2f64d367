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

import functools
import time
import warnings
from typing import NamedTuple

from . import driver
from .engine.build import repoint
from .errors import InputError, NimbleError
from .engine.launcher import TAKE_GENERAL_PATH, RngCells
from .analysis.memplan import MemPlan
from .engine.prepared import (Prepared, backfill_trials, build_prepared, kernel_priorities,
                       plan_graph, prove, task_times)
from .progress import say
from .analysis.schedule import Schedule
from .ir.taskgraph import TaskGraph
from .engine.weights import EPOCH as WEIGHTS_EPOCH
from .engine.weights import watch_modules


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
    serialized (see :mod:`nimble.engine.launcher`).

    Inspection: :attr:`graph` (the recorded TaskGraph), :attr:`schedule`, :attr:`memplan`,
    :attr:`exec_handle` (the raw ``CUgraphExec`` as an int, for a C or C++ host).
    """

    def __init__(self, model) -> None:
        self.model = model
        self._prepared: Prepared | None = None
        # The current graph's common call (Launcher.fast_call): None until a call made it,
        # False where the graph has none.
        self._fast = None

    # ---- preparation ------------------------------------------------------------------------
    def prepare(self, example_inputs, *, training: bool = False, use_multi_stream: bool = True,
                max_streams: int | None = None, arena_limit: int | str | None = "pool",
                device_launch: bool = True, gather_inputs: bool = True,
                verify: bool = True, relaunches: int | None = None,
                return_copies: bool = False, keep_recording: bool = False,
                recording=None, priorities: bool = True, backfill: bool | None = None,
                quiet: bool = True) -> "Nimble":
        """Record, schedule, plan, build and verify the model on ``example_inputs``.

        ``example_inputs`` is a tensor or a tuple of tensors on the GPU; every later call must
        pass tensors of the same shapes and dtypes.  For inference (``training=False``) the model
        must be in ``eval()`` mode.  With ``training=True`` (model in ``train()`` mode) one
        training step is recorded instead: the forward and its backward, each scheduled on
        several streams and rebuilt, sharing one arena; calls then return outputs that carry a
        ``grad_fn``, and ``backward()`` through them launches the backward graph and fills
        ``param.grad`` as eager does (see :mod:`nimble.engine.autograd`).  Batch-norm running
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
        into the arena.  ``recording`` reuses a live :class:`~nimble.record.recorder.Recording` of this
        model (from :func:`nimble.record.recorder.record` or an earlier ``keep_recording=True``) instead
        of recording again.  ``priorities`` gives every kernel of a multi-stream graph a
        scheduling priority from its slack on the critical path (:mod:`nimble.analysis.priorities`; each
        task is timed alone once for it), so that where kernels compete for the GPU, those the
        run waits for get the SMs first.  ``backfill`` (default: on for training) lets a phase
        whose critical path ends in narrow kernels run work with slack beside them, if that
        measures faster at prepare (:mod:`nimble.analysis.backfill`; :attr:`backfill` says what was
        measured and kept).  Progress goes to stderr unless ``quiet``.

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
                                      verify, relaunches, keep_recording, priorities,
                                      training if backfill is None else backfill)
        finally:
            restore()
        candidate.launcher.return_copies = return_copies
        candidate.graph.meta["prepare_seconds"] = dict(candidate.seconds)
        previous, self._prepared = self._prepared, candidate
        self._fast = None
        if previous is not None:
            previous.close()
        return self

    def _prepare(self, example_inputs, training, recording, quiet, use_multi_stream, max_streams,
                 arena_limit, device_launch, gather_inputs, verify, relaunches,
                 keep_recording, priorities, backfill) -> Prepared:
        seconds: dict[str, float] = {}
        rec = recording if recording is not None else self._record(example_inputs, training,
                                                                    quiet)
        if (rec.step is not None) != training:
            raise InputError("the recording passed to prepare() is of "
                             f"{'a training step' if rec.step else 'inference'}, but "
                             f"training={training}")
        seconds.update(rec.seconds)

        @functools.cache
        def durations() -> list[float]:
            # The same times pick among the schedules that fit the arena (only asked for when
            # the limit binds) and rank the kernels (priorities on): measured once, when needed.
            t0 = time.perf_counter()
            say("timing every task alone", quiet)
            times = task_times(rec)
            seconds["timing"] = time.perf_counter() - t0
            return times
        t0 = time.perf_counter()
        say(f"scheduling {len(rec.graph.tasks)} tasks", quiet)
        schedule, memplan = plan_graph(rec.graph, use_multi_stream, max_streams, arena_limit,
                                       durations)
        seconds["schedule_and_memplan"] = time.perf_counter() - t0 - seconds.get("timing", 0.0)
        say(f"{len(schedule.streams)} streams, {len(schedule.sync_edges)} syncs; arena "
            f"{memplan.arena_bytes / 2**20:.1f} MiB", quiet)

        ranks, trials = None, None
        if priorities and use_multi_stream and len(schedule.streams) > 1:
            ranks = kernel_priorities(schedule, durations())
        if backfill and use_multi_stream and len(schedule.streams) > 1:
            trials = backfill_trials(rec.graph, schedule, durations())
        t0 = time.perf_counter()
        if trials:
            say(f"timing {sum(map(len, trials.values()))} tail backfill(s) against none", quiet)
        candidate = build_prepared(self.model, rec, schedule, memplan,
                                   device_launch=device_launch, gather_inputs=gather_inputs,
                                   seconds=seconds, priorities=ranks, backfill_trials=trials)
        seconds["build"] = time.perf_counter() - t0
        for p in candidate.backfill:
            say(f"phase {p.phase}: {p.plain_ms:.3f} ms per launch plain, "
                + ", ".join(f"{ms:.3f}" for ms in p.trial_ms) + " with backfill; "
                + (f"kept {len(p.kept.deferred)} edge(s)" if p.kept else "kept none"), quiet)
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
                prove(candidate, rec, relaunches)
                seconds["verify"] = time.perf_counter() - t0
        except BaseException:
            candidate.close()
            raise
        candidate.recording = rec if keep_recording else None
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

        from .record.recorder import record, record_step

        if training:
            return record_step(self.model, example_inputs, quiet=quiet)
        with torch.no_grad():
            return record(self.model, example_inputs, quiet=quiet)

    # ---- calls ------------------------------------------------------------------------------
    @property
    def engine(self) -> Prepared:
        """The prepared graph behind this object (:class:`~nimble.engine.prepared.Prepared`):
        the built graph and its exec (``engine.built``), the per-call launcher, the arena's
        buffer addresses (``engine.bases``), the weights it reads and the late edges it kept.

        For tools, tests and embedding hosts that need more than the properties below; its
        fields belong to the engine and may change between versions.  Raises
        :class:`~nimble.errors.NimbleError` before prepare().
        """
        if self._prepared is None:
            raise NimbleError("call prepare(example_inputs) before running the model")
        return self._prepared

    def _state(self) -> Prepared:
        return self.engine

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
        state = self._state()
        if state.weights.epoch != WEIGHTS_EPOCH[0]:
            self._follow_weights(state)
        if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)):
            inputs = inputs[0]
        if state.step is not None:
            return state.step(inputs, state.launcher.unflatten)
        launcher = state.launcher
        if self._fast is None:
            self._fast = launcher.fast_call(state.weights) or False
        return launcher.unflatten(launcher.run_flat(inputs))

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

    def _follow_weights(self, state: Prepared) -> bool:
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
        A Python call skips writing a cell that already holds its input's address; reading this
        property makes the next Python call write every cell, so a host that writes cells
        between Python calls reads it again before handing back to Python.
        """
        launcher = self._state().launcher
        launcher.forget_cells()  # the caller may write them: later calls write every cell
        return [s.cell for s in launcher.slots]

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

    def trace(self, *inputs, runs: int = 5, start_stamps: bool = True, groups: int = 1):
        """Measure every task's start and end inside a real multi-stream run of the prepared
        graph(s); returns a :class:`nimble.debug.timeline.Timeline` (``.summary()``, ``.to_chrome()``).

        ``inputs`` are the flat inputs of every phase (random ones when none are given).  The
        graph is rebuilt with timestamp nodes for the measurement; the prepared graph itself is
        not changed and keeps serving calls.  ``start_stamps=False`` halves the timestamp nodes
        (each start is then its task's ready time; see :func:`nimble.debug.timeline.record_timeline`).
        ``groups=k`` measures a ``k``-th of the tasks in each of ``k`` instrumented runs and joins
        them, so each run is disturbed less.
        """
        from .debug.timeline import record_timeline

        return record_timeline(self._state(), list(inputs) if inputs else None, runs=runs,
                               start_stamps=start_stamps, groups=groups)

    def run_until(self, *, task: int | None = None, op: int | None = None,
                  module: str | None = None, inputs=None):
        """Step-through: run the prepared graph up to a task, an ATen op (its index in
        :attr:`graph`) or a module (its path), on ``inputs`` (the flat inputs of every phase;
        random when None), and return a :class:`nimble.debug.step_through.Snapshot` of every buffer the run
        touched (``.buffer(b)``, ``.tensor(b, dtype, shape)``, ``.op_outputs(k)``).  The
        outputs of earlier calls and the model's state are put back afterwards."""
        from .debug.step_through import run_until, select_tasks

        state = self._state()
        targets = select_tasks(state.graph, task=task, op=op, module=module)
        return run_until(state, targets, inputs)

    def first_divergence(self, *inputs, nonfinite: bool = False, quiet: bool = False):
        """The first ATen op whose output in the prepared graph differs from eager's on
        ``inputs`` (dtype-aware tolerance), or with ``nonfinite`` the first to write NaN or Inf;
        a :class:`nimble.debug.divergence.Divergence` (op, module, tasks, difference) or None.

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

        state = self._state()
        if state.step is not None:
            raise InputError("first_divergence compares inference graphs with eager; prepare "
                             "with training=False to search the forward")
        if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)):
            inputs = tuple(inputs[0])
        aligned = align(state.graph, eager_ops(self.model, inputs, keep_inputs=not nonfinite))
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
    def phases(self) -> list["PhaseView"]:
        """Each separately launched graph: one (``"inference"``), or ``"forward"`` and
        ``"backward"`` for a training step, with its tasks and its handles for a C host."""
        state = self._state()
        names = ["forward", "backward"] if state.step is not None else ["inference"]
        for launcher in state.launchers:
            launcher.forget_cells()  # a C host may write them: later calls write every cell
        return [PhaseView(name, built.span, int(built.exec.handle),
                          [s.cell for s in launcher.slots], [s.address for s in launcher.slots],
                          [o.data_ptr() for o in launcher.outputs])
                for name, built, launcher in zip(names, state.builts, state.launchers)]

    @property
    def priorities(self) -> list[int] | None:
        """The driver priority number each task's kernel node runs at (lower numbers run first,
        see :mod:`nimble.analysis.priorities`), or None when the graph runs without priorities
        (``prepare(priorities=False)`` or one stream)."""
        got = self._state().priorities
        return None if got is None else list(got)

    @property
    def backfill(self) -> list:
        """Per phase whose tail backfill was tried at prepare (:mod:`nimble.analysis.backfill`), a
        :class:`~nimble.analysis.backfill.Picked`: the phase's median ms per launch without late edges
        and with each candidate, and the candidate kept (None: the plain graph was faster).
        Empty where none was tried (one stream, inference by default, no narrow tail)."""
        return list(self._state().backfill)

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
        self._fast = None
        if self._prepared is not None:
            self._prepared.close()
            self._prepared = None
