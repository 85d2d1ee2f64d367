"""A causal LM split over the ranks of a process group as Megatron splits it, for the benches
and tests of tensor-parallel decoding (issue 51): each attention's query, key and value heads
and each MLP's intermediate columns shared out, the output and down projections split by rows
and their partial sums all-reduced (one ``torch.distributed.all_reduce`` each, which a prepared
graph holds as NCCL kernels); the embedding kept whole, the LM head split by rows of the
vocabulary and its logits gathered (one ``all_gather_into_tensor``; ``head="whole"`` keeps it
whole on every rank, as this split did before: at 1B the head is a fifth of the weights,
streamed by every rank).  Llama-architecture models of transformers (:mod:`nimble.cli.decoders`'s ``llama_*``).  Imports torch.

``all_reduce="one_shot"`` sums the partial sums with torch's one-shot all-reduce over
symmetric memory instead (``torch.ops.symm_mem.one_shot_all_reduce_copy``: each rank copies its
partial sum into a buffer every rank maps, meets the others at a barrier and reads their
buffers over NVLink; one kernel, a few KiB in a few µs where NCCL's kernel takes 13 µs on two
H200s); bfloat16 and float32 only (the op's types), and at most ``max_tokens`` tokens a call.
``all_reduce="peer"`` sums them with Nimble's own kernel over symmetric memory
(:class:`nimble.peer_sum.PeerSum`: one wait a call, the ranks added in rank order), for half,
bfloat16 and float32, at most ``max_tokens`` tokens a call too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

#: How the partial sums of a split layer are summed over the ranks.
ALL_REDUCES = ("nccl", "one_shot", "peer")


def nccl_sum(y):
    """``y`` summed over the ranks in place by NCCL."""
    dist.all_reduce(y)
    return y


class OneShotSum:
    """A sum over the ranks by torch's one-shot all-reduce over symmetric memory, through one
    buffer of ``max_numel`` elements that every split layer shares (the kernel's barriers keep
    one call's reads from the next call's writes; the graph keeps collectives in order)."""

    def __init__(self, max_numel: int, dtype, device) -> None:
        import torch
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD
        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by torch releases before symmetric memory was default
            enable(self.group_name)
        self.buffer = symm_mem.empty(max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, group)
        ops = torch.ops.symm_mem
        if hasattr(ops, "one_shot_all_reduce_copy"):  # the copy in, inside the kernel
            self.op = ops.one_shot_all_reduce_copy
        else:  # torch releases before it: a copy kernel, then the all-reduce
            self.op = lambda buffer, local, op, group_name: ops.one_shot_all_reduce(
                buffer.copy_(local), op, group_name)

    def __deepcopy__(self, memo) -> "OneShotSum":
        return self  # the buffer every rank maps is the group's (see PeerSum.__deepcopy__)

    def __call__(self, y):
        n = y.numel()
        if n > self.buffer.numel():
            raise ValueError(f"a one-shot all-reduce of {n} elements: the split was made for "
                             f"{self.buffer.numel()} (max_tokens too small)")
        return self.op(self.buffer[:n].view(y.shape), y.contiguous(), "sum", self.group_name)


class RowParallel(nn.Module):
    """A linear layer's rows of input features on this rank (its ``linear``: an ``nn.Linear``
    of those features, which :func:`nimble.fast_gemv.fast_gemv` may swap as any other); the
    full output summed over the ranks (one all-reduce per call, by ``reduce``:
    :func:`nccl_sum`, a :class:`OneShotSum` or a :class:`nimble.peer_sum.PeerSum`)."""

    def __init__(self, linear: nn.Linear, start: int, stop: int, reduce=nccl_sum) -> None:
        super().__init__()
        self.linear = nn.Linear(stop - start, linear.out_features, bias=False,
                                device=linear.weight.device, dtype=linear.weight.dtype)
        self.linear.weight.data.copy_(linear.weight.detach()[:, start:stop])
        self.reduce = reduce

    @property
    def weight(self) -> nn.Parameter:
        return self.linear.weight

    def forward(self, x):
        return self.reduce(self.linear(x))


def nccl_gather(local):
    """``local`` (every rank's of one shape) from every rank, stacked in rank order, by NCCL."""
    parts = local.new_empty((dist.get_world_size(),) + tuple(local.shape))
    dist.all_gather_into_tensor(parts, local.contiguous())
    return parts


class VocabParallel(nn.Module):
    """The head's rows of the vocabulary on this rank (its ``linear``: an ``nn.Linear`` of
    ``ceil(vocabulary / world)`` rows, the last rank's padded with zero rows), the logits
    gathered from every rank (by ``gather``: :func:`nccl_gather`) and the padding cut off: each
    rank streams its share of the head's weight, the largest of a small model's."""

    def __init__(self, head: nn.Linear, rank: int, world: int, gather=nccl_gather) -> None:
        super().__init__()
        self.vocabulary = head.out_features
        share = -(-self.vocabulary // world)
        start, stop = min(rank * share, self.vocabulary), min((rank + 1) * share,
                                                              self.vocabulary)
        self.linear = nn.Linear(head.in_features, share, bias=head.bias is not None,
                                device=head.weight.device, dtype=head.weight.dtype)
        with torch.no_grad():
            self.linear.weight.zero_()
            self.linear.weight[:stop - start].copy_(head.weight.detach()[start:stop])
            if head.bias is not None:
                self.linear.bias.zero_()
                self.linear.bias[:stop - start].copy_(head.bias.detach()[start:stop])
        self.gather = gather

    def forward(self, x):
        lead = x.shape[:-1]
        parts = self.gather(self.linear(x.reshape(-1, x.shape[-1])))  # (ranks, tokens, share)
        return parts.permute(1, 0, 2).reshape(*lead, -1)[..., :self.vocabulary]


def _columns(linear: nn.Linear, start: int, stop: int) -> nn.Linear:
    """A linear layer's output features ``start:stop``."""
    part = nn.Linear(linear.in_features, stop - start, bias=False,
                     device=linear.weight.device, dtype=linear.weight.dtype)
    part.weight.data.copy_(linear.weight.detach()[start:stop])
    return part


def _reduce_of(model, all_reduce: str, max_tokens: int | None):
    """The sum over the ranks the split layers use (see the module docstring)."""
    import torch

    if all_reduce not in ALL_REDUCES:
        raise ValueError(f"all_reduce={all_reduce!r}: one of {', '.join(ALL_REDUCES)}")
    if all_reduce == "nccl":
        return nccl_sum
    weight = model.model.layers[0].mlp.down_proj.weight
    if not max_tokens or max_tokens < 1:
        raise ValueError(f"the {all_reduce} all-reduce needs max_tokens (batch x prompt length "
                         "of the largest call) to size its buffer")
    if all_reduce == "peer":
        from ..peer_sum import PeerSum

        return PeerSum(max_tokens * model.config.hidden_size, weight.dtype, weight.device)
    if weight.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the one-shot all-reduce sums bfloat16 or float32, not {weight.dtype}: "
                         "use all_reduce='nccl' or 'peer' for this model")
    return OneShotSum(max_tokens * model.config.hidden_size, weight.dtype, weight.device)


def _kv_heads_of_rank(kv_heads: int, rank: int, world: int) -> range:
    """The key-value heads ``rank`` keeps: its share where they split over ``world``, else (a
    model with fewer key-value heads than ranks, as Megatron and vLLM do it) the one head its
    query heads read, each head kept on ``world // kv_heads`` ranks."""
    if kv_heads % world == 0:
        return range(rank * kv_heads // world, (rank + 1) * kv_heads // world)
    head = rank * kv_heads // world
    return range(head, head + 1)


#: Where the LM head lies: split by rows of the vocabulary (its logits gathered), or whole on
#: every rank.
HEADS = ("vocab", "whole")


def _gather_of(head: nn.Linear, world: int, all_reduce: str, max_rows: int | None):
    """How a vocabulary-split head's logits are gathered: by NCCL, or with ``"peer"`` by
    Nimble's kernel (a :class:`nimble.peer_sum.PeerSum` that gathers: a submodule of the head,
    its table one of the model's buffers) through buffers of ``max_rows`` rows of logits."""
    if all_reduce != "peer":
        return nccl_gather
    from ..peer_sum import PeerSum

    share = -(-head.out_features // world)
    return PeerSum(max_rows * share, head.weight.dtype, head.weight.device, gathers=True)


def split(model, rank: int, world: int, all_reduce: str = "nccl",
          max_tokens: int | None = None, head: str = "vocab", max_batch: int | None = None):
    """``model`` (a ``LlamaForCausalLM``) split over ``world`` ranks in place, this rank's
    share kept; its config then says the heads one rank holds (the static cache is sized from
    it), the head size unchanged.  Key-value heads fewer than the ranks are replicated (each
    rank keeps the one its query heads read).  ``all_reduce`` says how the partial sums are
    summed (:data:`ALL_REDUCES`; ``"one_shot"`` and ``"peer"`` need ``max_tokens``, the most
    tokens one call carries); ``head`` whether the LM head is split by the vocabulary
    (:class:`VocabParallel`: untied from the embedding, which every rank keeps whole) or kept
    whole (:data:`HEADS`).  With ``"peer"`` the split head's logits are gathered by the same
    kernel, through buffers of ``max_batch`` rows (the head's most: a step's batch; default
    ``max_tokens``)."""
    if head not in HEADS:
        raise ValueError(f"head={head!r}: one of {', '.join(HEADS)}")
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % world or (kv_heads % world and world % kv_heads) \
            or config.intermediate_size % world:
        raise ValueError(f"{heads} heads, {kv_heads} key-value heads and "
                         f"{config.intermediate_size} MLP columns do not split over {world}")
    q = slice(rank * heads // world * head_dim, (rank + 1) * heads // world * head_dim)
    kept = _kv_heads_of_rank(kv_heads, rank, world)
    kv = slice(kept.start * head_dim, kept.stop * head_dim)
    mlp = config.intermediate_size // world
    m = slice(rank * mlp, (rank + 1) * mlp)
    reduce = _reduce_of(model, all_reduce, max_tokens)
    for layer in model.model.layers:
        attention, ffn = layer.self_attn, layer.mlp
        attention.q_proj = _columns(attention.q_proj, q.start, q.stop)
        attention.k_proj = _columns(attention.k_proj, kv.start, kv.stop)
        attention.v_proj = _columns(attention.v_proj, kv.start, kv.stop)
        attention.o_proj = RowParallel(attention.o_proj, q.start, q.stop, reduce)
        # transformers keeps the query heads per key-value head on the module, from the config
        attention.num_key_value_groups = heads // world // len(kept)
        ffn.gate_proj = _columns(ffn.gate_proj, m.start, m.stop)
        ffn.up_proj = _columns(ffn.up_proj, m.start, m.stop)
        ffn.down_proj = RowParallel(ffn.down_proj, m.start, m.stop, reduce)
    if head == "vocab" and world > 1:
        model.lm_head = VocabParallel(model.lm_head, rank, world, _gather_of(
            model.lm_head, world, all_reduce, max_batch or max_tokens))
    local = type(config).from_dict(config.to_dict())
    local.num_attention_heads, local.num_key_value_heads = heads // world, len(kept)
    local.head_dim = head_dim
    model.config = local
    return model
