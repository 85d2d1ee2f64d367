"""A decode step served with programmatic edges, saved, then loaded with and without them
(``nimble.engine.loading.LOAD_WAITING_EDGES``): ms per token of each load side by side in one
fresh process, beside the same step prepared there.

    python3 tools/experiments/load_edges.py save FILE   # keeps the kernel binaries, prepares, saves
    python3 tools/experiments/load_edges.py time FILE   # a fresh process: the loads and a prepare

The Generator is ``decode_levers``'s variant (default: the levers on by default in the bench,
``programmatic+rope-attention+coordinate+gemv-prologues``) on ``llama3_1b`` in bf16, batch 1,
its 128-token prompt and 64 new tokens.  Saving keeps the kernel binaries, which attaches CUPTI:
no timing is taken in that process.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_VARIANT = "programmatic+rope-attention+coordinate+gemv-prologues"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["save", "time"])
    p.add_argument("file", type=Path)
    p.add_argument("--variant", default=DEFAULT_VARIANT)
    p.add_argument("--model", default="llama3_1b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


@contextlib.contextmanager
def prepared(args):
    """The variant's Generator on a fresh model (its levers applied as ``decode_levers`` applies
    them), closed after the block."""
    import torch._inductor.config as inductor_config
    from decode_levers import folding, prepare_options, variant

    from nimble.cli.decoders import causal_lm
    from nimble.decode_attention import decode_attention
    from nimble.fast_gemv import fast_gemv
    from nimble.fused_projections import fuse_projections
    from nimble.generate import Generator, prepare_with_nimble

    lever = variant(args.variant)
    model = causal_lm(args.model, args.dtype)
    fuse_projections(model)
    if lever.fast_gemv:
        fast_gemv(model, margin=lever.gemv_margin)
    if lever.decode_attention:
        decode_attention(model)
    with inductor_config.patch(**lever.inductor), folding(lever):
        generator = Generator(model, args.prompt + args.new_tokens, [args.prompt], [1],
                              prepare_step=prepare_with_nimble(prepare_options(lever), True))
    try:
        yield generator
    finally:
        generator.close()


def prompt(args):
    import torch

    torch.manual_seed(1)
    return torch.randint(0, 1000, (1, args.prompt), device="cuda")


def save(args) -> dict:
    import nimble

    nimble.keep_kernel_binaries()
    args.file.parent.mkdir(parents=True, exist_ok=True)
    with prepared(args) as generator:
        tokens = generator.generate(prompt(args), args.new_tokens)
        edges = generator.steps(1)[0].programmatic_edges
        generator.save(args.file)
    import torch

    torch.save(tokens.cpu(), args.file.with_suffix(".tokens.pt"))
    return {"saved": str(args.file), "programmatic_edges": len(edges)}


def time_rows(args) -> dict:
    """The two loads and a fresh prepare of the same variant, timed one after another."""
    import torch

    from nimble.cli.generate_bench import _time_mode
    from nimble.engine import loading
    from nimble.generate import Generator

    ids = prompt(args)
    want = torch.load(args.file.with_suffix(".tokens.pt"))
    prompts = {args.prompt: ids}
    out: dict = {}
    with contextlib.ExitStack() as stack:
        rows = {}
        for name, edges in (("loaded", False), ("loaded, its edges", True)):
            loading.LOAD_WAITING_EDGES = edges
            generator = Generator.load(args.file)
            stack.callback(generator.close)
            rows[name] = generator
        loading.LOAD_WAITING_EDGES = False
        rows["prepared here"] = stack.enter_context(prepared(args))
        for name, generator in rows.items():
            row = out[name] = _time_mode(generator.generate, prompts, args.new_tokens,
                                         args.rounds)
            row["programmatic_edges"] = len(generator.steps(1)[0].programmatic_edges)
            row["tokens_as_saved"] = bool(torch.equal(
                generator.generate(ids, args.new_tokens).cpu(), want))
            print(f"{name:<18} {row['token_ms_median']:.3f} ms/token (p90 "
                  f"{row['token_ms_p90']:.3f}), {row['programmatic_edges']} programmatic "
                  f"edges, tokens as saved: {row['tokens_as_saved']}", flush=True)
    return out


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    print(f"{torch.cuda.get_device_name()}, {args.variant}", flush=True)
    result = save(args) if args.mode == "save" else time_rows(args)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
