"""fast_gemv on the GPU: the GEMV's values at ragged sizes, the choice measured on real weights,
and a model with swapped layers prepared by Nimble, eager and through torch.compile."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _mlp(dtype):
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2048, 3072, bias=False), nn.SiLU(),
                         nn.Linear(3072, 1001), nn.SiLU(),
                         nn.Linear(1001, 2048, bias=False)).cuda().to(dtype).eval()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_gemv_sums_every_row_at_ragged_sizes(dtype):
    import torch

    from nimble.fast_gemv import CONFIGS, launch_gemv

    dt = getattr(torch, dtype)
    torch.manual_seed(1)
    for n, k in ((1001, 1500), (3, 4100), (4096, 2048)):
        w = torch.randn(n, k, device="cuda", dtype=dt)
        x = torch.randn(k, device="cuda", dtype=dt)
        want = (w.double() @ x.double())
        scale = (w.double().abs() @ x.double().abs())
        for config in CONFIGS:
            got = launch_gemv(x, w, config).double()
            # fp32 sums of exactly widened products: off by the output's rounding and the
            # sums' order, a few units of the output dtype's last place of |w| @ |x|.
            tol = scale * (2.0 ** -7 if dt is torch.bfloat16 else 2.0 ** -10 if
                           dt is torch.float16 else 2.0 ** -16) + 1e-6
            assert ((got - want).abs() <= tol).all(), (n, k, config)


def test_fast_gemv_measures_and_the_swapped_model_prepares_and_compiles():
    import torch
    from torch.nn import functional as F

    import nimble
    from nimble.fast_gemv import CONFIGS, GemvLinear, fast_gemv

    model = _mlp(torch.bfloat16)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        before = model(x)
    choices = fast_gemv(model)
    assert len(choices) == 3 and all(c.torch_us > 0 and c.gemv_us > 0 for c in choices)
    # Whatever was measured, run the GEMV on every layer: the paths below must hold for it.
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            layer.__class__ = GemvLinear
            layer.gemv_config = choices[0].config or CONFIGS[0]
    with torch.no_grad():
        eager = model(x)
        assert torch.allclose(eager.float(), before.float(), rtol=0.05, atol=0.05)
        nm = nimble.Nimble(model).prepare(x, return_copies=True)
        assert torch.equal(nm(x), eager)  # the same kernels, rewired: bit for bit
        fresh = torch.randn_like(x)
        assert torch.equal(nm(fresh), model(fresh))
        compiled = torch.compile(model)
        assert torch.allclose(compiled(x).float(), eager.float(), rtol=0.02, atol=0.02)
        inductor = nimble.Nimble(compiled).prepare(x, return_copies=True)
        assert torch.equal(inductor(fresh), compiled(fresh))
        batch = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
        h = batch
        for m in model:  # more than one row: torch's GEMM, unchanged
            h = F.linear(h, m.weight, m.bias) if isinstance(m, GemvLinear) else m(h)
        assert torch.equal(model(batch), h)
    nm.close()
    inductor.close()


class _LastHiddenState(__import__("torch").nn.Module):
    def __init__(self, decoder) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, ids):
        return self.decoder(input_ids=ids, use_cache=False).last_hidden_state


def test_gpt2s_conv1d_projections_run_the_gemv_and_the_model_prepares_bit_for_bit():
    import copy

    import torch

    transformers = pytest.importorskip("transformers", reason="needs transformers")
    import nimble
    from nimble.cli.decoders import GPT2_TINY
    from nimble.fast_gemv import fast_gemv

    torch.manual_seed(0)
    config = transformers.GPT2Config(**GPT2_TINY)
    model = _LastHiddenState(transformers.GPT2Model(config)).cuda().half().eval()
    stock = copy.deepcopy(model)
    ids = torch.randint(0, config.vocab_size, (1, 1), device="cuda")
    fast_gemv(model, margin=-10.0)  # every shape on the GEMV, whatever was measured
    convs = [m for m in model.modules() if type(m).__name__ == "GemvConv1D"]
    assert len(convs) == 4 * config.n_layer
    assert all(c.weight.t().is_contiguous() and c.gemv_config for c in convs)
    with torch.no_grad():
        eager = model(ids)
        torch.testing.assert_close(eager.float(), stock(ids).float(), rtol=2e-2, atol=2e-2)
        nm = nimble.Nimble(model).prepare(ids, return_copies=True)
        assert not nm.graph.meta["verified"]["not_bitwise"]
        assert sum("gemv" in t.name for t in nm.graph.kernel_tasks()) >= len(convs)
        for _ in range(2):
            fresh = torch.randint(0, config.vocab_size, ids.shape, device="cuda")
            assert torch.equal(nm(fresh), model(fresh))
        # six tokens: Conv1D's own addmm, on the weight stored column by column
        rows = torch.randint(0, config.vocab_size, (1, 6), device="cuda")
        torch.testing.assert_close(model(rows).float(), stock(rows).float(), rtol=2e-2,
                                   atol=2e-2)
    nm.close()
