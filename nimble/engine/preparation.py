"""What ``Nimble.prepare`` runs: check the model's mode, record (or reuse a recording), schedule
and plan, time what the options ask for, build, and prove.

:func:`prepare_engine` returns a new :class:`~nimble.engine.prepared.Prepared` and leaves the one
serving calls alone; :func:`saved_state` puts back what preparing changes in the model and the
random generator.
"""
from __future__ import annotations

import functools
import time
import warnings
from typing import Callable

from ..errors import InputError
from ..progress import say
from .options import PrepareOptions
from .profiler_guard import device_launch_allowed
from .prepared import (Prepared, backfill_trials, build_prepared, kernel_priorities, plan_graph,
                       prove, task_times)
from .priority_trials import resource_trials


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
        return
    if isinstance(model, torch.nn.Module):
        in_training = [name or type(m).__name__ for name, m in model.named_modules()
                       if m.training]
        if in_training:
            raise InputError(
                f"the model is in training mode ({len(in_training)} module(s), e.g. "
                f"'{in_training[0]}'), but prepare(training=False) records inference: call "
                "model.eval() first (batch norm and dropout behave differently in training)")


def _recording(model, example_inputs, training: bool, options: PrepareOptions, quiet: bool):
    """The recording to build from: the one passed in, or one made now."""
    import torch

    from ..record.recorder import record, record_step

    rec = options.recording
    if rec is None:
        if training:
            rec = record_step(model, example_inputs, quiet=quiet)
        else:
            with torch.no_grad():
                rec = record(model, example_inputs, quiet=quiet)
    if (rec.step is not None) != training:
        raise InputError("the recording passed to prepare() is of "
                         f"{'a training step' if rec.step else 'inference'}, but "
                         f"training={training}")
    return rec


def prepare_engine(model, example_inputs, *, training: bool, use_multi_stream: bool,
                   max_streams: int | None, options: PrepareOptions, quiet: bool) -> Prepared:
    """Record (or reuse ``options.recording``), schedule, plan, build and prove a new graph.

    The caller checks the model's mode (:func:`check_mode`) and puts its state back afterwards
    (:func:`saved_state`).  A failure frees what was built and raises.
    """
    rec = _recording(model, example_inputs, training, options, quiet)
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
    seconds["schedule_and_memplan"] = time.perf_counter() - t0 - seconds.get("timing", 0.0)
    say(f"{len(schedule.streams)} streams, {len(schedule.sync_edges)} syncs; arena "
        f"{memplan.arena_bytes / 2**20:.1f} MiB", quiet)

    several = use_multi_stream and len(schedule.streams) > 1
    ranks = kernel_priorities(schedule, durations()) if options.priorities and several else None
    trials = backfill_trials(rec.graph, schedule, durations()) \
        if options.backfill_on(training) and several else None
    ordering = resource_trials(rec.graph, schedule, durations()) \
        if options.resource_order and ranks is not None else []
    t0 = time.perf_counter()
    if trials:
        say(f"timing {sum(map(len, trials.values()))} tail backfill(s) against none", quiet)
    if ordering:
        say(f"timing {len(ordering)} resource-aware priority set(s) against the slack ones", quiet)
    candidate = build_prepared(model, rec, schedule, memplan,
                               device_launch=device_launch_allowed(options.device_launch),
                               gather_inputs=options.gather_inputs,
                               seconds=seconds, priorities=ranks, backfill_trials=trials,
                               priority_trials=ordering)
    seconds["build"] = time.perf_counter() - t0
    for r in rec.graph.meta.get("resource_order", []):
        say(f"phase {r['phase']}: {r['plain_ms']:.3f} ms per launch with slack priorities, "
            + ", ".join(f"{t['ms']:.3f} {t['rule']}" for t in r["trials"])
            + f"; kept {r['kept'] or 'the slack ones'}", quiet)
    for p in candidate.backfill:
        say(f"phase {p.phase}: {p.plain_ms:.3f} ms per launch plain, "
            + ", ".join(f"{ms:.3f}" for ms in p.trial_ms) + " with backfill; "
            + (f"kept {len(p.kept.deferred)} edge(s)" if p.kept else "kept none"), quiet)
    try:
        refusal = next((b.device_launch_refusal for b in candidate.builts
                        if b.device_launch_refusal), "")
        if refusal:
            # stacklevel: the warning names the line that called Nimble.prepare.
            warnings.warn(
                "the graph could not be made device-launchable, so each call pays the "
                f"driver's full host launch cost: {refusal}", RuntimeWarning, stacklevel=3)
        if options.verify:
            relaunches = options.proof_launches(training)
            t0 = time.perf_counter()
            say(f"verifying: {relaunches} launches against the single-stream recording"
                + (", then launches with random delays (the race fuzzer)" if options.fuzz else ""),
                quiet)
            prove(candidate, rec, relaunches, fuzz=options.fuzz)
            seconds["verify"] = time.perf_counter() - t0
    except BaseException:
        candidate.close()
        raise
    candidate.recording = rec if options.keep_recording else None
    return candidate
