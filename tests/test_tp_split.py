"""nimble/cli/tp_decoders.py's Megatron split, on the CPU: every rank's shard run in a
thread of its own, the all-reduce a sum over the threads in lockstep as NCCL's is over the
GPUs, gives the whole model's logits."""
from __future__ import annotations

import threading

import pytest
import torch


def _worker():
    from nimble.cli import tp_decoders

    return tp_decoders


class LockstepSum:
    """``all_reduce(y)`` for ``world`` threads: each waits for the others' tensors of the same
    call, and every one ends holding their sum."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.deposited: dict[int, torch.Tensor] = {}
        self.calls = 0

    def __call__(self, y, *args, **kwargs) -> None:
        self.deposited[threading.get_ident()] = y.clone()
        self.barrier.wait()
        total = sum(self.deposited.values())
        self.barrier.wait()
        y.copy_(total)
        if self.barrier.wait() == 0:
            self.deposited.clear()
            self.calls += 1
        self.barrier.wait()


def _one_layer(transformers):
    """A one-layer Llama's config: 8 query heads, 4 key-value heads, a vocabulary of 50."""
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                    num_attention_heads=8, num_key_value_heads=4, vocab_size=50)


def _logits_in_threads(shards: list, ids) -> list:
    """Each rank's shard run on ``ids`` in a thread of its own, named by its rank (as the
    lockstep collectives find it); their logits in rank order."""
    got: list = [None] * len(shards)

    def run(rank: int) -> None:
        with torch.no_grad():
            got[rank] = shards[rank](input_ids=ids, use_cache=False).logits
    threads = [threading.Thread(target=run, args=(rank,), name=str(rank))
               for rank in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


@pytest.mark.parametrize("world,kv_heads", [(2, 4), (4, 4), (4, 2), (4, 1)])
def test_the_ranks_shards_with_their_sums_give_the_whole_models_logits(monkeypatch, world,
                                                                        kv_heads):
    """Key-value heads split over the ranks, and fewer of them than ranks (replicated)."""
    transformers = pytest.importorskip("transformers")
    worker = _worker()
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=kv_heads,
                                      vocab_size=50)
    torch.manual_seed(0)
    whole = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 50, (1, 7))
    with torch.no_grad():
        want = whole(input_ids=ids, use_cache=False).logits
    shards = []
    for rank in range(world):
        torch.manual_seed(0)
        shards.append(worker.split(transformers.LlamaForCausalLM(config).eval(), rank, world,
                                   head="whole"))
    assert shards[0].config.num_attention_heads == 8 // world
    assert shards[0].config.num_key_value_heads == max(kv_heads // world, 1)
    assert shards[0].config.head_dim == 8
    reduce = LockstepSum(world)
    monkeypatch.setattr(worker.dist, "all_reduce", reduce)
    got = _logits_in_threads(shards, ids)
    assert reduce.calls == 2 * config.num_hidden_layers
    for logits in got:
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_a_model_whose_heads_do_not_split_is_refused():
    transformers = pytest.importorskip("transformers")
    config = _one_layer(transformers)
    with pytest.raises(ValueError, match="do not split over 3"):  # 8 heads over 3 ranks
        _worker().split(transformers.LlamaForCausalLM(config), 0, 3)
    config.num_attention_heads, config.num_key_value_heads, config.hidden_size = 12, 4, 96
    with pytest.raises(ValueError, match="do not split over 6"):  # 6 ranks, 4 key-value heads
        _worker().split(transformers.LlamaForCausalLM(config), 0, 6)


def test_the_one_shot_all_reduce_is_asked_for_with_what_it_needs():
    transformers = pytest.importorskip("transformers")
    config = _one_layer(transformers)
    worker = _worker()
    with pytest.raises(ValueError, match="all_reduce='ring': one of nccl, one_shot, peer"):
        worker.split(transformers.LlamaForCausalLM(config), 0, 2, all_reduce="ring")
    half = transformers.LlamaForCausalLM(config).half()
    with pytest.raises(ValueError, match="bfloat16 or float32, not torch.float16"):
        worker.split(half, 0, 2, all_reduce="one_shot", max_tokens=8)
    for all_reduce in ("one_shot", "peer"):
        with pytest.raises(ValueError, match=f"the {all_reduce} all-reduce needs max_tokens"):
            worker.split(transformers.LlamaForCausalLM(config), 0, 2, all_reduce=all_reduce)


def test_a_one_shot_sum_refuses_a_call_larger_than_its_buffer():
    worker = _worker()
    summed = worker.OneShotSum.__new__(worker.OneShotSum)  # no symmetric memory on the CPU
    summed.buffer, summed.group_name = torch.zeros(16), "0"
    summed.op = lambda buffer, local, op, group: (buffer.copy_(local), buffer)[1]
    y = torch.arange(12.0).view(3, 4)
    assert torch.equal(summed(y), y)  # the op gets a view of the buffer shaped as the input
    with pytest.raises(ValueError, match="17 elements: the split was made for 16"):
        summed(torch.zeros(17))


def test_the_row_parallel_projections_are_linears_the_gemv_swap_reaches():
    """The output and down projections' shards are ``nn.Linear`` inside the all-reduce, so
    that ``fast_gemv`` (and ``fast_generator``) give them its kernels as any other; a copy of
    the split model keeps summing through the same sum."""
    import copy

    transformers = pytest.importorskip("transformers")
    from nimble.fast_gemv import GemvLinear, fast_gemv

    config = _one_layer(transformers)
    torch.manual_seed(0)
    whole = transformers.LlamaForCausalLM(config)
    o_proj = whole.model.layers[0].self_attn.o_proj.weight.detach().clone()
    model = _worker().split(whole, 1, 2)
    layer = model.model.layers[0]
    assert torch.equal(layer.self_attn.o_proj.weight, o_proj[:, 32:])
    assert layer.mlp.down_proj.weight.shape == (64, 48)
    fast_gemv(model, time=lambda config, weights, x: 1.0 if config is None else 0.5)
    assert isinstance(layer.self_attn.o_proj.linear, GemvLinear)
    assert isinstance(layer.mlp.down_proj.linear, GemvLinear)
    copied = copy.deepcopy(model)
    assert copied.model.layers[0].mlp.down_proj.reduce is layer.mlp.down_proj.reduce


class LockstepGather:
    """``all_gather_into_tensor(parts, local)`` for ``world`` threads, each named by its rank."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.deposited: dict[int, torch.Tensor] = {}
        self.calls = 0

    def __call__(self, parts, local) -> None:
        self.deposited[int(threading.current_thread().name)] = local.clone()
        self.barrier.wait()
        parts.copy_(torch.stack([self.deposited[r] for r in range(self.world)]))
        if self.barrier.wait() == 0:
            self.calls += 1
        self.barrier.wait()


@pytest.mark.parametrize("world,vocabulary", [(2, 50), (4, 50), (3, 50)])
def test_a_head_split_by_the_vocabulary_gives_the_whole_models_logits(monkeypatch, world,
                                                                      vocabulary):
    """The LM head's rows shared out (50 over 4 and 3 ranks: the last share padded), the
    logits gathered in rank order and the padding cut off; tied to the embedding in the
    whole model, which every rank keeps."""
    transformers = pytest.importorskip("transformers")
    worker = _worker()
    config = transformers.LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=12, num_key_value_heads=12,
                                      vocab_size=vocabulary, tie_word_embeddings=True)
    torch.manual_seed(0)
    whole = transformers.LlamaForCausalLM(config).eval()
    assert whole.lm_head.weight is whole.model.embed_tokens.weight
    ids = torch.randint(0, vocabulary, (2, 5))
    with torch.no_grad():
        want = whole(input_ids=ids, use_cache=False).logits
    shards = []
    for rank in range(world):
        torch.manual_seed(0)
        shards.append(worker.split(transformers.LlamaForCausalLM(config).eval(), rank, world))
    assert isinstance(shards[0].lm_head, worker.VocabParallel)
    assert shards[0].lm_head.linear.weight.shape == (-(-vocabulary // world), 48)
    monkeypatch.setattr(worker.dist, "all_reduce", LockstepSum(world))
    monkeypatch.setattr(worker.dist, "get_world_size", lambda *a: world)
    gather = LockstepGather(world)
    monkeypatch.setattr(worker.dist, "all_gather_into_tensor", gather)
    got = _logits_in_threads(shards, ids)
    assert gather.calls == 1
    for logits in got:
        assert logits.shape == want.shape
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_the_head_is_kept_whole_when_asked_and_refused_by_another_name():
    transformers = pytest.importorskip("transformers")
    config = _one_layer(transformers)
    worker = _worker()
    model = worker.split(transformers.LlamaForCausalLM(config), 0, 2, head="whole")
    assert isinstance(model.lm_head, torch.nn.Linear)
    with pytest.raises(ValueError, match="head='rows': one of vocab, whole"):
        worker.split(transformers.LlamaForCausalLM(config), 0, 2, head="rows")
