"""How long a clean first-divergence walk takes, and how many ops it judged alone.

    python3 tools/experiments/compare_time.py nasnetalarge:float16 nasnetalarge:float32 \\
        resnet50:float32

For each ``MODEL:DTYPE``: prepare, then ``nm.first_divergence(x)`` on the example input, timed,
with the count of ops whose drift from the eager chain sent them to
``nimble.debug.divergence.isolated_difference``.
"""
import sys
import time

import torch

import nimble
import nimble.debug.divergence as divergence
from nimble.cli import models
from nimble.driver.gpu import use_cudnn_benchmark

use_cudnn_benchmark()
for spec in sys.argv[1:]:
    name, dt = spec.split(":")
    dtype = getattr(torch, dt)
    model = models.create(name).cuda().to(dtype).eval()
    x = models.example_input(name).to(dtype)
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=2))
    judged = []
    real = divergence.isolated_difference

    def counted(op, before, after):
        judged.append(op.index)
        return real(op, before, after)
    divergence.isolated_difference = counted
    try:
        t0 = time.perf_counter()
        found = nm.first_divergence(x, quiet=True)
        seconds = time.perf_counter() - t0
    finally:
        divergence.isolated_difference = real
    print(f"{name} {dt}: compare {seconds:.1f} s over {len(nm.graph.ops)} ops, "
          f"{len(judged)} judged alone, found {found}", flush=True)
    nm.close()
