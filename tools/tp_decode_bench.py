"""Tensor-parallel decoding's speed (issue 51): a Generator on a causal LM split over the ranks
(:mod:`nimble.cli.tp_decoders`), beside the compiled tight loop on the same split.
``nimble+fast`` is :func:`nimble.fast_decoding.fast_generator` on a copy of the split model
(each rank measures its own GEMV choices and Inductor its own tuning; the ranks still agree on
every token: what each computes alone feeds only its own share, which the sums and the
gathered logits join, except a head kept whole by ``--head whole``, whose logits may then
differ in their last bits from rank to rank).

    torchrun --nproc_per_node=N tools/tp_decode_bench.py [LM] [--dtype bfloat16]
        [--batch 1,8] [--prompt 128] [--new-tokens 64] [--rounds 5] [--modes M,...]
        [--all-reduce nccl|one_shot|peer] [--head vocab|whole] [--prefetch gaps|windows]
        [--graph-mixing] [--json F]

Run it with N = 1 (the whole model: one rank's split is all of it, its all-reduces trivial) and
with N = 2 or 4 on as many GPUs, and hold the lines against each other.  Every rank runs the
same work (the collectives meet), rank 0 prints: per batch, the milliseconds per token of each
mode ((T64 - T16) / 48 as ``nimble bench --generate`` times it, the median of ``--rounds``),
tokens/s, and the decode step's all-reduce kernels.  A mode that fails is a row with its
one-line error; the ranks fail alike, so the others still meet.  Multicast stays off
(``NCCL_NVLS_ENABLE=0``), and so does NCCL's graph mixing support (``NCCL_GRAPH_MIXING_SUPPORT=0``)
unless ``--graph-mixing`` keeps it: its event nodes make a graph with collectives host-launched;
each Generator row says how its decode step is launched.  ``--all-reduce one_shot`` sums the
split layers' partial sums with torch's one-shot all-reduce over symmetric memory instead of
NCCL's, ``--all-reduce peer`` with Nimble's kernel over symmetric memory
(:mod:`nimble.cli.tp_decoders`, :mod:`nimble.peer_sum`).  The LM head is split by the
vocabulary (its logits gathered) unless ``--head whole`` keeps it whole on every rank.
``--prefetch gaps`` has every Generator's steps ask the L2 for the weights read after kernels
that read none (the all-reduces among them) while those run, served unmeasured as a graph of
collectives serves it (``PrepareOptions(prefetch_l2="gaps")``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
from gpu_suite import start_rank  # tools/ is a script's first path entry

#: Nimble's Generator on the model's eager kernels, on Inductor's kernels, with every decode
#: lever of ``fast_generator`` (on a copy of the split model: the levers change it), and the
#: compiled loop.
MODES = ("nimble", "nimble+inductor", "nimble+fast", "compiled loop")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="llama_1b",
                   help="a Llama of nimble.cli.decoders (default llama_1b)")
    p.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16", "float32"))
    p.add_argument("--batch", default="1,8",
                   type=lambda text: [int(b) for b in text.split(",") if b.strip()])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--modes", default="nimble,compiled loop", type=_modes,
                   help=f"which of {', '.join(MODES)} to time (default nimble,compiled loop)")
    p.add_argument("--all-reduce", default="nccl", choices=("nccl", "one_shot", "peer"),
                   help="how the split layers sum their partial sums: NCCL's all-reduce, "
                        "torch's one-shot all-reduce over symmetric memory (bfloat16, float32) "
                        "or Nimble's peer sum over it")
    p.add_argument("--head", default="vocab", choices=("vocab", "whole"),
                   help="the LM head split by rows of the vocabulary, its logits gathered "
                        "(default), or whole on every rank")
    p.add_argument("--prefetch", choices=("gaps", "windows"),
                   help="serve this weight prefetch plan in the Generators' steps")
    p.add_argument("--graph-mixing", action="store_true",
                   help="keep NCCL's graph mixing support (its event nodes make the graphs "
                        "host-launched)")
    p.add_argument("--json", help="also write the rows here (rank 0)")
    return p.parse_args(argv)


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}, not {text!r}")
    return modes


def report_line(world: int, batch: int, mode: str, row: dict) -> str:
    """One mode's line: its ms per token and tokens/s, or its error."""
    if "error" in row:
        return f"{world} GPU(s), batch {batch}, {mode}: failed: {row['error']}"
    launch = f", decode step {row['launch']}-launched" if row.get("launch") else ""
    return (f"{world} GPU(s), batch {batch}, {mode}: {row['token_ms_median']:.3f} ms/token "
            f"(p90 {row['token_ms_p90']:.3f}), {row['tokens_per_s']:.0f} tokens/s{launch}")


def _timed(run, prompts: dict, args, batch: int) -> dict:
    from nimble.cli.common import one_line
    from nimble.cli.generate_bench import _time_mode

    try:
        row = _time_mode(run, prompts, args.new_tokens, args.rounds)
    except Exception as e:  # noqa: BLE001 - the other mode still runs
        return {"error": one_line(e)}
    row["tokens_per_s"] = batch / (row["token_ms_median"] / 1e3)
    return row


def _case(model, args, batch: int, report) -> dict:
    """The timings of ``args.modes`` at ``batch``, and each Generator's decode-step all-reduce
    kernels; ``report(mode, row)`` is called as each mode ends."""
    import torch

    from nimble.cli.common import one_line
    from nimble.cli.decode_loop import compiled_loop

    torch.manual_seed(1)  # the same prompts on every rank
    prompts = {args.prompt: torch.randint(0, model.config.vocab_size, (batch, args.prompt),
                                          device="cuda")}
    length = args.prompt + args.new_tokens
    rows: dict = {}
    for mode in args.modes:
        if mode == "compiled loop":
            try:
                rows[mode] = _timed(compiled_loop(model, length), prompts, args, batch)
            except Exception as e:  # noqa: BLE001 - the other modes still run
                rows[mode] = {"error": one_line(e)}
        else:
            rows[mode] = _generator_row(model, args, batch, prompts, mode)
        report(mode, rows[mode])
    return rows


def _generator_row(model, args, batch: int, prompts: dict, mode: str) -> dict:
    """A Generator's timing on the model's eager kernels, Inductor's or with every decode lever
    (:data:`MODES`), with its decode step's all-reduce kernels."""
    import copy

    from nimble import PrepareOptions
    from nimble.cli.common import one_line
    from nimble.fast_decoding import fast_generator
    from nimble.generate import Generator, prepare_with_nimble
    from nimble.ir.kernel_names import collective_kernel

    length, buckets = args.prompt + args.new_tokens, [args.prompt]
    options = PrepareOptions(prefetch_l2=args.prefetch) if args.prefetch else None
    try:
        if mode == "nimble+fast":
            generator = fast_generator(copy.deepcopy(model), max_cache_len=length,
                                       prompt_buckets=buckets, batch_sizes=[batch],
                                       options=options)
        else:
            generator = Generator(model, max_cache_len=length, prompt_buckets=buckets,
                                  batch_sizes=[batch], prepare_step=prepare_with_nimble(
                                      options, mode == "nimble+inductor"))
    except Exception as e:  # noqa: BLE001 - the other modes still run
        return {"error": one_line(e)}
    try:
        decode, _ = generator.steps(batch)
        row = _timed(generator.generate, prompts, args, batch)
        row["all_reduces"] = sum(collective_kernel(t.name) for t in decode.graph.tasks)
        row["launch"] = "device" if decode.launch_mode == "device-launchable" else "host"
        return row
    finally:
        generator.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world = start_rank(args.graph_mixing)
    from nimble.cli.decoders import causal_lm
    from nimble.cli.tp_decoders import split

    model = split(causal_lm(args.model, args.dtype), rank, world, all_reduce=args.all_reduce,
                  max_tokens=max(args.batch) * args.prompt, head=args.head,
                  max_batch=max(args.batch))
    results = {"model": args.model, "dtype": args.dtype, "world": world,
               "all_reduce": args.all_reduce, "head": args.head, "prefetch": args.prefetch,
               "graph_mixing": args.graph_mixing, "batches": {}}
    for batch in args.batch:
        def report(mode: str, row: dict, batch: int = batch) -> None:
            if rank == 0:
                print(report_line(world, batch, mode, row), flush=True)
        results["batches"][str(batch)] = _case(model, args, batch, report)
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    sys.stdout.flush()
    os._exit(0)  # after captured collectives, destroying the process group can hang


if __name__ == "__main__":
    raise SystemExit(main())
