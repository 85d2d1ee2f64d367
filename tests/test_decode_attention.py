"""decode_attention: the kernel's values (run by Triton's interpreter on the CPU, in float32 and
float16: the interpreter's bfloat16 products are wrong, so bfloat16 is the GPU test's), how a
call's slots are split, which calls take the kernel, and the swap on a tiny Llama."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nimble.decode_attention as da
from nimble.errors import InputError
from helpers import interpreted_cases, tiny_decoder

WORKER = Path(__file__).parent / "workers" / "decode_attention_interpreted.py"


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """Every kernel case of the worker, by case (Triton's interpreter)."""
    return interpreted_cases(WORKER)


def test_the_kernel_computes_attention_over_the_cache(interpreted):
    """Every shape (grouped heads, a head size no power of two, split and unsplit slots), dtype
    and kind of mask, each sequence of a batch at its own position, and a strided query."""
    plain = {n: r for n, r in interpreted.items() if not n.startswith("rope-")}
    assert len(plain) == 37
    for name, r in plain.items():
        limit = 2e-3 if "float16" in name else 1e-5
        assert r["shape_ok"] and r["error"] < limit, (name, r)
        # the hidden stretches skipped by masked loads, not a branch: the same bits
        assert r.get("branchless_same", True), (name, r)
        # a split joined by its last program, not a second kernel: the same bits
        assert r.get("last_joins_same", True), (name, r)
        # a block's values asked for beside its keys: the same bits
        assert r.get("values_early_same", True), (name, r)
        # the whole cache as one tile, every slot asked for before the mask is known
        if "whole_error" in r:
            assert r["whole_error"] < limit, (name, r)
    assert sum("whole_error" in r for r in plain.values()) == 36  # all but the strided view


def test_the_kernel_rotates_the_query_and_reads_the_steps_key_and_value_itself(interpreted):
    """With the rotary embedding and the step's new key and value given
    (:mod:`nimble.attention_rope`): the same bits as the kernel on the rotated query and the
    cache with the slot written, the cache's own slot (NaN) never read; the split's parts
    too."""
    rope = {n: r for n, r in interpreted.items() if n.startswith("rope-")}
    assert len(rope) == 12
    for name, r in rope.items():
        limit = 2e-3 if "float16" in name else 1e-5
        assert r["shape_ok"] and r["same"] and r["error"] < limit, (name, r)
        assert r["whole_same"], (name, r)  # the whole cache as one tile: rotated the same
        assert r["whole_late_same"], (name, r)  # its cache asked for before or after the wait
        assert r.get("parts_same", True), (name, r)
    assert sum("parts_same" in r for r in rope.values()) == 8  # the split shapes


def test_the_slots_are_split_until_the_call_has_its_programs():
    def split(*args):
        return da.split_for(*args, unsplit_blocks=0)

    assert split(1, 8, 192) == da.Split(3, 64)  # one block of slots a program
    assert split(1, 8, 4096) == da.Split(16, 256)  # 16 programs a head, 4 blocks each
    assert split(64, 8, 576) == da.Split(1, 576)  # 512 heads: one program each
    assert split(8, 8, 576) == da.Split(3, 192)
    for batch, kv_heads, slots in ((1, 1, 1), (2, 8, 65), (1, 8, 10_000), (5, 3, 700)):
        for plan in (split(batch, kv_heads, slots), da.split_for(batch, kv_heads, slots)):
            assert plan.slots_per_split % (plan.block if plan.whole else da.BLOCK_SLOTS) == 0
            # every slot in one split, no split empty
            assert (plan.splits - 1) * plan.slots_per_split < slots <= \
                plan.splits * plan.slots_per_split


def test_a_cache_of_at_most_whole_slots_is_one_tile_a_program(monkeypatch):
    monkeypatch.setattr(da, "WHOLE_SLOTS", 256)
    assert da.split_for(1, 8, 192) == da.Split(1, 256, 256, True)  # rounded up to a power of 2
    assert da.split_for(4, 8, 256) == da.Split(1, 256, 256, True)
    assert not da.split_for(1, 8, 257).whole  # longer: walked in blocks, split
    assert da.split_for(1, 8, 257).splits > 1
    # splits asked for, or a rule of its own, walk the blocks as before
    assert da.split_for(1, 8, 192, splits=3) == da.Split(3, 64)
    assert da.split_for(1, 8, 192, unsplit_blocks=0) == da.Split(3, 64)
    assert da.parts_layout((1, 32, 1, 64), (1, 8, 192, 64)).splits == 1
    # a tile past WHOLE_ELEMENTS (256 slots of 128) is walked in blocks
    assert not da.split_for(1, 8, 192, head_dim=128).whole
    assert da.parts_layout((1, 32, 1, 128), (1, 8, 192, 128)).splits == 3
    assert da.split_for(1, 8, 100, head_dim=128) == da.Split(1, 128, 128, True)
    assert da.split_for(2, 4, 3) == da.Split(1, 16, 16, True)  # the matrix units' least tile
    monkeypatch.setattr(da, "WHOLE_SLOTS", 0)  # off: the blocks' rule
    assert da.split_for(1, 8, 192) == da.Split(3, 64)


def test_a_short_cache_is_read_unsplit_and_a_longer_one_split(monkeypatch):
    monkeypatch.setattr(da, "WHOLE_SLOTS", 0)  # the blocks' rule alone
    short = 4 * da.BLOCK_SLOTS
    assert da.split_for(1, 8, short, unsplit_blocks=4) == da.Split(1, short)
    assert da.split_for(1, 8, short + 1, unsplit_blocks=4).splits > 1
    limit = da.UNSPLIT_BLOCKS * da.BLOCK_SLOTS  # the default rule
    if limit:
        assert da.split_for(1, 8, limit).splits == 1
    assert da.split_for(1, 8, limit + da.BLOCK_SLOTS + 1).splits > 1


def test_splits_asked_for_are_taken_up_to_one_a_block():
    assert da.split_for(1, 8, 4096, splits=1) == da.Split(1, 4096)
    assert da.split_for(1, 8, 4096, splits=4) == da.Split(4, 1024)
    assert da.split_for(1, 8, 100, splits=8) == da.Split(2, 64)


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it is on the GPU."""

    @property
    def is_cuda(self):
        return True


def _gpu_like(*shape, dtype=torch.float16):
    return torch.zeros(shape, dtype=dtype).as_subclass(_OnGpu)


def test_only_the_calls_the_kernel_computes_as_sdpa_take_it():
    q, k, v = _gpu_like(2, 8, 1, 64), _gpu_like(2, 2, 50, 64), _gpu_like(2, 2, 50, 64)
    mask = _gpu_like(2, 1, 1, 50, dtype=torch.bool)
    assert da.unsupported(q, k, v, mask, 0.0, {}) is None
    assert da.unsupported(q, k, v, None, 0.0, {"is_causal": False, "sliding_window": 8}) is None
    refused = {
        "query positions": (_gpu_like(2, 8, 5, 64), k, v, mask, 0.0, {}),
        "GPU": (torch.zeros(2, 8, 1, 64), k, v, mask, 0.0, {}),
        "dtype": (_gpu_like(2, 8, 1, 64, dtype=torch.float64), k, v, mask, 0.0, {}),
        "head sizes": (_gpu_like(2, 8, 1, 64), k, _gpu_like(2, 2, 50, 32), mask, 0.0, {}),
        "query heads": (_gpu_like(2, 7, 1, 64), k, v, mask, 0.0, {}),
        "dropout": (q, k, v, mask, 0.1, {}),
        "position bias": (q, k, v, mask, 0.0, {"position_bias": q}),
        "soft-capping": (q, k, v, mask, 0.0, {"softcap": 30.0}),
        "mask of shape": (q, k, v, _gpu_like(2, 1, 3, 50, dtype=torch.bool), 0.0, {}),
        "mask of dtype": (q, k, v, _gpu_like(2, 1, 1, 50, dtype=torch.int64), 0.0, {}),
    }
    for words, call in refused.items():
        reason = da.unsupported(*call)
        assert reason and words.split()[-1] in reason, (words, reason)
    big = _gpu_like(1, 4, 1, 512)
    assert "head sizes" in da.unsupported(big, _gpu_like(1, 4, 9, 512),
                                          _gpu_like(1, 4, 9, 512), None, 0.0, {})


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=2, vocab_size=97,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval(), transformers


def _decode(model, transformers, steps=5, prompt=6, cache_len=40):
    """The logits of a prompt and ``steps`` greedy tokens after it, through a static cache."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=cache_len)
    ids = torch.arange(1, prompt + 1).view(1, prompt)
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        out.append(logits)
        for t in range(steps):
            token = logits.argmax(-1, keepdim=True)
            logits = model(input_ids=token, past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[prompt + t]])).logits[:, -1]
            out.append(logits)
    return torch.stack(out)


def _attention(query, key, value, mask, scale):
    """The operator's values on the CPU (the operator is the GPU's), as ``(B, 1, H, D)``."""
    groups = query.shape[1] // key.shape[1]
    keys, values = (t.repeat_interleave(groups, 1) for t in (key, value))
    out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                           scale=scale)
    return out.transpose(1, 2).contiguous()


def _rules_as_if_on_the_gpu(monkeypatch) -> None:
    """The swap's rules for which calls take the kernel, on CPU tensors taken for the GPU's."""
    real = da.unsupported
    monkeypatch.setattr(da, "unsupported", lambda q, k, v, m, d, kw: real(
        q.as_subclass(_OnGpu), k.as_subclass(_OnGpu), v.as_subclass(_OnGpu),
        None if m is None else m.as_subclass(_OnGpu), d, kw))


def test_a_swapped_llama_decodes_on_the_operator_and_prefills_on_sdpa(monkeypatch):
    model, transformers = _tiny_llama()
    want = _decode(model, transformers)
    calls = []

    def on_cpu(query, key, value, mask, scale):  # the operator is the GPU's; its kernel here
        calls.append((tuple(query.shape), tuple(key.shape), mask.dtype))
        return _attention(query, key, value, mask, scale)
    monkeypatch.setattr(da, "decode_attention_op", on_cpu)
    _rules_as_if_on_the_gpu(monkeypatch)
    swap = da.decode_attention(model)
    assert model.config._attn_implementation == da.NAME
    got = _decode(model, transformers)
    # two layers, five single-token steps; the prompt ran on sdpa
    assert len(calls) == 10 and all(q == (1, 8, 1, 8) and k == (1, 2, 40, 8) and
                                    m == torch.bool for q, k, m in calls)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    swap.undo()
    assert model.config._attn_implementation == "sdpa"
    calls.clear()
    _decode(model, transformers)
    assert not calls


def test_a_model_not_on_sdpa_or_swapped_twice_is_refused():
    model, _ = _tiny_llama()
    da.decode_attention(model)
    with pytest.raises(InputError, match="already"):
        da.decode_attention(model)
    model.set_attn_implementation("eager")
    with pytest.raises(InputError, match="attn_implementation='sdpa'"):
        da.decode_attention(model)
    with pytest.raises(InputError, match="nn.Module"):
        da.decode_attention("model")


def test_the_values_early_switch_asks_for_the_values_before_the_scores_in_the_ptx():
    """VALUES_EARLY's point, in the code Triton writes for sm_90: every global load of a block
    (its keys and values) comes before the block's first exponential; without it the values'
    loads come after.  The whole cache's tile (WHOLE_SLOTS) the same, with no spill."""
    triton = pytest.importorskip("triton", reason="compiles with Triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import nimble.decode_attention_kernels as kernels

    ints = ("slots", "groups", "kv_heads", "splits", "slots_per_split", "sqb", "sqh", "skb",
            "skh", "skl", "svb", "svh", "svl", "smb", "smh", "sml", "sob", "soh",
            "scb", "ssb", "sknb", "sknh", "svnb", "svnh")
    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "mask_ptr": "*i1",
                "out_ptr": "*fp32", "part_ptr": "*fp32", "stat_ptr": "*fp32",
                "count_ptr": "*i32", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "kn_ptr": "*bf16",
                "vn_ptr": "*bf16", "pos_ptr": "*i64"}

    def ptx(early: bool, whole: bool = False) -> list[str]:
        constexprs = {"HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_R": 16,
                      "BLOCK_L": 256 if whole else 64, "MASK": 1, "SPLIT": not whole,
                      "IEEE": False, "BRANCHLESS": False, "LAST_JOINS": False,
                      "VALUES_EARLY": early, "ROPE": False, "WAITS": False, "WHOLE": whole,
                      "CACHE_EARLY": False}
        signature = {**pointers, "scale": "fp32", **{i: "i32" for i in ints},
                     **{name: "constexpr" for name in constexprs}}
        plan = da.Split(1, 256, 256, True) if whole else da.Split(3, 64)
        kernel = triton.compile(ASTSource(fn=kernels.attend, signature=signature,
                                          constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": da._warps(plan, 64), "num_stages": 2})
        return kernel.asm["ptx"].splitlines()

    def loads_after_first_exponential(lines: list[str]) -> int:
        first = next(i for i, line in enumerate(lines) if "ex2" in line)
        return sum("ld.global" in line for line in lines[first:])

    assert loads_after_first_exponential(ptx(True)) == 0
    assert loads_after_first_exponential(ptx(False)) > 0
    # the whole cache as one tile of 256 slots: its loads before its first exponential too,
    # and its two tiles held in registers on the warps it is given (no spill to local memory)
    whole = ptx(True, whole=True)
    assert loads_after_first_exponential(whole) == 0
    assert not any("ld.local" in line or "st.local" in line for line in whole)


@pytest.mark.parametrize("family", ["Qwen2", "Mistral", "Qwen3", "Gemma", "Phi3", "Granite",
                                    "Cohere", "Olmo2"])
def test_other_decoders_decode_on_the_operator_as_on_sdpa(monkeypatch, family):
    """The swap on other families' decoders (their own scalings, query-key norms, a sliding
    window's cache layers): every decode step's attention on the operator (its CPU form, the
    kernel's split in torch's operations), the logits those of sdpa."""
    transformers = pytest.importorskip("transformers")
    model = tiny_decoder(family, vocab=97, max_position_embeddings=256,
                         attn_implementation="sdpa")
    want = _decode(model, transformers, cache_len=200)  # four blocks of slots: split
    calls = []
    op = da.decode_attention_op

    def counted(*args):
        calls.append(tuple(args[0].shape))
        return op(*args)
    monkeypatch.setattr(da, "decode_attention_op", counted)
    _rules_as_if_on_the_gpu(monkeypatch)
    swap = da.decode_attention(model)
    got = _decode(model, transformers, cache_len=200)
    swap.undo()
    assert len(calls) == 10 and all(q == (1, 4, 1, 32) for q in calls), calls
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
