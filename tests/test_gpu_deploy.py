"""What deployment does on the GPU: half precision, many prepares, threads, weights, random ops."""
from __future__ import annotations

import threading

import pytest

from helpers import zoo_model

pytestmark = pytest.mark.gpu

SMALL_ZOO = ["resnet50", "inception_v3", "googlenet", "mobilenet_v2", "efficientnet_b0"]


class _Autocast:
    @staticmethod
    def wrap(model):
        import torch

        class Autocast(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = model

            def forward(self, x):
                with torch.autocast("cuda", dtype=torch.float16):
                    return self.inner(x)

        return Autocast().eval()


def _variant(model, x, variant: str):
    import torch

    if variant == "float16":
        return model.half(), x.half()
    if variant == "bfloat16":
        return model.to(torch.bfloat16), x.to(torch.bfloat16)
    if variant == "channels_last":
        return (model.to(memory_format=torch.channels_last),
                x.to(memory_format=torch.channels_last))
    return _Autocast.wrap(model), x


# ``nimble bench --dtype float16,bfloat16`` prepares (and so proves) every zoo model in half
# precision, nasnetalarge and pnasnet5large included; these add channels-last and autocast.
@pytest.mark.parametrize("variant", ["float16", "bfloat16", "channels_last", "autocast"])
@pytest.mark.parametrize("name", SMALL_ZOO)
def test_zoo_model_prepares_and_verifies_in_every_precision(name, variant):
    import torch

    import nimble

    model, x = _variant(*zoo_model(name), variant)
    nm = nimble.Nimble(model).prepare(x, return_copies=True,
                                      options=nimble.PrepareOptions(relaunches=10))
    fresh = torch.randn_like(x)
    with torch.no_grad():
        want = model(fresh)
    got = nm(fresh)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    nm.close()


def _encoder(layers: int):
    import torch
    from torch import nn

    torch.manual_seed(layers)
    layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
    return nn.TransformerEncoder(layer, layers).cuda().eval()


def test_several_models_and_prepares_in_one_process_all_stay_right():
    """The issue's sequence: a transformer prepared twice, then more models, then all called.

    It used to die with an illegal address on the second prepare: a fused op's internal
    temporaries reused their own bytes, and a pointer resolved to the smaller allocation.
    """
    import torch

    import nimble

    x = torch.randn(1, 128, 512, device="cuda")
    enc2 = _encoder(2)
    prepared = [(enc2, x, nimble.Nimble(enc2).prepare(x, use_multi_stream=False,
                                                       return_copies=True)),
                (enc2, x, nimble.Nimble(enc2).prepare(x, max_streams=2, return_copies=True))]
    for name in ("branchy", "resnet50"):
        model, inp = zoo_model(name)
        prepared.append((model, inp, nimble.Nimble(model).prepare(inp, return_copies=True)))
        prepared.append((model, inp, nimble.Nimble(model).prepare(
            inp, use_multi_stream=False, return_copies=True)))
    enc6 = _encoder(6)
    prepared.append((enc6, x, nimble.Nimble(enc6).prepare(x, return_copies=True)))
    for _ in range(3):
        for model, inp, nm in prepared:
            fresh = torch.randn_like(inp)
            with torch.no_grad():
                want = model(fresh)
            torch.testing.assert_close(nm(fresh), want, rtol=1e-4, atol=1e-4)


def test_calls_from_threads_on_their_own_streams_are_all_right():
    import torch

    import nimble

    model, x = zoo_model("branchy")
    nm = nimble.Nimble(model).prepare(x, return_copies=True,
                                      options=nimble.PrepareOptions(relaunches=4))
    inputs = [torch.randn_like(x) for _ in range(4)]
    expected = [nm(i).clone() for i in inputs]
    assert not torch.equal(expected[0], expected[1])
    with torch.no_grad():
        for i, want in zip(inputs, expected):
            torch.testing.assert_close(want, model(i), rtol=1e-4, atol=1e-4)
    failures: list[str] = []

    def worker(k: int, own_stream: bool) -> None:
        try:
            stream = torch.cuda.Stream() if own_stream else torch.cuda.current_stream()
            with torch.cuda.stream(stream):
                for i in range(300):
                    j = (i + k) % len(inputs)
                    if not torch.equal(nm(inputs[j]), expected[j]):
                        failures.append(f"thread {k} call {i}")
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            failures.append(f"thread {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(k, k % 2 == 1)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def _linear_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16)).cuda().eval()


def _check(nm, model, x) -> None:
    import torch

    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(nm(x), want, rtol=1e-5, atol=1e-5)


def test_weights_changed_in_place_or_moved_are_followed():
    import torch
    from torch import nn

    import nimble
    from nimble.errors import WeightsChangedError

    model = _linear_model()
    x = torch.randn(4, 64, device="cuda")
    nm = nimble.Nimble(model).prepare(x, return_copies=True,
                                      options=nimble.PrepareOptions(relaunches=4))
    _check(nm, model, x)
    model.load_state_dict(_linear_model().state_dict() | {
        "0.weight": torch.randn(64, 64, device="cuda")})  # copied in place
    _check(nm, model, x)
    model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()},
                          assign=True)  # new memory
    _check(nm, model, x)
    model[2].weight = nn.Parameter(torch.randn(16, 64, device="cuda"))
    _check(nm, model, x)
    model.double().float()
    _check(nm, model, x)
    with torch.no_grad():
        model[0].bias.data = torch.randn(64, device="cuda")  # around torch's module machinery
    assert nm.refresh() is True
    _check(nm, model, x)
    assert nm.refresh() is False
    model.half()
    with pytest.raises(WeightsChangedError, match="float16"):
        nm(x)


def test_a_model_left_in_training_mode_is_told_to_call_eval():
    import nimble
    from nimble.errors import InputError

    model, x = zoo_model("googlenet")
    model.train()
    with pytest.raises(InputError, match=r"model.eval\(\)"):
        nimble.Nimble(model).prepare(x)


@pytest.mark.usefixtures("failed_proofs_saved_aside")
def test_a_failed_prepare_leaves_the_working_graph_serving(monkeypatch):
    import torch

    import nimble
    from nimble.engine import proof
    from nimble.errors import VerificationError

    model, x = zoo_model("branchy")
    nm = nimble.Nimble(model).prepare(x, return_copies=True,
                                      options=nimble.PrepareOptions(relaunches=4))
    fresh = torch.randn_like(x)
    want = nm(fresh)
    exec_before = nm.exec_handle

    def refuse(*args, **kwargs):
        raise VerificationError("refused by the test")

    monkeypatch.setattr(proof, "verify_against_reference", refuse)
    with pytest.raises(VerificationError, match="refused"):
        nm.prepare(x, return_copies=True, options=nimble.PrepareOptions(relaunches=4))
    assert nm.exec_handle == exec_before
    assert torch.equal(nm(fresh), want)
    with pytest.raises(nimble.InputError):
        nm.prepare(x.cpu())
    assert torch.equal(nm(fresh), want)


class _Random:
    @staticmethod
    def create():
        import torch
        import torch.nn.functional as F
        from torch import nn

        class Random(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Linear(256, 256)
                self.b = nn.Linear(256, 256)

            def forward(self, x):
                left = F.dropout(self.a(x), 0.5, training=True)
                right = self.b(x) * torch.rand_like(x)
                return left + right

        torch.manual_seed(0)
        return Random().cuda().eval()


def test_random_ops_draw_fresh_numbers_and_match_eager_for_one_generator_state():
    import torch

    import nimble

    model = _Random.create()
    x = torch.randn(32, 256, device="cuda")
    multi = nimble.Nimble(model).prepare(
        x, return_copies=True, options=nimble.PrepareOptions(relaunches=10, keep_recording=True))
    single = nimble.Nimble(model).prepare(
        x, use_multi_stream=False, return_copies=True,
        options=nimble.PrepareOptions(relaunches=10, recording=multi.recording))
    assert multi.graph.meta["rng"]["increment"] > 0
    gen = torch.cuda.default_generators[0]
    for seed in range(3):
        torch.manual_seed(seed)
        with torch.no_grad():
            eager = model(x)
        after_eager = gen.get_offset()
        torch.manual_seed(seed)
        got_multi = multi(x)
        assert gen.get_offset() == after_eager
        torch.manual_seed(seed)
        got_single = single(x)
        assert torch.equal(got_multi, got_single)
        # the same masks as eager for the same generator state (the GEMMs may round apart)
        torch.testing.assert_close(got_multi, eager, rtol=1e-5, atol=1e-5)
    assert not torch.equal(multi(x), multi(x))  # each call draws fresh numbers


def test_the_same_input_tensor_again_is_read_anew_and_cells_written_elsewhere_are_rewritten():
    import torch

    import nimble

    model, x = zoo_model("branchy")
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=4))
    buf = torch.randn_like(x)

    def reference(t):
        return nm(t.clone()).clone()  # a new address: the cell is written
    for _ in range(3):
        want = reference(buf)
        assert torch.equal(nm(buf).clone(), want)  # first or repeated: same tensor, same answer
        buf.copy_(torch.randn_like(x))  # changed in place: no cell write, new contents read
        got = nm(buf).clone()  # before the reference's launch overwrites the output
        assert torch.equal(got, reference(buf))
    # A debugging run points the cells at the slots, a C host that writes them says so: calls
    # rewrite them.
    nm.trace(torch.randn_like(x))
    got = nm(buf).clone()
    assert torch.equal(got, reference(buf))
    [cell] = nm.input_cells
    other = torch.randn_like(x)
    nimble.driver.copy_to_device(cell, other.data_ptr().to_bytes(8, "little"))
    torch.cuda.synchronize()
    nm.host_writes_cells()
    got = nm(buf).clone()
    assert torch.equal(got, reference(buf))
    assert not torch.equal(got, reference(other))
