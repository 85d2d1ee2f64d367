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
from .common import (Fail, add_batch_argument, add_quiet_argument, check_models, model_help,
                     parse_batches, positive_int, require_gpu)
from ..driver.gpu import use_cudnn_benchmark

DTYPES = ("float32", "float16", "bfloat16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help=model_help("the model to prepare and save")
                   + "; with --generate, a causal LM (gpt2, gpt2_tiny, llama_small, llama_1b, "
                     "llama3_1b)")
    p.add_argument("-o", "--output", metavar="FILE", default=None,
                   help="where to write the saved graph (default MODEL-DTYPE-bBATCH.nimble)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="the model's and input's dtype (default float32)")
    add_batch_argument(p, several=True, default="1")
    p.add_argument("--instances", type=positive_int, default=1,
                   help="copies of the graph that serve callers at once (default 1)")
    p.add_argument("--no-weights", action="store_true",
                   help="leave the weights out: a load must pass the model (model=...)")
    p.add_argument("--generate", action="store_true",
                   help="save a decoding Generator of the causal LM MODEL (its prefill and "
                        "decode graphs per batch size; random weights), for Generator.load")
    p.add_argument("--prompt-buckets", type=parse_batches, default=[128], metavar="P,P,...",
                   help="with --generate: the prompt lengths to prepare (default 128)")
    p.add_argument("--max-cache-len", type=positive_int, default=None, metavar="L",
                   help="with --generate: the static cache's length (default the largest "
                        "prompt bucket + 64)")
    p.add_argument("--fuse-projections", action="store_true",
                   help="with --generate: make sibling projections one GEMM each first "
                        "(nimble.fused_projections; a batch-1 decode step's lever)")
    add_quiet_argument(p)


def run(args) -> int:
    if args.generate:
        return _save_generator(args)
    if args.fuse_projections:
        raise Fail("--fuse-projections applies to a Generator: add --generate")
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
    return _saved(lambda: nm.save(output, weights=not args.no_weights, quiet=args.quiet),
                  time.perf_counter() - began)


def _save_generator(args) -> int:
    """``--generate``: a Generator of the causal LM ``args.model`` prepared and saved."""
    from .decoders import CAUSAL_LMS

    if args.model not in CAUSAL_LMS:
        raise Fail(f"--generate takes a causal LM ({', '.join(CAUSAL_LMS)}), not {args.model!r}")
    if args.no_weights or args.instances != 1:
        raise Fail("--generate saves a Generator with its weights and one instance: drop "
                   "--no-weights and --instances")
    require_gpu("save")
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise Fail("--generate needs transformers, which is not installed here: "
                   "python -m pip install transformers")
    import nimble

    nimble.keep_kernel_binaries()  # before anything loads a kernel module
    from ..generate import Generator
    from .decoders import causal_lm

    batches = list(args.batches or [1])
    buckets = sorted(args.prompt_buckets)
    cache = args.max_cache_len or buckets[-1] + 64
    output = args.output or f"{args.model}-{args.dtype}-generator.nimble"
    began = time.perf_counter()
    generator = Generator(causal_lm(args.model, args.dtype), max_cache_len=cache,
                          prompt_buckets=buckets, batch_sizes=batches,
                          fuse_projections=args.fuse_projections)
    return _saved(lambda: generator.save(output, quiet=args.quiet), time.perf_counter() - began)


def _saved(save, prepare_seconds: float) -> int:
    """Run ``save`` (which returns the file's path) and print the path, its size and the
    seconds of preparing and saving, one tab-separated line."""
    began = time.perf_counter()
    path = save()
    saved = time.perf_counter() - began
    print(f"{path}\t{path.stat().st_size} bytes\tprepare {prepare_seconds:.2f} s\t"
          f"save {saved:.2f} s")
    return 0
