"""The GEMV of :mod:`nimble.fast_gemv` with the kernel before it folded into its loads: an
RMS or layer norm (with the residual add before it), a gated activation or a GELU, a decode
step's lever (issue 53).

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
- ``gemv_prologue(x, second, bias, norm_weight, norm_bias, eps, weight, prologue, ...)``: any
  kind of :mod:`nimble.prologue_kinds`, the layer norms (centred, scaled, shifted by
  ``norm_bias``, rounded once) and the GELUs (in float32, rounded once, as Inductor computes
  them) among them; ``bias``, the projection's before, added to ``x`` first.

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
from . import kernel_waits
from .kernel_waits import waits
# the kinds, a name of this module too (the tests' and the tuning's gp.RMSNORM, gp.ADDS...)
from .prologue_kinds import (ADD_LAYERNORM, ADD_RMSNORM, ADDS, BIASED, GELU_ERF,  # noqa: F401
                             GELU_TANH, LAYERNORM, NORMS, RMSNORM, SILU_GATED, second_input)

_KERNELS: list = []

#: Programs per multiprocessor the prologue GEMV launches at most: past that, its programs walk
#: the weight's row blocks grid-stride, each computing the norm once rather than once per block
#: (a tall weight, the gate-up projection or the LM head, is several waves of blocks).
PROGRAMS_PER_SM = 4
#: Weight tiles each program has asked for ahead of the one it sums (1 or 2): with 2, twice
#: the bytes in flight per program, the same loads in the same order of sums (the same bits).
#: 1: with 2 for every folded GEMV a 1B Llama's decode step measured 1.6% slower (its down
#: projection's GEMV slower, docs/results.md); :mod:`nimble.gemv_prologue_tuning` times both
#: per shape.
TILES_AHEAD = 1
#: The widest step of the norm's pass over the input (one step up to this many elements: its
#: latency comes once, before the GEMV's first sums).
MAX_NORM_BLOCK = 8192


def _kernels():
    """The Triton kernels (:mod:`nimble.gemv_prologue_kernels`, imported on first use: no
    Triton import where no GEMV runs): ``(prologue kernel, joined kernel)``."""
    if not _KERNELS:
        from . import gemv_prologue_kernels as kernels

        _KERNELS.append((kernels.gemv_prologue_kernel, kernels.gemv_joined_kernel))
    return _KERNELS[0]


def programs(blocks: int, device: torch.device, per_sm: int = PROGRAMS_PER_SM) -> int:
    """The programs a prologue GEMV of ``blocks`` row blocks launches on ``device``: at most
    ``per_sm`` a multiprocessor (every block where the device is no GPU: the interpreter)."""
    if device.type != "cuda":
        return blocks
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(blocks, per_sm * sms))


def launch(prologue: int, a: torch.Tensor, b: Optional[torch.Tensor],
           norm_weight: Optional[torch.Tensor], eps: float, weight: torch.Tensor,
           config: GemvConfig, grid: int | None = None, ahead: int | None = None,
           per_sm: int | None = None, bias: Optional[torch.Tensor] = None,
           norm_bias: Optional[torch.Tensor] = None
           ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``weight @ prologue(a, b)`` for vectors ``a`` (and ``b``) of ``in_features`` elements,
    on the current stream; with :data:`ADD_RMSNORM` or :data:`ADD_LAYERNORM` also ``a + b``,
    else None.  ``bias``: a vector added to ``a`` first (:data:`BIASED` prologues);
    ``norm_bias``: a layer norm's shift.  ``grid``: the programs to launch (default
    :func:`programs` with ``per_sm``, default :data:`PROGRAMS_PER_SM`), each walking the row
    blocks grid-stride; ``ahead``: the tiles asked for ahead (default :data:`TILES_AHEAD`)."""
    import triton

    n, k = weight.shape
    a = a.contiguous()
    b = a if b is None else b.contiguous()
    nw = a if norm_weight is None else norm_weight.contiguous()
    y = torch.empty(n, dtype=a.dtype, device=a.device)
    total = torch.empty_like(a) if prologue in ADDS else None
    blocks = triton.cdiv(n, config.block_n)
    _kernels()[0][(grid or programs(blocks, a.device, per_sm or PROGRAMS_PER_SM),)](
        a, b, nw, weight, y, a if total is None else total,
        a if bias is None else bias.contiguous(),
        a if norm_bias is None else norm_bias.contiguous(), n, k, weight.stride(0), eps,
        PROLOGUE=prologue, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        NORM_BLOCK=min(triton.next_power_of_2(k), MAX_NORM_BLOCK), WAITS=waits(a.device),
        LATE=kernel_waits.LAUNCH_DEPENDENTS_LATE, AHEAD=ahead or TILES_AHEAD,
        HAS_C=bias is not None, HAS_NB=norm_bias is not None,
        ONE_BLOCK=k <= MAX_NORM_BLOCK, num_warps=config.warps, num_stages=config.stages)
    return y, total


def reference(prologue: int, a: torch.Tensor, b: Optional[torch.Tensor],
              norm_weight: Optional[torch.Tensor], eps: float,
              weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
              norm_bias: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """What :func:`launch` computes, in torch's operations (rounded where the kernel rounds,
    the product summed in float32): the CPU's kernel and the tests' reference."""
    x, total = prologue_reference(prologue, a, b, norm_weight, eps, bias, norm_bias)
    return (weight.float() @ x.float()).to(a.dtype), total


def prologue_reference(prologue: int, a: torch.Tensor, b: Optional[torch.Tensor],
                       norm_weight: Optional[torch.Tensor], eps: float,
                       bias: Optional[torch.Tensor] = None,
                       norm_bias: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The vector a prologue computes from ``a`` (a vector, or rows normalised each on its
    own), and the residual sum where it adds one, rounded where the kernels round."""
    dt = a.dtype
    if prologue in BIASED and bias is not None:
        a = (a.float() + bias.float()).to(dt)
    if prologue == SILU_GATED:
        return (torch.nn.functional.silu(a.float()).to(dt).float() * b.float()).to(dt), None
    if prologue in (GELU_TANH, GELU_ERF):
        g = a.float()
        if prologue == GELU_TANH:
            t = torch.tanh(0.7978845608028654 * (g + 0.044715 * (g * g * g)))
        else:
            t = torch.erf(g * 0.7071067811865476)
        return (0.5 * g * (1.0 + t)).to(dt), None
    total = None
    if prologue in ADDS:
        a = total = (a.float() + b.float()).to(dt)
    a32 = a.float()
    if prologue in (RMSNORM, ADD_RMSNORM):
        rs = torch.rsqrt(a32.pow(2).mean(-1, keepdim=True) + eps)
        return (norm_weight.float() * (a32 * rs).to(dt).float()).to(dt), total
    mean = a32.mean(-1, keepdim=True)
    rs = torch.rsqrt((a32 - mean).pow(2).mean(-1, keepdim=True) + eps)
    y = (a32 - mean) * rs * norm_weight.float()
    if norm_bias is not None:
        y = y + norm_bias.float()
    return y.to(dt), total


def launch_joined(part: torch.Tensor, stat: torch.Tensor, weight: torch.Tensor,
                  layout, config: GemvConfig) -> torch.Tensor:
    """``weight @ attention`` for batch 1, the attention's output joined from the parts of
    :func:`nimble.decode_attention.launch_parts` (``layout`` its
    :class:`~nimble.decode_attention.PartsLayout`) as the GEMV reads it."""
    import triton

    n, k = weight.shape
    y = torch.empty(n, dtype=weight.dtype, device=weight.device)
    _kernels()[1][(triton.cdiv(n, config.block_n),)](
        part, stat, weight, y, n, k, weight.stride(0), layout.groups, layout.splits,
        HEAD_DIM=layout.head_dim, BLOCK_R=layout.block_r, BLOCK_D=layout.block_d,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, WAITS=waits(weight.device),
        num_warps=config.warps, num_stages=config.stages)
    return y


def joined_reference(part, stat, weight, layout) -> torch.Tensor:
    """What :func:`launch_joined` computes, in torch's operations."""
    from .decode_attention import join_reference

    x = join_reference(part, stat, layout, 1, weight.dtype).reshape(-1)
    return (weight.float() @ x.float()).to(weight.dtype)


def _run(prologue: int, a, b, norm_weight, eps: float, weight, config: tuple,
         per_sm: int = 0, ahead: int = 0, bias=None, norm_bias=None):
    """The operators' body; ``per_sm`` and ``ahead`` 0: the module's defaults at launch."""
    if not a.is_cuda:  # the tests' CPU runs: the same roundings in torch's operations
        return reference(prologue, a, b, norm_weight, eps, weight, bias, norm_bias)
    return launch(prologue, a, b, norm_weight, eps, weight, GemvConfig(*config),
                  ahead=ahead or None, per_sm=per_sm or None, bias=bias, norm_bias=norm_bias)


def _no_sum(x: torch.Tensor) -> torch.Tensor:
    """The generic operators' second result where their prologue adds no residual."""
    return x.new_empty(0)


@torch.library.custom_op("nimble::gemv_prologue", mutates_args=())
def gemv_prologue(x: torch.Tensor, second: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                  norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor],
                  eps: float, weight: torch.Tensor, prologue: int, block_n: int, block_k: int,
                  warps: int, stages: int, per_sm: int = 0, ahead: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight @ prologue(x, second)`` for any prologue (the layer norms and the GELUs fold
    through it): the product, and the residual sum where the prologue adds one (else an
    empty tensor)."""
    y, total = _run(prologue, x, second, norm_weight, eps, weight,
                    (block_n, block_k, warps, stages), per_sm, ahead, bias, norm_bias)
    return y, _no_sum(x) if total is None else total


@gemv_prologue.register_fake
def _gemv_prologue_shape(x, second, bias, norm_weight, norm_bias, eps, weight, prologue,
                         block_n, block_k, warps, stages, per_sm=0, ahead=0):
    return x.new_empty(weight.shape[0]), x.new_empty(x.shape) if prologue in ADDS \
        else _no_sum(x)


@torch.library.custom_op("nimble::gemv_rmsnorm", mutates_args=())
def gemv_rmsnorm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                 block_n: int, block_k: int, warps: int, stages: int, per_sm: int = 0,
                 ahead: int = 0) -> torch.Tensor:
    """``weight @ rmsnorm(x)`` (``per_sm``, ``ahead``: :func:`launch`'s; 0 its defaults)."""
    return _run(RMSNORM, x, None, norm_weight, eps, weight, (block_n, block_k, warps, stages),
                per_sm, ahead)[0]


@gemv_rmsnorm.register_fake
def _gemv_rmsnorm_shape(x, norm_weight, eps, weight, block_n, block_k, warps, stages,
                        per_sm=0, ahead=0):
    return x.new_empty(weight.shape[0])


@torch.library.custom_op("nimble::gemv_add_rmsnorm", mutates_args=())
def gemv_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, weight: torch.Tensor, block_n: int, block_k: int, warps: int,
                     stages: int, per_sm: int = 0, ahead: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight @ rmsnorm(x + residual)``, and the sum ``x + residual``."""
    return _run(ADD_RMSNORM, x, residual, norm_weight, eps, weight,
                (block_n, block_k, warps, stages), per_sm, ahead)


@gemv_add_rmsnorm.register_fake
def _gemv_add_rmsnorm_shape(x, residual, norm_weight, eps, weight, block_n, block_k, warps,
                            stages, per_sm=0, ahead=0):
    return x.new_empty(weight.shape[0]), x.new_empty(x.shape)


@torch.library.custom_op("nimble::gemv_gated", mutates_args=())
def gemv_gated(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, block_n: int,
               block_k: int, warps: int, stages: int, per_sm: int = 0,
               ahead: int = 0) -> torch.Tensor:
    """``weight @ (silu(gate) * up)``."""
    return _run(SILU_GATED, gate, up, None, 0.0, weight, (block_n, block_k, warps, stages),
                per_sm, ahead)[0]


@gemv_gated.register_fake
def _gemv_gated_shape(gate, up, weight, block_n, block_k, warps, stages, per_sm=0, ahead=0):
    return gate.new_empty(weight.shape[0])


@torch.library.custom_op("nimble::gemv_joined", mutates_args=())
def gemv_joined(part: torch.Tensor, stat: torch.Tensor, weight: torch.Tensor, groups: int,
                kv_heads: int, splits: int, head_dim: int, block_n: int, block_k: int,
                warps: int, stages: int) -> torch.Tensor:
    """``weight @ attention``, the attention joined from its split's parts (batch 1)."""
    from .decode_attention import PartsLayout

    layout = PartsLayout(groups, kv_heads, splits, head_dim)
    if not part.is_cuda:
        return joined_reference(part, stat, weight, layout)
    return launch_joined(part, stat, weight, layout,
                         GemvConfig(block_n, block_k, warps, stages))


@gemv_joined.register_fake
def _gemv_joined_shape(part, stat, weight, groups, kv_heads, splits, head_dim, block_n,
                       block_k, warps, stages):
    return weight.new_empty(weight.shape[0])


# ---- the same prologues before a GEMM of a few rows (nimble.gemm_rows) ---------------------

def _rows(prologue: int, a, b, norm_weight, eps: float, weight, launch: tuple, bias=None,
          norm_bias=None):
    """The rows operators' body: :func:`nimble.gemm_rows.launch_gemm_rows_prologue` on the GPU,
    else :func:`reference` row by row (the tests' CPU runs)."""
    if not a.is_cuda:
        outs = [reference(prologue, a[i], None if b is None else b[i], norm_weight, eps, weight,
                          bias, norm_bias) for i in range(a.shape[0])]
        total = torch.stack([t for _, t in outs]) if prologue in ADDS else None
        return torch.stack([y for y, _ in outs]), total
    from . import gemm_rows

    return gemm_rows.launch_gemm_rows_prologue(prologue, a, b, norm_weight, eps, weight,
                                               *launch, bias=bias, norm_bias=norm_bias)


@torch.library.custom_op("nimble::gemm_rows_prologue", mutates_args=())
def gemm_rows_prologue(x: torch.Tensor, second: Optional[torch.Tensor],
                       bias: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor],
                       norm_bias: Optional[torch.Tensor], eps: float, weight: torch.Tensor,
                       prologue: int, block_n: int, block_k: int, warps: int, stages: int,
                       split: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``prologue(x, second) @ weight.t()`` for ``x`` of 2 to 16 rows, each row on its own, for
    any prologue: the product, and the residual sum where it adds one (else empty)."""
    y, total = _rows(prologue, x, second, norm_weight, eps, weight,
                     (block_n, block_k, warps, stages, split), bias, norm_bias)
    return y, _no_sum(x) if total is None else total


@gemm_rows_prologue.register_fake
def _gemm_rows_prologue_shape(x, second, bias, norm_weight, norm_bias, eps, weight, prologue,
                              block_n, block_k, warps, stages, split=1):
    return x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape) \
        if prologue in ADDS else _no_sum(x)


@torch.library.custom_op("nimble::gemm_rows_rmsnorm", mutates_args=())
def gemm_rows_rmsnorm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, block_n: int, block_k: int, warps: int,
                      stages: int, split: int = 1) -> torch.Tensor:
    """``rmsnorm(x) @ weight.t()`` for ``x`` of 2 to 16 rows, each normalised on its own."""
    return _rows(RMSNORM, x, None, norm_weight, eps, weight,
                 (block_n, block_k, warps, stages, split))[0]


@gemm_rows_rmsnorm.register_fake
def _gemm_rows_rmsnorm_shape(x, norm_weight, eps, weight, block_n, block_k, warps, stages,
                             split=1):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("nimble::gemm_rows_add_rmsnorm", mutates_args=())
def gemm_rows_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float, weight: torch.Tensor, block_n: int, block_k: int,
                          warps: int, stages: int, split: int = 1
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rmsnorm(x + residual) @ weight.t()`` row by row, and the sum ``x + residual``."""
    return _rows(ADD_RMSNORM, x, residual, norm_weight, eps, weight,
                 (block_n, block_k, warps, stages, split))


@gemm_rows_add_rmsnorm.register_fake
def _gemm_rows_add_rmsnorm_shape(x, residual, norm_weight, eps, weight, block_n, block_k,
                                 warps, stages, split=1):
    return x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape)


@torch.library.custom_op("nimble::gemm_rows_gated", mutates_args=())
def gemm_rows_gated(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, block_n: int,
                    block_k: int, warps: int, stages: int, split: int = 1) -> torch.Tensor:
    """``(silu(gate) * up) @ weight.t()`` for 2 to 16 rows."""
    return _rows(SILU_GATED, gate, up, None, 0.0, weight,
                 (block_n, block_k, warps, stages, split))[0]


@gemm_rows_gated.register_fake
def _gemm_rows_gated_shape(gate, up, weight, block_n, block_k, warps, stages, split=1):
    return gate.new_empty(gate.shape[0], weight.shape[0])
