"""tools/dp_breakdown.py on the CPU: the arithmetic of its breakdown of a profiled step."""
from __future__ import annotations

import pytest
from helpers import load_tool

tool = load_tool("dp_breakdown")


def test_covered_time_is_the_union_of_the_intervals():
    assert tool.covered([]) == 0
    assert tool.covered([(0, 10), (5, 15), (20, 25)]) == 20
    assert tool.covered([(20, 25), (0, 30)]) == 30  # nested, in any order
    assert tool.covered([(0, 5), (5, 8)]) == 8  # touching


def test_a_step_splits_into_idle_compute_and_exposed_nccl():
    kernels = [("conv", 0, 100), ("ncclDevKernel_AllReduce_Sum_f32", 50, 100),  # 50 exposed
               ("sgd", 200, 50),  # a gap of 50 before it
               ("conv", 300, 100), ("ncclDevKernel_AllReduce_Sum_f32", 320, 40), ("sgd", 400, 50)]
    b = tool.breakdown(kernels, steps=2)
    assert b.wall == 450 / 2
    assert b.busy == (150 + 50 + 100 + 50) / 2
    assert b.idle == b.wall - b.busy == 100 / 2
    assert b.compute == (100 + 50 + 100 + 50) / 2 == b.compute_kernel_sum
    assert b.nccl == 140 / 2 and b.nccl_kernels == 1
    assert b.exposed == 50 / 2


def test_kernels_come_from_the_profilers_trace_and_none_is_an_error():
    trace = {"traceEvents": [{"cat": "kernel", "name": "k", "ts": 3, "dur": 2},
                             {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1, "dur": 1},
                             {"ph": "M"}]}
    assert tool.kernels_of(trace) == [("k", 3.0, 2.0)]
    with pytest.raises(ValueError, match="no kernel"):
        tool.breakdown([], steps=1)


def test_the_report_line_and_arguments():
    b = tool.Breakdown(4066, 3132, 934, 3132, 4627, 0, 0, 0)
    assert tool.line("local", b).startswith("local          wall    4066 us  busy    3132")
    args = tool.parse_args(["inception_v3", "--bucket-mib", "8"])
    assert (args.model, args.batch, args.steps, args.bucket_mib) == ("inception_v3", 32, 10, 8)
