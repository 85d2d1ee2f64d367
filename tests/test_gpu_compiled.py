"""Nimble on ``torch.compile``'d modules: Inductor's Triton kernels scheduled on many streams."""
from __future__ import annotations

import pytest

from helpers import zoo_model

pytestmark = pytest.mark.gpu


def _compile(model, x, **options):
    """``torch.compile(model, **options)``, compiled by one call on ``x`` before prepare
    (Nimble's warm-up would do it too)."""
    import torch

    compiled = torch.compile(model, **options)
    with torch.no_grad():
        compiled(x)
    return compiled


def _compiled(name: str, dtype: str = "float32", **options):
    import torch

    model, x = zoo_model(name)
    dt = getattr(torch, dtype)
    model, x = model.to(dt), x.to(dt)
    return model, _compile(model, x, **options), x


def _prepared_like(compiled, x, reference, **tolerance):
    """Nimble on ``compiled``, proven in prepare, with Triton kernels traced, and a call on a
    fresh input checked against ``reference``."""
    import torch

    import nimble

    nm = nimble.Nimble(compiled).prepare(x, return_copies=True,
                                         options=nimble.PrepareOptions(relaunches=10))
    assert nm.graph.meta["triton_launches"] > 0
    fresh = torch.randn_like(x)
    with torch.no_grad():
        torch.testing.assert_close(nm(fresh), reference(fresh), **tolerance)
    return nm


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_compiled_branchy_model_runs_its_triton_kernels_on_several_streams(dtype):
    import torch

    import nimble

    model, compiled, x = _compiled("branchy", dtype)
    nm = nimble.Nimble(compiled).prepare(x, return_copies=True,
                                         options=nimble.PrepareOptions(relaunches=20))
    meta = nm.graph.meta
    assert meta["triton_launches"] > 0, "no Triton kernel was traced"
    triton_tasks = [t for t in nm.graph.tasks if t.op >= 0 and "::" not in nm.graph.ops[t.op].name]
    assert triton_tasks and all(t.name.startswith("triton") for t in triton_tasks)
    assert len(nm.schedule.streams) > 1, "the four branches of a stage found no concurrency"
    fresh = torch.randn_like(x)
    with torch.no_grad():
        want = compiled(fresh)
    torch.testing.assert_close(nm(fresh), want)
    nm.close()


def test_a_prepared_graph_keeps_its_triton_kernels_loaded_after_dynamos_caches_are_reset():
    """Triton's and Inductor's kernel objects unload their modules when collected: after
    ``torch._dynamo.reset()`` frees the compiled code, the prepared graph's kernels are still
    loaded (each ``CUfunction`` answers the driver) and its outputs are the bits they were."""
    import gc

    import torch

    import nimble
    from nimble import driver
    from nimble.engine.kernel_owners import kernel_functions

    model, compiled, x = _compiled("branchy", "float16")
    nm = nimble.Nimble(compiled).prepare(x, return_copies=True)
    fresh = torch.randn_like(x)
    want = nm(fresh)
    prepared = nm._prepared
    assert prepared.kernel_owners, "no owner of the graph's Triton kernels was kept"
    del compiled
    torch._dynamo.reset()
    gc.collect()
    for function in kernel_functions(prepared):
        driver.function_fingerprint(function)  # CudaError (an invalid handle) once unloaded
    got = nm(fresh)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    nm.close()


def test_a_compile_mode_with_its_own_cuda_graphs_is_refused_and_the_process_stays_usable():
    import torch

    import nimble

    model, x = zoo_model("branchy")
    with pytest.raises(nimble.InputError, match="max-autotune-no-cudagraphs"):
        nimble.Nimble(torch.compile(model, mode="reduce-overhead")).prepare(x)
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=5))
    nm(x)
    nm.close()


def test_graph_breaks_are_captured_with_the_eager_code_between_them(monkeypatch):
    import torch

    # TF32 convolutions differ from the eager reference by ~1e-3 depending on the algorithm
    # each side picks; in full fp32 a wrong pointer stands out from rounding.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)

    class Broken(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Conv2d(3, 16, 3, padding=1)
            self.b = torch.nn.Conv2d(3, 16, 3, padding=1)
            self.c = torch.nn.Conv2d(32, 8, 1)

        def forward(self, x):
            left = torch.relu(self.a(x))
            torch._dynamo.graph_break()
            right = torch.sigmoid(self.b(x))
            return self.c(torch.cat([left, right], 1)).tanh()

    model = Broken().cuda().eval()
    x = torch.randn(2, 3, 32, 32, device="cuda")
    _prepared_like(_compile(model, x), x, model, rtol=1e-4, atol=1e-4).close()


def test_dynamic_shapes_are_prepared_for_the_example_and_other_shapes_refused():
    import torch

    import nimble

    _, compiled, x = _compiled("branchy", dynamic=True)
    nm = _prepared_like(compiled, x, compiled)
    with pytest.raises(nimble.InputError, match="shape"):
        nm(torch.randn(x.shape[0] + 1, *x.shape[1:], device="cuda"))
    nm.close()
