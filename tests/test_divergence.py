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
    assert tolerance(torch.float16)[0] > tolerance(torch.float32, tf32=False)[0]
    assert tolerance(torch.float32, tf32=True) == tolerance(torch.float16)
    assert tolerance(torch.int64) == (0.0, 0.0)


def test_a_difference_is_measured_against_the_tensors_scale_and_nonfinite_must_match():
    """Rounding in a long sum is relative to its terms: 1e-5 off an element near zero of a tensor
    whose largest element is 1e3 agrees in float32; 0.05 off a tensor of ones does not; a NaN or
    an infinity where eager has a finite value never agrees, while the same NaN does."""
    from nimble.divergence import _compare

    def raw(t):
        return t.contiguous().view(torch.uint8).clone()
    want = torch.tensor([1000.0, 1e-6, -3.0])
    got = want.clone()
    got[1] += 1e-5
    assert _compare(raw(got), want) == (True, pytest.approx(1e-5, rel=1e-2))
    ones = torch.ones(3)
    assert _compare(raw(ones + 0.05), ones)[0] is False  # beyond TF32 rounding too
    for bad in (float("nan"), float("inf")):
        got = want.clone()
        got[2] = bad
        assert _compare(raw(got), want) == (False, float("inf"))
    with_nan = torch.tensor([float("nan"), 1.0])
    assert _compare(raw(with_nan), with_nan) == (True, 0.0)


def test_the_nan_hunt_names_the_first_op_writing_nan():
    g, eager = _chain()
    run, _ = _runs(g, eager, wrong_from=5, value=float("nan"))
    found = first_nonfinite(run, g, align(g, eager))
    assert found.op == 5 and "NaN" in found.detail


def test_the_nan_hunt_passes_over_an_infinity_a_pad_writes_on_purpose_but_not_a_nan():
    """timm's "same" max pools pad with -inf: the hunt must not stop at each pad, while an
    infinity any other op writes, and a NaN a pad writes, still count."""
    g, eager = _chain()
    g.ops[2].name = eager[2].name = "aten::constant_pad_nd"

    def run_with(bad: dict[int, float]):
        def run_until(op: int) -> Snapshot:
            buffers = {}
            for k, e in enumerate(eager):
                t = e.outputs[0].clone()
                if k in bad:
                    t[1] = bad[k]
                buffers[k] = t.view(torch.uint8).clone()
            return Snapshot(g, set(range(op + 1)), buffers)
        return run_until
    aligned = align(g, eager)
    assert first_nonfinite(run_with({2: float("-inf")}), g, aligned) is None
    found = first_nonfinite(run_with({2: float("-inf"), 7: float("inf")}), g, aligned)
    assert found.op == 7 and found.detail.endswith("write Inf")
    found = first_nonfinite(run_with({2: float("nan"), 7: float("inf")}), g, aligned)
    assert found.op == 2 and found.detail.endswith("write NaN")


def test_a_long_walk_reports_its_progress(monkeypatch):
    import nimble.divergence as divergence

    monkeypatch.setattr(divergence, "PROGRESS_SECONDS", 0.0)
    g, eager = _chain(6)
    run, _ = _runs(g, eager, wrong_from=1000)
    lines: list[str] = []
    assert first_divergence(run, g, align(g, eager), lines.append) is None
    assert lines[0] == "compared 1 of 6 ops: up to op 0 all agree" and len(lines) == 6


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
