"""``PrepareOptions(programmatic_launch=...)`` on the GPU (issue 53): withdrawn, since graphs
built with the programmatic edges the analysis allowed gave wrong outputs on a busy GPU; asked
for, it warns and builds full dependencies, with the bits of a prepare that did not ask."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.LayerNorm(512),
                          nn.Linear(512, 2048), nn.SiLU(), nn.Linear(2048, 512))
    return model.cuda().half().eval(), torch.randn(8, 512, device="cuda", dtype=torch.float16)


def test_programmatic_launch_is_withdrawn_with_a_warning_and_the_same_bits():
    """Asked for, programmatic launch warns that it is withdrawn and builds every edge as a
    full dependency: no programmatic edge, and the bits of the same model prepared without
    asking (graphs built with them raced on a busy GPU: docs/findings.md)."""
    import torch

    import nimble

    model, x = _mlp()
    plain = nimble.Nimble(torch.compile(model, dynamic=False)).prepare(x)
    for asked in (True, "always"):
        torch._dynamo.reset()
        with pytest.warns(RuntimeWarning, match="programmatic launch is withdrawn"):
            nm = nimble.Nimble(torch.compile(model, dynamic=False)).prepare(
                x, options=nimble.PrepareOptions(programmatic_launch=asked))
        assert not nm.programmatic_edges and "programmatic" not in nm.graph.meta
        for _ in range(2):
            fresh = torch.randn_like(x)
            assert torch.equal(nm(fresh), plain(fresh))


def test_a_generator_asked_for_programmatic_launch_decodes_the_same_tokens():
    pytest.importorskip("transformers")
    import torch

    from nimble.cli.decoders import causal_lm
    from nimble.engine.options import PrepareOptions
    from nimble.generate import Generator, prepare_with_nimble

    model = causal_lm("llama_small", "float16")
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), device="cuda")
    tokens = {}
    for asked in (False, True):
        torch._dynamo.reset()
        step = prepare_with_nimble(PrepareOptions(programmatic_launch=asked), True)
        generator = Generator(model, max_cache_len=64, prompt_buckets=[16], prepare_step=step)
        decode, _ = generator.steps(1)
        assert not decode.programmatic_edges
        tokens[asked] = generator.generate(prompt, 32)
        generator.close()
    assert torch.equal(tokens[True], tokens[False])
