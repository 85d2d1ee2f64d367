"""tools/allreduce_latency.py on the CPU: its sizes and its report line."""
from __future__ import annotations

import argparse

import pytest
from helpers import load_tool

tool = load_tool("allreduce_latency")


def test_sizes_read_with_their_units():
    assert [tool.size(s) for s in ("16K", "1m", "2G", "512", "94MB")] == \
        [16 << 10, 1 << 20, 2 << 30, 512, 94 << 20]
    for bad in ("", "K", "-1M", "1.5M", "0"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive number"):
            tool.size(bad)


def test_arguments_default_to_the_gradient_and_decode_sizes():
    args = tool.parse_args([])
    assert args.sizes == [16 << 10, 1 << 20, 25 << 20, 94 << 20]
    assert (args.graphed, args.count) == ([8 << 10, 32 << 10], 32)
    assert tool.parse_args(["--graphed", "8K"]).graphed == [8 << 10]
    assert tool.parse_args(["--sizes", "4K,8M"]).sizes == [4 << 10, 8 << 20]


def test_a_rate_is_bytes_over_time():
    assert tool.rate_line(94 << 20, 352.4) == \
        "all_reduce     94.000 MiB:     352.4 us    279.7 GB/s"
