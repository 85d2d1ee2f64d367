"""The rotary embedding and the cache read folded into the decode attention (issue 53): an
Inductor graph pass, run by :func:`nimble.gemv_prologue_pass.fusing` with ``rope_attention``.

Where a compiled graph feeds ``nimble::decode_attention`` a query rotated in transformers'
``rotate_half`` form (``x * cos + rotate_half(x) * sin``), and caches that are the graph's
inputs with the step's key (rotated with the same ``cos`` and ``sin``) and value written at one
position (``index_put`` or ``index_copy`` over the slots), the pass calls
``nimble::decode_attention_rope`` (:mod:`nimble.attention_rope`) on the unrotated query and key,
the new value and the caches as the graph received them. The cache writes stay, moved after the
attention (so that Inductor still writes them in place: to the graph's end by default); nothing
else reads the query's rotation, which goes. Anything else (a partial or interleaved rotary
embedding, a cache that is no graph input, several positions) stays as it was.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx

from . import attention_rope  # noqa: F401  (registers the operators the pass inserts)
from .fx_patterns import aten, is_call, operand_orders, val

#: The cache writes the pass takes: ``index_put(cache, [None, None, index], new)`` and
#: ``index_copy(cache, 2, index, new)``.
WRITES = (aten.index_put.default, aten.index_copy.default)
#: Whether the cache writes go as late as their readers allow (together at the graph's end,
#: where Inductor's combo kernels may launch several as one) rather than right after their
#: attention (measured slower: each a branch of the step's DAG of its own, docs/results.md).
WRITES_LAST = True


@dataclass(frozen=True)
class Rotation:
    """``x * cos + rotate_half(x) * sin``."""

    x: fx.Node
    cos: fx.Node
    sin: fx.Node


@dataclass(frozen=True)
class CacheWrite:
    """``cache`` with ``new`` written at the slots ``index``."""

    node: fx.Node
    cache: fx.Node
    index: fx.Node
    new: fx.Node


def _last_dim(node, dim) -> bool:
    rank = val(node).dim()
    return dim in (-1, rank - 1)


def _is_slice(node, x, start: int, end: int) -> bool:
    """Whether ``node`` is ``x[..., start:end]``."""
    if not is_call(node, aten.slice.Tensor) or node.args[0] is not x or node.kwargs:
        return False
    given = list(node.args[1:])
    dim, lo, hi, step = given + [0, None, None, 1][len(given):]
    size = val(x).shape[-1]
    lo = 0 if lo is None else lo
    hi = size if hi is None or hi >= size else hi
    return _last_dim(x, dim) and (lo, hi, step) == (start, end, 1)


def _is_rotate_half(node, x) -> bool:
    """Whether ``node`` is ``cat((-x[..., half:], x[..., :half]), -1)``."""
    size = val(x).shape[-1]
    if size % 2 or not is_call(node, aten.cat.default) or len(node.args[0]) != 2:
        return False
    if not _last_dim(x, node.args[1] if len(node.args) > 1 else 0):
        return False
    negated, first = node.args[0]
    return (is_call(negated, aten.neg.default) and _is_slice(negated.args[0], x, size // 2, size)
            and _is_slice(first, x, 0, size // 2))


def _is_angle(node, x) -> bool:
    """Whether ``node`` is a ``cos`` or ``sin`` for ``x`` ``(B, heads, 1, D)``: ``(B or 1, 1,
    1, D)`` in ``x``'s dtype."""
    a, v = val(node), val(x)
    return (a is not None and a.dim() == 4 and a.shape[1] == 1 and a.shape[2] == 1
            and a.shape[3] == v.shape[3] and a.shape[0] in (1, v.shape[0])
            and a.dtype == v.dtype)


def match_rotation(node) -> Optional[Rotation]:
    """The rotation ``node`` computes, if it is one of a single position's head vectors."""
    if not is_call(node, aten.add.Tensor) or node.kwargs or len(node.args) != 2:
        return None
    for straight, turned in operand_orders(node):
        if not (is_call(straight, aten.mul.Tensor) and is_call(turned, aten.mul.Tensor)):
            continue
        for x, cos in operand_orders(straight):
            v = val(x)
            if v is None or v.dim() != 4 or v.shape[2] != 1:
                continue
            for rot, sin in operand_orders(turned):
                if _is_rotate_half(rot, x) and _is_angle(cos, x) and _is_angle(sin, x):
                    return Rotation(x, cos, sin)
    return None


def match_cache_write(node) -> Optional[CacheWrite]:
    """The write ``node`` is, if it writes one slot of a cache the graph takes as an input."""
    if is_call(node, aten.index_put.default):
        cache, indices, new = node.args[:3]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate")
        if accumulate or len(indices) != 3 or indices[0] is not None or indices[1] is not None:
            return None
        index = indices[2]
    elif is_call(node, aten.index_copy.default):
        cache, dim, index, new = node.args[:4]
        if dim not in (2, -2):
            return None
    else:
        return None
    c, i, n = val(cache), val(index), val(new)
    if not isinstance(cache, fx.Node) or cache.op != "placeholder" or c is None or i is None \
            or n is None or c.dim() != 4 or i.numel() != 1 or i.dim() != 1 \
            or i.dtype not in (torch.int64, torch.int32) \
            or tuple(n.shape) != (c.shape[0], c.shape[1], 1, c.shape[3]) or n.dtype != c.dtype:
        return None
    return CacheWrite(node, cache, index, new)


def _fold(graph: fx.Graph, attention: fx.Node) -> Optional[fx.Node]:
    query, key, value, mask, scale = attention.args[:5]
    q_rot = match_rotation(query)
    k_write, v_write = match_cache_write(key), match_cache_write(value)
    if q_rot is None or k_write is None or v_write is None or k_write.index is not v_write.index:
        return None
    k_rot = match_rotation(k_write.new)
    if k_rot is None or k_rot.cos is not q_rot.cos or k_rot.sin is not q_rot.sin:
        return None
    with graph.inserting_before(attention):
        new = graph.call_function(
            torch.ops.nimble.decode_attention_rope.default,
            (q_rot.x, k_write.cache, v_write.cache, mask, scale, q_rot.cos, q_rot.sin, k_rot.x,
             v_write.new, k_write.index))
    new.meta["val"] = val(attention)
    attention.replace_all_uses_with(new)
    graph.erase_node(attention)
    return new


def _move_writes(graph: fx.Graph, folded: list[fx.Node], last: bool) -> None:
    """Each folded attention's cache writes moved after it: it reads the caches as the graph
    received them, and a write before that read would keep Inductor from writing in place.
    With ``last``, each goes as late as its readers allow (before its first reader, the copy
    back into the graph's input at the end): the layers' writes then stand together, off the
    layers' chain, where Inductor may launch them as one combo kernel; else right after the
    attention."""
    for attention in folded:
        after = attention
        for cache in attention.args[1:3]:
            for write in [u for u in cache.users if u is not attention and match_cache_write(u)]:
                order = {n: i for i, n in enumerate(graph.nodes)}
                readers = sorted(write.users, key=order.__getitem__)
                if order[write] > order[attention] or any(
                        order[u] < order[attention] for u in readers):
                    continue
                if last and readers:
                    readers[0].prepend(write)
                else:
                    after.append(write)
                    after = write


def fold_rope(graph: fx.Graph) -> int:
    """Fold the rotary embedding and the cache read into each ``nimble::decode_attention`` of
    ``graph`` where the pattern matches (see the module's text); how many were folded."""
    folded = [new for attention in [n for n in graph.nodes
                                    if is_call(n, torch.ops.nimble.decode_attention.default)]
              if (new := _fold(graph, attention)) is not None]
    if folded:
        graph.eliminate_dead_code()  # the query's rotation, and views of the written caches
        _move_writes(graph, folded, WRITES_LAST)
    return len(folded)
