"""Hugging Face decoders on the GPU: GPT-2 and a Llama-architecture model (random weights, no
downloads) prepare, prove bit for bit, run on several streams exactly as on one, and follow
eager; a forward that really synchronises, and a cache that grows, are typed errors.

transformers' mask code takes another path while a stream is capturing (an explicit mask where
eager asks the attention for ``is_causal``; :mod:`nimble.record.host_sync`), so eager runs
another attention kernel and is compared to a tolerance of the dtype.  The models are
``tools/record_fixture.py``'s, the ones its fixtures are recorded from.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import load_tool

pytestmark = pytest.mark.gpu

#: How far from eager an output may be, per dtype (another attention kernel, same arithmetic).
TOLERANCE = {"float16": 2e-2, "bfloat16": 5e-2}


def _decoder(name: str, dtype: str):
    """``(model, input ids)`` of ``tools/record_fixture.py``; skips without transformers."""
    pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    return load_tool("record_fixture").transformer_model(name, dtype)


def _fresh_ids(model, ids):
    return torch.randint(0, model.model.config.vocab_size, ids.shape, device=ids.device)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["gpt2", "llama_small"])
def test_a_decoder_proves_bitwise_and_multi_stream_equals_one_stream(name, dtype):
    import nimble

    model, ids = _decoder(name, dtype)
    multi = nimble.Nimble(model).prepare(ids, return_copies=True)
    verified = multi.graph.meta["verified"]
    assert verified["launches"] >= 100 and verified["outputs"] == len(multi.graph.outputs)
    assert not verified["not_bitwise"], verified["not_bitwise"]
    assert len(multi.schedule.streams) > 1
    single = nimble.Nimble(model).prepare(
        ids, use_multi_stream=False, return_copies=True,
        options=nimble.PrepareOptions(relaunches=4, fuzz=False))
    assert len(single.schedule.streams) == 1
    tolerance = TOLERANCE[dtype]
    for _ in range(2):
        fresh = _fresh_ids(model, ids)
        got = multi(fresh)
        assert torch.equal(got, single(fresh))
        with torch.no_grad():
            want = model(fresh)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
    assert not torch.equal(multi(_fresh_ids(model, ids)), got)
    multi.close()
    single.close()


class ScaledByItsLargest(torch.nn.Module):
    """A decoder whose wrapper reads a value back to the host: it cannot be captured."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        hidden = self.model(ids)
        return hidden / hidden.abs().max().item()  # the synchronising line


def _line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(marker))


def test_a_wrapper_that_synchronises_is_a_capture_error_naming_its_line():
    import nimble
    from nimble.errors import CaptureError

    model, ids = _decoder("llama_small", "float16")
    wrapped = ScaledByItsLargest(model).eval()
    before = {k: v.clone() for k, v in wrapped.state_dict().items()}
    with pytest.raises(CaptureError) as info:
        nimble.Nimble(wrapped).prepare(ids)
    message = str(info.value)
    line = _line_of("# the synchronising line")
    assert f"{Path(__file__).name}:{line} (in forward): " \
           "return hidden / hidden.abs().max().item()" in message, message
    assert "synchronises with the host" in message
    # nothing half-done: no capture left open, the generator usable, the weights as they were
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.randn(4, device="cuda").isfinite().all()
    after = wrapped.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    # and the decoder itself, which does not synchronise under capture, still prepares
    nm = nimble.Nimble(model).prepare(ids, options=nimble.PrepareOptions(relaunches=4))
    assert not nm.graph.meta["verified"]["not_bitwise"]
    nm.close()


class DecodesIntoAGrowingCache(torch.nn.Module):
    """Holds a DynamicCache across calls, as a decode loop would."""

    def __init__(self, model) -> None:
        import transformers

        super().__init__()
        self.model = model
        self.cache = transformers.DynamicCache(config=model.config)

    def forward(self, ids):
        return self.model(input_ids=ids, past_key_values=self.cache,
                          use_cache=True).last_hidden_state


class ReturnsItsCache(torch.nn.Module):
    """Returns the whole output, the cache the decoder made among it."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=True)


def test_a_dynamic_cache_held_or_returned_is_an_input_error_advising_a_static_cache():
    import nimble
    from nimble.errors import InputError

    model, ids = _decoder("llama_small", "float16")
    decoder = model.model
    with pytest.raises(InputError, match=r"attribute 'cache' of \w+ is a DynamicCache.*"
                                         r"StaticCache"):
        nimble.Nimble(DecodesIntoAGrowingCache(decoder).eval()).prepare(ids)
    with pytest.raises(InputError, match=r"result of the forward of \w+ is a DynamicCache.*"
                                         r"StaticCache"):
        nimble.Nimble(ReturnsItsCache(decoder).eval()).prepare(ids)
    assert not torch.cuda.is_current_stream_capturing()


def test_measured_priorities_time_a_decoder_on_its_own_token_ids():
    """``resource_order=True`` launches the phase several times before the proof; each launch
    gets the recording's token ids copied in first, since an input's bytes are reused by later
    activations (an embedding reading those as ids indexes out of range and kills the context).
    Last in the file: a failure here takes the CUDA context with it."""
    import nimble

    model, ids = _decoder("gpt2", "float16")
    measured = nimble.Nimble(model).prepare(
        ids, return_copies=True, options=nimble.PrepareOptions(resource_order=True))
    assert "resource_order" in measured.graph.meta
    assert not measured.graph.meta["verified"]["not_bitwise"]
    single = nimble.Nimble(model).prepare(
        ids, use_multi_stream=False, return_copies=True,
        options=nimble.PrepareOptions(relaunches=4, fuzz=False))
    for _ in range(2):
        fresh = _fresh_ids(model, ids)
        assert torch.equal(measured(fresh), single(fresh))
    measured.close()
    single.close()
