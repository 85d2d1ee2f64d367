"""The GEMV of :mod:`nimble.fast_gemv` with the kernel before it folded into its loads: an
RMS norm (with the residual add before it) or a gated activation, a decode step's lever
(issue 53).

At batch 1 a decoder layer's GEMVs are separated by small kernels over one vector: the residual
add and RMS norm before the attention's projections, the activation of a gated MLP before its
down projection.  Each is a few microseconds of a step that streams no weight, and a kernel
boundary.  Here the GEMV computes that vector itself, chunk by chunk as it reads it: every
program of the GEMV reads the whole input (a few kilobytes, from the L2), which costs far less
than a launch.  The kernels:

- ``gemv_rmsnorm(x, residual, norm_weight, eps, weight)``: ``weight @ rmsnorm(x + residual)``,
  and the sum ``x + residual`` itself (written by the first program), which the layer's next
  residual add reads; without a residual, ``weight @ rmsnorm(x)``.
- ``gemv_gated(gate, up, weight)``: ``weight @ (silu(gate) * up)``.

Each rounds where the model's own code rounds (the sum, the normalised vector and its product
with the norm's weight, the activation and the gated product, all to the input's dtype), so the
GEMV reads the vector the separate kernels would have written; only the GEMV's order of sums is
its own.  They are custom operators that ``torch.compile`` traces as one call each and Nimble
records as any kernel; :mod:`nimble.gemv_prologue_pass` puts them into a compiled graph.
"""
from __future__ import annotations

from typing import Optional

import torch

from .fast_gemv import GemvConfig

_KERNELS: dict = {}

#: What a prologue computes: an RMS norm of the input, of the input plus a residual, or a
#: SiLU-gated product of two inputs.
RMSNORM, ADD_RMSNORM, SILU_GATED = 0, 1, 2


def _kernel():
    """The Triton kernel (made on first use: no Triton import where no GEMV runs)."""
    if _KERNELS:
        return _KERNELS["gemv"]
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_prologue_kernel(a_ptr, b_ptr, nw_ptr, w_ptr, y_ptr, sum_ptr, N, K, stride_w, eps,
                             PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
        dt = a_ptr.dtype.element_ty
        rs = 1.0
        if PROLOGUE != 2:
            # the norm's sum of squares over the whole input, before the GEMV's first step
            squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                cols = k + tl.arange(0, BLOCK_K)
                col_ok = cols < K
                a = tl.load(a_ptr + cols, mask=col_ok, other=0.0)
                if PROLOGUE == 1:
                    a = (a.to(tl.float32) + tl.load(b_ptr + cols, mask=col_ok,
                                                    other=0.0).to(tl.float32)).to(dt)
                    if tl.program_id(0) == 0:
                        tl.store(sum_ptr + cols, a, mask=col_ok)
                a32 = a.to(tl.float32)
                squares += a32 * a32
            rs = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
            # the input at cols, rounded to its dtype where the model's own code rounds it
            a = tl.load(a_ptr + cols, mask=col_ok, other=0.0)
            if PROLOGUE == 2:  # silu(gate) * up
                g = a.to(tl.float32)
                act = (g / (1.0 + tl.exp(-g))).to(dt)
                up = tl.load(b_ptr + cols, mask=col_ok, other=0.0)
                x = (act.to(tl.float32) * up.to(tl.float32)).to(dt)
            else:
                if PROLOGUE == 1:  # the residual's sum first
                    a = (a.to(tl.float32) + tl.load(b_ptr + cols, mask=col_ok,
                                                    other=0.0).to(tl.float32)).to(dt)
                normed = (a.to(tl.float32) * rs).to(dt)
                nw = tl.load(nw_ptr + cols, mask=col_ok, other=0.0)
                x = (nw.to(tl.float32) * normed.to(tl.float32)).to(dt)
            acc += w.to(tl.float32) * x[None, :].to(tl.float32)
        tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=row_ok)

    _KERNELS["gemv"] = gemv_prologue_kernel
    return gemv_prologue_kernel


def launch(prologue: int, a: torch.Tensor, b: Optional[torch.Tensor],
           norm_weight: Optional[torch.Tensor], eps: float, weight: torch.Tensor,
           config: GemvConfig) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``weight @ prologue(a, b)`` for vectors ``a`` (and ``b``) of ``in_features`` elements,
    on the current stream; with :data:`ADD_RMSNORM` also ``a + b``, else None."""
    import triton

    n, k = weight.shape
    a = a.contiguous()
    b = a if b is None else b.contiguous()
    nw = a if norm_weight is None else norm_weight.contiguous()
    y = torch.empty(n, dtype=a.dtype, device=a.device)
    total = torch.empty_like(a) if prologue == ADD_RMSNORM else None
    _kernel()[(triton.cdiv(n, config.block_n),)](
        a, b, nw, weight, y, a if total is None else total, n, k, weight.stride(0), eps,
        PROLOGUE=prologue, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.warps, num_stages=config.stages)
    return y, total


def reference(prologue: int, a: torch.Tensor, b: Optional[torch.Tensor],
              norm_weight: Optional[torch.Tensor], eps: float,
              weight: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """What :func:`launch` computes, in torch's operations (rounded where the kernel rounds,
    the product summed in float32): the CPU's kernel and the tests' reference."""
    dt = a.dtype
    total = None
    if prologue == SILU_GATED:
        x = (torch.nn.functional.silu(a.float()).to(dt).float() * b.float()).to(dt)
    else:
        if prologue == ADD_RMSNORM:
            a = total = (a.float() + b.float()).to(dt)
        a32 = a.float()
        rs = torch.rsqrt(a32.pow(2).mean() + eps)
        x = (norm_weight.float() * (a32 * rs).to(dt).float()).to(dt)
    return (weight.float() @ x.float()).to(dt), total


def _run(prologue: int, a, b, norm_weight, eps: float, weight, config: tuple):
    if not a.is_cuda:  # the tests' CPU runs: the same roundings in torch's operations
        return reference(prologue, a, b, norm_weight, eps, weight)
    return launch(prologue, a, b, norm_weight, eps, weight, GemvConfig(*config))


@torch.library.custom_op("nimble::gemv_rmsnorm", mutates_args=())
def gemv_rmsnorm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                 block_n: int, block_k: int, warps: int, stages: int) -> torch.Tensor:
    """``weight @ rmsnorm(x)``."""
    return _run(RMSNORM, x, None, norm_weight, eps, weight, (block_n, block_k, warps, stages))[0]


@gemv_rmsnorm.register_fake
def _gemv_rmsnorm_shape(x, norm_weight, eps, weight, block_n, block_k, warps, stages):
    return x.new_empty(weight.shape[0])


@torch.library.custom_op("nimble::gemv_add_rmsnorm", mutates_args=())
def gemv_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, weight: torch.Tensor, block_n: int, block_k: int, warps: int,
                     stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight @ rmsnorm(x + residual)``, and the sum ``x + residual``."""
    return _run(ADD_RMSNORM, x, residual, norm_weight, eps, weight,
                (block_n, block_k, warps, stages))


@gemv_add_rmsnorm.register_fake
def _gemv_add_rmsnorm_shape(x, residual, norm_weight, eps, weight, block_n, block_k, warps,
                            stages):
    return x.new_empty(weight.shape[0]), x.new_empty(x.shape)


@torch.library.custom_op("nimble::gemv_gated", mutates_args=())
def gemv_gated(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, block_n: int,
               block_k: int, warps: int, stages: int) -> torch.Tensor:
    """``weight @ (silu(gate) * up)``."""
    return _run(SILU_GATED, gate, up, None, 0.0, weight, (block_n, block_k, warps, stages))[0]


@gemv_gated.register_fake
def _gemv_gated_shape(gate, up, weight, block_n, block_k, warps, stages):
    return gate.new_empty(weight.shape[0])
