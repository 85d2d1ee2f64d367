"""The GEMM of a few rows' cases under Triton's interpreter, one JSON line each: run as a
subprocess with ``TRITON_INTERPRET=1`` set before Triton is imported, by
``tests/test_gemm_rows.py``."""
from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from nimble import gemm_rows  # noqa: E402

CASES = [  # rows, weight rows, input width, launch: within one step, ragged, many steps
    (2, 21, 200, (16, 256, 4, 1)),
    (8, 40, 1000, (32, 256, 4, 3)),
    (16, 64, 2048, (64, 512, 8, 3)),
    (5, 17, 33, (16, 16, 4, 1)),
    (8, 21, 1000, (4, 256, 4, 1)),  # on the CUDA cores: fewer than 16 weight rows a program
    (3, 9, 70, (2, 64, 4, 1)),
    # the columns split: into 4 parts of 2 steps, the last short; into 3 of 3 steps (of 7)
    (8, 40, 1100, (16, 128, 4, 1, 4)),
    (4, 19, 440, (4, 64, 4, 1, 3)),
]


def main() -> None:
    for rows, n, k, launch in CASES:
        torch.manual_seed(rows + n + k)
        weight = torch.randn(n, k, dtype=torch.float16) / k ** 0.5
        x = torch.randn(rows, k, dtype=torch.float16)
        got = gemm_rows.launch_gemm_rows(x, weight, *launch)
        # a split's parts added by a second kernel: the same bits as by the last program
        second = gemm_rows.launch_gemm_rows(x, weight, *launch, last_joins=False) \
            if len(launch) > 4 else got
        want = x.double() @ weight.double().t()
        print(json.dumps({
            "case": f"{rows}x{k}@{n}",
            "shape": list(got.shape),
            "error": float((got.double() - want).norm() / want.norm()),
            # each row's sums are its own: a row alone gives the same bits
            "second_kernel_same": torch.equal(second, got),
            "rows_alone": all(torch.equal(got[i], gemm_rows.launch_gemm_rows(
                torch.cat([x[i:i + 1], x[i:i + 1]]), weight, *launch)[0])
                for i in range(rows))}))


if __name__ == "__main__":
    main()
