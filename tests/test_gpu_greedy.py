"""The decode steps' split argmax on Inductor's kernels: the tokens of torch's argmax, ties and
NaNs included, at a Llama 3 vocabulary in bfloat16 and float32."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_inductors_split_argmax_picks_torchs_token(dtype):
    from nimble.decode_steps import ARGMAX_CHUNK, greedy

    torch._dynamo.reset()
    compiled = torch.compile(greedy, fullgraph=True, dynamic=False)
    torch.manual_seed(0)
    logits = torch.randn(8, 128_256, device="cuda").to(getattr(torch, dtype))
    logits[1, [5, ARGMAX_CHUNK + 5, 100_000]] = 50  # equal maxima in three chunks
    logits[2, [70_000, 70_001]] = float("nan")
    logits[3] = float("-inf")
    logits[4, -1] = 50  # the last logit, in the padded chunk
    logits[5, 2 * ARGMAX_CHUNK - 1] = 50  # a chunk's last place
    got = compiled(logits)
    assert torch.equal(got, logits.float().argmax(-1))
    assert got[1:6].tolist() == [5, 70_000, 0, 128_255, 2 * ARGMAX_CHUNK - 1]
