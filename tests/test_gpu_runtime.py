"""The Nimble API end to end on the GPU: prepare (with its bitwise proof), calls, errors."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _model(name: str):
    import torch

    from nimble import models

    torch.backends.cudnn.benchmark = True
    try:
        return models.create(name).cuda(), models.example_input(name)
    except ImportError as e:
        pytest.skip(str(e))


def test_seed_example_runs_as_written():
    import torch

    import nimble

    model, dummy_input = _model("branchy")
    nm = nimble.Nimble(model)
    nm.prepare(dummy_input, training=False)
    real_input = torch.randn_like(dummy_input)
    out = nm(real_input)
    with torch.no_grad():
        want = model(real_input)
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3)
    assert len(nm.schedule.streams) > 1
    assert isinstance(nm.exec_handle, int) and nm.exec_handle != 0
    nm.close()
    nm.close()


def test_outputs_are_views_unless_copies_asked_for():
    import torch

    import nimble

    model, x = _model("branchy")
    nm = nimble.Nimble(model).prepare(x, relaunches=4)
    a = nm(torch.randn_like(x))
    kept = a.clone()
    b = nm(torch.randn_like(x))
    assert a.data_ptr() == b.data_ptr() and not torch.equal(kept, b)
    nm.prepare(x, relaunches=4, return_copies=True)
    a = nm(x)
    b = nm(torch.randn_like(x))
    assert a.data_ptr() != b.data_ptr()


def test_wrong_inputs_are_typed_errors():
    import torch

    import nimble
    from nimble.errors import InputError, NimbleError

    model, x = _model("branchy")
    nm = nimble.Nimble(model)
    with pytest.raises(NimbleError, match="prepare"):
        nm(x)
    nm.prepare(x, relaunches=2)
    with pytest.raises(InputError, match="prepared for"):
        nm(torch.randn(2, 3, 64, 64, device="cuda"))
    with pytest.raises(InputError, match="prepared for"):
        nm(x.double())
    with pytest.raises(InputError, match="prepared for"):
        nm(x.cpu())
    with pytest.raises(InputError, match="input"):
        nm(x, x)
    with pytest.raises(NimbleError, match="training"):
        nm.prepare(x, training=True)


def test_a_missed_relocation_is_caught_by_the_proof(monkeypatch):
    """Leave one reader's pointer at the recorded address: the poisoned run must fail loudly."""
    from nimble import build
    from nimble.errors import VerificationError
    from nimble.runtime import Nimble

    model, x = _model("branchy")
    real = build.relocate_params
    missed = []

    def leaky(task, bases):
        block = bytearray(real(task, bases))
        if not missed:
            reads = {a.buffer for a in task.accesses if not a.write}
            for p in task.pointers:
                if p.buffer in reads and bases[p.buffer] != p.value - p.offset:
                    block[p.location:p.location + 8] = p.value.to_bytes(8, "little")
                    missed.append((task.id, p.buffer))
                    break
        return bytes(block)

    monkeypatch.setattr(build, "relocate_params", leaky)
    with pytest.raises(VerificationError, match="differs"):
        Nimble(model).prepare(x, relaunches=2)
    assert missed


# ``nimble bench`` prepares (and so verifies) every zoo model in both modes; these cover the
# shapes that matter without doubling the suite's GPU time.
@pytest.mark.parametrize("name,multi", [("inception_v3", True), ("inception_v3", False),
                                        ("resnet50", True), ("gemm_chains", True),
                                        ("nasnetalarge", True)])
def test_zoo_model_prepares_and_verifies_bitwise(name, multi):
    import torch

    import nimble

    model, x = _model(name)
    nm = nimble.Nimble(model).prepare(x, use_multi_stream=multi, relaunches=100)
    out = nm(x)
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
    if multi and name in ("inception_v3", "googlenet", "nasnetalarge", "gemm_chains"):
        assert len(nm.schedule.streams) > 1
    assert nm.memplan.arena_bytes <= nm.memplan.buffer_bytes
    nm.close()
