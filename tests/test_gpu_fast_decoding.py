"""nimble.fast_decoding.fast_generator on the GPU: every lever applied, the steps proven, the
tokens those of the same model's Generator prepared without the folds."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

PROMPT, NEW_TOKENS = 64, 12


def test_a_fast_generator_applies_every_lever_and_decodes_as_a_plain_generator_of_its_model():
    import torch

    pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    from nimble.cli.decoders import causal_lm
    import torch._inductor.config as inductor_config

    from nimble.fast_decoding import INDUCTOR_SETTINGS, fast_generator
    from nimble.generate import Generator, prepare_with_nimble

    model = causal_lm("llama_small", "bfloat16")
    layers = model.config.num_hidden_layers
    torch.manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT), device="cuda")
    # compiled afresh: a graph from Inductor's cache would skip the pass whose folds it checks
    with inductor_config.patch(fx_graph_cache=False):
        fast = fast_generator(model, PROMPT + NEW_TOKENS, [PROMPT], [1])
    try:
        levers = fast.levers
        assert levers.fused_projections == 2 * layers, levers.describe()
        assert levers.attention is not None, levers.describe()
        assert max(run.roped for run in levers.folds) == layers, levers.describe()
        # every folded GEMV's launch was timed on its own kernel, in this prepare or before it
        from nimble import gemv_prologue_tuning

        assert gemv_prologue_tuning.chosen(), levers.describe()
        decode, _ = fast.steps(1)
        assert not decode.graph.meta["verified"]["not_bitwise"]
        tokens = fast.generate(ids, NEW_TOKENS)
        assert torch.equal(fast.generate(ids, NEW_TOKENS), tokens)
    finally:
        fast.close()
    torch._dynamo.reset()
    # the same (fused, GEMV, attention-swapped) model under the same Inductor settings,
    # without the folds
    with inductor_config.patch(**INDUCTOR_SETTINGS):
        plain = Generator(model, PROMPT + NEW_TOKENS, [PROMPT], [1],
                          prepare_step=prepare_with_nimble(None, True))
    try:
        expected = plain.generate(ids, NEW_TOKENS)
    finally:
        plain.close()
    # the folds round as the model's code does: the first tokens are the same (a later one
    # may part at a near-tie)
    assert torch.equal(tokens[:, :PROMPT + 8], expected[:, :PROMPT + 8]), (tokens, expected)
