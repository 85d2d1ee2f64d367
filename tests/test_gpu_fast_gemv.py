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
