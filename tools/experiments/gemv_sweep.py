"""Every GEMV configuration of a grid against torch's GEMM (cuBLASLt) on single-row products of
given weight shapes, the weights rotated past the L2 cache (``nimble.fast_gemv.graph_timer``),
and how far each falls from the device's copy bandwidth: what ``nimble.fast_gemv.CONFIGS`` was
chosen from (issue 53).  With ``--rows R`` (2 to 16), the products of ``R`` rows on
``nimble.gemm_rows`` over :func:`row_grid` (each launch shape also with its columns split into
each of ``--splits``' part counts that the shape's width holds): what
``nimble.fast_gemv.ROW_CONFIGS`` was chosen from.

    python3 tools/experiments/gemv_sweep.py --shapes 3072x2048,2048x2048,16384x2048,2048x8192,128256x2048
    python3 tools/experiments/gemv_sweep.py --rows 8 --dtype float16 --shapes 2304x768,768x3072
    python3 tools/experiments/gemv_sweep.py --rows 8 --splits 1,2,4,8
"""
from __future__ import annotations

import argparse
import itertools
import sys

#: A Llama 3.2 1B shape's projections with the sibling ones fused: query-key-value, output,
#: gate-up, down, and the LM head.
DEFAULT_SHAPES = "3072x2048,2048x2048,16384x2048,2048x8192,128256x2048"
#: The grid of one row (block_n, block_k, warps, stages), and of a few rows on the tensor cores
#: (``tl.dot``'s tiles: block_n and block_k at least 16) and on the CUDA cores (fewer weight
#: rows a program, the tile at most :data:`LANE_TILE` elements a row of the input).
GRID = ((4, 8, 16), (512, 1024), (4, 8), (1, 3))
DOT_GRID = ((16, 32, 64), (64, 128, 256, 512), (4, 8), (1, 3, 4))
LANE_GRID = ((2, 4, 8), (128, 256, 512, 1024), (4, 8), (1, 3))
LANE_TILE = 2048
#: The part counts ``nimble.fast_gemv.ROW_CONFIGS``' split launches were chosen from.
SPLITS = (1, 2, 4, 8)


def row_grid(splits=(1,)) -> list:
    """The few rows' grid: :data:`DOT_GRID`'s tiles of at most 16K elements, and
    :data:`LANE_GRID`'s of at most :data:`LANE_TILE`, each with its columns split into each of
    ``splits`` parts."""
    from dataclasses import replace

    tiles = grid(*DOT_GRID) + [c for c in grid(*LANE_GRID)
                               if c.block_n * c.block_k <= LANE_TILE]
    return [replace(c, split=s) for s in splits for c in tiles]


def fits(config, in_features: int) -> bool:
    """Whether ``in_features`` columns split into ``config``'s parts hold that many (a split
    with fewer would time another configuration again)."""
    from nimble.gemm_rows import split_columns

    return split_columns(in_features, config.block_k, config.split)[1] == config.split


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``OUTxIN[,OUTxIN...]`` as ``(out_features, in_features)`` pairs."""
    try:
        shapes = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"{text!r}: shapes are OUTxIN, comma-separated")
    return shapes


def grid(block_n, block_k, warps, stages) -> list:
    """The configurations of the grid whose tile holds at most 16K elements."""
    from nimble.fast_gemv import GemvConfig

    return [GemvConfig(*c) for c in itertools.product(block_n, block_k, warps, stages)
            if c[0] * c[1] <= 16384]


def parse_splits(text: str) -> tuple[int, ...]:
    """``S[,S...]``: part counts of 1 or more."""
    try:
        splits = tuple(int(v) for v in text.split(","))
    except ValueError:
        splits = ()
    if not splits or min(splits) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: splits are counts of 1 or more")
    return splits


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--rows", type=int, default=1, help="rows of the input (1: the GEMV)")
    p.add_argument("--splits", type=parse_splits, default=(1,),
                   help="with --rows: the part counts the columns are split into (1,2,4,8)")
    args = p.parse_args(argv)
    from nimble.gemm_rows import MAX_ROWS

    if not 1 <= args.rows <= MAX_ROWS or (args.rows > 1 and args.dtype == "float32"):
        p.error(f"--rows is 1 to {MAX_ROWS}, and 1 in float32 (nimble.gemm_rows takes half "
                "and bfloat16)")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    from nimble.cli.decode_bandwidth import copy_bandwidth
    from nimble.fast_gemv import graph_timer

    dtype = getattr(torch, args.dtype)
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy / 1e12:.2f} TB/s; "
          f"{args.rows} row(s)")
    grid_of_rows = grid(*GRID) if args.rows == 1 else row_grid(args.splits)
    for n, k in args.shapes:
        configs = [c for c in grid_of_rows if fits(c, k)]
        torch.manual_seed(0)
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02]
        size = n * k * weights[0].element_size()
        x = torch.randn((k,) if args.rows == 1 else (args.rows, k), device="cuda", dtype=dtype)
        theirs = graph_timer(None, weights, x)
        timed = sorted(((graph_timer(c, weights, x), c) for c in configs), key=lambda t: t[0])
        us, best = timed[0]
        print(f"{n}x{k} {size / 1e6:.1f} MB: torch {theirs:.2f} µs "
              f"({size / theirs / 1e6 / (copy / 1e12) * 100:.0f}% of copy), best GEMV "
              f"{us:.2f} µs ({size / us / 1e6 / (copy / 1e12) * 100:.0f}%) {best}; next: "
              + ", ".join(f"{u:.2f} {c.block_n}/{c.block_k}/{c.warps}/{c.stages}/{c.split}"
                          for u, c in timed[1:4]), flush=True)
        del weights
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
