"""A module's weights as its kernels see them (nimble.record.module_weights): a tensor-parallel
model's DTensor parameters unwrapped into the shard each rank holds, by the parameter's name
(two CPU processes of one gloo group, no GPU)."""
from __future__ import annotations

import torch
from helpers import gloo_ranks
from torch import nn

from nimble.record.module_weights import module_weights, plain_tensors


def test_plain_parameters_and_buffers_are_themselves_and_shared_ones_listed_by_each_name():
    bn = nn.BatchNorm1d(4)
    model = nn.Sequential(nn.Linear(4, 4), bn)
    model.tied = model[0]  # the same Linear under a second name
    weights = module_weights(model)
    assert weights["0.weight"] is model[0].weight and weights["tied.weight"] is model[0].weight
    assert weights["1.running_mean"] is bn.running_mean
    assert plain_tensors("w", model[0].bias) == [("w", model[0].bias)]


def _rank(rank: int, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6))
    mesh = init_device_mesh("cpu", (2,))
    parallelize_module(model, mesh, {"0": ColwiseParallel()})
    weight = model[0].weight
    weights = module_weights(model)
    results[rank] = {
        "dtensor": isinstance(weight, DTensor), "names": sorted(weights),
        "plain": all(type(t) in (torch.Tensor, nn.Parameter) for t in weights.values()),
        "shard": tuple(weights["0.weight"].shape),
        "same_bytes": weights["0.weight"].data_ptr() == weight.to_local().data_ptr(),
    }


def test_a_tensor_parallel_models_parameters_are_the_shards_each_rank_holds():
    results = gloo_ranks(_rank)
    for rank in (0, 1):
        seen = results[rank]
        assert seen["dtensor"] and seen["names"] == ["0.bias", "0.weight"], seen
        assert seen["plain"] and seen["shard"] == (3, 8) and seen["same_bytes"], seen
