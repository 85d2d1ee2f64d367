"""Greedy decoding over a static cache as Nimble graphs, on the GPU (:mod:`nimble.generate`).

The tokens equal transformers' own ``generate(do_sample=False, cache_implementation="static")``
with eager kernels, token for token, for 64 new tokens at batch 1 and 8 (GPT-2 and the small
Llama, float16, random weights); the decode step is proven bit for bit like any graph, from the
same cache contents every launch, and the proof leaves the cache as it found it.  A batch size's
prefill is one Nimble with a shape bucket per prompt length, all in one arena, on eager kernels
and on Inductor's.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

NEW_TOKENS = 64


def _lm(name: str):
    pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    from nimble.cli.decoders import causal_lm

    return causal_lm(name, "float16")


def prepare_proving_decode(module, examples):
    """The decode step with the default proof (100 launches and the fuzzer); the prefill
    graphs with a short one, to keep the file quick."""
    import nimble
    from nimble.generate import DecodeStep

    options = None if isinstance(module, DecodeStep) else \
        nimble.PrepareOptions(relaunches=4, fuzz=False)
    return nimble.Nimble(module).prepare(buckets=examples, options=options)


def assert_one_prefill_per_batch(prefill, batch: int, prompt_buckets):
    """The prefill of a batch size: one Nimble, a bucket per prompt length (ids and ``last``),
    each proven, all in one arena whose shared region is the largest bucket's plan."""
    assert [b.input_shapes for b in prefill.buckets] == \
        [((batch, p), (1,)) for p in prompt_buckets]
    assert all("verify_served" in cost.seconds for cost in prefill.prepare_report.buckets)
    memory = prefill.device_bytes
    assert len(memory.instance_bytes) == 1
    assert memory.shared_bytes == max(b.arena_bytes for b in prefill.buckets)


def _prompt(model, batch: int, length: int):
    return torch.randint(0, model.config.vocab_size, (batch, length), device="cuda")


@pytest.mark.parametrize("name", ["gpt2_tiny", "llama_small"])
def test_greedy_tokens_equal_the_librarys_static_cache_generate(name):
    from nimble.generate import Generator, library_greedy

    model = _lm(name)
    generator = Generator(model, max_cache_len=128 + NEW_TOKENS, prompt_buckets=[128],
                          batch_sizes=[1, 8], prepare_step=prepare_proving_decode)
    try:
        for batch in (1, 8):
            decode, prefill = generator.steps(batch)
            assert_one_prefill_per_batch(prefill, batch, [128])
            verified = decode.graph.meta["verified"]
            assert verified["launches"] >= 100 and not verified["not_bitwise"], verified
            torch.manual_seed(batch)
            ids = _prompt(model, batch, 128)
            want = library_greedy(model, ids, NEW_TOKENS)
            got = generator.generate(ids, NEW_TOKENS)
            assert got.shape == want.shape == (batch, 128 + NEW_TOKENS)
            differ = (got != want).any(dim=0).nonzero().flatten().tolist()
            assert not differ, f"batch {batch}: first differing token at {differ[0] - 128}"
            assert torch.equal(generator.generate(ids, NEW_TOKENS), got)  # again, same cache
        if name == "llama_small":  # separate q, k, v projections: work beside work
            assert decode.schedule.width > 1 and len(decode.schedule.streams) > 1
    finally:
        generator.close()


def test_a_generator_with_fused_projections_decodes_the_fused_models_tokens_with_fewer_gemms():
    """``Generator(fuse_projections=True)`` on the small Llama: every layer's q/k/v and gate/up
    one GEMM each, the decode step proven bit for bit, its tokens the library's greedy ones on
    the fused model, and fewer kernels than the unfused model's step."""
    import copy

    from nimble.generate import Generator, library_greedy

    model = _lm("llama_small")
    plain = copy.deepcopy(model)
    generator = Generator(model, max_cache_len=128 + NEW_TOKENS, prompt_buckets=[128],
                          prepare_step=prepare_proving_decode, fuse_projections=True)
    unfused = Generator(plain, max_cache_len=128 + NEW_TOKENS, prompt_buckets=[128],
                        prepare_step=prepare_proving_decode)
    try:
        assert generator.fused_projections == 2 * model.config.num_hidden_layers
        decode, _ = generator.steps(1)
        verified = decode.graph.meta["verified"]
        assert verified["launches"] >= 100 and not verified["not_bitwise"], verified
        assert len(decode.graph.tasks) < len(unfused.steps(1)[0].graph.tasks)
        ids = _prompt(model, 1, 128)
        assert torch.equal(generator.generate(ids, NEW_TOKENS),
                           library_greedy(model, ids, NEW_TOKENS))
    finally:
        generator.close()
        unfused.close()


def test_gpt2_default_config_decodes_as_the_library_does():
    from nimble.generate import Generator, library_greedy

    model = _lm("gpt2")
    generator = Generator(model, max_cache_len=128 + NEW_TOKENS, prompt_buckets=[128],
                          prepare_step=prepare_proving_decode)
    try:
        ids = _prompt(model, 1, 128)
        assert torch.equal(generator.generate(ids, NEW_TOKENS),
                           library_greedy(model, ids, NEW_TOKENS))
    finally:
        generator.close()


def test_a_padded_prompt_runs_its_bucket_as_the_eager_steps_do_and_limits_are_input_errors():
    """A prompt shorter than its bucket is padded on the right: the graphs give the tokens the
    same step modules give eagerly (transformers' prefill of the unpadded prompt multiplies
    other shapes, so it may round differently)."""
    import nimble
    from nimble.errors import InputError
    from nimble.generate import Generator, run_eagerly

    model = _lm("llama_small")
    options = nimble.PrepareOptions(relaunches=4, fuzz=False)
    graphs = Generator(model, max_cache_len=160, prompt_buckets=[32, 96],
                       prepare_step=lambda module, examples:
                       nimble.Nimble(module).prepare(buckets=examples, options=options))
    eager = Generator(model, max_cache_len=160, prompt_buckets=[32, 96], prepare_step=run_eagerly)
    try:
        assert_one_prefill_per_batch(graphs.steps(1)[1], 1, [32, 96])
        for length in (20, 32, 70):
            ids = _prompt(model, 1, length)
            assert torch.equal(graphs.generate(ids, 48), eager.generate(ids, 48)), length
        with pytest.raises(InputError, match=r"prompt of 97 tokens is longer than the largest "
                                             r"prepared bucket \(96 tokens; buckets \[32, 96\], "
                                             r"cache 160 tokens\)"):
            graphs.generate(_prompt(model, 1, 97), 8)
        with pytest.raises(InputError, match="generate at most 65 new tokens"):
            graphs.generate(_prompt(model, 1, 96), 66)
    finally:
        graphs.close()


def test_compiled_prefill_buckets_share_one_arena_and_compute_what_the_eager_step_does():
    """``prepare_with_nimble(compile_steps=True)``: one ``torch.compile``d prefill recorded at
    every prompt bucket's shape, each a static-shape graph of its own: every bucket's logits
    (a full prompt and a padded one) are the eager step's, to Inductor's rounding."""
    import nimble
    from nimble.generate import Generator, pad_right, prepare_with_nimble, run_eagerly

    model = _lm("gpt2_tiny")
    buckets = [16, 48]
    compiled = Generator(model, max_cache_len=80, prompt_buckets=buckets,
                         prepare_step=prepare_with_nimble(
                             nimble.PrepareOptions(relaunches=4, fuzz=False),
                             compile_steps=True))
    eager = Generator(model, max_cache_len=80, prompt_buckets=buckets, prepare_step=run_eagerly)
    try:
        _, prefill = compiled.steps(1)
        assert_one_prefill_per_batch(prefill, 1, buckets)
        for length in (16, 30, 48):
            ids = _prompt(model, 1, length)
            bucket = compiled.limits.bucket_for(length)
            padded = pad_right(ids, bucket)
            last = torch.tensor([length - 1], device="cuda")
            got = prefill(padded, last)[1].float().clone()
            want = eager.steps(1)[1](padded, last)[1].float()
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=str(length))
            assert compiled.generate(ids, 8).shape == (1, length + 8)
    finally:
        compiled.close()


def test_the_proof_leaves_the_cache_as_it_found_it():
    """Preparing a decode step launches it over a hundred times, each writing the cache: the
    proof starts every launch from the cache's bytes as they were and writes them back."""
    import nimble
    from nimble.generate import DecodeStep, Generator, run_eagerly

    model = _lm("llama_small")
    generator = Generator(model, max_cache_len=64, prompt_buckets=[16], prepare_step=run_eagerly)
    generator.generate(_prompt(model, 1, 16), 20)
    cache = generator.caches[1]
    step = DecodeStep(model, cache).eval()
    example = (torch.zeros((1, 1), dtype=torch.long, device="cuda"),
               torch.tensor([35], device="cuda"))
    with torch.no_grad():  # what prepare's eager warm-up and task timing write, the same again
        step(*example)
    before = [(layer.keys.clone(), layer.values.clone(), layer.cumulative_length.clone())
              for layer in cache.layers]
    nm = nimble.Nimble(step).prepare(tuple(x.clone() for x in example))
    try:
        assert nm.graph.meta["verified"]["launches"] >= 100
        for layer, (keys, values, counter) in zip(cache.layers, before):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
            assert torch.equal(layer.cumulative_length, counter)
    finally:
        nm.close()
