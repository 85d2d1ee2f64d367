"""``nimble save``: prepare a built-in or zoo model and write it to one file that
``nimble.load`` (or the C runtime) rebuilds in another process without preparing again.

The command keeps the kernel binaries of its own process from the start
(``nimble.keep_kernel_binaries``), so every kernel the graph launches can be written down,
cuBLASLt's GEMMs included; its graphs launch from the host while it runs, which does not change
the saved file."""
from __future__ import annotations

import argparse
import time

from . import models
from .common import (add_batch_argument, add_quiet_argument, check_models, model_help,
                     positive_int)
from ..driver.gpu import use_cudnn_benchmark

DTYPES = ("float32", "float16", "bfloat16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help=model_help("the model to prepare and save"))
    p.add_argument("-o", "--output", metavar="FILE", default=None,
                   help="where to write the saved graph (default MODEL-DTYPE-bBATCH.nimble)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="the model's and input's dtype (default float32)")
    add_batch_argument(p, several=True, default="1")
    p.add_argument("--instances", type=positive_int, default=1,
                   help="copies of the graph that serve callers at once (default 1)")
    p.add_argument("--no-weights", action="store_true",
                   help="leave the weights out: a load must pass the model (model=...)")
    add_quiet_argument(p)


def run(args) -> int:
    check_models([args.model], "save")
    import nimble

    nimble.keep_kernel_binaries()  # before anything loads a kernel module
    import torch

    use_cudnn_benchmark()
    dtype = getattr(torch, args.dtype)
    batches = list(args.batches or [1])
    output = args.output or f"{args.model}-{args.dtype}-b{'-'.join(map(str, batches))}.nimble"
    model = models.create(args.model).cuda().to(dtype).eval()
    x = models.example_input(args.model, batches[0]).to(dtype)
    began = time.perf_counter()
    nm = nimble.Nimble(model).prepare(
        x, batch_sizes=batches if len(batches) > 1 else None, instances=args.instances,
        quiet=args.quiet)
    prepared = time.perf_counter() - began
    began = time.perf_counter()
    path = nm.save(output, weights=not args.no_weights, quiet=args.quiet)
    saved = time.perf_counter() - began
    print(f"{path}\t{path.stat().st_size} bytes\tprepare {prepared:.2f} s\tsave {saved:.2f} s")
    return 0
