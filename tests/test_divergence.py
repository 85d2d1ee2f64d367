"""First divergence and the NaN hunt (nimble.debug.divergence) with stand-in graph runs (no GPU)."""
from __future__ import annotations

import pytest
import torch

from nimble.debug.divergence import first_divergence, first_nonfinite, tolerance
from nimble.debug.eager_twins import EagerOp, align, eager_ops, span_bytes
from nimble.errors import InputError
from nimble.debug.step_through import Snapshot
from nimble.ir.taskgraph import Access, Op, Task, TaskGraph


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
    from nimble.debug.divergence import _compare

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
    import nimble.debug.divergence as divergence

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


class _Scaled(torch.nn.Module):
    """``n`` multiplications by a weight, one fresh output each."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.w = torch.nn.Parameter(torch.tensor([1.5, 1.25, 0.75, 1.1]), requires_grad=False)

    def forward(self, x):
        for _ in range(self.n):
            x = x * self.w
        return x


def _scaled_graph(n: int, eager):
    """The recording of :class:`_Scaled`: op k reads buffer k (buffer 0 the input), writes
    buffer k + 1."""
    g = TaskGraph()
    g.ops = [Op(k, e.name, f"mul{k}", [Access(k, 0, 16, False), Access(k + 1, 0, 16, True)])
             for k, e in enumerate(eager)]
    g.tasks = [Task(k, "kernel", op=k) for k in range(n)]
    return g


def _graph_values(x, w, n, rounding: float, fault_at: int = -1, wrong_weight_at: int = -1):
    """What the graph's buffers hold: each op off by ``rounding`` (relative) from its exact
    product, op ``fault_at`` 5.0 off, op ``wrong_weight_at`` multiplied by another weight."""
    values = [x.clone()]
    for k in range(n):
        weight = w * 1.1 if k == wrong_weight_at else w
        y = values[-1] * weight * (1 + rounding)
        values.append(y + 5.0 if k == fault_at else y)
    return {k: v.contiguous().view(torch.uint8).clone() for k, v in enumerate(values)}


def _stand_ins(g, buffers, before_calls):
    def run_until(op):
        return Snapshot(g, set(range(op + 1)), buffers)

    def run_before(op, read):
        before_calls.append((op, set(read)))
        return Snapshot(g, set(range(op)), {b: buffers[b] for b in read})
    return run_until, run_before


@pytest.fixture
def no_tf32(monkeypatch):
    import nimble.debug.divergence as divergence
    monkeypatch.setattr(divergence, "tf32_allowed", lambda: False)


def test_the_eager_run_knows_which_earlier_output_each_input_was_and_keeps_the_rest():
    """An input made by an earlier op is found in the graph range holding that op's output (at
    the right offset for a view of it); a weight or the model's input is kept by value."""
    class Sliced(torch.nn.Module):
        def forward(self, x, w):
            y = x * w
            return y[2:] * w[:2]
    x, w = torch.arange(4.0) + 1, torch.tensor([2.0, 3.0, 4.0, 5.0])
    eager = eager_ops(Sliced(), (x, w), keep_inputs=True)
    assert [e.name for e in eager] == ["aten::mul.Tensor", "aten::slice.Tensor",
                                       "aten::slice.Tensor", "aten::mul.Tensor"]
    g = TaskGraph()
    g.ops = [Op(0, eager[0].name, "", [Access(0, 0, 16, False), Access(2, 0, 16, True)]),
             Op(1, eager[1].name, ""), Op(2, eager[2].name, ""),
             Op(3, eager[3].name, "", [Access(2, 8, 8, False), Access(3, 0, 8, True)])]
    aligned = align(g, eager)
    assert aligned[0].sources == [None, None]  # the model's input and the weight
    assert torch.equal(eager[0].inputs[0].value, x) and torch.equal(eager[0].inputs[1].value, w)
    assert aligned[3].sources[0] == Access(2, 8, 8, False)  # y[2:]: 8 bytes into y's range
    assert aligned[3].sources[1] is None and torch.equal(eager[3].inputs[1].value, w[:2])
    assert aligned[3].isolable and aligned[3].outputs == [0]


def test_rounding_that_builds_up_over_depth_is_not_a_divergence_but_a_fault_still_is(no_tf32):
    """Each op of the graph is 5e-5 off (within float32's 1e-4): run from the model's input, the
    chain drifts past the tolerance within a few ops, while each op run again on the graph's own
    inputs agrees.  A kernel 5.0 off, and one reading another weight, are still named."""
    n = 12
    model, x = _Scaled(n), torch.arange(4.0) + 1
    eager = eager_ops(model, (x,), keep_inputs=True)
    g = _scaled_graph(n, eager)
    aligned = align(g, eager)
    drifting = _graph_values(x, model.w.detach(), n, 5e-5)
    calls = []
    run_until, run_before = _stand_ins(g, drifting, calls)
    chained = first_divergence(run_until, g, aligned)
    assert chained is not None and chained.op < n // 2  # without isolation: a false alarm
    assert first_divergence(run_until, g, aligned, run_before=run_before) is None
    assert not calls  # each op's inputs read from its own run: no op writes over them
    for fault in ({"fault_at": 7}, {"wrong_weight_at": 9}):
        values = _graph_values(x, model.w.detach(), n, 5e-5, **fault)
        run_until, run_before = _stand_ins(g, values, [])
        found = first_divergence(run_until, g, aligned, run_before=run_before)
        assert found is not None and found.op == next(iter(fault.values())), (fault, found)
        assert "its eager twin run on the graph's own inputs" in found.detail


def test_a_walk_counts_its_runs_and_the_ops_judged_again_alone(no_tf32):
    """:class:`WalkCost`: each kind of run counted and timed through its wrapper, and every op
    that differed from the eager chain and was judged again on its own inputs counted, so that a
    slow walk says where its time went."""
    from nimble.debug.divergence import WalkCost

    n = 12
    model, x = _Scaled(n), torch.arange(4.0) + 1
    eager = eager_ops(model, (x,), keep_inputs=True)
    g = _scaled_graph(n, eager)
    aligned = align(g, eager)
    run_until, run_before = _stand_ins(g, _graph_values(x, model.w.detach(), n, 5e-5), [])
    cost = WalkCost()
    stops = cost.counted("stops of one op", run_until)
    assert first_divergence(stops, g, aligned, run_before=run_before, cost=cost) is None
    walked = sum(1 for op in aligned if op.pairs and any(t.op == op.index for t in g.tasks))
    assert cost.runs == {"stops of one op": walked}
    assert 0 < cost.judged_alone < walked  # the first ops agree with the chain, the deep ones not
    line = cost.summary()
    assert f"{walked} stops of one op (" in line and line.endswith(
        f"{cost.judged_alone} op(s) judged again on the graph's own inputs")


def test_a_sum_of_products_run_alone_is_held_to_its_terms_magnitude(no_tf32):
    """64 terms of 100 with alternating signs sum to 0: another summation order may leave 0.3
    (a 2e-5 fraction of the terms' 6,400) and still be right, while 5.0 off is a fault.  The
    eager chain, measured against the result's own size, cannot tell the two apart."""
    class Product(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([[1.0], [-1.0]] * 32), requires_grad=False)

        def forward(self, x):
            return x @ self.w
    x = torch.full((1, 64), 100.0)
    eager = eager_ops(Product(), (x,), keep_inputs=True)
    assert [e.name for e in eager] == ["aten::mm"]
    g = TaskGraph()
    g.ops = [Op(0, "aten::mm", "", [Access(0, 0, 256, False), Access(1, 0, 4, True)])]
    g.tasks = [Task(0, "kernel", op=0)]
    aligned = align(g, eager)
    for off, wrong in ((0.3, False), (5.0, True)):
        buffers = {0: x.view(torch.uint8).clone(),
                   1: (eager[0].outputs[0] + off).view(torch.uint8).clone()}
        run_until, run_before = _stand_ins(g, buffers, [])
        assert first_divergence(run_until, g, aligned) is not None  # the chain alone: alarm
        found = first_divergence(run_until, g, aligned, run_before=run_before)
        assert (found is not None) == wrong, (off, found)


def test_an_input_the_recorded_op_does_not_read_where_its_producer_wrote_is_not_judged_alone():
    """If the recorded op's accesses do not cover the range its producer's output was paired
    with, the eager twin cannot be fed the graph's values: the chain's verdict stands."""
    n = 3
    model, x = _Scaled(n), torch.arange(4.0) + 1
    eager = eager_ops(model, (x,), keep_inputs=True)
    g = _scaled_graph(n, eager)
    g.ops[2].accesses[0] = Access(7, 0, 16, False)  # reads elsewhere than op 1 wrote
    aligned = align(g, eager)
    assert aligned[1].isolable and aligned[2].sources[0] is None and not aligned[2].isolable


def test_an_op_that_writes_over_its_inputs_is_judged_on_a_run_of_the_tasks_before_it(no_tf32):
    """When the arena placed an op's output (or scratch) over an input it has finished reading,
    its own run no longer holds that input: the inputs come from a run of every task before it."""
    from nimble.debug.divergence import overwrites_inputs

    n = 6
    model, x = _Scaled(n), torch.arange(4.0) + 1
    eager = eager_ops(model, (x,), keep_inputs=True)
    g = _scaled_graph(n, eager)
    g.tasks[3].accesses = [Access(3, 0, 16, True)]  # op 3's kernel also writes its input buffer
    aligned = align(g, eager)
    assert overwrites_inputs(g, aligned[3]) and not overwrites_inputs(g, aligned[2])
    calls = []
    run_until, run_before = _stand_ins(g, _graph_values(x, model.w.detach(), n, 5e-5), calls)
    assert first_divergence(run_until, g, aligned, run_before=run_before) is None
    assert [op for op, _ in calls] == [3] and calls[0][1] == {3}
