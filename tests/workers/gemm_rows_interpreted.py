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


PROLOGUE_CASES = [  # prologue, rows, weight rows, input width, launch, biased
    (0, 3, 20, 300, (16, 64, 4, 1), False),
    (1, 8, 21, 1000, (32, 128, 4, 1, 4), False),  # the residual's sum, the columns split
    (2, 5, 9, 200, (4, 64, 4, 1), False),  # the gated product on the CUDA cores
    # a layer norm (shifted by its bias) of the residual sum with the projection's bias,
    # the columns split; of the rows alone on the CUDA cores; the GELUs
    (4, 8, 21, 1000, (32, 128, 4, 1, 4), True),
    (3, 5, 9, 200, (4, 64, 4, 1), True),
    (5, 4, 33, 300, (16, 64, 4, 1), True),
    (6, 3, 20, 300, (16, 64, 4, 1), False),
]


def prologue_cases() -> None:
    from nimble import gemv_prologues as gp

    for prologue, rows, n, k, launch, biased in PROLOGUE_CASES:
        torch.manual_seed(prologue + rows + n)
        weight = torch.randn(n, k, dtype=torch.float16) / k ** 0.5
        a, b = torch.randn(rows, k, dtype=torch.float16), torch.randn(rows, k, dtype=torch.float16)
        if prologue == gp.SILU_GATED:  # the gate and up halves of one fused projection's
            a, b = torch.cat([a, b], dim=1).split(k, dim=1)  # rows: rows apart
            assert a.stride(0) == 2 * k
        if prologue in (gp.LAYERNORM, gp.ADD_LAYERNORM):  # an offset the centring takes out
            a = (a.float() + 2.0).to(torch.float16)
        nw = torch.rand(k, dtype=torch.float16) + 0.5
        second = b if gp.second_input(prologue) else None
        extra = {"bias": (0.5 * torch.randn(k)).half() if biased and prologue in gp.BIASED
                 else None,
                 "norm_bias": (0.1 * torch.randn(k)).half() if biased and prologue in (
                     gp.LAYERNORM, gp.ADD_LAYERNORM) else None}
        args = (nw if prologue in gp.NORMS else None, 1e-5, weight)
        got, total = gemm_rows.launch_gemm_rows_prologue(prologue, a, second, *args, *launch,
                                                         **extra)
        want = [gp.reference(prologue, a[i], b[i], *args, **extra) for i in range(rows)]
        ref = torch.stack([w[0] for w in want]).double()
        alone = [gemm_rows.launch_gemm_rows_prologue(
            prologue, torch.cat([a[i:i + 1]] * 2),
            None if second is None else torch.cat([b[i:i + 1]] * 2), *args, *launch,
            **extra)[0][0] for i in range(rows)]
        print(json.dumps({
            "case": f"prologue {prologue} {rows}x{k}@{n}",
            "shape": list(got.shape),
            "error": float((got.double() - ref).norm() / ref.norm()),
            "sum_equal": total is None if prologue not in gp.ADDS else torch.equal(
                total, torch.stack([w[1] for w in want])),
            "second_kernel_same": True,
            "rows_alone": all(torch.equal(got[i], alone[i]) for i in range(rows))}))


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
    prologue_cases()
