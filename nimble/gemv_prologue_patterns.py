"""The patterns :mod:`nimble.gemv_prologue_pass` folds into a GEMV (or a GEMM of a few rows),
matched on the operations as Inductor hands a graph over after its decompositions: an RMS norm
(``x * rsqrt(mean(x**2) + eps)`` times its weight, in float32 between the conversions the
model's code makes), a layer norm (``(x - mean) * rsqrt(var + eps)`` from ``var_mean``, times
its weight, plus its bias where it has one), a SiLU-gated product (SiLU as ``x / (1 +
exp(-x))``, ``x * sigmoid(x)`` or ``silu``), a GELU (``0.5 x (1 + erf(x / sqrt 2))`` or its
tanh approximation, as decomposed), and the residual sum beneath a norm, one of its operands
perhaps a projection's output plus the projection's bias.  Every tensor is of the product's
dtype, over vectors (or rows) of its input width."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx

from .fx_patterns import aten
from .fx_patterns import is_call as _is
from .fx_patterns import operand_orders as _orders
from .fx_patterns import other_operand as _other
from .fx_patterns import strip_convert as _strip_convert
from .fx_patterns import strip_views as _strip_views
from .fx_patterns import val as _val


@dataclass(frozen=True)
class Norm:
    """A norm the pass can fold: of ``value`` (``rows`` rows of ``k``), scaled by ``weight``,
    shifted by ``bias`` (a layer norm's, where it has one), ``centred`` for a layer norm."""

    value: fx.Node
    weight: fx.Node
    eps: float
    centred: bool = False
    bias: Optional[fx.Node] = None


def vector_of(node, k: int, dtype, rows: int = 1) -> bool:
    """Whether ``node`` is ``rows`` contiguous rows of ``k`` elements of ``dtype`` (its last
    dimension ``k``: a norm over it is then a norm over each row of the GEMV's input)."""
    v = _val(node)
    if not (v is not None and v.numel() == rows * k and v.dim() >= 1 and v.shape[-1] == k
            and v.dtype == dtype):
        return False
    return v.is_contiguous() or (rows > 1 and v.stride(-1) == 1 and _rows_view(v, rows, k))


def _rows_view(v, rows: int, k: int) -> bool:
    """Whether ``v`` (its rows contiguous, apart: a slice of a fused projection's output) is a
    ``rows x k`` matrix without a copy, as a GEMM of rows reads it."""
    try:
        v.view(rows, k)
    except RuntimeError:
        return False
    return True


# ---- the patterns ---------------------------------------------------------------------------

def _silu_input(node) -> Optional[fx.Node]:
    """``x`` where ``node`` is SiLU of ``x`` (in float32 between conversions, as decomposed)."""
    node = _strip_convert(node)
    if _is(node, aten.silu.default):
        return _strip_convert(node.args[0], torch.float32)
    if _is(node, aten.div.Tensor):
        x, denominator = node.args[:2]
        if (_is(denominator, aten.add.Tensor) and 1 in denominator.args[:2]
                and len(denominator.args) == 2 and not denominator.kwargs):
            e = _other(denominator, 1)
            if _is(e, aten.exp.default) and _is(e.args[0], aten.neg.default) \
                    and e.args[0].args[0] is x:
                return _strip_convert(x, torch.float32)
    if _is(node, aten.mul.Tensor):
        for s, x in (node.args[:2], node.args[1::-1]):
            if _is(s, aten.sigmoid.default) and s.args[0] is x:
                return _strip_convert(x, torch.float32)
    return None


def match_gated(x, k: int, dtype, rows: int = 1) -> Optional[tuple]:
    """``(gate, up)`` where ``x`` is ``silu(gate) * up`` over ``rows`` rows of ``k``
    elements."""
    x = _strip_convert(x)
    if not _is(x, aten.mul.Tensor) or x.kwargs:
        return None
    for activated, up in (x.args[:2], x.args[1::-1]):
        gate = _silu_input(activated)
        if gate is not None and vector_of(gate, k, dtype, rows) \
                and vector_of(up, k, dtype, rows):
            return gate, up
    return None


def match_rmsnorm(x, k: int, dtype, rows: int = 1) -> Optional[Norm]:
    """The norm where ``x`` is ``weight * rmsnorm(input)`` over each of ``rows`` rows of ``k``
    elements, the norm's arithmetic in float32 (the conversions optional)."""
    x = _strip_convert(x)
    if not _is(x, aten.mul.Tensor) or x.kwargs:
        return None
    for weight, normed in (x.args[:2], x.args[1::-1]):
        if not vector_of(weight, k, dtype):
            continue
        scaled = _strip_convert(normed)
        if not _is(scaled, aten.mul.Tensor):
            continue
        for source, rs in (scaled.args[:2], scaled.args[1::-1]):
            eps = _rsqrt_of_mean_square(rs, source)
            value = _strip_convert(source, torch.float32)
            if eps is not None and vector_of(value, k, dtype, rows):
                return Norm(value, weight, eps)
    return None


def _rsqrt_of_mean_square(rs, source) -> Optional[float]:
    """``eps`` where ``rs`` is ``rsqrt(mean(source ** 2, -1, keepdim) + eps)``."""
    if not _is(rs, aten.rsqrt.default) or not _is(rs.args[0], aten.add.Tensor):
        return None
    mean, eps = rs.args[0].args[:2]
    if not isinstance(eps, float) or rs.args[0].kwargs or not _is(mean, aten.mean.dim):
        return None
    if not _over_last(mean, source) or not (len(mean.args) > 2 and mean.args[2]):
        return None
    square = mean.args[0]
    if _is(square, aten.pow.Tensor_Scalar) and square.args[0] is source and square.args[1] == 2:
        return eps
    if _is(square, aten.mul.Tensor) and square.args[0] is source and square.args[1] is source:
        return eps
    return None


def residual_sum(node, k: int, dtype, rows: int = 1) -> Optional[tuple]:
    """``(a, b)`` where ``node`` is ``a + b``, both ``rows`` rows of ``k`` elements."""
    if not _is(node, aten.add.Tensor) or node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    if vector_of(a, k, dtype, rows) and vector_of(b, k, dtype, rows):
        return a, b
    return None


def match_layernorm(x, k: int, dtype, rows: int = 1) -> Optional[Norm]:
    """The layer norm ``x`` is, over each of ``rows`` rows of ``k`` elements: ``(v - mean) *
    rsqrt(var + eps) * weight (+ bias)`` in float32 of ``var_mean(v)``, rounded once."""
    x = _strip_convert(x)
    bias = None
    if _is(x, aten.add.Tensor) and not x.kwargs:
        for scaled, shift in _orders(x):
            if _is(scaled, aten.mul.Tensor) and vector_of(shift, k, dtype):
                x, bias = scaled, shift
                break
    if not _is(x, aten.mul.Tensor) or x.kwargs:
        return None
    for normed, weight in _orders(x):
        if not vector_of(weight, k, dtype):
            continue
        found = _centred_and_scaled(normed, k, dtype, rows)
        if found is not None:
            value, eps = found
            return Norm(value, weight, eps, centred=True, bias=bias)
    return None


def _centred_and_scaled(node, k: int, dtype, rows: int) -> Optional[tuple]:
    """``(v, eps)`` where ``node`` is ``(v32 - mean) * rsqrt(var + eps)``, ``var, mean`` the
    ``var_mean`` of ``v32`` (``v`` in float32) over its last dimension, unbiased off."""
    if not _is(node, aten.mul.Tensor) or node.kwargs:
        return None
    for centred, rs in _orders(node):
        if not (_is(centred, aten.sub.Tensor) and _is(rs, aten.rsqrt.default)
                and _is(rs.args[0], aten.add.Tensor)):
            continue
        v32, mean = centred.args[:2]
        var, eps = rs.args[0].args[:2]
        if not (isinstance(eps, float) and _is(var, operator.getitem)
                and _is(mean, operator.getitem)):
            continue
        stats = var.args[0]
        if stats is not mean.args[0] or (var.args[1], mean.args[1]) != (0, 1) \
                or not _is(stats, aten.var_mean.correction) or stats.args[0] is not v32:
            continue
        if not _over_last(stats, v32) or stats.kwargs.get("correction", 1) != 0 \
                or not stats.kwargs.get("keepdim", False):
            continue
        value = _strip_convert(v32, torch.float32)
        if vector_of(value, k, dtype, rows):
            return value, eps
    return None


def _over_last(stats, source) -> bool:
    """Whether the reduction ``stats`` is over the last dimension of ``source`` alone."""
    dims = stats.args[1] if len(stats.args) > 1 else None
    rank = _val(source).dim() if _val(source) is not None else -1
    return rank >= 1 and list(dims or []) in ([-1], [rank - 1])


@dataclass(frozen=True)
class Activation:
    """A GELU the pass can fold: of ``value`` (``rows`` rows of ``k``), by ``tanh`` or not."""

    value: fx.Node
    tanh: bool


_HALF, _ROOT_HALF, _TANH_SCALE, _CUBE = 0.5, 0.7071067811865476, 0.7978845608028654, 0.044715


def _is_number(x, want: float) -> bool:
    """Whether ``x`` is the constant ``want`` (as the decomposition wrote it, to rounding)."""
    return isinstance(x, (int, float)) and abs(x - want) <= 1e-7 * max(1.0, abs(want))


def _times(node, want: float):
    """``y`` where ``node`` is ``y * want`` (either order), else None."""
    if not _is(node, aten.mul.Tensor) or node.kwargs:
        return None
    for y, c in _orders(node):
        if _is_number(c, want):
            return y
    return None


def _cube_of(node, g) -> bool:
    """Whether ``node`` is ``g ** 3`` (as a power, or as ``g * g * g``)."""
    if _is(node, aten.pow.Tensor_Scalar):
        return node.args[0] is g and _is_number(node.args[1], 3.0)
    if _is(node, aten.mul.Tensor):
        for square, other in _orders(node):
            if other is g and _is(square, aten.mul.Tensor) and square.args[:2] == (g, g):
                return True
    return False


def _tanh_argument_of(node, g) -> bool:
    """Whether ``node`` is ``sqrt(2/pi) * (g + 0.044715 g^3)``."""
    inner = _times(node, _TANH_SCALE)
    if not _is(inner, aten.add.Tensor) or inner.kwargs:
        return False
    for first, cubed in _orders(inner):
        if first is g and _cube_of(_times(cubed, _CUBE), g):
            return True
    return False


def match_gelu(x, k: int, dtype, rows: int = 1) -> Optional[Activation]:
    """The GELU ``x`` is, of ``rows`` rows of ``k`` elements: ``0.5 g (1 + erf(g / sqrt 2))``
    or ``0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))`` in float32 (or the dtype's own
    operations) of ``g``, or ``aten.gelu``."""
    x = _strip_convert(x)
    if _is(x, aten.gelu.default):
        value = _strip_convert(x.args[0], torch.float32)
        tanh = x.kwargs.get("approximate", x.args[1] if len(x.args) > 1 else "none") == "tanh"
        return Activation(value, tanh) if vector_of(value, k, dtype, rows) else None
    if not _is(x, aten.mul.Tensor) or x.kwargs:
        return None
    for halved, one_plus in _orders(x):
        g = _times(halved, _HALF)
        if g is None or not _is(one_plus, aten.add.Tensor) or one_plus.kwargs:
            continue
        t = next((t for t, one in _orders(one_plus) if _is_number(one, 1.0)), None)
        if _is(t, aten.erf.default) and _times(t.args[0], _ROOT_HALF) is g:
            tanh = False
        elif _is(t, aten.tanh.default) and _tanh_argument_of(t.args[0], g):
            tanh = True
        else:
            continue
        value = _strip_convert(g, torch.float32)
        if vector_of(value, k, dtype, rows):
            return Activation(value, tanh)
    return None


def biased(node, k: int, dtype, rows: int = 1) -> Optional[tuple]:
    """``(output, bias)`` where ``node`` (beneath views) is a projection's ``output`` (``rows``
    rows of ``k``, computed in the graph) plus its ``bias`` (a vector of ``k``, an input or a
    constant of the graph: the model's parameter)."""
    node = _strip_views(node)
    if not _is(node, aten.add.Tensor) or node.kwargs or len(node.args) != 2:
        return None
    for output, bias in _orders(node):
        v = _val(bias)
        if (isinstance(bias, fx.Node) and bias.op in ("placeholder", "get_attr")
                and v is not None and v.dim() == 1 and vector_of(bias, k, dtype)
                and isinstance(output, fx.Node) and output.op == "call_function"
                and vector_of(output, k, dtype, rows)):
            return output, bias
    return None
