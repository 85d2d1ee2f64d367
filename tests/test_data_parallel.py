"""A ``DistributedDataParallel`` model given to ``Nimble`` unchanged (no GPU: real DDPs over gloo
on the CPU).

:mod:`nimble.engine.data_parallel` unwraps the DDP and takes its settings as
``average_gradients``; what a graph cannot hold is refused with what to use instead.  DDP's
buffer broadcast (:mod:`nimble.record.buffer_broadcast`) is checked against eager DDP's own
forward over two processes.  The GPU side (a prepared DDP step against eager DDP) is
``tests/test_gpu_collectives.py``.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from helpers import FIXTURE_DIR, gloo_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nimble.engine.data_parallel import check_grad_sync, data_parallel_target, ddp_average
from nimble.errors import InputError
from nimble.record.gradient_average import BUCKET_BYTES, FIRST_BUCKET_BYTES, GradientAverage

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # broadcast_buffers's rename


@pytest.fixture(scope="module")
def one_rank():
    """A gloo process group of one rank in this process, gone after the module's tests."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rdv')}",
                                rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).train()


def test_a_ddp_prepares_its_module_with_its_group_and_default_buckets(one_rank):
    ddp = DistributedDataParallel(_network())
    target = data_parallel_target(ddp, training=True)
    assert target.module is ddp.module  # one rank: no buffer to broadcast to anyone
    assert target.wrapper is ddp
    # its reducer holds the parameters' gradient-accumulation nodes: captured on stand-ins
    assert target.average == GradientAverage(group=ddp.process_group, bucket_bytes=BUCKET_BYTES,
                                             first_bucket_bytes=FIRST_BUCKET_BYTES,
                                             held_accumulators=True, last_bucket_bytes=None)
    # the reducer's buckets as they are (Nimble's own averaging splits its last one)
    assert target.average.last_bucket_bytes is None


@pytest.mark.parametrize("settings", [dict(gradient_as_bucket_view=True),
                                      dict(static_graph=True), dict(broadcast_buffers=False)])
def test_settings_a_graph_holds_by_construction_are_accepted(one_rank, settings):
    ddp = DistributedDataParallel(_network(), **settings)
    target = data_parallel_target(ddp, training=True)
    assert target.module is ddp.module and target.average == ddp_average(ddp)


def test_bucket_cap_mb_sets_every_bucket_the_first_one_too(one_rank):
    average = data_parallel_target(DistributedDataParallel(_network(), bucket_cap_mb=2),
                                   training=True).average
    # DDP's reducer keeps its small first bucket only where bucket_cap_mb was left out
    assert (average.bucket_bytes, average.first_bucket_bytes) == (2 * 2**20, 2 * 2**20)


def test_inference_runs_the_wrapped_module_and_averages_nothing(one_rank):
    ddp = DistributedDataParallel(_network().eval())
    target = data_parallel_target(ddp, training=False)
    assert target.module is ddp.module and target.average is None


def test_a_plain_model_keeps_its_average_gradients(one_rank):
    model = _network()
    assert data_parallel_target(model, True, True) == \
        data_parallel_target(model, True, GradientAverage())
    assert data_parallel_target(model, True).average is None
    with pytest.raises(InputError, match="leave average_gradients out"):
        data_parallel_target(DistributedDataParallel(model), True, True)


def test_find_unused_parameters_is_refused_with_what_to_use(one_rank):
    ddp = DistributedDataParallel(_network(), find_unused_parameters=True)
    with pytest.raises(InputError, match="find_unused_parameters=False"):
        data_parallel_target(ddp, training=True)
    assert data_parallel_target(ddp, training=False).module is ddp.module  # inference: fine


def test_communication_hooks_are_refused_python_or_built_in(one_rank):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooked = DistributedDataParallel(_network())
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(InputError, match="communication hook \\(allreduce_hook.*without it"):
        data_parallel_target(hooked, training=True)
    built_in = DistributedDataParallel(_network())
    built_in._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    with pytest.raises(InputError, match="communication hook \\(.*FP16_COMPRESS"):
        data_parallel_target(built_in, training=True)


def test_ignored_parameters_are_refused(one_rank):
    model = _network()
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["3.bias"])
    with pytest.raises(InputError, match="requires_grad=False"):
        data_parallel_target(DistributedDataParallel(model), training=True)


def test_no_sync_is_refused_at_prepare_and_at_each_call(one_rank):
    ddp = DistributedDataParallel(_network())
    check_grad_sync(ddp)
    check_grad_sync(None)
    with ddp.no_sync():
        with pytest.raises(InputError, match="outside"):
            data_parallel_target(ddp, training=True)
        with pytest.raises(InputError, match="Leave no_sync\\(\\) out"):
            check_grad_sync(ddp)


def test_nimble_prepares_the_wrapped_module_with_the_wrappers_averaging(one_rank, monkeypatch):
    import nimble.api

    seen = {}

    class Stop(Exception):
        pass

    def prepare_serving(model, examples, **kwargs):
        seen.update(model=model, average=kwargs["average"], training=kwargs["training"])
        raise Stop
    monkeypatch.setattr(nimble.api, "prepare_serving", prepare_serving)
    ddp = DistributedDataParallel(_network(), bucket_cap_mb=4)
    nm = nimble.Nimble(ddp)
    with pytest.raises(Stop):
        nm.prepare(torch.randn(4, 6), training=True)
    assert seen["model"] is ddp.module and seen["training"]
    assert seen["average"] == GradientAverage(ddp.process_group, 4 * 2**20, 4 * 2**20,
                                              held_accumulators=True, last_bucket_bytes=None)
    ddp.eval()
    with pytest.raises(Stop):
        nm.prepare(torch.randn(4, 6))
    assert seen["model"] is ddp.module and seen["average"] is None
    assert nm._target.module is nm.model  # nothing adopted from a failed prepare


def _ddps_bucket_order(model: nn.Module, **settings) -> list[list[int]]:
    """The parameters (by position) of each bucket DDP's reducer hands to its communication
    hook, in the order it calls it, once its buckets are rebuilt after a first backward."""
    position = {id(p): i for i, p in enumerate(model.parameters())}
    ddp = DistributedDataParallel(model, **settings)
    called: list[list[int]] = []

    def hook(state, bucket):
        called.append(sorted(position[id(p)] for p in bucket.parameters()))
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    ddp.register_comm_hook(None, hook)
    x = torch.randn(8, next(model.parameters()).shape[1])
    for _ in range(2):
        called.clear()
        ddp(x).sum().backward()
    return called


@pytest.mark.parametrize("widths,settings", [
    ([30, 40, 50, 10], dict(bucket_cap_mb=0.004)),
    ([512, 512, 512, 512, 512], {}),  # DDP's defaults: a small first bucket, then 25 MiB
])
def test_the_all_reduces_go_in_the_order_ddps_reducer_calls_its_buckets(one_rank, monkeypatch,
                                                                          widths, settings):
    def network() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(widths, widths[1:])):
            layers += [nn.Linear(a, b)] + ([nn.BatchNorm1d(b), nn.ReLU()] if i == 0 else [])
        return nn.Sequential(*layers).train()
    want = _ddps_bucket_order(network(), **settings)
    assert len(want) >= 2
    average = data_parallel_target(DistributedDataParallel(network(), **settings),
                                   training=True).average
    from nimble.record.gradient_average import averaged_gradients

    called: list[list[int]] = []
    # each gradient's values are its position + 1 (one rank: the division leaves them)
    monkeypatch.setattr(dist, "all_reduce", lambda flat, group=None: called.append(
        sorted(round(v) - 1 for v in dict.fromkeys(flat.tolist()))))
    grads = [torch.full_like(p, float(i + 1)) for i, p in enumerate(network().parameters())]
    averaged_gradients(grads, average)
    assert called == want


def _broadcast_rank(rank: int, results) -> None:
    eager = DistributedDataParallel(_network())
    ddp = DistributedDataParallel(_network())
    target = data_parallel_target(ddp, training=True)
    names = [n for n, _ in target.module.named_parameters()]
    with torch.no_grad():  # each rank's own statistics, as training leaves them
        for bn in (eager.module[1], ddp.module[1]):
            bn.running_mean.fill_(rank + 1.0)
            bn.running_var.fill_(rank + 2.0)
            bn.num_batches_tracked.fill_(rank + 3)
    torch.manual_seed(rank)
    x = torch.randn(5, 6)
    want, got = eager(x), target.module(x)
    results[rank] = dict(
        wrapped=type(target.module).__name__, names=names == [
            n for n, _ in ddp.named_parameters()],
        out=torch.equal(want, got),
        buffers=[torch.equal(a, b) for a, b in zip(eager.module.buffers(),
                                                   ddp.module.buffers())],
        tracked=int(ddp.module[1].num_batches_tracked))


def test_buffers_are_broadcast_from_rank_0_in_the_forward_as_ddp_does():
    results = gloo_ranks(_broadcast_rank)
    for rank in (0, 1):
        seen = results[rank]
        assert seen["wrapped"] == "BufferBroadcast" and seen["names"], seen
        assert seen["out"] and all(seen["buffers"]), seen
        assert seen["tracked"] == 3 + 1, seen  # rank 0's count, then this forward's


def test_training_collectives_in_the_forward_only_where_data_parallel_puts_them():
    from nimble.engine.collectives import check_training_collectives
    from nimble.ir.taskgraph import TaskGraph

    g = TaskGraph.load(FIXTURE_DIR / "resnet50_train.json.gz")
    kernels = [t for t in g.tasks if t.kind == "kernel"]
    kernels[-1].name = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"  # a bucket's all-reduce
    next(t for t in kernels if t.id < g.meta["phases"][0]).name = \
        "ncclDevKernel_Broadcast_RING_LL"

    class Broadcasting(nn.Module):
        nimble_forward_collectives = True
    sync_bn = nn.Sequential(nn.SyncBatchNorm(4)).train()
    with pytest.raises(InputError, match="collectives"):
        check_training_collectives(g, training=True, averaging=True, model=nn.Linear(2, 2))
    check_training_collectives(g, training=True, averaging=True, model=Broadcasting())
    check_training_collectives(g, training=True, averaging=True, model=sync_bn)
    with pytest.raises(InputError, match="SyncBatchNorm.*average_gradients=True.*BatchNorm"):
        check_training_collectives(g, training=True, averaging=False, model=sync_bn)
