"""Data-parallel training step, side by side on every rank (several GPUs, under torchrun).

    torchrun --nproc_per_node=N tools/dp_bench.py [MODEL ...] [--batch 32] [--rounds 5]
        [--iters 10] [--graph-mixing]

Per model (default resnet50 at CIFAR-10's 32² with 10 classes, as the paper's training table
takes it, and inception_v3 at 299²; :func:`nimble.cli.train_bench.setup`), ``--batch`` images
per GPU, each rank times one SGD step (momentum 0.9, cross-entropy) in every mode, modes
interleaved in rounds (:func:`nimble.cli.harness.time_rounds`, the same order on every rank):

- ``ddp``: ``DistributedDataParallel`` eager;
- ``ddp graphed``: DDP around ``torch.cuda.make_graphed_callables`` of the model (its all-reduce
  eager, from DDP's hooks);
- ``nimble``: ``prepare(training=True, average_gradients=True)``, the all-reduce inside the
  backward graph;
- ``nimble ddp``: the ``DistributedDataParallel`` of ``ddp`` (DDP's defaults) called through
  ``nimble.Nimble(ddp).prepare(x, training=True)``, the unchanged DDP script: the same
  averaging, and DDP's buffer broadcast from rank 0 inside the forward graph;
- ``nimble local``: the same step prepared without averaging: what a GPU alone takes for it;
- ``all-reduce``: the bucketed averaging of every gradient alone (the copies into buckets, the
  divide, the all-reduces), captured in a CUDA graph and replayed: its GPU time, what the
  backward graph has to hide (timed eagerly it is host-bound: many times its GPU time).

Rank 0 prints, per mode, the median ms per step with the rounds' spread, the images per second
of all ranks together, and Nimble's speed-up over ``ddp``; then Nimble's scaling efficiency
(``nimble local`` / ``nimble``: the step on N GPUs against the same step on one, per-GPU batch
held) and how much of the all-reduce is hidden behind compute (1 - (``nimble`` - ``nimble
local``) / ``all-reduce``); the same three for ``nimble ddp`` (keys ending ``_ddp_wrapped``,
its buffer broadcast counted as exposed).  Run with ``--nproc_per_node=1`` too for the one-GPU
rows.

NCCL's graph mixing support is off (``NCCL_GRAPH_MIXING_SUPPORT=0``, set before the process
group) unless ``--graph-mixing`` keeps it: its event nodes around each captured collective make
the driver refuse a device-launchable graph, so Nimble's graphs with all-reduces are then
host-launched.  Each Nimble row says how its graphs (forward, backward) are launched.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
from gpu_suite import start_rank  # tools/ is a script's first path entry

DEFAULT_MODELS = ["resnet50", "inception_v3"]
MODES = ("ddp", "ddp graphed", "nimble", "nimble local", "nimble ddp", "all-reduce")
#: Nimble's rows and the suffix of their derived keys.
NIMBLE_ROWS = (("nimble", ""), ("nimble ddp", "_ddp_wrapped"))


def derived(rows: dict[str, dict], world: int, batch: int) -> dict:
    """What the medians of ``rows`` (ms per step, per mode) say: images per second of all
    ranks, Nimble over DDP, Nimble's scaling efficiency and the share of the all-reduce hidden
    behind the backward (clamped to [0, 1])."""
    ms = {mode: row["median_ms"] for mode, row in rows.items()}
    out = {"images_per_s": {m: world * batch * 1000.0 / v for m, v in ms.items()
                            if m != "all-reduce"}}
    for mode, suffix in NIMBLE_ROWS:
        if mode not in ms:
            continue
        if "ddp" in ms:
            out[f"{mode.replace(' ', '_')}_x_ddp"] = ms["ddp"] / ms[mode]
        if "nimble local" in ms:
            out[f"scaling_efficiency{suffix}"] = ms["nimble local"] / ms[mode]
            if ms.get("all-reduce"):
                exposed = max(ms[mode] - ms["nimble local"], 0.0)
                out[f"all_reduce_hidden{suffix}"] = \
                    min(max(1.0 - exposed / ms["all-reduce"], 0.0), 1.0)
    return out


def launch_modes(nm) -> list[str]:
    """How each of a prepared step's graphs (forward, backward) is launched."""
    return ["device" if built.device_launch else "host" for built in nm.engine.builts]


def averaging(args):
    """The ``average_gradients`` of the ``nimble`` row: Nimble's defaults (True), or a
    :class:`nimble.GradientAverage` with the command line's averaging options."""
    from nimble.record.gradient_average import GradientAverage

    if not args.average_in_all_reduce and args.last_bucket_mib is None:
        return True
    if args.last_bucket_mib is None:
        return GradientAverage(average_in_all_reduce=args.average_in_all_reduce)
    last = int(args.last_bucket_mib * 2**20) or None  # 0: DDP's buckets, none split
    return GradientAverage(average_in_all_reduce=args.average_in_all_reduce,
                           last_bucket_bytes=last)


def _steps(name: str, batch: int, rank: int, quiet: bool, average=True) -> tuple[dict, dict]:
    """Every mode's step for ``name`` on this rank (GPU), and each Nimble mode's
    :func:`launch_modes`; ``average``: the ``nimble`` row's ``average_gradients`` (the
    all-reduce row times the same)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import nimble
    from nimble.cli.train_bench import setup, training_step

    base, x, y = setup(name, batch)
    steps, launches = {}, {}
    ddp = DistributedDataParallel(copy.deepcopy(base), device_ids=[rank])
    steps["ddp"] = training_step(ddp, ddp, x, y)
    graphed_model = copy.deepcopy(base)
    graphed = DistributedDataParallel(torch.cuda.make_graphed_callables(graphed_model, (x,)),
                                      device_ids=[rank])
    steps["ddp graphed"] = training_step(graphed, graphed, x, y)
    for mode, averaged in (("nimble", average), ("nimble local", None)):
        model = copy.deepcopy(base)
        nm = nimble.Nimble(model).prepare(x, training=True, average_gradients=averaged,
                                          quiet=quiet)
        steps[mode] = training_step(nm, model, x, y)
        launches[mode] = launch_modes(nm)
    wrapped = DistributedDataParallel(copy.deepcopy(base), device_ids=[rank])
    nm = nimble.Nimble(wrapped).prepare(x, training=True, quiet=quiet)
    steps["nimble ddp"] = training_step(nm, wrapped, x, y)
    launches["nimble ddp"] = launch_modes(nm)
    steps["all-reduce"] = _graphed_average([torch.zeros_like(p) for p in base.parameters()],
                                           average)
    return steps, launches


def _graphed_average(grads: list, average=True) -> Callable[[], None]:
    """The replay of a CUDA graph holding ``averaged_gradients`` of ``grads`` (captured after an
    eager warm-up on the capture's stream, as NCCL asks); ``average`` as ``average_gradients``
    takes it."""
    import torch

    from nimble.record.gradient_average import averaged_gradients, gradient_average

    settings = gradient_average(average)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        averaged_gradients(grads, settings)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        averaged_gradients(grads, settings)
    return graph.replay


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist

    from nimble.cli.harness import mode_rows, time_rounds

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=DEFAULT_MODELS)
    parser.add_argument("--batch", type=int, default=32, help="images per GPU")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--graph-mixing", action="store_true",
                        help="keep NCCL's graph mixing support (its event nodes make Nimble's "
                             "graphs with collectives host-launched)")
    parser.add_argument("--average-in-all-reduce", action="store_true",
                        help="the nimble row divides inside NCCL's all-reduce (ReduceOp.AVG)")
    parser.add_argument("--last-bucket-mib", type=float,
                        help="the nimble row's last bucket split to at most this many MiB "
                             "(default Nimble's, 4; 0 keeps DDP's buckets unsplit)")
    args = parser.parse_args(argv)
    rank, world = start_rank(args.graph_mixing)
    for name in args.models:
        steps, launches = _steps(name, args.batch, rank, rank != 0, averaging(args))
        rows = mode_rows(time_rounds(steps, args.rounds, args.iters))
        result = {"model": name, "world": world, "batch_per_gpu": args.batch,
                  "gpu": torch.cuda.get_device_name(), "graph_mixing": args.graph_mixing,
                  "average_in_all_reduce": args.average_in_all_reduce,
                  "last_bucket_mib": args.last_bucket_mib,
                  "launch": launches, "modes": rows, **derived(rows, world, args.batch)}
        if rank == 0:
            print(_report(result))
            print(json.dumps(result), flush=True)
        dist.barrier()
    torch.cuda.synchronize()
    sys.stdout.flush()
    os._exit(0)  # after captured collectives, destroying the process group can hang


def _report(r: dict) -> str:
    mixing = "on" if r.get("graph_mixing") else "off"
    lines = [f"{r['model']}, {r['world']} x {r['gpu']}, batch {r['batch_per_gpu']} per GPU, "
             f"NCCL graph mixing {mixing}"
             + (", the nimble row averaging inside the all-reduce"
                if r.get("average_in_all_reduce") else "")
             + (f", its last bucket at most {r['last_bucket_mib']} MiB"
                if r.get("last_bucket_mib") is not None else "")]
    for mode, row in r["modes"].items():
        rate = r["images_per_s"].get(mode)
        launch = r.get("launch", {}).get(mode)
        lines.append(f"  {mode:<13} {row['median_ms']:8.3f} ms ({row['min_ms']:.3f}-"
                     f"{row['max_ms']:.3f})" + (f"  {rate:9.0f} images/s" if rate else "")
                     + (f"  launched {'/'.join(launch)}" if launch else ""))
    keys = [k + suffix for _, suffix in NIMBLE_ROWS
            for k in ("scaling_efficiency", "all_reduce_hidden")]
    for key in ["nimble_x_ddp", "nimble_ddp_x_ddp"] + keys:
        if key in r:
            lines.append(f"  {key.replace('_', ' ')}: {r[key]:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
