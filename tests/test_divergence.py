"""First divergence and the NaN hunt (nimble.divergence) with stand-in graph runs (no GPU)."""
from __future__ import annotations

import pytest
import torch

from nimble.divergence import (EagerOp, align, eager_ops, first_divergence, first_nonfinite,
                               span_bytes, tolerance)
from nimble.errors import InputError
from nimble.stepper import Snapshot
from nimble.taskgraph import Access, Op, Task, TaskGraph


def _chain(n: int = 12):
    """``n`` ops, op k writes buffer k (4 floats) with one task; eager op k returns k + [0..3]."""
    g = TaskGraph()
    g.ops = [Op(k, "aten::add.Tensor", f"layer{k}", [Access(k, 0, 16, True)]) for k in range(n)]
    g.tasks = [Task(k, "kernel", op=k) for k in range(n)]
    eager = [EagerOp("aten::add.Tensor", [torch.arange(4.0) + k]) for k in range(n)]
    return g, eager


def _runs(graph, eager, wrong_from: int, value=1.0):
    """A stand-in for run_until: op outputs as eager's, off by ``value`` from ``wrong_from``."""
    calls = []

    def run_until(op: int) -> Snapshot:
        calls.append(op)
        buffers = {}
        for k, e in enumerate(eager):
            t = e.outputs[0] + (value if k >= wrong_from else 0.0)
            buffers[k] = t.contiguous().view(torch.uint8).clone()
        return Snapshot(graph, set(range(op + 1)), buffers)
    return run_until, calls


def test_the_first_op_that_goes_wrong_is_found_walking_in_order():
    g, eager = _chain(100)
    aligned = align(g, eager)
    run, calls = _runs(g, eager, wrong_from=61)
    found = first_divergence(run, g, aligned)
    assert found.op == 61 and found.module == "layer61" and found.tasks == [61]
    assert found.max_abs_diff == pytest.approx(1.0)
    assert calls == list(range(62))  # stops at the first
    run, _ = _runs(g, eager, wrong_from=1000)
    assert first_divergence(run, g, aligned) is None


def test_a_fault_on_one_branch_is_found_though_later_branches_agree():
    """Ops 0-9 on branch a, 10-19 on branch b; the fault at op 4 shows on a only."""
    g, eager = _chain(20)

    def run_until(op):
        buffers = {}
        for k, e in enumerate(eager):
            t = e.outputs[0] + (1.0 if 4 <= k < 10 else 0.0)
            buffers[k] = t.contiguous().view(torch.uint8).clone()
        return Snapshot(g, set(), buffers)
    assert first_divergence(run_until, g, align(g, eager)).op == 4


def test_differences_inside_the_dtype_tolerance_are_not_divergence():
    g, eager = _chain()
    run, _ = _runs(g, eager, wrong_from=3, value=1e-7)
    assert first_divergence(run, g, align(g, eager)) is None
    assert tolerance(torch.float16)[0] > tolerance(torch.float32)[0]
    assert tolerance(torch.int64) == (0.0, 0.0)


def test_the_nan_hunt_names_the_first_op_writing_nan():
    g, eager = _chain()
    run, _ = _runs(g, eager, wrong_from=5, value=float("nan"))
    found = first_nonfinite(run, g, align(g, eager))
    assert found.op == 5 and "NaN" in found.detail


def test_alignment_refuses_another_op_sequence_and_pairs_outputs_by_extent():
    g, eager = _chain(3)
    with pytest.raises(InputError, match="other ops"):
        align(g, eager[:2] + [EagerOp("aten::mul.Tensor", [])])
    g.ops[1].accesses = [Access(9, 0, 64, True), Access(1, 0, 16, True)]
    pairs = align(g, eager)[1].pairs
    assert [a.buffer for a, _ in pairs] == [1]  # the 16-byte output, not the 64-byte range
    assert span_bytes([2, 3], [3, 1], 4) == 24 and span_bytes([2, 3], [1, 2], 4) == 24
    assert span_bytes([0, 3], [3, 1], 4) == 0


def test_eager_ops_keep_every_op_and_its_fresh_outputs():
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    ops = eager_ops(lin, [x])
    assert ops and all(isinstance(o.name, str) for o in ops)
    final = [o for o in ops if o.outputs and tuple(o.outputs[0].shape) == (2, 3)]
    assert final and torch.allclose(final[-1].outputs[0], lin(x).detach())
