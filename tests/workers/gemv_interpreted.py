"""The plain GEMV's cases under Triton's interpreter, one JSON line each: run as a subprocess
with ``TRITON_INTERPRET=1`` set before Triton is imported, by ``tests/test_fast_gemv.py``."""
from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

import nimble.fast_gemv as fg  # noqa: E402

SHAPES = [  # rows, input width, configuration: within one step, two steps, ragged, many
    (13, 300, fg.GemvConfig(4, 512, 4, 1)),
    (16, 2048, fg.GemvConfig(8, 1024, 8, 1)),
    (21, 3000, fg.GemvConfig(4, 1024, 8, 3)),
    (8, 8192, fg.GemvConfig(8, 1024, 8, 1)),
]


def main() -> None:
    for dtype in (torch.float32, torch.float16):
        for n, k, config in SHAPES:
            torch.manual_seed(n + k)
            weight = torch.randn(n, k, dtype=dtype) / k ** 0.5
            x = torch.randn(k, dtype=dtype)
            got = {}
            for early in (1, 2):
                fg.EARLY_TILES = early
                got[early] = fg.launch_gemv(x, weight, config)
            want = weight.double() @ x.double()
            print(json.dumps({
                "case": f"{n}x{k}-{str(dtype).removeprefix('torch.')}",
                "error": float((got[1].double() - want).norm() / want.norm()),
                "same_bits": bool(torch.equal(got[1], got[2]))}))


if __name__ == "__main__":
    main()
