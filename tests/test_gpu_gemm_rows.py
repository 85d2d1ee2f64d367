"""nimble.gemm_rows on the GPU: the GEMM of a few rows' values at ragged sizes in every
launch shape, the choice measured at batch 8, and a model on it prepared bit for bit."""
from __future__ import annotations

import pytest

from helpers import in_threads

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_gemm_of_rows_sums_every_row_at_ragged_sizes(dtype):
    import torch

    from nimble.fast_gemv import ROW_CONFIGS, GemvConfig
    from nimble.gemm_rows import launch_gemm_rows

    dt = getattr(torch, dtype)
    torch.manual_seed(1)
    for rows, n, k in ((2, 1001, 1500), (8, 3, 4100), (16, 4096, 2048), (5, 50257, 768)):
        w = torch.randn(n, k, device="cuda", dtype=dt)
        x = torch.randn(rows, k, device="cuda", dtype=dt)
        want = x.double() @ w.double().t()
        scale = x.double().abs() @ w.double().abs().t()
        # and the columns split, on the tensor cores and the CUDA cores
        for config in ROW_CONFIGS + (GemvConfig(16, 128, 4, 3, 4), GemvConfig(64, 64, 4, 4, 8),
                                     GemvConfig(4, 256, 4, 1, 3)):
            got = launch_gemm_rows(x, w, *config.row_args)
            assert got.shape == (rows, n)
            if config.split > 1:  # the parts added by the last program or a second kernel
                assert torch.equal(got, launch_gemm_rows(x, w, *config.row_args, False))
                assert torch.equal(got, launch_gemm_rows(x, w, *config.row_args, True))
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


def _rows_model():
    """Two projections on the GEMM of rows at 2, 4, 8 and 16 rows, in launch shapes on the
    CUDA cores, on the tensor cores, and with the columns split."""
    import torch
    from torch import nn

    from nimble.fast_gemv import ROW_CONFIGS, GemvConfig, GemvLinear

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(1024, 2048, bias=False), nn.SiLU(),
                          nn.Linear(2048, 1024)).cuda().half().eval()
    configs = {2: ROW_CONFIGS[-1], 4: GemvConfig(16, 128, 4, 3, 4), 8: ROW_CONFIGS[0],
               16: GemvConfig(32, 256, 4, 3, 2)}
    for layer in (model[0], model[2]):
        layer.__class__ = GemvLinear
        layer.row_configs = dict(configs)
    return model, configs


def test_one_model_on_the_gemm_of_rows_serves_batches_threads_a_profiler_and_new_weights():
    import torch
    from torch.nn import functional as F

    import nimble
    from nimble import gemm_rows

    model, configs = _rows_model()
    prepared, inputs = {}, {}
    with torch.no_grad():
        for rows in configs:
            x = torch.randn(rows, 1024, device="cuda", dtype=torch.half)
            want = F.linear(F.silu(F.linear(x, model[0].weight)), model[2].weight, model[2].bias)
            torch.testing.assert_close(model(x), want, rtol=0.02, atol=0.02)
            nm = nimble.Nimble(model).prepare(x, return_copies=True)
            assert not nm.graph.meta["verified"]["not_bitwise"], rows
            names = [t.name for t in nm.graph.kernel_tasks()]
            assert sum("gemm_rows_kernel" in n for n in names) == 2, (rows, names)
            # the split's parts are added by their own kernel, recorded like any other
            assert sum("gemm_rows_reduce_kernel" in n for n in names) == (
                2 if configs[rows].split > 1 and not gemm_rows.LAST_JOINS else 0)
            prepared[rows] = nm
            inputs[rows] = [torch.randn_like(x) for _ in range(3)]
        expected = {r: [model(x) for x in xs] for r, xs in inputs.items()}
        for r, nm in prepared.items():  # one process, every batch: each graph its own
            assert all(torch.equal(nm(x), e) for x, e in zip(inputs[r], expected[r])), r

        batches = list(configs)

        def serve(k: int, failures: list) -> None:
            rows = batches[k]
            for i in range(60):
                j = i % 3
                if not torch.equal(prepared[rows](inputs[rows][j]), expected[rows][j]):
                    failures.append(f"{rows} rows, call {i}")

        assert in_threads(serve, [torch.cuda.Stream() for _ in batches]) == []

        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            eager = model(inputs[4][0])
            graphed = [prepared[r](inputs[r][0]) for r in configs]
            torch.cuda.synchronize()
        assert torch.equal(eager, expected[4][0])
        assert all(torch.equal(g, expected[r][0]) for g, r in zip(graphed, configs))
        kernels = {e.key for e in prof.key_averages()}
        assert any("gemm_rows_kernel" in k for k in kernels), sorted(kernels)[:20]

        # weights changed after prepare, in place: every graph reads the new ones
        model[0].weight.mul_(-0.5)
        model[2].weight.copy_(torch.randn_like(model[2].weight) * 0.02)
        for r, nm in prepared.items():
            x = inputs[r][1]
            assert not torch.equal(model(x), expected[r][1]), r
            assert torch.equal(nm(x), model(x)), r
    for nm in prepared.values():
        nm.close()


def test_a_launch_shape_first_run_from_several_threads_at_once_gives_each_its_product():
    import threading

    import torch

    from nimble.gemm_rows import launch_gemm_rows

    torch.manual_seed(5)
    w = torch.randn(3000, 1536, device="cuda", dtype=torch.bfloat16)
    xs = [torch.randn(r, 1536, device="cuda", dtype=torch.bfloat16) for r in (3, 8, 11, 16)]
    launch = (16, 64, 8, 1, 3)  # a shape no other test launches: compiled by these threads
    got: dict = {}
    start = threading.Barrier(len(xs))

    def run(k: int, failures: list) -> None:
        start.wait()
        got[k] = launch_gemm_rows(xs[k], w, *launch)
        torch.cuda.current_stream().synchronize()

    assert in_threads(run, [torch.cuda.Stream() for _ in xs]) == []
    for k, x in enumerate(xs):
        assert torch.equal(got[k], launch_gemm_rows(x, w, *launch)), k
        torch.testing.assert_close(got[k].float(), x.float() @ w.float().t(), rtol=0.02,
                                   atol=0.05)


@pytest.mark.parametrize("prologue", [0, 1, 2])
def test_a_prologue_computes_the_rows_as_the_model_rounds_them(prologue):
    import torch

    from nimble import gemv_prologues
    from nimble.fast_gemv import GemvConfig
    from nimble.gemm_rows import launch_gemm_rows_prologue

    torch.manual_seed(prologue)
    for rows, n, k in ((2, 1001, 1500), (8, 3072, 2048), (16, 77, 4100)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        a, b = (torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        args = (b if prologue else None, nw if prologue != 2 else None, 1e-6, w)
        want = [gemv_prologues.reference(prologue, a[i].cpu(), b[i].cpu(), nw.cpu(), 1e-6,
                                         w.cpu()) for i in range(rows)]
        for config in (GemvConfig(64, 128, 4, 4), GemvConfig(2, 512, 4, 3),
                       GemvConfig(32, 256, 4, 1, 4)):
            got, total = launch_gemm_rows_prologue(prologue, a, *args, *config.row_args)
            ref = torch.stack([y for y, _ in want]).to("cuda")
            torch.testing.assert_close(got.float(), ref.float(), rtol=0.02, atol=0.02)
            if prologue == 1:
                assert torch.equal(total.cpu(), torch.stack([t for _, t in want]))
            else:
                assert total is None
