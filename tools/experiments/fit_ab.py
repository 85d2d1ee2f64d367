"""Fitting into the arena limit, side by side in one process (GPU): the stream cap alone,
workspace chains at fixed thresholds, prepare's own choice, and no limit at all.

    python3 tools/experiments/fit_ab.py MODEL BATCH [THRESHOLD_MB ...]

Times a full SGD training step (as ``nimble bench --training`` takes it) of
``make_graphed_callables`` and of Nimble multi-stream with each way of fitting the schedule
(default thresholds 32 and 64 MB).  Median ms of 5 rounds × 10 steps, three repeats; the last
column is the speed-up over ``make_graphed_callables``.
"""
from __future__ import annotations

import copy
import sys

import torch

import nimble
import nimble.engine.prepared
from nimble.analysis import arena_fit
from nimble.cli import train_bench
from nimble.cli.harness import time_rounds
from nimble.driver.gpu import use_cudnn_benchmark
from nimble.analysis.deps import build_dag


def fixed_chain(threshold: int | None):
    """A ``schedule_within`` that chains at ``threshold`` bytes (None: the cap alone) in the
    phases the cap alone had to narrow, then runs the cap search."""
    def schedule_within(graph, max_streams, arena_limit, durations=None):
        dag = build_dag(graph)
        alone = arena_fit.capped_schedule(graph, dag, max_streams, arena_limit)
        if threshold is None or not alone.lowered:
            return alone.schedule, alone.plan
        chained, _ = arena_fit.chain_workspaces(graph, dag, threshold, phases=alone.lowered)
        tried = arena_fit.capped_schedule(graph, chained, max_streams, arena_limit)
        return tried.schedule, tried.plan
    return schedule_within


def main() -> int:
    name, batch = sys.argv[1], int(sys.argv[2])
    thresholds = [int(t) for t in sys.argv[3:]] or [32, 64]
    use_cudnn_benchmark()
    base, x, y = train_bench.setup(name, batch)
    graphed_model = copy.deepcopy(base)
    graphed = torch.cuda.make_graphed_callables(graphed_model, (x,))
    steps = {"make_graphed_callables": train_bench.training_step(graphed, graphed_model, x, y)}
    variants = [("cap alone", fixed_chain(None), {})]
    variants += [(f"chain >= {t} MB", fixed_chain(t << 20), {}) for t in thresholds]
    variants += [("prepare's choice", None, {}),
                 ("no arena limit", None, {"options": nimble.PrepareOptions(arena_limit=None)})]
    own = nimble.engine.prepared.schedule_within
    for label, patched, kwargs in variants:
        nimble.engine.prepared.schedule_within = patched or own
        try:
            model = copy.deepcopy(base)
            nm = nimble.Nimble(model).prepare(x, training=True, **kwargs)
        finally:
            nimble.engine.prepared.schedule_within = own
        print(f"{label:<24}{len(nm.schedule.streams):4d} streams, arena "
              f"{nm.memplan.arena_bytes / 2**20:.0f} MB", flush=True)
        steps[label] = train_bench.training_step(nm, model, x, y)
    for repeat in range(3):
        samples = time_rounds(steps, 5, 10)
        medians = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
        base_ms = medians["make_graphed_callables"]
        for label, ms in medians.items():
            print(f"{name} batch {batch} repeat {repeat} {label:<24}{ms:9.3f} ms"
                  f"  x{base_ms / ms:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
