"""The GEMM of a few rows (a decode step at a small batch, issue 53): ``x @ weight.t()`` for
``x`` of 2 to :data:`MAX_ROWS` rows, one pass over the weight.

At batch 8 a decoder's projections are still bound by the weight's bytes (each weight element
is used 8 times), and cuBLASLt's kernels for so few rows leave much of the bandwidth unused, as
they do at one row.  Here each program owns ``block_n`` rows of the weight and streams them
once, multiplying each tile by every row of ``x``, the sums in fp32: with ``block_n`` of at
least :data:`MIN_DOT_BLOCK` on the tensor cores (``x`` padded to the tensor core's 16 rows in
registers: the padding costs no memory traffic), with fewer on the CUDA cores, each lane
summing its products across the steps as the single-row GEMV does (more programs over a
short, wide weight, where the tensor cores' 16-row blocks leave too few to fill the GPU).
:func:`nimble.fast_gemv.fast_gemv` times it against torch's GEMM per weight shape and batch
(its ``rows``, in the launch shapes of its ``ROW_CONFIGS``) and swaps it in only where it is
faster, as it does the single-row GEMV.

:func:`launch_gemm_rows_prologue` computes the rows as it reads them, from the inputs of the
kernel before the GEMM: an RMS norm (of a residual sum, which it writes too) or a SiLU-gated
product, as :mod:`nimble.gemv_prologues` does for one row, so that that kernel goes.

Half and bfloat16 only: a float32 ``tl.dot`` would round its inputs to TF32, which torch's
float32 GEMM does not do by default.  The operator ``nimble::gemm_rows`` is opaque to
``torch.compile`` and recorded by Nimble as any kernel.  Its kernels are compiled with the wait
of :mod:`nimble.kernel_waits` (the GEMM's first weight tile asked for before it, the split's
reduction reading nothing before it) and are :data:`nimble.ir.waiting_kernels.WAITING_KERNELS`:
a prepare with programmatic launch may make the edges into them programmatic.
"""
from __future__ import annotations

import torch

from . import kernel_waits
from . import prologue_kinds as kinds
from .errors import InputError
from .kernel_waits import waits

#: The most rows of ``x`` the kernel takes (the tensor core's 16-row tile: one tile of rows).
MAX_ROWS = 16
#: The dtypes the kernel takes.
DTYPES = (torch.float16, torch.bfloat16)
#: The least ``block_n`` and ``block_k`` of a launch on the tensor cores (``tl.dot``'s smallest
#: tile); a smaller ``block_n`` sums on the CUDA cores.
MIN_DOT_BLOCK = 16

#: The outputs a program of the split's reduction adds up.
REDUCE_BLOCK = 1024
#: Whether a split's parts are added by the last of each block's programs to finish (each
#: counts itself on an atomic counter zeroed every call; one kernel boundary fewer) rather
#: than by a second kernel.  The faster form in a decode step (the counter's zeroing runs on a
#: side stream), the slower one timed alone, where the zeroing is on the path
#: (docs/results.md, "The GEMM of rows with its columns split").
LAST_JOINS = True

_KERNEL: list = []


def takes(rows: int, dtype: torch.dtype) -> bool:
    """Whether the kernel computes ``rows`` rows of ``dtype``."""
    return 2 <= rows <= MAX_ROWS and dtype in DTYPES


def _kernel():
    """The Triton kernels (:mod:`nimble.gemm_rows_kernels`, imported on first use: no Triton
    import where no GEMM of rows runs): the GEMM's, and the split's reduction after it."""
    if not _KERNEL:
        from . import gemm_rows_kernels as kernels

        _KERNEL.extend((kernels.gemm_rows_kernel, kernels.gemm_rows_reduce_kernel))
    return _KERNEL[0]


def split_columns(in_features: int, block_k: int, split: int) -> tuple[int, int]:
    """``(columns a split, splits)`` of ``in_features`` columns cut into at most ``split``
    parts of whole ``block_k`` steps."""
    steps = -(-in_features // block_k)
    chunk = -(-steps // max(1, split)) * block_k
    return chunk, -(-in_features // chunk)


def check_operands(x: torch.Tensor, weight: torch.Tensor, rows_apart: bool = False) -> None:
    """Raise :class:`~nimble.errors.InputError`, saying what to pass, where the kernel cannot
    take ``x`` and ``weight``: ``x`` a contiguous ``rows x in_features`` matrix of 2 to
    :data:`MAX_ROWS` rows in half or bfloat16, ``weight`` an ``out x in_features`` matrix of
    that dtype on its device, its rows contiguous (``rows_apart``: each row of ``x``
    contiguous, the rows anywhere)."""
    if x.dim() != 2 or not 2 <= x.shape[0] <= MAX_ROWS:
        raise InputError(f"nimble.gemm_rows takes 2 to {MAX_ROWS} rows as a matrix, got x of "
                         f"shape {tuple(x.shape)}: one row is the GEMV's (nimble.fast_gemv), "
                         "more rows torch's GEMM")
    if x.dtype not in DTYPES:
        raise InputError(f"nimble.gemm_rows takes float16 or bfloat16, got {x.dtype}: torch's "
                         "GEMM computes float32 without TF32 rounding")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise InputError(f"nimble.gemm_rows: weight of shape {tuple(weight.shape)} does not "
                         f"take rows of {x.shape[1]}: it is out_features x in_features")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise InputError(f"nimble.gemm_rows: x is {x.dtype} on {x.device}, weight "
                         f"{weight.dtype} on {weight.device}: give both one dtype and device")
    if not (x.stride(1) == 1 if rows_apart else x.is_contiguous()) or weight.stride(1) != 1:
        raise InputError("nimble.gemm_rows reads x contiguously and each row of the weight "
                         "contiguously: pass x.contiguous() and a weight whose rows are (a "
                         "transposed view is not)")


def launch_gemm_rows(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int,
                     warps: int, stages: int, split: int = 1,
                     last_joins: bool | None = None) -> torch.Tensor:
    """``x @ weight.t()`` for ``x`` of ``rows x in_features`` (contiguous, 2 to
    :data:`MAX_ROWS` rows) on the current stream: programs of ``block_n`` weight rows (on the
    tensor cores from :data:`MIN_DOT_BLOCK`, with ``block_k`` at least that too) stepping
    ``block_k`` columns, ``warps`` warps, ``stages`` of Triton's pipelining.  With ``split``
    more than 1 the columns are cut into that many parts (:func:`split_columns`), each a
    program's, for more programs over a long weight; the parts' float32 sums are added in
    their order, so every call gives the same bits: by the last program of each block of weight
    rows to finish, or (``last_joins`` False) by a second kernel (None: :data:`LAST_JOINS`)."""
    check_operands(x, weight)
    return _launch(x, weight, (block_n, block_k, warps, stages, split), last_joins)[0]


def launch_gemm_rows_prologue(prologue: int, a: torch.Tensor, b: torch.Tensor | None,
                              norm_weight: torch.Tensor | None, eps: float,
                              weight: torch.Tensor, block_n: int, block_k: int, warps: int,
                              stages: int, split: int = 1, last_joins: bool | None = None,
                              bias: torch.Tensor | None = None,
                              norm_bias: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`launch_gemm_rows` of the rows ``prologue(a, b)``, computed as the weight is read:
    ``prologue`` is one of :mod:`nimble.prologue_kinds`: ``RMSNORM`` (each row of ``a``
    normalised and scaled by ``norm_weight``, with ``eps``), ``ADD_RMSNORM`` (of ``a + b``,
    that sum returned too: else None), ``SILU_GATED`` (``silu(a) * b``), ``LAYERNORM`` and
    ``ADD_LAYERNORM`` (each row centred, scaled by ``norm_weight`` and shifted by
    ``norm_bias`` where given), ``GELU_TANH`` and ``GELU_ERF``; ``bias`` (a vector) is added to
    ``a`` first where a residual sum or a GELU reads a projection's output.  Rounded to the
    rows' dtype where the model's own code rounds, as the single-row GEMV's prologues do.
    Each program reads the whole rows (a few tens of kilobytes, from the L2) for the norms."""
    # a prologue's rows may lie apart (the halves of a fused gate-up projection's output)
    check_operands(a, weight, rows_apart=True)
    k = a.shape[1]
    if prologue not in kinds.ALL:
        raise InputError(f"nimble.gemm_rows: prologue {prologue} is none of "
                         f"nimble.prologue_kinds' kinds ({min(kinds.ALL)} to {max(kinds.ALL)})")
    if kinds.second_input(prologue) and (b is None or b.shape != a.shape or b.dtype != a.dtype
                                      or b.stride(1) != 1):
        raise InputError("nimble.gemm_rows: this prologue reads a second matrix b of a's shape "
                         f"and dtype ({tuple(a.shape)}, {a.dtype})")
    if prologue in kinds.NORMS and (norm_weight is None or norm_weight.numel() != k):
        raise InputError(f"nimble.gemm_rows: the norm's weight is a vector of {k}")
    for name, vector in (("bias", bias), ("norm_bias", norm_bias)):
        if vector is not None and vector.numel() != k:
            raise InputError(f"nimble.gemm_rows: the prologue's {name} is a vector of {k}, "
                             f"not {tuple(vector.shape)}")
    vectors = tuple(None if v is None else v.contiguous() for v in (norm_weight, bias,
                                                                    norm_bias))
    return _launch(a, weight, (block_n, block_k, warps, stages, split), last_joins, prologue,
                   b, *vectors, eps)


#: Elements of the rows each step of a prologue's norm pass reads (its tile's registers).
NORM_TILE = 8192


def _launch(x, weight, launch: tuple, last_joins, prologue: int = -1, b=None, norm_weight=None,
            bias=None, norm_bias=None, eps: float = 0.0
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    import triton

    block_n, block_k, warps, stages, split = launch
    rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if prologue in kinds.ADDS \
        else None
    # the tensor cores take 16 rows at least; the CUDA cores' lanes, the rows' power of two
    padded = max(MIN_DOT_BLOCK if block_n >= MIN_DOT_BLOCK else 1, triton.next_power_of_2(rows))
    chunk, splits = split_columns(k, block_k, split)
    partial = splits > 1
    joins = partial and (LAST_JOINS if last_joins is None else last_joins)
    blocks = triton.cdiv(n, block_n)
    sums = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device) if partial else y
    # each block's programs counted from zero at every call
    count = torch.zeros(blocks, dtype=torch.int32, device=x.device) if joins else y
    kernel = _kernel()
    kernel[(blocks, splits)](
        x, weight, y, sums, count, x if b is None else b,
        x if norm_weight is None else norm_weight, x if total is None else total,
        x if bias is None else bias, x if norm_bias is None else norm_bias, rows, n, k,
        weight.stride(0), x.stride(0), x.stride(0) if b is None else b.stride(0), chunk, eps,
        M_PAD=padded, BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=partial, LAST_JOINS=joins,
        WAITS=waits(x.device), LATE=kernel_waits.LAUNCH_DEPENDENTS_LATE, PROLOGUE=prologue,
        NORM_BLOCK=max(16, min(triton.next_power_of_2(k), NORM_TILE // padded)),
        HAS_C=bias is not None, HAS_NB=norm_bias is not None, num_warps=warps,
        num_stages=stages)
    if partial and not joins:
        _KERNEL[1][(triton.cdiv(rows * n, REDUCE_BLOCK),)](
            sums, y, rows * n, SPLITS=splits, BLOCK=REDUCE_BLOCK, WAITS=waits(x.device),
            num_warps=4)
    return y, total


@torch.library.custom_op("nimble::gemm_rows", mutates_args=())
def gemm_rows_op(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int,
                 warps: int, stages: int, split: int = 1) -> torch.Tensor:
    """The GEMM of a few rows as an operator ``torch.compile`` traces as one call (on the CPU,
    the same product in torch's operations, summed in float32: what the CPU tests compile)."""
    if not x.is_cuda:
        return (x.float() @ weight.float().t()).to(x.dtype)
    return launch_gemm_rows(x, weight, block_n, block_k, warps, stages, split)


@gemm_rows_op.register_fake
def _gemm_rows_shape(x, weight, block_n, block_k, warps, stages, split=1):
    return x.new_empty(x.shape[0], weight.shape[0])
