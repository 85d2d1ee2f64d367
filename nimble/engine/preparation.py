"""What ``Nimble.prepare`` runs: check the model's mode, record (or reuse a recording), schedule
and plan, time what the options ask for, build, and prove, for every shape bucket and model
instance.

:func:`prepare_serving` goes in stages: record and plan every bucket, allocate each instance's
arena once (sized by the largest plan, :mod:`nimble.engine.arena_layout`), build every bucket in
it, prove every bucket; then build each further instance from the same recordings, plans and
priorities and give it a short proof.  One example and one instance is the same path with one of
each.  It returns a new :class:`~nimble.engine.serving.Serving` and leaves the one serving calls
alone; :func:`saved_state` puts back what preparing changes in the model and the random
generator.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from .. import driver
from ..analysis.deps import communicates
from ..analysis.memplan import MemPlan
from ..analysis.programmatic import plan_apart
from ..analysis.schedule import Schedule, phase_spans
from ..errors import GraphFaultError, InputError, VerificationError
from ..progress import logger as log, say
from .arena_layout import shared_layout
from .collectives import (check_data_parallel, check_instances, check_training_collectives,
                          refusal_reason)
from .kernel_owners import keep_owners
from .launcher import CallOrder
from .options import PrepareOptions
from .prefetch import planned_prefetch, served_prefetch
from .programmatic_pick import planned_programmatic, recorded_rule
from .profiler_guard import device_launch_allowed
from .prepared import (ArenaRegion, Prepared, arena_limit_bytes, backfill_trials, build_prepared,
                       kernel_priorities, plan_graph, task_times)
from .proof import ProofProgress
from .proving import prove, prove_copy
from .priority_trials import PriorityTrial, planned_ordering
from .serving import (Bucket, BucketCost, InstanceCost, PrepareReport, Serving,
                      check_pad_shapes, close_partial, shapes_of)


def saved_state(model, training: bool) -> Callable[[], None]:
    """A function that puts back what preparing changes: the default CUDA generator's state,
    and for a training step the module buffers (batch-norm running statistics, which warm-up,
    capture and the proof update as training forwards do)."""
    import torch

    generator = None
    if torch.cuda.is_available():
        torch.cuda.init()  # the default generators exist only once CUDA is initialised
        generator = torch.cuda.default_generators[torch.cuda.current_device()]
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


@contextlib.contextmanager
def restored_after(restore: Callable[[], None]) -> Iterator[None]:
    """Call ``restore`` when the block ends, however it ends, unless a kernel fault took the
    CUDA context: no state can be copied back then, and the copy's own error would hide the
    fault."""
    try:
        yield
    except GraphFaultError:
        raise
    except BaseException:
        restore()
        raise
    restore()


def model_state_kept(model, training: bool):
    """Put back what preparing changes (:func:`saved_state`) when the block ends
    (:func:`restored_after`)."""
    return restored_after(saved_state(model, training))


def check_mode(model, training: bool) -> None:
    """Raise :class:`~nimble.errors.InputError` where the model's train/eval mode does not
    match what is to be recorded."""
    import torch

    if training:
        if not isinstance(model, torch.nn.Module):
            raise InputError("prepare(training=True) needs a torch.nn.Module (its "
                             "parameters are what the backward computes gradients for)")
        if not model.training:
            raise InputError(
                "the model is in eval() mode, but prepare(training=True) records a training "
                "step: call model.train() first (or prepare(training=False) for inference)")
        check_data_parallel(model)
        return
    if isinstance(model, torch.nn.Module):
        in_training = [name or type(m).__name__ for name, m in model.named_modules()
                       if m.training]
        if in_training:
            raise InputError(
                f"the model is in training mode ({len(in_training)} module(s), e.g. "
                f"'{in_training[0]}'), but prepare(training=False) records inference: call "
                "model.eval() first (batch norm and dropout behave differently in training)")


def _recording(model, example_inputs, training: bool, options: PrepareOptions, quiet: bool,
               average=None):
    """The recording to build from: the one passed in, or one made now (a training step's
    gradients averaged over ``average``'s ranks where given)."""
    import torch

    from ..record.programmatic import launched_programmatically
    from ..record.recorder import record, record_step

    rec = options.recording
    if rec is None:
        with launched_programmatically(recorded_rule(options)):
            if training:
                rec = record_step(model, example_inputs, quiet=quiet, average=average)
            else:
                with torch.no_grad():
                    rec = record(model, example_inputs, quiet=quiet)
    if (rec.step is not None) != training:
        raise InputError("the recording passed to prepare() is of "
                         f"{'a training step' if rec.step else 'inference'}, but "
                         f"training={training}")
    return rec


@dataclass
class _Planned:
    """One bucket recorded and planned: what every instance of it is built from."""

    rec: Any
    schedule: Schedule
    memplan: MemPlan
    priorities: list[int] | None
    trials: dict | None
    seconds: dict
    #: Resource-aware priorities to time against ``priorities`` (``resource_order`` on).
    ordering: list[PriorityTrial] = field(default_factory=list)


def _plan(model, example, training: bool, use_multi_stream: bool, max_streams: int | None,
          options: PrepareOptions, quiet: bool, priority_range: Callable,
          average=None) -> _Planned:
    """Record (or reuse ``options.recording``), schedule, plan, and rank the kernels."""
    rec = _recording(model, example, training, options, quiet, average)
    check_training_collectives(rec.graph, training, averaging=average is not None, model=model)
    rec.graph.meta.pop("resource_order", None)  # a reused recording's is of an earlier prepare
    seconds: dict[str, float] = dict(rec.seconds)

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
    schedule, memplan = plan_graph(rec.graph, use_multi_stream, max_streams, options.arena_limit,
                                   durations)
    if recorded_rule(options):  # the pairs' buffers kept apart, where the limit allows
        memplan = plan_apart(rec.graph, schedule.edges(), memplan,
                             arena_limit_bytes(rec.graph, options.arena_limit))
    seconds["schedule_and_memplan"] = time.perf_counter() - t0 - seconds.get("timing", 0.0)
    say(f"{len(schedule.streams)} streams, {len(schedule.sync_edges)} syncs; arena "
        f"{memplan.arena_bytes / 2**20:.1f} MiB", quiet)
    several = use_multi_stream and len(schedule.streams) > 1
    ranks = kernel_priorities(schedule, durations(), priority_range()) \
        if options.priorities and several else None
    lockstep = communicates(rec.graph)
    if lockstep and several and (options.backfill_on(training) or options.resource_order is True):
        # How many graphs a timed choice launches hangs on each rank's own task times.
        log.info("the graph holds NCCL collectives: the timed choices (tail backfill, "
                 "resource order) are skipped, so that every rank launches alike")
    trials = backfill_trials(rec.graph, schedule, durations()) \
        if options.backfill_on(training) and several and not lockstep else None
    resource_order = False if lockstep and options.resource_order is True \
        else options.resource_order
    ranks, ordering = planned_ordering(resource_order, rec, schedule, durations, ranks,
                                       priority_range())
    return _Planned(rec, schedule, memplan, ranks, trials, seconds, ordering)


def _build(model, planned: _Planned, options: PrepareOptions, region: ArenaRegion,
           first: Prepared | None, quiet: bool) -> Prepared:
    """A bucket built in ``region``: as planned (resource-aware priorities and backfill trials
    timed) for the first instance, with the first instance's priorities and late edges for a
    copy."""
    t0 = time.perf_counter()
    if first is None and planned.trials:
        say(f"timing {sum(map(len, planned.trials.values()))} tail backfill(s) against none",
            quiet)
    if first is None and planned.ordering:
        say(f"timing {len(planned.ordering)} resource-aware priority set(s) against the slack "
            "ones", quiet)
    seconds = planned.seconds if first is None else {}
    prefetch_trials = planned_prefetch(planned.rec.graph, options) if first is None else None
    if prefetch_trials:
        say(f"timing weight prefetch in {len(prefetch_trials)} phase(s) against none", quiet)
    served = first.prefetch if first else served_prefetch(planned.rec.graph, options)
    for r in planned.rec.graph.meta.get("prefetch_l2", []) if first is None and served else ():
        say(f"phase {r['phase']}: {r['windows']} weight prefetch(es) ({r['plan']}) of "
            f"{r['bytes'] / 2**20:.1f} MiB served unmeasured (a graph of collectives)", quiet)
    programmatic = planned_programmatic(planned.rec.graph, planned.schedule, planned.memplan,
                                        options, first)
    if programmatic.trials:
        say(f"timing programmatic edges in {len(programmatic.trials)} phase(s) against none",
            quiet)
    built = build_prepared(model, planned.rec, planned.schedule, planned.memplan,
                           device_launch=device_launch_allowed(options.device_launch),
                           gather_inputs=options.gather_inputs, seconds=seconds,
                           priorities=first.priorities if first else planned.priorities,
                           backfill_trials=planned.trials if first is None else None,
                           region=region, late_edges=first.late_edges if first else (),
                           priority_trials=planned.ordering if first is None else (),
                           prefetch_trials=prefetch_trials,
                           prefetch=served, programmatic=programmatic)
    seconds["build"] = time.perf_counter() - t0
    if first is not None:
        built.backfill = first.backfill
    for r in built.graph.meta.get("resource_order", []) if first is None else ():
        say(f"phase {r['phase']}: {r['plain_ms']:.3f} ms per launch with slack priorities, "
            + ", ".join(f"{t['ms']:.3f} {t['rule']}" for t in r["trials"])
            + f"; kept {r['kept'] or 'the slack ones'}", quiet)
    for r in built.graph.meta.get("prefetch_l2", []) if prefetch_trials else ():
        say(f"phase {r['phase']}: {r['plain_ms']:.3f} ms per launch plain, "
            f"{r['prefetch_ms']:.3f} with {r['windows']} weight prefetch(es) "
            f"({r.get('plan', 'windows')}) of "
            f"{r['bytes'] / 2**20:.1f} MiB; " + ("kept" if r["kept"] else "kept none"), quiet)
    for r in built.graph.meta.get("programmatic", []) if programmatic.trials else ():
        say(f"phase {r['phase']}: {r['plain_ms']:.3f} ms per launch plain, "
            f"{r['programmatic_ms']:.3f} with {r['edges']} programmatic edge(s); "
            + ("kept" if r["kept"] else "kept none"), quiet)
    for p in built.backfill if first is None else ():
        say(f"phase {p.phase}: {p.plain_ms:.3f} ms per launch plain, "
            + ", ".join(f"{ms:.3f}" for ms in p.trial_ms) + " with backfill; "
            + (f"kept {len(p.kept.deferred)} edge(s)" if p.kept else "kept none"), quiet)
    return built


def _prove(candidate: Prepared, planned: _Planned, options: PrepareOptions, training: bool,
           quiet: bool) -> None:
    """The full proof of a bucket's first build (warns where device launch was refused)."""
    refusal = next((b.device_launch_refusal for b in candidate.builts
                    if b.device_launch_refusal), "")
    refusal = refusal_reason(planned.rec.graph, refusal)
    if refusal:
        # stacklevel: the warning names the line that called Nimble.prepare.
        warnings.warn(
            "the graph could not be made device-launchable, so each call pays the "
            f"driver's full host launch cost: {refusal}", RuntimeWarning, stacklevel=4)
    if options.verify:
        relaunches = options.proof_launches(training)
        t0 = time.perf_counter()
        say(f"verifying: {relaunches} launches against the single-stream recording"
            + (", then launches with random delays (the race fuzzer)" if options.fuzz else ""),
            quiet)
        progress = ProofProgress()
        try:
            prove(candidate, planned.rec, relaunches, fuzz=options.fuzz, progress=progress)
        except Exception as e:
            fault = driver.context_fault()
            if fault is not None:
                raise fault_error(planned.rec.graph, fault, progress.stage, e) from e
            if isinstance(e, VerificationError):
                raise mismatch_error(planned.rec.graph, e, one_order(planned.schedule)) from e
            raise
        candidate.seconds["verify"] = time.perf_counter() - t0


#: Where :func:`saved_recording` saves the recording of a graph that failed its proof or faulted
#: in it (the system's temporary folder when unset).
FAULT_DIR_VARIABLE = "NIMBLE_FAULT_DIR"


def saved_recording(graph, what: str) -> str | None:
    """``graph`` saved to ``$NIMBLE_FAULT_DIR`` (or the temporary folder) as
    ``nimble-<what>-<model>-<pid>.json.gz`` for a bug report: the file's path, or None where it
    could not be written (logged either way)."""
    folder = os.environ.get(FAULT_DIR_VARIABLE) or tempfile.gettempdir()
    name = _model_name(graph)
    path = os.path.join(folder, f"nimble-{what}-{name}-{os.getpid()}.json.gz")
    try:
        graph.save(path)
    except OSError as e:
        log.warning("could not save the recording of %s to %s: %s", name, path, e)
        return None
    log.warning("the recording of %s, whose rebuilt graph failed its proof, is saved to %s",
                name, path)
    return path


def _model_name(graph) -> str:
    # a name a shell, a bug tracker and a file copy take as one word: "PrefillStep (compiled)"
    # becomes "PrefillStep_compiled"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(graph.meta.get("model", "model"))).strip("_") \
        or "model"


def one_order(schedule: Schedule) -> bool:
    """Whether every phase of ``schedule`` runs its tasks on one stream, in one order."""
    return all(len({schedule.stream_of[t] for t in span}) <= 1
               for span in phase_spans(schedule.phases, len(schedule.stream_of)))


def mismatch_error(graph, cause: VerificationError, one_stream: bool) -> VerificationError:
    """``cause`` (a rebuilt graph's outputs differ from the recording's) with the recording
    saved for a bug report; on a graph that runs each phase in one order (``one_stream``), the
    likelier cause named, since no two tasks ran unordered there."""
    path = saved_recording(graph, "mismatch")
    likelier = (" This graph runs each phase on one stream, so no two of its tasks ran "
                "unordered: a parameter word relocated that is no pointer, or a pointer kept as "
                "recorded, is the likelier cause." if one_stream else "")
    kept = (f" Its recording is saved to {path} (nimble inspect reads it): attach it to a bug "
            "report." if path else "")
    return VerificationError(f"{cause}{likelier}{kept}", path)


def fault_error(graph, fault: str, stage: str, cause: BaseException) -> GraphFaultError:
    """The error for a proof that ended in a kernel fault, shown during ``stage``: the recording
    saved to ``$NIMBLE_FAULT_DIR`` (or the temporary folder) for a bug report, and what to do."""
    name = _model_name(graph)
    path = saved_recording(graph, "fault")
    kept = f"; its recording is saved to {path} (nimble inspect reads it)" if path else ""
    return GraphFaultError(
        f"a kernel faulted with {fault} while the rebuilt graph of {name} was being proven "
        f"(shown during {stage}: {type(cause).__name__}), and the CUDA context of this process "
        f"is lost: no further GPU work can run in it. Restart the process{kept}", fault, path,
        stage)


def _check_pad_outputs(planned: _Planned, k: int) -> None:
    inputs = shapes_of(planned.rec.static_inputs)
    outputs = tuple(tuple(r.shape) for r in planned.rec.graph.outputs)
    if check_pad_shapes(outputs, f"outputs of bucket {k}") != inputs[0][0]:
        raise InputError(f"pad=True needs the batch on dim 0 of every output; bucket {k}'s "
                         f"inputs {list(inputs)} give outputs {list(outputs)}: prepare "
                         "without pad")


def prepare_serving(model, examples: list, *, instances: int, pad: bool, training: bool,
                    use_multi_stream: bool, max_streams: int | None, options: PrepareOptions,
                    quiet: bool, average=None) -> Serving:
    """Every bucket of ``examples`` (one example each) on ``instances`` model instances,
    recorded, planned, built and proven in stages (see the module docstring).

    The caller checks the arguments (:func:`nimble.engine.serving.bucket_examples`) and the
    model's mode (:func:`check_mode`) and puts its state back afterwards (:func:`saved_state`).
    A failure frees everything built so far and raises.
    """
    began = time.perf_counter()
    if options.recording is not None and len(examples) > 1:
        raise InputError("PrepareOptions(recording=...) holds one recording, of one shape: "
                         "prepare one bucket with it, or leave it out to record every bucket")
    report = PrepareReport()
    priority_range = functools.cache(driver.stream_priority_range)
    planned: list[_Planned] = []
    built: list[list[Prepared]] = []
    arenas: list[driver.DeviceMemory] = []
    orders: list[CallOrder] = []
    try:
        for k, example in enumerate(examples):
            planned.append(_plan(model, example, training, use_multi_stream, max_streams,
                                 options, quiet, priority_range, average))
            check_instances(planned[-1].rec.graph, instances)
            if pad:
                _check_pad_outputs(planned[-1], k)
        layout = shared_layout([p.rec.graph for p in planned], [p.memplan for p in planned])
        for j in range(instances):
            t0 = time.perf_counter()
            arenas.append(driver.DeviceMemory.allocate(layout.size))
            orders.append(CallOrder())
            report.arena_seconds += time.perf_counter() - t0
            row: list[Prepared] = []
            built.append(row)
            for k, (p, state) in enumerate(zip(planned, layout.states)):
                row.append(_build(model, p, options, ArenaRegion(arenas[j], state, orders[j]),
                                  built[0][k] if j else None, quiet))
            for k, (p, candidate) in enumerate(zip(planned, row)):
                if j == 0:
                    _prove(candidate, p, options, training, quiet)
                else:
                    report.instances.append(_prove_instance(candidate, p, options, j, quiet))
    except BaseException:
        close_partial(built, arenas, orders)
        raise
    buckets = [Bucket(shapes_of(p.rec.static_inputs), [row[k] for row in built])
               for k, p in enumerate(planned)]
    keep_owners([bucket.instances[0] for bucket in buckets])
    for bucket in buckets:  # a copy launches the kernels of the graph it copies
        for copy in bucket.instances[1:]:
            copy.kernel_owners = list(bucket.instances[0].kernel_owners)
            copy.kernel_facts = bucket.instances[0].kernel_facts
    for bucket, p in zip(buckets, planned):
        first = bucket.instances[0]
        first.recording = p.rec if options.keep_recording else None
        first.graph.meta["prepare_seconds"] = dict(first.seconds)
        # "verify" is the whole proof, which verify_served and verify_fuzz divide between them
        stages = {k: v for k, v in first.seconds.items()
                  if k != "verify" or "verify_served" not in first.seconds}
        report.buckets.append(BucketCost(bucket.input_shapes, stages))
    report.total = time.perf_counter() - began
    return Serving(buckets, arenas, layout, pad, report)


#: Poisoned launches of the proof of a further instance (a relocated copy of a proven graph).
INSTANCE_PROOF_LAUNCHES = 4


def _prove_instance(copy: Prepared, planned: _Planned, options: PrepareOptions, instance: int,
                    quiet: bool) -> InstanceCost:
    proof, launches = 0.0, 0
    if options.verify:
        t0 = time.perf_counter()
        say(f"instance {instance}: {INSTANCE_PROOF_LAUNCHES} launches against the recording",
            quiet)
        launches = prove_copy(copy, planned.rec, INSTANCE_PROOF_LAUNCHES)["launches"]
        proof = time.perf_counter() - t0
    return InstanceCost(instance, shapes_of(planned.rec.static_inputs), copy.seconds["build"],
                        proof, launches)
