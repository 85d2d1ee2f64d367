"""The decode steps' greedy pick: the split argmax equals torch's argmax on ties, NaNs and
infinities, and a compiled step takes it only for a large vocabulary."""
from __future__ import annotations

import pytest
import torch

import nimble.decode_steps as steps
from nimble.decode_steps import ARGMAX_CHUNK, SPLIT_ARGMAX_FROM, greedy, split_argmax


def _rows(width: int, batch: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, width, generator=g)


@pytest.mark.parametrize("width", [1, ARGMAX_CHUNK - 1, ARGMAX_CHUNK, 5 * ARGMAX_CHUNK + 17,
                                   128_256])
def test_the_split_argmax_is_torchs_argmax_on_random_rows(width):
    values = _rows(width, seed=width)
    assert torch.equal(split_argmax(values), values.argmax(-1))


def test_equal_maxima_in_two_chunks_and_in_one_pick_the_first():
    values = torch.zeros(4, 3 * ARGMAX_CHUNK + 5)
    values[0, [7, ARGMAX_CHUNK + 2, 3 * ARGMAX_CHUNK + 1]] = 9.0  # three chunks hold it
    values[1, [ARGMAX_CHUNK + 9, ARGMAX_CHUNK + 3]] = 9.0  # one chunk, twice
    values[2] = 1.0  # every value the same
    values[3, -1] = 9.0  # the last chunk, which is mostly padding
    got = split_argmax(values)
    assert torch.equal(got, values.argmax(-1))
    assert got.tolist() == [7, ARGMAX_CHUNK + 3, 0, 3 * ARGMAX_CHUNK + 4]


def test_nans_and_infinities_resolve_as_one_argmax():
    width = 2 * ARGMAX_CHUNK + 3
    values = _rows(width, batch=5)
    values[0, [ARGMAX_CHUNK + 4, 2 * ARGMAX_CHUNK + 1]] = float("nan")
    values[1, 2 * ARGMAX_CHUNK] = float("inf")
    values[2] = float("-inf")
    values[3, 11] = float("nan")
    values[3, 3] = float("inf")
    values[4, :] = float("-inf")
    values[4, 2 * ARGMAX_CHUNK + 2] = -1e30
    assert torch.equal(split_argmax(values), values.argmax(-1))


def test_a_batch_of_leading_dimensions_keeps_its_shape():
    values = torch.randn(2, 3, 4 * ARGMAX_CHUNK + 1)
    assert torch.equal(split_argmax(values), values.argmax(-1))


def _traced_ops(fn, logits) -> tuple[list, torch.Tensor]:
    """The torch functions and methods Dynamo traced of ``fn(logits)``, and its result."""
    seen: list = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op in ("call_function",
                                                                        "call_method"))
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(logits)
    return seen, out


def test_a_compiled_step_takes_the_split_for_a_large_vocabulary_and_gets_argmaxs_token():
    logits = _rows(128_256, batch=2).to(torch.bfloat16)
    ops, got = _traced_ops(greedy, logits)
    assert any("gather" in op for op in ops), ops
    assert torch.equal(got, logits.float().argmax(-1))


def test_a_compiled_step_with_a_small_vocabulary_is_one_argmax():
    logits = _rows(SPLIT_ARGMAX_FROM - 1)
    ops, got = _traced_ops(greedy, logits)
    assert not any("gather" in op for op in ops), ops
    assert torch.equal(got, logits.argmax(-1))


def test_eager_kernels_keep_torchs_argmax(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("split_argmax called outside torch.compile")

    monkeypatch.setattr(steps, "split_argmax", refused)
    logits = _rows(128_256)
    assert torch.equal(greedy(logits), logits.argmax(-1))
