"""A causal LM split over the ranks of a process group as Megatron splits it, for the benches
and tests of tensor-parallel decoding (issue 51): each attention's query, key and value heads
and each MLP's intermediate columns shared out, the output and down projections split by rows
and their partial sums all-reduced (one ``torch.distributed.all_reduce`` each, which a prepared
graph holds as NCCL kernels); the embedding and the head kept whole.  Llama-architecture models
of transformers (:mod:`nimble.cli.decoders`'s ``llama_*``).  Imports torch.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn


class RowParallel(nn.Module):
    """A linear layer's rows of input features on this rank; the full output summed over the
    ranks (one all-reduce per call)."""

    def __init__(self, linear: nn.Linear, start: int, stop: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach()[:, start:stop].clone())

    def forward(self, x):
        y = nn.functional.linear(x, self.weight)
        dist.all_reduce(y)
        return y


def _columns(linear: nn.Linear, start: int, stop: int) -> nn.Linear:
    """A linear layer's output features ``start:stop``."""
    part = nn.Linear(linear.in_features, stop - start, bias=False,
                     device=linear.weight.device, dtype=linear.weight.dtype)
    part.weight.data.copy_(linear.weight.detach()[start:stop])
    return part


def split(model, rank: int, world: int):
    """``model`` (a ``LlamaForCausalLM``) split over ``world`` ranks in place, this rank's
    share kept; its config then says the heads one rank holds (the static cache is sized from
    it), the head size unchanged."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % world or kv_heads % world or config.intermediate_size % world:
        raise ValueError(f"{heads} heads, {kv_heads} key-value heads and "
                         f"{config.intermediate_size} MLP columns do not split over {world}")
    q = slice(rank * heads // world * head_dim, (rank + 1) * heads // world * head_dim)
    kv = slice(rank * kv_heads // world * head_dim, (rank + 1) * kv_heads // world * head_dim)
    mlp = config.intermediate_size // world
    m = slice(rank * mlp, (rank + 1) * mlp)
    for layer in model.model.layers:
        attention, ffn = layer.self_attn, layer.mlp
        attention.q_proj = _columns(attention.q_proj, q.start, q.stop)
        attention.k_proj = _columns(attention.k_proj, kv.start, kv.stop)
        attention.v_proj = _columns(attention.v_proj, kv.start, kv.stop)
        attention.o_proj = RowParallel(attention.o_proj, q.start, q.stop)
        ffn.gate_proj = _columns(ffn.gate_proj, m.start, m.stop)
        ffn.up_proj = _columns(ffn.up_proj, m.start, m.stop)
        ffn.down_proj = RowParallel(ffn.down_proj, m.start, m.stop)
    local = type(config).from_dict(config.to_dict())
    local.num_attention_heads, local.num_key_value_heads = heads // world, kv_heads // world
    local.head_dim = head_dim
    model.config = local
    return model
