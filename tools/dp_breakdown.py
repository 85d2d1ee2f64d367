"""Where the time of a data-parallel training step goes on the GPU (issue 51), per mode.

    torchrun --nproc_per_node=N tools/dp_breakdown.py [MODEL] [--batch 32] [--steps 10]
        [--bucket-mib 4] [--graph-mixing] [--json F]

``tools/dp_bench.py`` says how much slower a step with its gradients averaged is than the same
step alone; this says why.  Each rank prepares the model's SGD step (as ``dp_bench.py`` does:
:func:`nimble.cli.train_bench.setup` and ``training_step``) three ways: ``local`` (no
averaging), ``average`` (``average_gradients=True``, DDP's bucket sizes) and ``average small``
(``--bucket-mib`` buckets), runs each under ``torch.profiler`` for ``--steps`` steps after a
warm-up, and rank 0 prints, per step, from the kernels' intervals in the trace:

- ``wall``: first kernel's start to last kernel's end, over the steps;
- ``busy``: time some kernel runs; ``idle``: ``wall`` less ``busy`` (host work, launches,
  waits between graphs, and nodes that are not kernels);
- ``compute``: time some kernel other than NCCL's runs, and the sum of those kernels' own
  durations (beside ``local``'s, what sharing the SMs with NCCL costs);
- ``nccl``: time some NCCL kernel runs, and its kernels per step; ``exposed``: time only NCCL
  kernels run (``busy`` less ``compute``);
- how the step's graphs (forward, backward) are launched: from the device, or by the host.

The profiler slows the host, so ``wall`` and ``idle`` are longer than in ``dp_bench.py``; hold
the modes against each other.  Multicast stays off, and so does NCCL's graph mixing support
(``NCCL_GRAPH_MIXING_SUPPORT=0``, whose event nodes make a graph with collectives
host-launched) unless ``--graph-mixing`` keeps it.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
from gpu_suite import start_rank  # tools/ is a script's first path entry


def covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, start, end = 0.0, None, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total + (end - start if end is not None else 0.0)


@dataclass(frozen=True)
class Breakdown:
    """Per step, in µs (see the module docstring)."""

    wall: float
    busy: float
    idle: float
    compute: float
    compute_kernel_sum: float
    nccl: float
    nccl_kernels: float
    exposed: float


def breakdown(kernels: list[tuple[str, float, float]], steps: int) -> Breakdown:
    """The :class:`Breakdown` of ``kernels`` (``(name, start µs, duration µs)``) spread over
    ``steps`` steps."""
    if not kernels:
        raise ValueError("the trace holds no kernel: was the profiler's CUDA activity on?")
    spans = [(s, s + d) for _, s, d in kernels]
    comm = [(s, s + d) for name, s, d in kernels if _nccl(name)]
    comp = [(s, s + d) for name, s, d in kernels if not _nccl(name)]
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    busy, compute, nccl = covered(spans), covered(comp), covered(comm)
    return Breakdown(wall=wall / steps, busy=busy / steps, idle=(wall - busy) / steps,
                     compute=compute / steps,
                     compute_kernel_sum=sum(e - s for s, e in comp) / steps,
                     nccl=nccl / steps, nccl_kernels=len(comm) / steps,
                     exposed=(busy - compute) / steps)


def _nccl(name: str) -> bool:
    return "nccl" in name.lower()


def kernels_of(trace: dict) -> list[tuple[str, float, float]]:
    """``(name, start, duration)`` of every kernel of a chrome trace ``torch.profiler`` wrote."""
    return [(e["name"], float(e["ts"]), float(e["dur"])) for e in trace.get("traceEvents", [])
            if e.get("cat") == "kernel"]


def line(mode: str, b: Breakdown) -> str:
    return (f"{mode:<14} wall {b.wall:7.0f} us  busy {b.busy:7.0f}  idle {b.idle:7.0f}  "
            f"compute {b.compute:7.0f} (kernels {b.compute_kernel_sum:.0f})  nccl {b.nccl:6.0f} "
            f"in {b.nccl_kernels:.0f} kernels  exposed {b.exposed:5.0f}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="resnet50")
    p.add_argument("--batch", type=int, default=32, help="images per GPU")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--bucket-mib", type=int, default=4, help="the small buckets' size")
    p.add_argument("--graph-mixing", action="store_true",
                   help="keep NCCL's graph mixing support")
    p.add_argument("--json", help="also write the rows here (rank 0)")
    return p.parse_args(argv)


def _steps(args, rank: int) -> dict:
    """Per mode, ``(its step, how its graphs are launched)``."""
    import nimble
    from dp_bench import launch_modes
    from nimble.cli.train_bench import setup, training_step
    from nimble.record.gradient_average import GradientAverage

    base, x, y = setup(args.model, args.batch)
    ways = {"local": None, "average": True,
            "average small": GradientAverage(bucket_bytes=args.bucket_mib << 20)}
    steps = {}
    for mode, average in ways.items():
        model = copy.deepcopy(base)
        nm = nimble.Nimble(model).prepare(x, training=True, average_gradients=average,
                                          quiet=rank != 0)
        steps[mode] = (training_step(nm, model, x, y), launch_modes(nm))
    return steps


def _profiled(step, steps: int, rank: int) -> Breakdown:
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"trace_{rank}.json"
        prof.export_chrome_trace(str(path))
        return breakdown(kernels_of(json.loads(path.read_text())), steps)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world = start_rank(args.graph_mixing)
    rows, launches = {}, {}
    for mode, (step, launches[mode]) in _steps(args, rank).items():
        rows[mode] = _profiled(step, args.steps, rank)
        if rank == 0:
            print(f"{line(mode, rows[mode])}  launched {'/'.join(launches[mode])}", flush=True)
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(
            {"model": args.model, "world": world, "batch_per_gpu": args.batch,
             "graph_mixing": args.graph_mixing, "launch": launches,
             "modes": {m: asdict(b) for m, b in rows.items()}}, indent=1))
    sys.stdout.flush()
    os._exit(0)  # after captured collectives, destroying the process group can hang


if __name__ == "__main__":
    raise SystemExit(main())
