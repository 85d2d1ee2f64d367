"""The rotary embedding and the cache read in the decode attention kernel on the GPU
(nimble.attention_rope): the kernel against the plain kernel on the rotated query and the
written cache in the three dtypes, and a swapped Llama whose step folds them, compiled and
prepared by Nimble."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

NEW_TOKENS = 24


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_kernel_rotating_and_reading_the_new_slot_matches_the_plain_kernel(dtype):
    import torch

    import nimble.attention_rope as ar
    import nimble.decode_attention as da

    dt = getattr(torch, dtype)
    torch.manual_seed(7)
    for batch, heads, kv_heads, slots, head_dim, splits in (
            (1, 32, 8, 192, 64, 3), (1, 32, 8, 4096, 64, None), (2, 6, 2, 300, 128, None),
            (1, 8, 8, 100, 64, 1)):
        fused = torch.randn(batch, 1, (heads + 2 * kv_heads) * head_dim, device="cuda",
                            dtype=dt)
        q, k_new, v_new = (t.view(batch, 1, -1, head_dim).transpose(1, 2) for t in fused.split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1))
        k, v = (torch.randn(batch, kv_heads, slots, head_dim, device="cuda", dtype=dt)
                for _ in range(2))
        position = torch.tensor([slots - 9], device="cuda")
        k[:, :, position], v[:, :, position] = float("nan"), float("nan")
        angle = torch.randn(1, 1, 1, head_dim // 2, device="cuda").repeat(1, 1, 1, 2)
        rope = da.Rope(angle.cos().to(dt), angle.sin().to(dt), k_new, v_new, position)
        keep = (torch.arange(slots, device="cuda") <= position).view(1, 1, 1, slots)
        got = da.launch(q, k, v, keep, head_dim ** -0.5, splits, rope=rope)
        qr, kr, vr = ar.reference_inputs(q, k, v, rope)
        want = da.launch(qr, kr, vr, keep, head_dim ** -0.5, splits)
        assert torch.isfinite(got).all(), (slots, "the cache's own slot was read")
        # the kernel's rotation may contract into fused multiply-adds where torch's does not:
        # the last bit of a rotated element, no more
        limit = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}.get(dt, 2 ** -20)
        assert (got.float() - want.float()).abs().max() <= limit * want.float().abs().max(), \
            (batch, slots, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_whole_cache_asked_for_before_the_wait_gives_the_same_bits(monkeypatch, dtype):
    """nimble.decode_attention.CACHE_BEFORE_WAIT: a cache of at most WHOLE_SLOTS, read as one
    tile with the rotation folded, asked for before or after the kernel's wait: the same
    bits, the cache's own slot (NaN) never read."""
    import torch

    import nimble.decode_attention as da

    dt = getattr(torch, dtype)
    torch.manual_seed(9)
    for batch, slots in ((1, 192), (8, 152), (1, 256)):
        heads, kv_heads, head_dim = 32, 8, 64
        assert da.split_for(batch, kv_heads, slots).whole
        fused = torch.randn(batch, 1, (heads + 2 * kv_heads) * head_dim, device="cuda",
                            dtype=dt)
        q, k_new, v_new = (t.view(batch, 1, -1, head_dim).transpose(1, 2) for t in fused.split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1))
        k, v = (torch.randn(batch, kv_heads, slots, head_dim, device="cuda", dtype=dt)
                for _ in range(2))
        position = torch.tensor([slots - 5], device="cuda")
        k[:, :, position], v[:, :, position] = float("nan"), float("nan")
        angle = torch.randn(1, 1, 1, head_dim // 2, device="cuda").repeat(1, 1, 1, 2)
        rope = da.Rope(angle.cos().to(dt), angle.sin().to(dt), k_new, v_new, position)
        keep = (torch.arange(slots, device="cuda") <= position).view(1, 1, 1, slots)
        got = {}
        for early in (True, False):
            monkeypatch.setattr(da, "CACHE_BEFORE_WAIT", early)
            got[early] = da.launch(q, k, v, keep, head_dim ** -0.5, None, rope=rope)
        assert torch.isfinite(got[True]).all(), (batch, slots)
        assert torch.equal(got[True], got[False]), (batch, slots, dtype)


def test_a_swapped_llamas_step_with_its_rotation_folded_prepares_proven_and_decodes_alike():
    import torch

    pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    from nimble.cli.decoders import causal_lm
    from nimble.decode_attention import decode_attention
    from nimble.gemv_prologue_pass import fusing
    from nimble.generate import Generator, prepare_with_nimble

    model = causal_lm("llama_small", "bfloat16")
    swap = decode_attention(model)
    torch.manual_seed(8)
    ids = torch.randint(0, model.config.vocab_size, (1, 128), device="cuda")
    tokens, tasks = {}, {}
    try:
        for roped in (False, True):
            torch._dynamo.reset()
            with fusing(rope_attention=roped) as the_pass:
                generator = Generator(model, max_cache_len=128 + NEW_TOKENS,
                                      prompt_buckets=[128], batch_sizes=[1],
                                      prepare_step=prepare_with_nimble(None, True))
            try:
                decode, _ = generator.steps(1)
                assert not decode.graph.meta["verified"]["not_bitwise"]
                tasks[roped] = len(decode.graph.tasks)
                tokens[roped] = generator.generate(ids, NEW_TOKENS)
                assert torch.equal(generator.generate(ids, NEW_TOKENS), tokens[roped])
            finally:
                generator.close()
            if roped:
                layers = model.config.num_hidden_layers
                assert max(r.roped for r in the_pass.runs) == layers, the_pass.runs
    finally:
        swap.undo()
    print(tasks)
    assert tasks[True] <= tasks[False]
    # the kernel's rotation of the query may differ from Inductor's in a last bit: the first
    # tokens are the same (later ones may part at a near-tie)
    assert torch.equal(tokens[True][:, :136], tokens[False][:, :136]), (tokens[True],
                                                                        tokens[False])
