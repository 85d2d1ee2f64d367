"""One rank of tests/test_gpu_collectives.py's tensor-parallel decoding test (``torchrun``).

``tp_decode_worker.py``: every rank builds the same small Llama (random weights, one seed),
takes transformers' greedy tokens from it whole, then splits it over the ranks as Megatron does
(each attention's query, key and value heads and each MLP's intermediate columns shared out,
the output and down projections split by rows and their partial sums all-reduced over NCCL; the
embedding and the head kept whole) and decodes the same prompt with a
:class:`nimble.generate.Generator` on the split model: its decode step and prefill are prepared
graphs holding the all-reduces.  One JSON line per rank: the tokens' agreement with the whole
model's (departures judged at near-ties as the bench judges them), and the all-reduce kernels
of the decode step's graph.
"""
from __future__ import annotations

import json
import os
import traceback

import torch
import torch.distributed as dist
from torch import nn

NEW_TOKENS = 24
PROMPT = 16


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


def main() -> None:
    from nimble.cli.decoders import causal_lm
    from nimble.cli.generate_bench import _mismatches, wrong_sequences
    from nimble.generate import Generator, library_greedy
    from nimble.ir.kernel_names import collective_kernel

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    seen: dict = {"rank": rank, "world": world}
    try:
        # float16: the split model sums in another order, and the near-tie judgement (8 units
        # in the last place) is the bench's for this dtype
        model = causal_lm("llama_small", "float16")
        torch.manual_seed(5)
        ids = torch.randint(0, model.config.vocab_size, (1, PROMPT), device="cuda")
        want, logits = library_greedy(model, ids, NEW_TOKENS, with_logits=True)
        split(model, rank, world)
        generator = Generator(model, max_cache_len=PROMPT + NEW_TOKENS, prompt_buckets=[PROMPT],
                              batch_sizes=[1])
        got = generator.generate(ids, NEW_TOKENS)
        mismatch = _mismatches(got, want, logits, torch.float16)
        decode, _ = generator.steps(1)
        seen.update(mismatch=mismatch, wrong=wrong_sequences(mismatch),
                    all_reduces=sum(collective_kernel(t.name) for t in decode.graph.tasks),
                    layers=len(model.model.layers), streams=len(decode.schedule.streams))
    except Exception as e:  # noqa: BLE001 - the test reports it with the rank
        seen.update(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-3000:])
    print(json.dumps(seen), flush=True)
    os._exit(0)  # after captured collectives, destroying the process group can hang


if __name__ == "__main__":
    main()
