"""tools/experiments/gemv_sweep.py: its shapes and its grid (no GPU)."""
from __future__ import annotations

import argparse

import pytest

from helpers import load_tool

tool = load_tool("experiments/gemv_sweep")


def test_shapes_parse_and_bad_ones_are_refused():
    assert tool.parse_shapes("3072x2048,2048X8192") == [(3072, 2048), (2048, 8192)]
    assert tool.parse([]).shapes[-1] == (128256, 2048)
    for bad in ("3072", "ax2", "0x4", "1x2x3"):
        with pytest.raises(argparse.ArgumentTypeError):
            tool.parse_shapes(bad)


def test_the_grid_keeps_tiles_of_at_most_16k_elements_and_holds_the_chosen_configs():
    from nimble.fast_gemv import CONFIGS

    configs = tool.grid((4, 8, 16), (512, 1024), (4, 8), (1, 3))
    assert len(configs) == 24 and all(c.block_n * c.block_k <= 16384 for c in configs)
    assert set(CONFIGS) <= set(configs)
    assert tool.grid((32,), (1024,), (4,), (1,)) == []
    assert set(CONFIGS) <= set(tool.grid(*tool.GRID))


def test_the_rows_grid_holds_the_chosen_row_configs_and_bad_rows_are_refused():
    from nimble.fast_gemv import ROW_CONFIGS
    from nimble.gemm_rows import MIN_DOT_BLOCK

    configs = tool.row_grid()
    assert set(ROW_CONFIGS) <= set(tool.row_grid(tool.SPLITS))
    dots = [c for c in configs if c.block_n >= MIN_DOT_BLOCK]
    assert dots and all(c.block_k >= MIN_DOT_BLOCK for c in dots)
    lanes = [c for c in configs if c.block_n < MIN_DOT_BLOCK]  # the CUDA cores' tiles
    assert lanes and all(c.block_n * c.block_k <= tool.LANE_TILE for c in lanes)
    assert tool.parse(["--rows", "8", "--dtype", "float16"]).rows == 8
    assert {c.split for c in configs} == {1}
    split = tool.row_grid((1, 4))
    assert len(split) == 2 * len(configs) and {c.split for c in split} == {1, 4}
    # a split into 4 parts is timed only where the width holds 4 parts of whole steps
    four = next(c for c in split if c.split == 4 and c.block_k == 256)
    assert tool.fits(four, 2048) and not tool.fits(four, 768) and tool.fits(configs[0], 16)
    assert tool.parse(["--rows", "8", "--splits", "1,2,8"]).splits == (1, 2, 8)
    for bad in (["--rows", "0"], ["--rows", "17"], ["--rows", "8", "--dtype", "float32"],
                ["--rows", "8", "--splits", "0"], ["--rows", "8", "--splits", "a"]):
        with pytest.raises(SystemExit):
            tool.parse(bad)
