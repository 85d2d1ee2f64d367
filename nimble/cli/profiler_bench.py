"""``nimble bench --profiler``: Nimble's graphs before and after a torch profiler run (issue 36).

A ``torch.profiler`` run of CUDA activity can change how the driver runs graphs for the rest of
the process.  Per model, in one process:

1. capture ``torch.cuda.graph`` (its input copied in on every call, as in ``nimble bench``) and
   prepare every kind of :data:`KINDS`: Nimble multi-stream with the default options, the same
   with ``device_launch=False``, Nimble single-stream;
2. time them all (``before``);
3. run ``torch.profiler.profile(activities=[CPU, CUDA], with_stack=True)`` over one eager forward;
4. time the same objects again (``after``);
5. capture and prepare fresh ones of each kind and time old and fresh together
   (``after, again`` and ``prepared after``).

Every timing is :func:`~nimble.cli.harness.time_rounds` (``--rounds`` rounds of ``--iters``
calls, the modes' order changing from round to round).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from . import models
from .common import Fail
from .harness import (Column, format_table, mode_rows, run_models, time_rounds, to_dtype,
                      torch_graph_call, write_results)
from ..driver.gpu import use_cudnn_benchmark
from ..progress import say

GRAPH = "torch.cuda.graph"
#: The label suffix of the objects prepared after the profiler ran.
FRESH = " (prepared after)"


@dataclass(frozen=True)
class NimbleKind:
    """A Nimble graph the mode times: its row label and how it is prepared."""
    label: str
    multi_stream: bool
    device_launch: bool


KINDS = (NimbleKind("nimble multi", True, True),
         NimbleKind("nimble multi, host launch", True, False),
         NimbleKind("nimble single", False, True))

#: Every row of the table, in order.
MODES = (GRAPH, *(k.label for k in KINDS))


def prepare_kinds(model, x) -> dict:
    """A prepared ``Nimble`` of every kind in :data:`KINDS`, by label: the first records the
    model, the others reuse its recording.  Nothing is left open if one fails."""
    import nimble

    prepared: dict = {}
    recording = None
    try:
        for kind in KINDS:
            options = nimble.PrepareOptions(device_launch=kind.device_launch,
                                            keep_recording=recording is None,
                                            recording=recording)
            nm = nimble.Nimble(model).prepare(x, use_multi_stream=kind.multi_stream,
                                              options=options)
            prepared[kind.label] = nm
            if recording is None:
                recording = nm.recording
    except BaseException:
        close_all(prepared)
        raise
    return prepared


def close_all(prepared: dict) -> None:
    for nm in prepared.values():
        nm.close()


def profile_one_forward(model, x) -> float:
    """Seconds of one eager forward (no autograd) under ``torch.profiler.profile`` with CPU and
    CUDA activities and Python stacks, as issue 36 ran it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                  with_stack=True):
        model(x)
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _graph_and_kinds(model, x, prepared: dict, suffix: str = "") -> dict[str, Callable]:
    """Calls of a fresh ``torch.cuda.graph`` and of a fresh Nimble of every kind (added to
    ``prepared`` under their labels + ``suffix``, for the caller to close)."""
    calls = {GRAPH + suffix: torch_graph_call(model, x)}
    for label, nm in prepare_kinds(model, x).items():
        prepared[label + suffix] = nm
        calls[label + suffix] = (lambda nm=nm: nm(x))
    return calls


def compare(before: dict, after: dict, again: dict) -> dict[str, dict]:
    """Per mode of :data:`MODES`, its median ms before the profiler, after it, once more after
    it, and of the one prepared after it, with the ratios to ``before`` (``before``, ``after``
    and ``again`` are :func:`~nimble.cli.harness.mode_rows` of the three timings)."""
    rows = {}
    for label in MODES:
        base = before[label]["median_ms"]
        after_ms, fresh_ms = after[label]["median_ms"], again[label + FRESH]["median_ms"]
        rows[label] = {"before_ms": base, "after_ms": after_ms,
                       "after_over_before": after_ms / base,
                       "after_again_ms": again[label]["median_ms"],
                       "prepared_after_ms": fresh_ms,
                       "prepared_after_over_before": fresh_ms / base}
    return rows


def bench_profiler(name: str, args, dtype: str = "float32") -> dict:
    """The before / after numbers of ``name`` in ``dtype`` at ``args.batch``."""
    use_cudnn_benchmark()
    model, x = to_dtype(models.create(name).cuda(), models.example_input(name, args.batch), dtype)
    info: dict = {"model": name, "dtype": dtype, "batch": args.batch, "rounds": args.rounds,
                  "iters": args.iters}

    def step(what: str) -> None:
        say(f"{name} ({dtype}): {what}", args.quiet, "bench")

    prepared: dict = {}
    try:
        step("capturing torch.cuda.graph; preparing Nimble multi, multi host-launch, single")
        calls = _graph_and_kinds(model, x, prepared)
        info["launch_modes"] = {label: nm.launch_mode for label, nm in prepared.items()}
        step(f"timing {len(calls)} modes before the profiler")
        before = mode_rows(time_rounds(calls, args.rounds, args.iters))
        step("torch.profiler (CPU and CUDA, with_stack) over one eager forward")
        info["profiler_seconds"] = profile_one_forward(model, x)
        step(f"timing the same {len(calls)} modes after the profiler")
        after = mode_rows(time_rounds(calls, args.rounds, args.iters))
        # Nimble rebuilds device-launchable graphs for host launch once a profiler ran
        # (nimble.engine.profiler_guard): say which each one runs now.
        info["launch_modes_after"] = {label: nm.launch_mode for label, nm in prepared.items()}
        step("capturing and preparing fresh ones after the profiler")
        calls.update(_graph_and_kinds(model, x, prepared, FRESH))
        step(f"timing {len(calls)} modes, old and fresh")
        again = mode_rows(time_rounds(calls, args.rounds, args.iters))
    finally:
        close_all(prepared)
    info.update(timings={"before": before, "after": after, "after_again": again},
                modes=compare(before, after, again))
    return info


_COLUMNS = [Column("mode", 28, left=True), Column("before ms", 10), Column("after ms", 10),
            Column("after/before", 13), Column("prepared-after ms", 18), Column("/before", 8)]


def format_result(info: dict) -> str:
    """One model's table: a row per mode of :data:`MODES`."""
    head = (f"{info['model']} ({info['dtype']}, batch {info['batch']}): torch.profiler over one "
            f"eager forward took {info['profiler_seconds']:.2f} s")
    rows = [[label, f"{r['before_ms']:.3f}", f"{r['after_ms']:.3f}",
             f"{r['after_over_before']:.3f}", f"{r['prepared_after_ms']:.3f}",
             f"{r['prepared_after_over_before']:.3f}"] for label, r in info["modes"].items()]
    legend = (f"median ms per call of {info['rounds']} rounds of {info['iters']} calls; before / "
              "after: the same objects before and after the profiler ran; prepared-after: a "
              "fresh one captured or prepared after it (timed beside the old ones once more)")
    return head + "\n" + format_table(_COLUMNS, rows, legend)


def run(args) -> int:
    """``nimble bench --profiler``."""
    if args.training:
        raise Fail("bench: --profiler times inference calls; leave out --training")
    outcome, out = run_models(args, "bench --profiler", bench_profiler, format_result)
    write_results(args, out, outcome, "bench --profiler results", profiler=True)
    return outcome.status
