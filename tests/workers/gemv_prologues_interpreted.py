"""The prologue GEMV's cases under Triton's interpreter, one JSON line each: run as a subprocess
with ``TRITON_INTERPRET=1`` set before Triton is imported, by ``tests/test_gemv_prologues.py``."""
from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

import nimble.gemv_prologues as gp  # noqa: E402
from nimble.fast_gemv import GemvConfig  # noqa: E402

SHAPES = [  # rows, input width, configuration: ragged rows and columns, one step and several
    (37, 300, GemvConfig(4, 128, 4, 1)),
    (64, 2048, GemvConfig(8, 1024, 8, 1)),
    (5, 96, GemvConfig(16, 512, 8, 1)),
]
PROLOGUES = {"rmsnorm": gp.RMSNORM, "add_rmsnorm": gp.ADD_RMSNORM, "silu_gated": gp.SILU_GATED}


def main() -> None:
    for dtype in (torch.float32, torch.float16):
        for n, k, config in SHAPES:
            torch.manual_seed(n + k)
            weight = torch.randn(n, k, dtype=dtype) / k ** 0.5
            a, b = torch.randn(k, dtype=dtype), torch.randn(k, dtype=dtype)
            norm_weight = (1 + 0.1 * torch.randn(k)).to(dtype)
            for name, prologue in PROLOGUES.items():
                second = None if prologue == gp.RMSNORM else b
                nw = None if prologue == gp.SILU_GATED else norm_weight
                y, total = gp.launch(prologue, a, second, nw, 1e-6, weight, config)
                want, want_total = gp.reference(prologue, a, second, nw, 1e-6, weight)
                error = float((y.double() - want.double()).norm() / want.double().norm())
                print(json.dumps({
                    "case": f"{name}-{n}x{k}-{str(dtype).removeprefix('torch.')}",
                    "error": error, "shape_ok": tuple(y.shape) == (n,),
                    "total_same": None if total is None else bool(torch.equal(total,
                                                                              want_total))}))


if __name__ == "__main__":
    main()
