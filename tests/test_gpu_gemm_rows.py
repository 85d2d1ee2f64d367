"""nimble.gemm_rows on the GPU: the GEMM of a few rows' values at ragged sizes in every
launch shape, the choice measured at batch 8, and a model on it prepared bit for bit."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_gemm_of_rows_sums_every_row_at_ragged_sizes(dtype):
    import torch

    from nimble.fast_gemv import ROW_CONFIGS
    from nimble.gemm_rows import launch_gemm_rows

    dt = getattr(torch, dtype)
    torch.manual_seed(1)
    for rows, n, k in ((2, 1001, 1500), (8, 3, 4100), (16, 4096, 2048), (5, 50257, 768)):
        w = torch.randn(n, k, device="cuda", dtype=dt)
        x = torch.randn(rows, k, device="cuda", dtype=dt)
        want = x.double() @ w.double().t()
        scale = x.double().abs() @ w.double().abs().t()
        for config in ROW_CONFIGS:
            got = launch_gemm_rows(x, w, *config.args)
            assert got.shape == (rows, n)
            tol = scale * (2.0 ** -7 if dt is torch.bfloat16 else 2.0 ** -10) + 1e-6
            assert ((got.double() - want).abs() <= tol).all(), (rows, n, k, config)


def test_a_batch_of_eight_is_measured_and_a_model_on_the_gemm_of_rows_prepares_bit_for_bit():
    import torch
    from torch import nn

    import nimble
    from nimble.fast_gemv import ROW_CONFIGS, GemvLinear, fast_gemv

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 3072, bias=False), nn.SiLU(), nn.Linear(3072, 1001),
                          nn.SiLU(), nn.Linear(1001, 2048, bias=False)).cuda().half().eval()
    x = torch.randn(8, 2048, device="cuda", dtype=torch.half)
    with torch.no_grad():
        before = model(x)
    choices = fast_gemv(model, rows=(8,))
    assert len(choices) == 3 and all(c.rows == 8 and c.torch_us > 0 and c.gemv_us > 0
                                     for c in choices)
    # whatever was measured, every layer on the GEMM of rows: the paths below must hold for it
    for layer in model:
        if isinstance(layer, nn.Linear):
            layer.__class__ = GemvLinear
            layer.row_configs = {8: ROW_CONFIGS[3]}
    with torch.no_grad():
        eager = model(x)
        torch.testing.assert_close(eager.float(), before.float(), rtol=0.02, atol=0.02)
        nm = nimble.Nimble(model).prepare(x, return_copies=True)
        assert not nm.graph.meta["verified"]["not_bitwise"]
        assert sum("gemm_rows" in t.name for t in nm.graph.kernel_tasks()) == 3
        fresh = torch.randn_like(x)
        assert torch.equal(nm(fresh), model(fresh))
        compiled = torch.compile(model)
        inductor = nimble.Nimble(compiled).prepare(x, return_copies=True)
        assert torch.equal(inductor(fresh), compiled(fresh))
    nm.close()
    inductor.close()
