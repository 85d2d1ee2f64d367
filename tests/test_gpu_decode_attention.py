"""decode_attention on the GPU: the kernel's values in three dtypes (bfloat16 too, which the
CPU's interpreter cannot check), and Generators on a swapped model, eager and on Inductor's
kernels, proven bit for bit and giving the swapped model's own greedy tokens; the kernel read
unsplit and split alike."""
from __future__ import annotations

import itertools

import pytest
import torch
from helpers import attention_reference, generator_worker_tokens

pytestmark = pytest.mark.gpu

NEW_TOKENS = 48


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_kernel_matches_attention_in_float64(dtype):
    import nimble.decode_attention as da
    from nimble.decode_attention import launch

    dt = getattr(torch, dtype)
    # (batch, query heads, key-value heads, slots, head size): a 1B Llama layer split over
    # programs, a long cache, a head size no power of two, a batch with one program a head
    for batch, heads, kv_heads, slots, head_dim in ((1, 32, 8, 192, 64),
                                                   (1, 32, 8, 576, 64), (1, 32, 8, 8192, 64),
                                                   (3, 12, 12, 200, 80), (64, 8, 2, 300, 128)):
        torch.manual_seed(slots)
        q = torch.randn(batch, heads, 1, head_dim, device="cuda", dtype=dt)
        k, v = (torch.randn(batch, kv_heads, slots, head_dim, device="cuda", dtype=dt)
                for _ in range(2))
        position = torch.randint(1, slots, (batch,), device="cuda")
        keep = (torch.arange(slots, device="cuda")[None, :] <= position[:, None]).view(
            batch, 1, 1, slots)
        masks = (keep, torch.where(keep, 0.0, torch.finfo(dt).min).to(dt), None)
        # the rule's split, every slot on one program (the unsplit kernel), a split of two
        for mask, splits in itertools.product(masks, (None, 1, 2)):
            got = launch(q, k, v, mask, head_dim ** -0.5, splits, branchless=False)
            # the hidden stretches skipped by masked loads instead of a branch: other code
            # (Triton compiles the loop otherwise), so not always the same bits; as close
            branchless = launch(q, k, v, mask, head_dim ** -0.5, splits, branchless=True)
            # a split joined by whichever of its programs ends last: the same values each time
            joined = [launch(q, k, v, mask, head_dim ** -0.5, splits, last_joins=True)
                      for _ in range(3)]
            assert all(torch.equal(j, joined[0]) for j in joined), (batch, slots, dtype, splits)
            torch.cuda.synchronize()
            want = attention_reference(q, k, v, None if mask is None else keep, head_dim ** -0.5)
            limit = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dt]
            forms = [("join kernel", got), ("last program joins", joined[0]),
                     ("branchless", branchless)]
            if splits is None and da.split_for(batch, kv_heads, slots, head_dim=head_dim).whole:
                forms[0] = ("whole", got)  # the rule's: the whole cache as one tile a program
                assert slots == 192, "the only case short enough"
            for form, value in forms:
                error = float((value.double() - want).norm() / want.norm())
                assert error < limit, (batch, heads, kv_heads, slots, head_dim, dtype, splits,
                                       form, error)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager kernels", "inductor"])
def test_a_swapped_llama_generates_its_own_greedy_tokens_from_proven_graphs(compiled):
    pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    from nimble.cli.decoders import causal_lm
    from nimble.decode_attention import NAME, decode_attention
    from nimble.generate import Generator, library_greedy, prepare_with_nimble

    model = causal_lm("llama_small", "bfloat16")
    swap = decode_attention(model)
    generator = Generator(model, max_cache_len=128 + NEW_TOKENS, prompt_buckets=[128],
                          batch_sizes=[1, 8], prepare_step=prepare_with_nimble(None, compiled))
    try:
        assert model.config._attn_implementation == NAME
        for batch in (1, 8):
            decode, _ = generator.steps(batch)
            assert not decode.graph.meta["verified"]["not_bitwise"]
            names = [t.short_name or t.name for t in decode.graph.tasks]
            assert any("attend" in n for n in names), names
            torch.manual_seed(batch)
            ids = torch.randint(0, model.config.vocab_size, (batch, 128), device="cuda")
            got = generator.generate(ids, NEW_TOKENS)
            if not compiled:  # the same kernels as the swapped model's eager greedy
                assert torch.equal(got, library_greedy(model, ids, NEW_TOKENS))
            assert torch.equal(generator.generate(ids, NEW_TOKENS), got)
    finally:
        generator.close()
        swap.undo()
    assert model.config._attn_implementation == "sdpa"


def test_a_saved_generator_of_a_swapped_model_loads_and_decodes_its_tokens(tmp_path):
    """The file carries the attention kernel's binary (found in Triton's cache, as Inductor's
    kernels are): loaded in another process and proven at its load, the Generator decodes the
    saving process's tokens."""
    pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    torch.manual_seed(0)
    saved, loaded, _ = generator_worker_tokens(tmp_path, "save-swapped",
                                               torch.randint(0, 1000, (1, 50)))
    assert torch.equal(loaded, saved)
