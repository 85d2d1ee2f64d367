"""tools/experiments/autotune_spread.py: the report of per-process recordings and the kernels
each one's autotuning picked differently from the most common recording (no GPU)."""
from __future__ import annotations

import argparse

from helpers import load_tool

tool = load_tool("experiments/autotune_spread")


def _run(kernels: dict, multi_ms: float, how: str = "autotuned") -> dict:
    return {"cudnn": how, "tasks": sum(kernels.values()), "streams": 2,
            "ms": {"graph": 2.0, "multi": multi_ms}, "x_graph": 2.0 / multi_ms,
            "kernels": kernels}


def test_differences_are_against_the_recording_most_processes_made():
    split_k = {"gemm": 1, "splitk_gemm": 2, "splitk_reduce": 2}
    plain = {"gemm": 3}
    runs = [_run(split_k, 0.9), _run(plain, 1.0), _run(plain, 1.0), {"cudnn": "autotuned",
                                                                      "error": ["died"]}]
    base, diffs = tool._differences(runs)
    assert base == 1
    assert diffs[0] == {"gemm": -2, "splitk_gemm": 2, "splitk_reduce": 2}
    assert diffs[1] == diffs[2] == diffs[3] == {}


def test_report_has_a_line_per_process_and_the_kernels_that_differ():
    runs = [_run({"a": 2}, 1.0), _run({"a": 2}, 1.0), _run({"a": 1, "b": 3}, 0.8, "heuristics"),
            {"cudnn": "autotuned", "error": ["RuntimeError: boom"]}]
    text = tool._report(argparse.Namespace(model="m", dtype="float32", rounds=5, iters=50), runs)
    lines = text.splitlines()
    assert lines[1].split()[:3] == ["0:", "cudnn", "autotuned"] and lines[1].endswith("x2.00")
    assert "x2.50" in lines[3] and "heuristics" in lines[3]
    assert "failed: ['RuntimeError: boom']" in lines[4]
    assert "kernel counts against process 0's recording:" in text
    assert "  2:   +3 b" in lines and "  2:   -1 a" in lines
    assert not any(line.startswith("  3:   ") for line in lines)
