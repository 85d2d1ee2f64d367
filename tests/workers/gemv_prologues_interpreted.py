"""The prologue GEMV's cases under Triton's interpreter, one JSON line each: run as a subprocess
with ``TRITON_INTERPRET=1`` set before Triton is imported, by ``tests/test_gemv_prologues.py``."""
from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

import nimble.decode_attention as da  # noqa: E402
import nimble.gemv_prologues as gp  # noqa: E402
from nimble.fast_gemv import GemvConfig  # noqa: E402

SHAPES = [  # rows, input width, configuration, programs: ragged rows and columns, one step
    # and several, a program per row block and fewer programs walking them grid-stride
    (37, 300, GemvConfig(4, 128, 4, 1), None),
    (64, 2048, GemvConfig(8, 1024, 8, 1), None),
    (5, 96, GemvConfig(16, 512, 8, 1), None),
    (45, 300, GemvConfig(4, 128, 4, 1), 3),
    (64, 10000, GemvConfig(8, 1024, 8, 1), 2),  # the norm's pass in two steps
]
#: Per case, its prologue and whether the projection's bias before it is added in first (and,
#: for a layer norm, whether it shifts by a bias of its own).
PROLOGUES = {"rmsnorm": (gp.RMSNORM, False), "add_rmsnorm": (gp.ADD_RMSNORM, False),
             "silu_gated": (gp.SILU_GATED, False), "add_rmsnorm_biased": (gp.ADD_RMSNORM, True),
             "layernorm": (gp.LAYERNORM, True), "add_layernorm": (gp.ADD_LAYERNORM, True),
             "gelu_tanh": (gp.GELU_TANH, True), "gelu_erf": (gp.GELU_ERF, False)}


def main() -> None:
    for dtype in (torch.float32, torch.float16):
        for n, k, config, grid in SHAPES:
            torch.manual_seed(n + k)
            weight = torch.randn(n, k, dtype=dtype) / k ** 0.5
            a, b = torch.randn(k, dtype=dtype), torch.randn(k, dtype=dtype)
            norm_weight = (1 + 0.1 * torch.randn(k)).to(dtype)
            # an offset the layer norm's centring must take out (an RMS norm keeps it)
            shifted = (a.float() + 3.0).to(dtype)
            bias, norm_bias = (0.5 * torch.randn(k)).to(dtype), (0.1 * torch.randn(k)).to(dtype)
            for name, (prologue, biased) in PROLOGUES.items():
                second = b if gp.second_input(prologue) else None
                nw = norm_weight if prologue in gp.NORMS else None
                first = shifted if prologue in (gp.LAYERNORM, gp.ADD_LAYERNORM) else a
                extra = {"bias": bias if biased and prologue in gp.BIASED else None,
                         "norm_bias": norm_bias if biased and prologue in (
                             gp.LAYERNORM, gp.ADD_LAYERNORM) else None}
                y, total = gp.launch(prologue, first, second, nw, 1e-6, weight, config, grid,
                                     **extra)
                two_ahead, _ = gp.launch(prologue, first, second, nw, 1e-6, weight, config,
                                         grid, ahead=2, **extra)
                want, want_total = gp.reference(prologue, first, second, nw, 1e-6, weight,
                                                **extra)
                error = float((y.double() - want.double()).norm() / want.double().norm())
                print(json.dumps({
                    "case": f"{name}-{n}x{k}/{grid or 'all'}-"
                            f"{str(dtype).removeprefix('torch.')}",
                    "error": error, "shape_ok": tuple(y.shape) == (n,),
                    # two tiles asked ahead: the same loads, the same order of sums
                    "two_ahead_same": bool(torch.equal(two_ahead, y)),
                    "total_same": None if total is None else bool(torch.equal(total,
                                                                              want_total))}))

    joined_cases()


JOINED = [  # query heads, key-value heads, slots, head size, splits, rows of the weight
    (32, 8, 192, 64, 3, 40),  # a Llama 3.2 1B layer's attention, split in three
    (6, 2, 300, 32, 2, 17),   # a head size of 32, ragged rows
    (4, 4, 130, 80, 3, 9),    # no grouping, a head size no power of two, a short last split
]


def joined_cases() -> None:
    """The GEMV that joins the attention's split as it reads it, against the attention the
    two kernels give (attend, join) and a GEMV of it, and against the torch reference."""
    for dtype in (torch.float32, torch.float16):
        for heads, kv_heads, slots, head_dim, splits, n in JOINED:
            torch.manual_seed(heads + slots)
            q = torch.randn(1, heads, 1, head_dim, dtype=dtype)
            k, v = (torch.randn(1, kv_heads, slots, head_dim, dtype=dtype) for _ in range(2))
            keep = (torch.arange(slots) <= slots - 7).view(1, 1, 1, slots)
            w = torch.randn(n, heads * head_dim, dtype=dtype) / (heads * head_dim) ** 0.5
            part, stat = da.launch_parts(q, k, v, keep, head_dim ** -0.5, splits)
            layout = da.parts_layout(q.shape, k.shape, splits)
            got = gp.launch_joined(part, stat, w, layout, GemvConfig(4, 512, 4, 1))
            attention = da.launch(q, k, v, keep, head_dim ** -0.5, splits=splits)
            want = (w.float() @ attention.reshape(-1).float()).to(dtype)
            ref_part, ref_stat = da.parts_reference(q, k, v, keep, head_dim ** -0.5, splits)
            joined = da.join_reference(part, stat, layout, 1, dtype)
            print(json.dumps({
                "case": f"joined-{heads}x{kv_heads}x{slots}x{head_dim}/{splits}-"
                        f"{str(dtype).removeprefix('torch.')}",
                "error": float((got.double() - want.double()).norm() / want.double().norm()),
                "shape_ok": tuple(got.shape) == (n,),
                # the join in torch's operations on the kernel's own parts, against the join
                # kernel's output; and the parts in torch's operations against the kernel's
                "join_error": float((joined.double() - attention.double()).abs().max()),
                "parts_error": float((ref_part - part).abs().max() / part.abs().max()),
                "stats_error": float((ref_stat - stat).nan_to_num(0, 0, 0).abs().max())}))


if __name__ == "__main__":
    main()
