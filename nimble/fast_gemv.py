"""``fast_gemv(model)``: a decode step's single-row projections on a Triton GEMV where it is
measured faster than torch's GEMM (issue 53).

At batch 1 every projection of a decoder is a matrix-vector product: a pass over the weight,
bound by memory bandwidth.  On the small and the tall-and-narrow weights of a decoder (its
attention's projections, its MLP's down projection) cuBLASLt's kernels for one row leave much
of the bandwidth unused, where a plain GEMV (a few rows of the weight per program, the row's
dot product summed in fp32) takes more of it (docs/results.md, "A GEMV where it is measured
faster").  Which kernel is faster depends on the weight's shape and the GPU, so nothing here is
assumed: ``fast_gemv`` times torch's GEMM
and each GEMV configuration of :data:`CONFIGS` on the model's own weights of every distinct
shape (rotated past the L2 cache, as a decode step reads them once each), and a layer takes the
GEMV only where its shape's best configuration beat torch's by :data:`MARGIN`.

The swapped layers keep their class's parameters, names and ``state_dict`` (an ``nn.Linear``
becomes a :class:`GemvLinear`, its subclass; transformers' ``Conv1D``, GPT-2's projections with
the weight stored ``in x out``, a ``GemvConv1D``, its weight's values stored column by column
so that the GEMV reads ``weight.t()``'s rows contiguously); an input of more than one row (a
prefill, a batch) runs the class's own GEMM as before, so only single-row calls change
kernels.  The GEMV is the custom operator ``nimble::gemv``, which ``torch.compile`` traces as
one opaque call and Nimble records as any kernel.  A GEMV sums in another order than cuBLASLt's
kernels, so outputs may differ in the last bits, as between any two GEMM kernels.
"""
from __future__ import annotations

import logging
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from .errors import InputError
from . import gemm_rows, kernel_waits
from .kernel_waits import waits

log = logging.getLogger("nimble")

#: A GEMV configuration wins only when faster than torch's GEMM by this fraction.
MARGIN = 0.03
#: The margin where the kernel before each GEMV will be folded into it
#: (:mod:`nimble.gemv_prologue_pass`): a GEMV up to 10% slower than torch's GEMM alone is kept,
#: since the fold takes out a kernel and its boundary that the GEMM, timed alone, is not charged
#: for.  In a 1B decoder's step the gate-up projection is the one shape this moves (16 of 65
#: GEMVs), and its step ran 3-5% faster so (docs/results.md, "The gate-up projection on the
#: folded GEMV, and where the spread between compilations was").
PROLOGUE_MARGIN = -0.10

#: The weight tiles (1 or 2) a GEMV's program asks for before it waits for its input: behind a
#: programmatic edge (``PrepareOptions(programmatic_launch=True)``) they stream while the
#: predecessor ends; 2 is a whole row block of a weight of up to ``2 * block_k`` columns (an
#: output projection's).  The same bits either way; 1: 2 measured no faster on a 1B decoder's
#: step (docs/results.md; ``tools/experiments/decode_levers.py``'s ``early-tiles``).
EARLY_TILES = 1


def decode_rows(batch_sizes: Iterable[int]) -> tuple[int, ...]:
    """The row counts :func:`fast_gemv` measures for a decode step at ``batch_sizes`` (one
    token a row): those the GEMV and :mod:`nimble.gemm_rows` take."""
    return tuple(sorted({b for b in batch_sizes if 1 <= b <= gemm_rows.MAX_ROWS}))


def margin_for(folded: bool) -> float:
    """The margin a GEMV is kept by: :data:`PROLOGUE_MARGIN` where the fold pass runs on the
    compilation (``folded``), else :data:`MARGIN`."""
    return PROLOGUE_MARGIN if folded else MARGIN


@dataclass(frozen=True)
class GemvConfig:
    """One launch shape of the GEMV kernel: rows of the weight per program, the columns read
    per step, the program's warps and Triton's pipelining stages; for :mod:`nimble.gemm_rows`,
    also the parts its columns are split into (``split``; 1 for the GEMV)."""

    block_n: int
    block_k: int
    warps: int
    stages: int
    split: int = 1

    @property
    def args(self) -> tuple[int, int, int, int]:
        """The GEMV operators' launch arguments, in their order."""
        return self.block_n, self.block_k, self.warps, self.stages

    @property
    def row_args(self) -> tuple[int, int, int, int, int]:
        """:func:`nimble.gemm_rows.gemm_rows_op`'s launch arguments, in their order."""
        return (*self.args, self.split)


#: The configurations timed per weight shape: the winners of tools/experiments/gemv_sweep.py's
#: grid at a 1B decoder's shapes, and their neighbours.
CONFIGS = (GemvConfig(4, 1024, 8, 1), GemvConfig(4, 1024, 8, 3), GemvConfig(8, 1024, 8, 1),
           GemvConfig(8, 512, 4, 1), GemvConfig(8, 512, 4, 3), GemvConfig(16, 512, 8, 1))
#: The launch shapes of :mod:`nimble.gemm_rows` timed per weight shape and row count (2 or more
#: rows): the winners of ``tools/experiments/gemv_sweep.py --rows 8``'s grid at GPT-2's and a 1B
#: decoder's shapes (docs/results.md), on the tensor cores and (``block_n`` 2) the CUDA cores,
#: and (``--splits 1,2,4,8``) the columns split into 2, 4 and 8 parts.
ROW_CONFIGS = (GemvConfig(64, 64, 4, 4), GemvConfig(64, 128, 4, 4), GemvConfig(64, 256, 8, 1),
               GemvConfig(32, 256, 4, 3), GemvConfig(32, 512, 4, 1), GemvConfig(16, 512, 4, 1),
               GemvConfig(2, 512, 4, 3), GemvConfig(32, 256, 4, 1, 2),
               GemvConfig(32, 256, 4, 1, 4), GemvConfig(32, 256, 4, 1, 8))


@dataclass(frozen=True)
class ShapeChoice:
    """What ``fast_gemv`` measured for one weight shape, and what it chose."""

    out_features: int
    in_features: int
    dtype: str
    layers: int
    torch_us: float
    gemv_us: float
    config: GemvConfig | None  # None: torch's GEMM stays
    rows: int = 1  # the rows of the input: 1, the GEMV; more, nimble.gemm_rows

    def describe(self) -> str:
        kernel = "GEMV" if self.rows == 1 else f"GEMM of {self.rows} rows"
        pick = kernel if self.config else "torch"
        return (f"{self.out_features}x{self.in_features} {self.dtype} ({self.layers} layers): "
                f"torch {self.torch_us:.2f} µs, {kernel} {self.gemv_us:.2f} µs -> {pick}")


# ---- the kernel and its operator ------------------------------------------------------------

_KERNEL: list = []


def _kernel():
    """The Triton GEMV (made on first use: no Triton import where no GEMV runs)."""
    if _KERNEL:
        return _KERNEL[0]
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, WAITS: tl.constexpr, EARLY: tl.constexpr,
                    LATE: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        if WAITS and not LATE:  # behind a programmatic edge: the next kernel may launch now
            tl.extra.cuda.gdc_launch_dependents()
        # the first EARLY steps' weight tiles are asked for before the wait for the input (a
        # constant of the graph: nimble.ir.waiting_kernels.WAITING_KERNELS); their sums are the
        # loop's first, in its order, so the bits are the same however many are asked early
        cols = tl.arange(0, BLOCK_K)
        col_ok = cols < K
        w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        if EARLY == 2:
            cols1 = BLOCK_K + tl.arange(0, BLOCK_K)
            col1_ok = cols1 < K
            w1 = tl.load(w_ptr + rows[:, None] * stride_w + cols1[None, :],
                         mask=row_ok[:, None] & col1_ok[None, :], other=0.0,
                         eviction_policy="evict_first")
        if WAITS:
            tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
        # Products summed per lane across the row's steps, reduced once at the end.
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc += w.to(tl.float32) * x[None, :].to(tl.float32)
        first = BLOCK_K
        if EARLY == 2:
            if K > BLOCK_K:
                x1 = tl.load(x_ptr + cols1, mask=col1_ok, other=0.0)
                acc += w1.to(tl.float32) * x1[None, :].to(tl.float32)
            first = 2 * BLOCK_K
        for k in range(first, K, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
            acc += w.to(tl.float32) * x[None, :].to(tl.float32)
        if WAITS and LATE:  # kernel_waits.LAUNCH_DEPENDENTS_LATE: its weight is read
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=row_ok)

    _KERNEL.append(gemv_kernel)
    return gemv_kernel


def launch_gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig) -> torch.Tensor:
    """``weight @ x`` for a vector ``x`` of ``in_features`` elements, on the current stream."""
    import triton

    n, k = weight.shape
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    _kernel()[(triton.cdiv(n, config.block_n),)](
        x, weight, y, n, k, weight.stride(0), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        WAITS=waits(x.device), EARLY=EARLY_TILES, LATE=kernel_waits.LAUNCH_DEPENDENTS_LATE,
        num_warps=config.warps,
        num_stages=config.stages)
    return y


@torch.library.custom_op("nimble::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, warps: int,
            stages: int) -> torch.Tensor:
    """The GEMV as an operator ``torch.compile`` traces as one call (on the CPU, the same
    product in torch's operations, summed in float32: what the CPU tests compile)."""
    if not x.is_cuda:
        return (weight.float() @ x.float()).to(x.dtype)
    return launch_gemv(x, weight, GemvConfig(block_n, block_k, warps, stages))


@gemv_op.register_fake
def _gemv_shape(x, weight, block_n, block_k, warps, stages):
    return x.new_empty(weight.shape[0])


#: The configurations of :mod:`nimble.gemm_rows` chosen per row count (2 or more rows).
RowConfigs = dict[int, GemvConfig]


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             config: GemvConfig | None, row_configs: RowConfigs | None) -> torch.Tensor | None:
    """``x`` times ``weight`` (``out_features x in_features``) plus ``bias`` on the GEMV (one
    row, ``config`` set) or on :mod:`nimble.gemm_rows` (a row count ``row_configs`` has, in a
    dtype it takes: a model made float32 after :func:`fast_gemv` runs torch's), else None:
    torch's GEMM.  Only on the GPU, the weight's rows contiguous and no gradient to
    record (a model moved to the CPU, or trained, after :func:`fast_gemv` runs torch's)."""
    k = weight.shape[1]
    if not (x.is_cuda and x.shape[-1] == k and weight.stride(1) == 1
            and not (torch.is_grad_enabled() and weight.requires_grad)):
        return None
    rows = x.numel() // k
    if rows == 1 and config is not None:
        y = gemv_op(x.reshape(k).contiguous(), weight, *config.args)
    elif row_configs and rows in row_configs and gemm_rows.takes(rows, x.dtype):
        y = gemm_rows.gemm_rows_op(x.reshape(rows, k).contiguous(), weight,
                                   *row_configs[rows].row_args)
    else:
        return None
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                config: GemvConfig | None,
                row_configs: RowConfigs | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on the GEMV where ``x`` is one row on the GPU and
    ``config`` is set, on :mod:`nimble.gemm_rows` where its row count has a configuration in
    ``row_configs`` (a model moved to the CPU after :func:`fast_gemv` runs torch's)."""
    y = _product(x, weight, bias, config, row_configs)
    return F.linear(x, weight, bias) if y is None else y


class GemvLinear(nn.Linear):
    """An ``nn.Linear`` whose single-row calls run the GEMV configuration ``gemv_config``, and
    whose calls of a row count in ``row_configs`` run :mod:`nimble.gemm_rows`."""

    gemv_config: GemvConfig | None = None
    row_configs: RowConfigs | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemv_linear(x, self.weight, self.bias, self.gemv_config, self.row_configs)


# ---- transformers' Conv1D (GPT-2's projections) ---------------------------------------------

def _conv1d_class():
    """transformers' ``Conv1D`` where transformers is loaded (a model of it exists), else None:
    importing it here would load transformers for every model."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return getattr(utils, "Conv1D", None)


def _conv1d_forward(self, x: torch.Tensor) -> torch.Tensor:
    # weight.t() is out x in: contiguous rows once fast_gemv re-laid it
    y = _product(x, self.weight.t(), self.bias, self.gemv_config, self.row_configs)
    return super(gemv_conv1d_class(), self).forward(x) if y is None else y


_GEMV_CONV1D: list = []


def __getattr__(name: str):
    # GemvConv1D subclasses transformers' Conv1D, so it is made where that class exists; a
    # name of the module all the same, so that a pickled model finds it
    if name == "GemvConv1D" and _conv1d_class() is not None:
        return gemv_conv1d_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def gemv_conv1d_class() -> type:
    """``GemvConv1D``: transformers' ``Conv1D`` (``x @ weight + bias``, the weight ``in x
    out``) whose single-row calls run the GEMV on ``weight.t()``; :func:`fast_gemv` stores that
    weight column by column (the same shape, values and name; its strides changed) so that the
    GEMV reads its rows contiguously."""
    if not _GEMV_CONV1D:
        base = _conv1d_class()
        if base is None:
            raise InputError("GemvConv1D swaps transformers' Conv1D: import transformers first")
        cls = type("GemvConv1D", (base,), {"gemv_config": None, "row_configs": None,
                                           "forward": _conv1d_forward,
                                           "__module__": __name__,
                                           "__doc__": gemv_conv1d_class.__doc__})
        _GEMV_CONV1D.append(cls)
    return _GEMV_CONV1D[0]


def _relay_by_columns(weight: nn.Parameter) -> None:
    """``weight`` (``in x out``) stored column by column in place: the Parameter, its shape and
    its values stay (an optimizer, ``load_state_dict`` and ``state_dict`` see the same tensor),
    and its transpose is a contiguous ``out x in`` matrix the GEMV reads."""
    if weight.stride(0) != 1:
        weight.data = weight.detach().t().contiguous().t()


# ---- choosing per shape ---------------------------------------------------------------------

#: ``time(config, weights, x) -> µs per call`` of torch's GEMM (``config`` None) or of the GEMV
#: in ``config``, on ``x`` over ``weights``: how a candidate is timed (:func:`graph_timer`; a
#: stand-in in the tests).
Timer = Callable[[GemvConfig | None, list, torch.Tensor], float]


def _targets(model: nn.Module) -> list[tuple[object, torch.Tensor]]:
    """Every GEMM the swap can reach: ``(owner, weight)`` of each ``nn.Linear`` (its exact
    class), of each group of fused projections (:mod:`nimble.fused_projections`: a member's
    ``_group``, which reads its ``gemv_config``), and of each transformers ``Conv1D`` (its
    weight's transpose: ``out x in``, as the GEMV reads it)."""
    found, groups = [], set()
    conv1d = _conv1d_class()
    for m in model.modules():
        group = getattr(m, "_group", None)
        if type(m) in (nn.Linear, GemvLinear):
            found.append((m, m.weight))
        elif conv1d is not None and type(m) in (conv1d, *_GEMV_CONV1D):
            found.append((m, m.weight.t()))
        elif hasattr(group, "gemv_config") and id(group) not in groups and not group.stale:
            groups.add(id(group))
            found.append((group, group.weight))
    # the GEMV reads each row of the weight contiguously (a transposed view stays torch's); a
    # Conv1D's weight is re-laid for it where the GEMV is chosen
    return [(owner, w) for owner, w in found
            if w.dim() == 2 and (w.stride(1) == 1 or _is_conv1d(owner))]


def _is_conv1d(owner) -> bool:
    conv1d = _conv1d_class()
    return conv1d is not None and isinstance(owner, conv1d)


def _key(weight: torch.Tensor) -> tuple:
    return tuple(weight.shape), weight.dtype, weight.device


def choose(weights: list, time: Timer, configs: Iterable[GemvConfig] = CONFIGS,
           margin: float = MARGIN, rows: int = 1) -> ShapeChoice:
    """Time torch's GEMM and every configuration of ``configs`` on ``weights`` (all of one
    shape) for an input of ``rows`` rows (1: the GEMV; more: :mod:`nimble.gemm_rows`); the
    fastest configuration where it beats torch's by ``margin``, else None."""
    n, k = weights[0].shape
    shape = (k,) if rows == 1 else (rows, k)
    x = torch.randn(shape, dtype=weights[0].dtype, device=weights[0].device)
    torch_us = time(None, weights, x)
    best: tuple[float, GemvConfig | None] = (float("inf"), None)
    for config in configs:
        us = time(config, weights, x)
        if us < best[0]:
            best = (us, config)
    gemv_us, config = best
    keep = config if gemv_us < torch_us * (1 - margin) else None
    return ShapeChoice(n, k, str(weights[0].dtype).removeprefix("torch."), len(weights),
                       torch_us, gemv_us, keep, rows)


def graph_timer(config: GemvConfig | None, weights: list, x: torch.Tensor,
                replays: int = 5) -> float:
    """µs per call of torch's GEMM (``config`` None) or the GEMV (``x`` one row; else
    :mod:`nimble.gemm_rows`) over ``weights`` in a CUDA graph, median of ``replays``: the
    weights (repeated past twice the L2 cache) are read once each per pass, as a decode step
    reads them."""
    def call(w):
        if config is None:
            return F.linear(x, w)
        if x.dim() == 1:
            return launch_gemv(x, w, config)
        return gemm_rows.launch_gemm_rows(x, w, *config.row_args)
    size = weights[0].numel() * weights[0].element_size()
    wanted = copies_past_l2(size, x.device)
    # clones keep the layout (a Conv1D's transposed view times torch's GEMM on its own); the
    # GEMV reads rows-contiguous copies, as a chosen Conv1D is re-laid
    rotation = list(weights) + [weights[0].clone() for _ in range(wanted - len(weights))]
    if config is not None:
        rotation = [w if w.stride(1) == 1 else w.contiguous() for w in rotation]
    return replay_us(call, rotation, x.device, replays)


def copies_past_l2(size: int, device: torch.device) -> int:
    """How many weights of ``size`` bytes pass twice ``device``'s L2 cache (at most 64): a
    rotation over them reads each from DRAM."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(64, -(-2 * l2 // size)))


def replay_us(call: Callable[[torch.Tensor], object], rotation: list, device: torch.device,
              replays: int = 5) -> float:
    """µs per call of ``call(w)`` for each ``w`` of ``rotation`` in turn, captured in one CUDA
    graph on a side stream (every kernel compiled and warmed before the capture), median of
    ``replays`` replays after an untimed one."""
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        for w in rotation:
            call(w)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for w in rotation:
            call(w)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(rotation))
    return statistics.median(times)


def fast_gemv(model: nn.Module, time: Timer | None = None,
              configs: Iterable[GemvConfig] = CONFIGS,
              margin: float = MARGIN, rows: Iterable[int] = (1,),
              row_margin: float | None = None) -> list[ShapeChoice]:
    """Give each GEMM of ``model`` the GEMV (an input of one row) or :mod:`nimble.gemm_rows`
    (an input of each other row count of ``rows``: a decode step's batch sizes) where it was
    measured faster (see the module docstring); what was measured and chosen, per weight shape
    and row count.  Call it after :func:`~nimble.fused_projections.fuse_projections` (whose
    groups it reaches) and before preparing.  ``time`` replaces the measurement (:data:`Timer`;
    with the default, the model's weights must be on a CUDA device), ``configs`` the GEMV's
    configurations tried, ``margin`` how much faster the kernel must be (negative: how much
    slower it may be, where what it allows pays for it, as :mod:`nimble.gemv_prologue_pass`'s
    folds do; a GEMM of rows, which no fold takes, is kept by :data:`MARGIN` at least, or by
    ``row_margin`` where it is given: an experiment's, for what a step's programmatic edges
    may pay, which the timing alone does not see).  Called
    again, it measures and chooses again: a row count not in ``rows``
    runs torch's GEMM from then on."""
    if not isinstance(model, nn.Module):
        raise InputError(f"fast_gemv takes an nn.Module, got {type(model).__name__}")
    rows = sorted(set(rows))
    if any(not 1 <= r <= gemm_rows.MAX_ROWS for r in rows):
        raise InputError(f"fast_gemv's rows are 1 (the GEMV) to {gemm_rows.MAX_ROWS} "
                         f"(nimble.gemm_rows), got {rows}")
    targets = _targets(model)
    devices = {w.device.type for _, w in targets}
    if time is None and targets and devices != {"cuda"}:
        raise InputError("fast_gemv measures the model's GEMMs on the GPU: move the model to a "
                         f"CUDA device first (its weights are on {sorted(devices)})")
    by_shape: dict[tuple, list] = {}
    for owner, weight in targets:
        by_shape.setdefault(_key(weight), []).append((owner, weight))
    choices = []
    with torch.no_grad():
        for members in by_shape.values():
            weights = [w for _, w in members]
            chosen: dict[int, GemvConfig | None] = {}
            for r in rows:
                if r > 1 and not gemm_rows.takes(r, weights[0].dtype):
                    continue  # float32: torch's GEMM (the kernel's tl.dot would round to TF32)
                # nothing is folded into a GEMM of rows: a negative margin does not hold there
                kept_by = margin if r == 1 else (
                    max(margin, MARGIN) if row_margin is None else row_margin)
                choice = choose(weights, time or graph_timer,
                                configs if r == 1 else ROW_CONFIGS, kept_by, r)
                choices.append(choice)
                chosen[r] = choice.config
                log.info("fast_gemv: %s", choice.describe())
            for owner, _ in members:
                _give(owner, chosen)
    return choices


def _give(owner, chosen: dict[int, GemvConfig | None]) -> None:
    """``owner``'s kernels as ``chosen`` (per row count; a count absent: torch's GEMM)."""
    single = chosen.get(1)
    row_configs = {r: c for r, c in chosen.items() if r > 1 and c is not None}
    taken = single is not None or bool(row_configs)
    if _is_conv1d(owner):
        if taken:
            _relay_by_columns(owner.weight)
            owner.__class__ = gemv_conv1d_class()
        if not isinstance(owner, tuple(_GEMV_CONV1D)):
            return
    elif isinstance(owner, nn.Linear):
        if type(owner) is nn.Linear and taken:
            owner.__class__ = GemvLinear
        if not isinstance(owner, GemvLinear):
            return
    # a swapped layer, or a fused group (its GEMM of the members' shared input)
    owner.gemv_config = single
    owner.row_configs = row_configs or None
