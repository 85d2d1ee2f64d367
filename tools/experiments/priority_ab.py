"""Kernel priorities and the tail backfill on and off, side by side in one process (GPU).

    python3 tools/experiments/priority_ab.py MODEL BATCH {train,infer} [DTYPE]

Times Nimble single-stream, multi-stream without kernel priorities
(``PrepareOptions(priorities=False)``), without the tail backfill
(``PrepareOptions(backfill=False)``; it is on by default in training) and the default (both on)
against
``make_graphed_callables`` (train: a full SGD step as ``nimble bench --training`` takes it) or
``torch.cuda.graph`` with the input copied in (infer).  Median ms of the rounds, CUDA events,
warm-up first; the last column is the speed-up over torch's graph.
"""
from __future__ import annotations

import copy
import sys

import torch

import nimble
from nimble.cli import models
from nimble.cli import train_bench
from nimble.cli.bench import torch_graph_call
from nimble.cli.harness import time_rounds
from nimble.driver.gpu import use_cudnn_benchmark

VARIANTS = [("single", {"use_multi_stream": False}),
            ("multi, no priorities", {"options": nimble.PrepareOptions(priorities=False)}),
            ("multi, no backfill", {"options": nimble.PrepareOptions(backfill=False)}),
            ("multi, default", {})]


def main() -> int:
    name, batch, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dtype = getattr(torch, sys.argv[4] if len(sys.argv) > 4 else "float32")
    use_cudnn_benchmark()
    steps = {}
    if kind == "train":
        base, x, y = train_bench.setup(name, batch)
        graphed_model = copy.deepcopy(base)
        graphed = torch.cuda.make_graphed_callables(graphed_model, (x,))
        steps["torch graph"] = train_bench.training_step(graphed, graphed_model, x, y)
        for label, kw in VARIANTS:
            model = copy.deepcopy(base)
            nm = nimble.Nimble(model).prepare(x, training=True, **kw)
            steps[label] = train_bench.training_step(nm, model, x, y)
        rounds, iters = 5, 10
    else:
        model = models.create(name).cuda().eval().to(dtype)
        x = models.example_input(name, batch).to(dtype)
        steps["torch graph"] = torch_graph_call(model, x)
        for label, kw in VARIANTS:
            nm = nimble.Nimble(model).prepare(x, **kw)
            steps[label] = (lambda nm=nm: nm(x))
        rounds, iters = 7, 50
    samples = time_rounds(steps, rounds, iters)
    medians = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    for label, v in samples.items():
        print(f"{name} batch {batch} {kind} {str(dtype).removeprefix('torch.')} {label:<22}"
              f"{medians[label]:9.3f} ms ({min(v):.3f}-{max(v):.3f})"
              f"  x{medians['torch graph'] / medians[label]:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
