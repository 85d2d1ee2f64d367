"""What one NCCL all-reduce costs on this machine's GPUs, by size, eagerly and inside a CUDA graph.

    torchrun --nproc_per_node=N tools/allreduce_latency.py [--sizes 16K,1M,25M,94M]
        [--graphed 8K,32K] [--count 32] [--iters 20] [--graph-mixing]

The floor under the two places Nimble puts all-reduces: a data-parallel backward's gradient
buckets (large: bandwidth) and a tensor-parallel decode step's partial sums (a few KiB each,
two per layer: latency).  Rank 0 prints whether GPU 0 reaches GPU 1's memory directly (peer
access; ``nvidia-smi topo -m`` says over what), then per ``--sizes`` the GPU time of one eager
float32 all-reduce (the median of 5 rounds of ``--iters`` calls after a warm-up, CUDA events)
and its rate (bytes / time), then per ``--graphed`` size (a decode step's hidden state at batch
1 and 8 of a 2048-wide model by default) ``--count`` bfloat16 all-reduces of that many bytes
captured in one CUDA graph: the time of each one replayed; then the same for Nimble's peer sum
(:class:`nimble.peer_sum.PeerSum`), after its sum of one random tensor is held against NCCL's
(the largest difference; with two ranks both round one float32 sum, so it is 0).  Multicast stays off (``NCCL_NVLS_ENABLE=0``), and NCCL's
graph mixing support too unless ``--graph-mixing`` keeps it (its event nodes sit around each
captured all-reduce).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
from gpu_suite import start_rank  # tools/ is a script's first path entry

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
#: Timed rounds per measurement (their median is reported).
ROUNDS = 5


def size(text: str) -> int:
    """Bytes from ``16K``, ``94M``, ``1G`` or a plain number."""
    text = text.strip().upper().removesuffix("B")
    scale = UNITS.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in UNITS else text
    if not number.isdigit() or int(number) <= 0:
        raise argparse.ArgumentTypeError(f"a size is a positive number with K, M or G, "
                                         f"not {text!r}")
    return int(number) * scale


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=[size(s) for s in ("16K", "1M", "25M", "94M")],
                   type=lambda text: [size(s) for s in text.split(",") if s.strip()])
    p.add_argument("--graphed", default=[size("8K"), size("32K")],
                   type=lambda text: [size(s) for s in text.split(",") if s.strip()])
    p.add_argument("--count", type=int, default=32)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--graph-mixing", action="store_true",
                   help="keep NCCL's graph mixing support")
    return p.parse_args(argv)


def rate_line(nbytes: int, us: float) -> str:
    """One eager size's line: its time and bytes per second."""
    return (f"all_reduce {nbytes / 2**20:10.3f} MiB: {us:9.1f} us "
            f"{nbytes / us / 1e3:8.1f} GB/s")


def _median_ms(fn, iters: int) -> float:
    """The median over :data:`ROUNDS` rounds of ``fn``'s GPU ms per call, ``iters`` calls a
    round after a warm-up (:func:`nimble.cli.harness.time_rounds`; every rank calls alike)."""
    from nimble.cli.harness import time_rounds

    return statistics.median(time_rounds({"all_reduce": fn}, ROUNDS, iters)["all_reduce"])


def _graphed_us(nbytes: int, count: int, iters: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    return _captured_us(lambda: dist.all_reduce(t), count, iters)


def _captured_us(call, count: int, iters: int) -> float:
    """The GPU µs of each of ``count`` calls of ``call`` captured in one CUDA graph, replayed."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # a warm-up before the capture (NCCL's, Triton's compilation)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(count):
            call()
    return _median_ms(graph.replay, iters) * 1e3 / count


def _peer_line(nbytes: int, count: int, iters: int) -> str:
    """The peer sum's difference from NCCL's and its time captured, or why it could not run."""
    import torch
    import torch.distributed as dist

    from nimble.cli.common import one_line
    from nimble.peer_sum import PeerSum

    try:
        summed = PeerSum(nbytes // 2, torch.bfloat16)
        torch.manual_seed(dist.get_rank())
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        theirs = x.clone()
        dist.all_reduce(theirs)
        differs = (summed(x).float() - theirs.float()).abs().max().item()
        t = torch.ones(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        us = _captured_us(lambda: summed(t), count, iters)
    except Exception as e:  # noqa: BLE001 - NCCL's line stands without it
        return f"graphed: Nimble's peer sum failed: {one_line(e)}"
    return (f"graphed: {count} x {nbytes} B bfloat16 Nimble peer sum, {us:.1f} us each "
            f"(largest difference from NCCL's sum: {differs:g})")


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world = start_rank(args.graph_mixing)
    import torch
    import torch.distributed as dist

    if rank == 0:
        peer = torch.cuda.can_device_access_peer(0, 1) if torch.cuda.device_count() > 1 else None
        print(f"{world} ranks on {torch.cuda.get_device_name()}; peer access 0->1: {peer}",
              flush=True)
    for nbytes in args.sizes:
        t = torch.ones(nbytes // 4, device="cuda")
        us = _median_ms(lambda t=t: dist.all_reduce(t), args.iters) * 1e3
        if rank == 0:
            print(rate_line(nbytes, us), flush=True)
    for nbytes in args.graphed:
        us = _graphed_us(nbytes, args.count, args.iters)
        if rank == 0:
            print(f"graphed: {args.count} x {nbytes} B bfloat16 all_reduce, {us:.1f} us each",
                  flush=True)
        line = _peer_line(nbytes, args.count, args.iters)
        if rank == 0:
            print(line, flush=True)
    sys.stdout.flush()
    os._exit(0)  # after a captured collective, destroying the process group can hang


if __name__ == "__main__":
    raise SystemExit(main())
