"""A decode step's rotary embedding and cache read in the attention kernel (issue 53).

In a decoder with a static cache, each layer's step computes the query's and the new key's
rotary embedding, writes the new key and value into the cache, and only then runs the
attention over the cache: a kernel (Inductor's, for the embedding and the cache writes) and a
kernel boundary on the step's critical path before the attention.  Here the attend kernel of
:mod:`nimble.decode_attention` takes the query and the new key before their rotary embedding,
applies it itself, and reads the new key and value in place of the cache's slot at the step's
position, so that it needs the cache as it was before the step.  The cache's write stays (the
next step reads it), but nothing on the layer's chain waits for it (the pass moves the layers'
writes to the graph's end: :data:`nimble.attention_rope_pass.WRITES_LAST`).

``nimble::decode_attention_rope`` (and ``nimble::decode_attention_rope_parts``, the split's
parts unjoined, for :func:`nimble.gemv_prologues.gemv_joined`) are what
:mod:`nimble.attention_rope_pass` puts in a compiled graph where it finds the rotary
embedding in transformers' ``rotate_half`` form feeding a cache write and
``nimble::decode_attention``.  The embedding is computed in float32 and rounded once, as
Inductor's kernel computes it for the cache.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import decode_attention as da


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``rotate_half``: the last dimension's halves swapped, the first negated."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in float32, rounded once to ``x``'s dtype."""
    y = x.float() * cos.float() + rotate_half(x.float()) * sin.float()
    return y.to(x.dtype)


def with_new_slot(cache: torch.Tensor, new: torch.Tensor, position: torch.Tensor
                  ) -> torch.Tensor:
    """A copy of ``cache`` ``(B, Hkv, L, D)`` whose slot ``position`` holds ``new``."""
    out = cache.clone()
    out[:, :, position.reshape(-1)] = new.to(cache.dtype)
    return out


def _rope(cos, sin, key_new, value_new, position) -> da.Rope:
    return da.Rope(cos, sin, key_new, value_new, position)


def reference_inputs(query, key, value, rope: da.Rope) -> tuple:
    """``(query, key, value)`` as the plain attention reads them: the query rotated, the
    caches with the step's slot written (torch's operations)."""
    return (rotated(query, rope.cos, rope.sin),
            with_new_slot(key, rotated(rope.key, rope.cos, rope.sin), rope.position),
            with_new_slot(value, rope.value, rope.position))


@torch.library.custom_op("nimble::decode_attention_rope", mutates_args=())
def decode_attention_rope(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          mask: Optional[torch.Tensor], scale: float, cos: torch.Tensor,
                          sin: torch.Tensor, key_new: torch.Tensor, value_new: torch.Tensor,
                          position: torch.Tensor) -> torch.Tensor:
    """The attention of the rotated ``query`` over the caches ``key`` and ``value`` as they
    were before the step, the step's slot ``position`` read as ``key_new`` rotated and
    ``value_new`` (on the CPU, the same in torch's operations: what the CPU tests compile)."""
    rope = _rope(cos, sin, key_new, value_new, position)
    if not query.is_cuda:
        return torch.ops.nimble.decode_attention(*reference_inputs(query, key, value, rope),
                                                 mask, scale)
    return da.launch(query, key, value, mask, scale, rope=rope)


@decode_attention_rope.register_fake
def _decode_attention_rope_shape(query, key, value, mask, scale, cos, sin, key_new, value_new,
                                 position):
    batch, heads, _, head_dim = query.shape
    return query.new_empty((batch, 1, heads, head_dim))


@torch.library.custom_op("nimble::decode_attention_rope_parts", mutates_args=())
def decode_attention_rope_parts(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                mask: Optional[torch.Tensor], scale: float, splits: int,
                                cos: torch.Tensor, sin: torch.Tensor, key_new: torch.Tensor,
                                value_new: torch.Tensor, position: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_attention_rope`'s split parts, unjoined
    (:func:`nimble.decode_attention.launch_parts`)."""
    rope = _rope(cos, sin, key_new, value_new, position)
    if not query.is_cuda:
        return da.parts_reference(*reference_inputs(query, key, value, rope), mask, scale,
                                  splits)
    return da.launch_parts(query, key, value, mask, scale, splits, rope=rope)


@decode_attention_rope_parts.register_fake
def _decode_attention_rope_parts_shape(query, key, value, mask, scale, splits, cos, sin,
                                       key_new, value_new, position):
    layout = da.parts_layout(query.shape, key.shape, splits)
    rows = layout.rows(query.shape[0])
    return (query.new_empty((rows, layout.block_d), dtype=torch.float32),
            query.new_empty((rows, 2), dtype=torch.float32))
