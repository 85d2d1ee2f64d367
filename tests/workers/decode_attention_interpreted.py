"""The decode-attention kernel's cases under Triton's interpreter, one JSON line each: run as a
subprocess with ``TRITON_INTERPRET=1`` set before Triton is imported (the interpreter cannot
take over a Triton imported without it), by ``tests/test_decode_attention.py``."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

import nimble.attention_rope as ar  # noqa: E402
import nimble.decode_attention as da  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for its helpers
from helpers import attention_reference as reference  # noqa: E402

# the cases' own splits walk the cache in blocks; whole_launch reads it as one tile
da.WHOLE_SLOTS = 0

CASES = [  # batch, query heads, key-value heads, slots, head size, splits (None: the rule's)
    (1, 32, 8, 192, 64, 3),  # a Llama 3.2 1B layer split over three programs per head
    (1, 32, 8, 192, 64, 1),  # ... and read by one program per head
    (2, 4, 4, 70, 80, None),  # no grouping, a head size that is no power of two
    (3, 6, 2, 300, 32, 2),
    (40, 4, 4, 50, 16, None),  # enough heads that one program per head suffices: no split
    (2, 4, 2, 5, 16, None),  # fewer slots than the matrix units' least tile
]
DTYPES = ("float32", "float16")
MASKS = ("bool", "additive", "none")


def error(got, want) -> float:
    return float((got.double() - want).norm() / want.norm())


def case(shape, dtype_name: str, mask_kind: str) -> dict:
    batch, heads, kv_heads, slots, head_dim, splits = shape
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    q = torch.randn(batch, heads, 1, head_dim, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, slots, head_dim, dtype=dtype) for _ in range(2))
    # each sequence at its own position, so whole stretches of slots are hidden for some
    position = torch.randint(1, slots, (batch,))
    keep = (torch.arange(slots)[None, :] <= position[:, None]).view(batch, 1, 1, slots)
    mask = {"bool": keep, "none": None,
            "additive": torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)}[mask_kind]
    got = da.launch(q, k, v, mask, head_dim ** -0.5, splits, branchless=False)
    branchless = da.launch(q, k, v, mask, head_dim ** -0.5, splits, branchless=True)
    last_joins = da.launch(q, k, v, mask, head_dim ** -0.5, splits, branchless=False,
                           last_joins=True)
    da.VALUES_EARLY = True
    try:
        values_early = da.launch(q, k, v, mask, head_dim ** -0.5, splits, branchless=False)
    finally:
        da.VALUES_EARLY = False
    want = reference(q, k, v, None if mask is None else keep, head_dim ** -0.5)
    whole = whole_launch(q, k, v, mask, head_dim ** -0.5)
    return {"case": f"{shape}-{dtype_name}-{mask_kind}", "error": error(got, want),
            "whole_error": error(whole, want),
            "values_early_same": bool(torch.equal(got, values_early)),
            "shape_ok": tuple(got.shape) == (batch, 1, heads, head_dim) and got.dtype == dtype,
            "branchless_same": bool(torch.equal(got, branchless)),
            "last_joins_same": bool(torch.equal(got, last_joins))}


def whole_launch(*args, rope=None):
    """The kernel reading the whole cache as one tile (``WHOLE_SLOTS`` past every case's
    slots), its split left to the rule."""
    before = da.WHOLE_SLOTS, da.WHOLE_ELEMENTS
    da.WHOLE_SLOTS, da.WHOLE_ELEMENTS = 512, 512 * 128
    try:
        assert da.split_for(args[0].shape[0], args[1].shape[1], args[1].shape[2],
                            head_dim=args[0].shape[-1]).whole
        return da.launch(*args, rope=rope)
    finally:
        da.WHOLE_SLOTS, da.WHOLE_ELEMENTS = before


def strided() -> dict:
    """A fused projection's output sliced for the query, one mask for the whole batch."""
    torch.manual_seed(1)
    fused = torch.randn(2, 1, 3 * 128)
    q = fused[..., :128].view(2, 1, 4, 32).transpose(1, 2)
    k, v = (torch.randn(2, 2, 130, 32) for _ in range(2))
    mask = (torch.arange(130) < 77).view(1, 1, 1, 130)
    got = da.launch(q, k, v, mask, 0.125)
    return {"case": "strided", "error": error(got, reference(q, k, v, mask.expand(2, 1, 1, 130),
                                                             0.125)),
            "shape_ok": tuple(got.shape) == (2, 1, 4, 32)}


def rope_case(shape, dtype_name: str, mask_kind: str) -> dict:
    """The kernel rotating the query and the new key itself and reading the new key and value
    in place of the cache's slot (NaN before the step, so a read of it shows), against the
    kernel on the rotated query and the written cache; and the split's parts."""
    batch, heads, kv_heads, slots, head_dim, splits = shape
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(2)
    fused = torch.randn(batch, 1, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k_new, v_new = (t.view(batch, 1, -1, head_dim).transpose(1, 2) for t in fused.split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1))  # strided views
    k, v = (torch.randn(batch, kv_heads, slots, head_dim, dtype=dtype) for _ in range(2))
    position = torch.tensor([slots // 2 + 3])
    k[:, :, position], v[:, :, position] = float("nan"), float("nan")
    angle = torch.randn(1, 1, 1, head_dim // 2).repeat(1, 1, 1, 2)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    keep = (torch.arange(slots) <= position).view(1, 1, 1, slots).expand(batch, 1, 1, slots)
    mask = {"bool": keep, "none": None,
            "additive": torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)}[mask_kind]
    rope = da.Rope(cos, sin, k_new, v_new, position)
    got = da.launch(q, k, v, mask, head_dim ** -0.5, splits, rope=rope)
    qr, kr, vr = ar.reference_inputs(q, k, v, rope)
    want = da.launch(qr, kr, vr, mask, head_dim ** -0.5, splits)
    whole = whole_launch(q, k, v, mask, head_dim ** -0.5, rope=rope)
    da.CACHE_BEFORE_WAIT = False  # the cache asked for after the wait, as the plain kernel does
    try:
        whole_late = whole_launch(q, k, v, mask, head_dim ** -0.5, rope=rope)
    finally:
        da.CACHE_BEFORE_WAIT = True
    out = {"case": f"rope-{shape}-{dtype_name}-{mask_kind}",
           "same": bool(torch.equal(got, want)),
           "whole_same": bool(torch.equal(whole, whole_launch(qr, kr, vr, mask,
                                                              head_dim ** -0.5))),
           "whole_late_same": bool(torch.equal(whole, whole_late)),
           "error": error(got, reference(qr, kr, vr, None if mask is None else keep,
                                         head_dim ** -0.5)),
           "shape_ok": tuple(got.shape) == (batch, 1, heads, head_dim)}
    plan = da.split_for(batch, kv_heads, slots, splits=splits)
    if plan.splits > 1:
        part, stat = da.launch_parts(q, k, v, mask, head_dim ** -0.5, plan.splits, rope=rope)
        want_part, want_stat = da.launch_parts(qr, kr, vr, mask, head_dim ** -0.5, plan.splits)
        out["parts_same"] = bool(torch.equal(part, want_part) and torch.equal(stat, want_stat))
    return out


ROPE_CASES = [  # batch, query heads, key-value heads, slots, head size, splits
    (1, 32, 8, 192, 64, 3),  # a Llama 3.2 1B layer, split in three
    (2, 6, 2, 130, 32, None),  # a batch, a ragged last block
    (1, 4, 4, 70, 80, 1),  # a head size no power of two, unsplit
]


def main() -> int:
    for shape in CASES:
        for dtype in DTYPES:
            for mask in MASKS:
                print(json.dumps(case(shape, dtype, mask)), flush=True)
    print(json.dumps(strided()), flush=True)
    for shape in ROPE_CASES:
        for dtype in DTYPES:
            for mask in ("bool", "none"):
                print(json.dumps(rope_case(shape, dtype, mask)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
