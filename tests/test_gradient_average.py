"""Gradients averaged across ranks inside the recorded backward (no GPU: gloo on the CPU).

:mod:`nimble.record.gradient_average` puts the averaging into the backward that
``prepare(training=True, average_gradients=...)`` records; on the GPU the all-reduces are NCCL
kernels of the backward graph.  Here the same functions run eagerly over two CPU processes.
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from helpers import FIXTURE_DIR, gloo_ranks

from nimble.record.gradient_average import (GradientAverage, averaged_gradients, bucket_plan,
                                            gradient_average, split_last_bucket)


def test_buckets_run_from_the_last_gradient_back_the_first_one_small():
    sizes = [400, 100, 300, 200, 50]  # bytes per gradient, in parameter order
    assert bucket_plan(sizes, ["f32"] * 5, bucket_bytes=450, first_bucket_bytes=200) == \
        [[4, 3], [2, 1, 0]]
    assert bucket_plan(sizes, ["f32"] * 5, bucket_bytes=10**9, first_bucket_bytes=10**9) == \
        [[4, 3, 2, 1, 0]]
    assert bucket_plan(sizes, ["f32"] * 5, bucket_bytes=1, first_bucket_bytes=1) == \
        [[4], [3], [2], [1], [0]]


def test_a_bucket_holds_one_dtype():
    assert bucket_plan([8, 8, 8, 8], ["f16", "f16", "f32", "f32"], 10**6, 10**6) == \
        [[3, 2], [1, 0]]
    assert bucket_plan([], []) == []
    # interleaved dtypes each fill their own bucket, the first of each dtype the small one
    assert bucket_plan([40, 20] * 3, ["f32", "f16"] * 3, 40, 20) == [[5], [4], [2], [3, 1], [0]]


def _ddp_buckets(sizes: list[int], dtypes: list, first: int, cap: int) -> list[list[int]]:
    """DDP's own bucket assignment (the reducer's rebuild), its gradients made from the last
    parameter back."""
    tensors = [torch.empty(n, dtype=d) for n, d in zip(sizes, dtypes)]
    order = list(reversed(range(len(tensors))))
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [tensors[i] for i in order], [first, cap], [False] * len(order), order)
    return buckets


@pytest.mark.parametrize("elements,dtypes,first,cap", [
    ([100, 25, 75, 50, 12], [torch.float32] * 5, 160, 320),
    ([100, 25, 75, 50, 12], [torch.float32] * 5, 4 * 1000, 4 * 1000),
    ([10] * 6, [torch.float32, torch.float16] * 3, 20, 40),
    ([64, 3, 64, 64, 1, 8], [torch.float16] * 2 + [torch.float32] * 4, 128, 256),
])
def test_the_plan_is_ddps_bucket_assignment(elements, dtypes, first, cap):
    if not hasattr(dist, "_compute_bucket_assignment_by_size"):
        pytest.skip("this torch has no DDP bucket assignment to compare with")
    sizes = [n * torch.empty(0, dtype=d).element_size() for n, d in zip(elements, dtypes)]
    plan = bucket_plan(sizes, [str(d) for d in dtypes], cap, first)
    want = _ddp_buckets(elements, dtypes, first, cap)
    closed = [b for b in plan if sum(sizes[i] for i in b) >= first]
    assert plan[:len(closed)] == want[:len(closed)]  # the buckets that filled, in order
    # those left open at the end go in an order DDP leaves to a hash map
    assert sorted(plan[len(closed):]) == sorted(want[len(closed):])


def test_average_gradients_argument_forms():
    assert gradient_average(None) is None and gradient_average(False) is None
    assert gradient_average(True) == GradientAverage()
    # Nimble's own averaging splits the bucket reduced last to at most 4 MiB
    assert gradient_average(True).last_bucket_bytes == 4 * 2**20
    given = GradientAverage(bucket_bytes=4096)
    assert gradient_average(given) is given
    group = object()
    assert gradient_average(group).group is group


def _rank(rank: int, results) -> None:
    from nimble.record.recorder import _GradTargets, _step_gradients

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    torch.manual_seed(10 + rank)  # each rank its own batch
    x = torch.randn(5, 3, requires_grad=True)
    params = list(model.parameters())
    out = model(x)
    targets = _GradTargets([0], params, [x] + params)
    small = GradientAverage(bucket_bytes=40, first_bucket_bytes=8)  # several buckets
    got = _step_gradients([out], targets, [torch.ones_like(out)], small)
    local = torch.autograd.grad(model(x), [x] + params, torch.ones_like(out))
    results[rank] = ([g.clone() for g in got], [g.clone() for g in local])
    results[10 + rank] = averaged_gradients([None, params[0].detach() * (rank + 1), None],
                                            small)


def test_the_parameters_gradients_are_the_ranks_mean_and_the_inputs_stay_local():
    results = gloo_ranks(_rank)
    (got0, local0), (got1, local1) = results[0], results[1]
    assert torch.equal(got0[0], local0[0]) and torch.equal(got1[0], local1[0])  # input
    for a, b, l0, l1 in zip(got0[1:], got1[1:], local0[1:], local1[1:]):
        assert torch.equal(a, b)  # every rank holds the same average
        assert torch.allclose(a, (l0 + l1) / 2, rtol=1e-6, atol=1e-7)
        assert a.shape == l0.shape
    for k in (10, 11):
        none0, mean, none2 = results[k]
        assert none0 is None and none2 is None
    assert torch.equal(results[10][1], results[11][1])


def test_check_average_says_what_is_missing():
    from nimble.engine.collectives import check_average
    from nimble.errors import InputError

    check_average(None, training=False, instances=4, examples=[1, 2])
    with pytest.raises(InputError, match="pass training=True"):
        check_average(GradientAverage(), training=False, instances=1, examples=[1])
    with pytest.raises(InputError, match="leave out buckets"):
        check_average(GradientAverage(), training=True, instances=2, examples=[1])
    from types import SimpleNamespace

    from nimble.ir.taskgraph import TaskGraph

    plain = SimpleNamespace(graph=TaskGraph.load(FIXTURE_DIR / "resnet50_train.json.gz"))
    with pytest.raises(InputError, match="recording made without it"):
        check_average(GradientAverage(), training=True, instances=1, examples=[1],
                      recording=plain)
    assert not dist.is_initialized()  # the two ranks above ran in processes of their own
    with pytest.raises(InputError, match="init_process_group"):
        check_average(GradientAverage(), training=True, instances=1, examples=[1])


def test_only_the_averaging_all_reduces_may_be_in_a_training_steps_backward():
    from nimble.engine.collectives import check_training_collectives
    from nimble.errors import InputError
    from nimble.ir.taskgraph import TaskGraph

    g = TaskGraph.load(FIXTURE_DIR / "resnet50_train.json.gz")
    forward_tasks = g.meta["phases"][0]
    kernels = [t for t in g.tasks if t.kind == "kernel"]
    last = kernels[-1]
    last.name = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    check_training_collectives(g, training=True, averaging=True)
    with pytest.raises(InputError, match="collectives"):
        check_training_collectives(g, training=True, averaging=False)
    first = next(t for t in kernels if t.id < forward_tasks)
    first.name = "ncclDevKernel_Broadcast_RING_LL"  # a DDP-like broadcast in the forward
    with pytest.raises(InputError, match="collectives"):
        check_training_collectives(g, training=True, averaging=True)


def test_the_buckets_are_all_reduced_in_their_plans_order(monkeypatch):
    """Every rank must issue its all-reduces in one order, and the plan's (the last gradients
    first, as the backward makes them, and as DDP's reducer buckets them) lets the first start
    while the backward still runs."""
    sizes = [100, 25, 75, 50, 12]  # float32 elements per gradient, in parameter order
    grads = [torch.full((n,), float(i + 1)) for i, n in enumerate(sizes)]
    small = GradientAverage(bucket_bytes=4 * 80, first_bucket_bytes=4 * 40)
    plan = bucket_plan([4 * n for n in sizes], ["f32"] * len(sizes), small.bucket_bytes,
                       small.first_bucket_bytes)
    assert len(plan) >= 3 and plan[0][0] == len(sizes) - 1
    if hasattr(dist, "_compute_bucket_assignment_by_size"):
        assert plan == _ddp_buckets(sizes, [torch.float32] * len(sizes),
                                    small.first_bucket_bytes, small.bucket_bytes)
    reduced = []

    def all_reduce(flat, group=None):
        # each gradient's values are its index + 1, halved by the division over 2 ranks
        reduced.append([round(2 * v) - 1 for v in dict.fromkeys(flat.tolist())])
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    out = averaged_gradients(grads, small)
    assert reduced == plan
    assert all(torch.equal(o, g / 2) for o, g in zip(out, grads))


def _backward_with_averaging(sizes: list[int], plan: list[list[int]]):
    """A backward of ``len(sizes)`` layers, last layer first (each an input-gradient kernel
    and a weight-gradient kernel), then per bucket of ``plan`` what averaged_gradients records:
    a copy into the bucket, its division, its NCCL all-reduce.  ``(graph, weight-gradient task
    per layer, all-reduce task per bucket)``."""
    from nimble.ir.taskgraph import Access, Buffer, BufferKind, Task, TaskGraph, TaskKind

    g = TaskGraph()

    def buffer(size: int) -> int:
        g.buffers.append(Buffer(len(g.buffers), BufferKind.INTERMEDIATE, size,
                                (len(g.buffers) + 1) << 24))
        return len(g.buffers) - 1

    def task(name: str, reads: list[int], writes: list[int]) -> int:
        accesses = [Access(b, 0, g.buffers[b].size, False) for b in reads] + \
            [Access(b, 0, g.buffers[b].size, True) for b in writes]
        g.tasks.append(Task(len(g.tasks), TaskKind.KERNEL, name=name, accesses=accesses))
        return len(g.tasks) - 1

    saved = [buffer(4096) for _ in sizes]  # the forward's activations
    incoming = buffer(4096)  # the loss's gradient
    weight_task: dict[int, int] = {}
    grads = {}
    for layer in reversed(range(len(sizes))):
        grads[layer] = buffer(sizes[layer])
        weight_task[layer] = task("wgrad", [incoming, saved[layer]], [grads[layer]])
        below = buffer(4096)
        task("dgrad", [incoming, saved[layer]], [below])
        incoming = below
    reduces = []
    for bucket in plan:
        flat = buffer(sum(sizes[i] for i in bucket))
        task("cat", [grads[i] for i in bucket], [flat])
        task("div", [flat], [flat])
        reduces.append(task("ncclDevKernel_AllReduce_Sum_f32_RING_LL", [flat], [flat]))
    return g, weight_task, reduces


def test_each_buckets_all_reduce_waits_only_for_its_own_gradients():
    """In the recorded backward's DAG a bucket's all-reduce follows the gradients it holds and
    the buckets before it, nothing else: it can run beside the rest of the backward."""
    from nimble.analysis.deps import ancestors, build_dag

    sizes = [4 * n for n in (100, 25, 75, 50, 12, 40)]
    plan = bucket_plan(sizes, ["f32"] * len(sizes), 4 * 80, 4 * 40)
    g, weight_task, reduces = _backward_with_averaging(sizes, plan)
    dag = build_dag(g)
    before = ancestors(dag)
    for b, (bucket, reduce) in enumerate(zip(plan, reduces)):
        waits_for = {layer for layer, t in weight_task.items() if before[reduce] >> t & 1}
        # its own gradients, and those of the buckets reduced before it
        assert waits_for == {i for earlier in plan[:b + 1] for i in earlier}, (b, waits_for)
        if b:
            assert before[reduce] >> reduces[b - 1] & 1  # the ranks' one order
    assert not before[reduces[0]] >> weight_task[0] & 1  # the first runs beside the stem's work


@pytest.mark.parametrize("cap,want", [(15, [[4, 3], [2, 1], [0]]), (25, [[4, 3], [2], [1, 0]]),
                                      (5, [[4, 3], [2, 1], [0]]), (30, [[4, 3], [2, 1, 0]]),
                                      (None, [[4, 3], [2, 1, 0]])])
def test_the_last_bucket_splits_off_the_gradients_made_last(cap, want):
    assert split_last_bucket([[4, 3], [2, 1, 0]], [10] * 5, cap) == want
    assert split_last_bucket([], [], cap) == []


def test_averaging_inside_the_all_reduce_leaves_the_bucket_undivided(monkeypatch):
    sizes = [100, 25, 75, 50, 12]
    grads = [torch.full((n,), float(i + 1)) for i, n in enumerate(sizes)]
    seen = []

    def all_reduce(flat, op=None, group=None):
        seen.append((op, sorted({round(v) for v in flat.tolist()})))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    average = GradientAverage(bucket_bytes=4 * 200, first_bucket_bytes=4 * 40,
                              average_in_all_reduce=True, last_bucket_bytes=4 * 100)
    out = averaged_gradients(grads, average)
    whole = bucket_plan([4 * n for n in sizes], ["f32"] * 5, 4 * 200, 4 * 40)
    assert whole == [[4, 3], [2, 1, 0]]
    # the last bucket split; each bucket's values its gradients' index + 1, undivided
    assert seen == [(dist.ReduceOp.AVG, [4, 5]), (dist.ReduceOp.AVG, [2, 3]),
                    (dist.ReduceOp.AVG, [1])]
    assert all(torch.equal(o, g) for o, g in zip(out, grads))
