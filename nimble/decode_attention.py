"""``decode_attention(model)``: a transformers decoder's single-query attention on one Triton
kernel that reads the cache's key and value heads as they are (issue 53).

A decode step's attention is one query token against the whole static cache.  Through
transformers' ``sdpa`` implementation under ``torch.compile``, grouped-query attention first
copies every key and value head once per query head that shares it (``repeat_kv``: at a Llama
3.2 1B shape four copies of each layer's cache a token), then runs a library attention kernel
made for long queries; both are latency-bound at one token, and each is a kernel boundary on
the step's critical path.  Here the query heads of one key-value head are one tile of a program
(padded to the matrix units' sixteen rows), each program reads one stretch of that head's
cache slots once, skips the stretches the mask hides (a static cache's slots past the
position), and keeps a running softmax in fp32; where the slots are split over several
programs a second small kernel joins their parts (flash-decoding's split).

``decode_attention(model)`` registers the implementation ``"nimble_decode"`` with transformers'
``AttentionInterface`` (and ``sdpa``'s masks with its ``AttentionMaskInterface``) and points the
model at it; it returns an :class:`AttentionSwap` whose ``undo()`` points it back.  Only the
calls this kernel computes as ``sdpa`` would take it: one query position, on the GPU, in
float16, bfloat16 or float32, key and value heads of one size up to 256 that divide the query
heads, a boolean or additive mask (or none), no dropout, no position bias, no soft-capping.
Every other call (a prefill, a batch of queries) runs transformers' ``sdpa`` as before.  The
kernel is the custom operator ``nimble::decode_attention``, which ``torch.compile`` traces as
one call and Nimble records as any kernel.  It sums in another order than the library's
kernels, so outputs may differ in the last bits, as between any two attention kernels.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .errors import InputError
from .kernel_waits import waits

log = logging.getLogger("nimble")

#: The name the implementation is registered under with transformers.
NAME = "nimble_decode"
#: The implementation a model must run before the swap: its masks are the ones the kernel takes,
#: and it runs every call the kernel does not.
REPLACES = "sdpa"
#: Largest head size the kernel takes.
MAX_HEAD_DIM = 256
#: Cache slots a program reads per step of its loop.
BLOCK_SLOTS = 64
#: The programs a call aims for (about an H100's or H200's multiprocessors): the cache's slots
#: are split until the key-value heads of the batch reach it, a block of slots per program at
#: the least.
TARGET_PROGRAMS = 132
#: Caches of at most this many blocks of slots are read unsplit: one program per (sequence,
#: key-value head) walks them all, and no second kernel joins parts.  Each block a program
#: walks adds about 2 µs where the join costs about 3 (tools/experiments/attention_split.py,
#: docs/results.md), so only the shortest caches gain.
UNSPLIT_BLOCKS = 2
#: Whether a program skips the stretches the mask hides by loads masked to the live slots
#: (no branch in its loop) rather than by a branch around each block.  Off: measured slower
#: in nearly every shape, and far slower where most of the cache is hidden, since each hidden
#: block still runs its dots (tools/experiments/attention_split.py --branchless,
#: docs/results.md); its values are close to the default's but not its bits on the GPU.
BRANCHLESS = False
#: Whether a split's parts are joined by the last of its programs to finish (each counts
#: itself on an atomic counter zeroed every call, the last reads the parts in split order, so
#: the values do not depend on which program is last) rather than by a second kernel: one
#: kernel boundary fewer a call.  Off: measured faster only from about 12 programs a head
#: (long caches at batch 1), slower below (tools/experiments/attention_split.py
#: --last-joins, docs/results.md).
LAST_JOINS = False
#: Whether a program asks for a block's values right after its keys rather than after the
#: block's scores: the two loads' latencies overlap, at the cost of the values' registers
#: held through the scores.  The same arithmetic either way (the same bits); on since measured
#: faster in a decode step (docs/results.md, "Values early, the rotary fold with its writes at
#: the end, programmatic edges into Nimble's kernels").
VALUES_EARLY = True
#: Caches of at most this many slots are read as one tile by one program per (sequence,
#: key-value head): every slot's key and value asked for at once, beside the mask rather than
#: after it, no loop over blocks and no join; the tile's slots are the cache's rounded up to a
#: power of two.  0: off, every cache walked in blocks of :data:`BLOCK_SLOTS`.  Measured faster
#: than the split at 128, 192 and 256 slots, batch 1 and 8
#: (``tools/experiments/attention_split.py --whole 256``, docs/results.md).
WHOLE_SLOTS = 256
#: Whether the attention with the rotary embedding folded in, its cache read as one tile,
#: asks for the cache's keys and values before its wait for the predecessor (behind a
#: programmatic edge, while the query's projection ends): its step's write of the cache comes
#: after it, and the new slot is read from the new key and value.  The same loads and the same
#: bits either way (:data:`nimble.ir.waiting_kernels.WAITING_KERNELS` lets such an edge be
#: programmatic only where no write of the cache comes before the kernel).
CACHE_BEFORE_WAIT = True
#: The largest tile of keys (slots × head size, each rounded up to a power of two) read whole:
#: on 8 warps a thread then holds 64 of its keys and 64 of its values, no spill (the PTX test).
WHOLE_ELEMENTS = 256 * 64
#: Rows of the matrix units' tiles: the query heads of a key-value head are padded to them.
MIN_TILE = 16
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Split:
    """How a call's cache slots are spread over programs."""

    splits: int  # programs per (sequence, key-value head)
    slots_per_split: int  # a multiple of block
    block: int = BLOCK_SLOTS  # slots a program reads per step of its loop
    whole: bool = False  # one tile of every slot, read before the mask is known


def whole_block(slots: int, head_dim: int = 64) -> int:
    """The tile of a cache of ``slots`` read whole (:data:`WHOLE_SLOTS`,
    :data:`WHOLE_ELEMENTS`), or 0 where it is walked in blocks."""
    tile = max(MIN_TILE, _pow2(slots))  # the matrix units' least
    return tile if 0 < slots <= WHOLE_SLOTS and tile * _pow2(head_dim) <= WHOLE_ELEMENTS else 0


def split_for(batch: int, kv_heads: int, slots: int, target: int | None = None,
              block: int = BLOCK_SLOTS, unsplit_blocks: int | None = None,
              splits: int | None = None, head_dim: int = 64) -> Split:
    """The split of ``slots`` cache slots for ``batch * kv_heads`` (sequence, head) pairs: as
    many programs per pair as bring the call to ``target`` programs (default
    :data:`TARGET_PROGRAMS`), at most one per block of slots; none where the slots are
    ``unsplit_blocks`` blocks or fewer (default :data:`UNSPLIT_BLOCKS`; ``splits`` given: that
    many, at most one per block).  A cache of at most :data:`WHOLE_SLOTS` slots of
    ``head_dim`` asked for with no ``splits`` or rule of its own is one tile per pair
    (:func:`whole_block`)."""
    tile = whole_block(slots, head_dim) if splits is None and unsplit_blocks is None \
        and block == BLOCK_SLOTS else 0
    if tile:
        return Split(1, tile, tile, True)
    blocks = -(-slots // block)
    if target is None:
        target = TARGET_PROGRAMS
    if unsplit_blocks is None:
        unsplit_blocks = UNSPLIT_BLOCKS
    if splits is None:
        splits = 1 if blocks <= unsplit_blocks else \
            -(-target // max(1, batch * kv_heads))
    splits = max(1, min(blocks, splits))
    per_split = -(-blocks // splits) * block
    return Split(-(-slots // per_split), per_split, block)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ---- the kernels and their operator ---------------------------------------------------------

_KERNELS: list = []


def _kernels():
    """The two Triton kernels (:mod:`nimble.decode_attention_kernels`, imported on first use: no
    Triton import where no attention runs)."""
    if not _KERNELS:
        from . import decode_attention_kernels as kernels

        _KERNELS.append((kernels.attend, kernels.join))
    return _KERNELS[0]


@dataclass(frozen=True)
class Rope:
    """What the attend kernel needs to apply a step's rotary embedding itself
    (:mod:`nimble.attention_rope`): ``cos`` and ``sin`` ``(B or 1, 1, 1, D)``, the step's new
    key (before its rotary embedding) and value ``(B, Hkv, 1, D)``, and ``position``, the
    cache slot they go to (one element)."""

    cos: torch.Tensor
    sin: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    position: torch.Tensor

    def arguments(self) -> tuple:
        """The kernel's pointer and stride arguments."""
        def batch_stride(t):
            return t.stride(0) if t.shape[0] > 1 else 0
        return (self.cos, self.sin, self.key, self.value, self.position,
                batch_stride(self.cos), batch_stride(self.sin), self.key.stride(0),
                self.key.stride(1), self.value.stride(0), self.value.stride(1))


def _launch_attend(query, key, value, mask, scale, plan: Split, branchless: bool,
                   last_joins: bool, out: torch.Tensor | None, rope: Rope | None = None):
    """The attend kernel over ``plan``'s split: ``(part, stat)`` where it splits (joined into
    ``out`` by its last program with ``last_joins``), else its output written to ``out``;
    with ``rope``, the query and the new key rotated by the kernel, and the new key and value
    read in place of the cache's slot at the position."""
    attend, _ = _kernels()
    batch, heads, _, head_dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    layout = PartsLayout(heads // kv_heads, kv_heads, plan.splits, head_dim)
    if mask is None:
        kind, mask_t, mask_strides = 0, query, (0, 0, 0)
    else:
        kind = 1 if mask.dtype == torch.bool else 2
        mask_t = mask.expand(batch, heads, 1, slots)
        mask_strides = (mask_t.stride(0), mask_t.stride(1), mask_t.stride(3))
    parted = plan.splits > 1
    # unsplit, the kernel writes the output alone: no parts and no count to allocate
    part = stat = count = out if out is not None else query
    if parted:
        rows = layout.rows(batch)
        part = torch.empty((rows, layout.block_d), dtype=torch.float32, device=query.device)
        stat = torch.empty((rows, 2), dtype=torch.float32, device=query.device)
        if last_joins:  # each pair's programs counted from zero, every call
            count = torch.zeros(batch * kv_heads, dtype=torch.int32, device=query.device)
    target = out if out is not None else part
    attend[(batch * kv_heads, plan.splits)](
        query, key, value, mask_t, target, part, stat, count, scale, slots, layout.groups,
        kv_heads, plan.splits, plan.slots_per_split,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), *mask_strides,
        target.stride(0), target.stride(2) if target.dim() > 2 else 0,
        *(rope.arguments() if rope is not None else (query,) * 5 + (0,) * 6),
        HEAD_DIM=head_dim, BLOCK_D=layout.block_d, BLOCK_R=layout.block_r, BLOCK_L=plan.block,
        MASK=kind, SPLIT=parted, IEEE=query.dtype == torch.float32, BRANCHLESS=bool(branchless),
        LAST_JOINS=bool(parted and last_joins), VALUES_EARLY=bool(VALUES_EARLY),
        ROPE=rope is not None, WAITS=waits(query.device), WHOLE=plan.whole,
        CACHE_EARLY=bool(CACHE_BEFORE_WAIT and plan.whole and rope is not None),
        num_warps=_warps(plan, layout.block_d), num_stages=2)
    return part, stat


def _warps(plan: Split, block_d: int) -> int:
    # a whole cache's tile of keys and of values held at once: 8 warps keep each thread's
    # share of the two at 128 registers from 256 slots of 64
    return 8 if plan.whole and plan.block * block_d > BLOCK_SLOTS * 128 else 4


def _contiguous_heads(*tensors):
    # the kernels step the head dimension contiguously
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def _contiguous_rope(rope: Rope | None) -> Rope | None:
    if rope is None:
        return None
    cos, sin, key, value = _contiguous_heads(rope.cos, rope.sin, rope.key, rope.value)
    return Rope(cos, sin, key, value, rope.position.reshape(-1))


def launch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           mask: torch.Tensor | None, scale: float, splits: int | None = None,
           branchless: bool | None = None, last_joins: bool | None = None,
           rope: Rope | None = None) -> torch.Tensor:
    """The attention of ``query`` ``(B, H, 1, D)`` over ``key`` and ``value``
    ``(B, Hkv, L, D)`` with ``mask`` (boolean or additive, broadcastable to ``(B, H, 1, L)``,
    or None), as ``(B, 1, H, D)``, on the current stream; ``splits``: programs per (sequence,
    key-value head), else :func:`split_for`'s; ``branchless``: hidden stretches skipped by
    masked loads rather than a branch (default :data:`BRANCHLESS`); ``last_joins``: a split's
    parts joined by its last program rather than a second kernel (default
    :data:`LAST_JOINS`); ``rope``: the query before its rotary embedding, which the kernel
    applies, and the step's new key and value read in place of the cache's slot at the
    position (:class:`Rope`)."""
    branchless = BRANCHLESS if branchless is None else branchless
    last_joins = LAST_JOINS if last_joins is None else last_joins
    _, join = _kernels()
    batch, heads, _, head_dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    query, key, value = _contiguous_heads(query, key, value)
    out = torch.empty((batch, 1, heads, head_dim), dtype=query.dtype, device=query.device)
    plan = split_for(batch, kv_heads, slots, splits=splits, head_dim=head_dim)
    part, stat = _launch_attend(query, key, value, mask, scale, plan, branchless, last_joins,
                                out, _contiguous_rope(rope))
    if plan.splits > 1 and not last_joins:
        layout = PartsLayout(heads // kv_heads, kv_heads, plan.splits, head_dim)
        join[(batch * kv_heads,)](part, stat, out, layout.groups, kv_heads, plan.splits,
                                  out.stride(0), out.stride(2), HEAD_DIM=head_dim,
                                  BLOCK_D=layout.block_d, BLOCK_R=layout.block_r,
                                  WAITS=waits(out.device), num_warps=4)
    return out


@dataclass(frozen=True)
class PartsLayout:
    """Where the attend kernel's split leaves a (sequence, key-value head)'s parts: row
    ``(pair * splits + split) * block_r + r`` of ``part`` (``block_d`` floats) and of ``stat``
    (its running maximum and sum) holds query head ``g * groups + r`` of pair ``b * kv_heads +
    g``."""

    groups: int
    kv_heads: int
    splits: int
    head_dim: int

    @property
    def block_r(self) -> int:
        """A tile's rows: the query heads of a key-value head, padded to the matrix units'."""
        return max(MIN_TILE, _pow2(self.groups))

    @property
    def block_d(self) -> int:
        return max(MIN_TILE, _pow2(self.head_dim))

    def rows(self, batch: int) -> int:
        """The rows of ``part`` and ``stat`` for ``batch`` sequences."""
        return batch * self.kv_heads * self.splits * self.block_r


def parts_layout(query_shape, key_shape, splits: int | None = None) -> PartsLayout:
    """The layout of the attend kernel's parts for these shapes, split over ``splits``
    programs (at most one per block of slots; None: :func:`split_for`'s rule)."""
    batch, heads, _, head_dim = query_shape
    kv_heads, slots = key_shape[1], key_shape[2]
    plan = split_for(batch, kv_heads, slots, splits=splits, head_dim=head_dim)
    return PartsLayout(heads // kv_heads, kv_heads, plan.splits, head_dim)


def launch_parts(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 mask: torch.Tensor | None, scale: float, splits: int,
                 rope: Rope | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The attend kernel alone over ``splits`` programs per (sequence, key-value head), at
    least two: ``(part, stat)`` in :class:`PartsLayout`'s rows, for a kernel that joins them
    as it reads them (:func:`nimble.gemv_prologues.gemv_joined`); ``rope`` as for
    :func:`launch`."""
    query, key, value = _contiguous_heads(query, key, value)
    plan = split_for(query.shape[0], key.shape[1], key.shape[2], splits=splits)
    if plan.splits < 2:
        raise InputError(f"launch_parts splits the cache's slots over programs: {splits} "
                         f"programs of {key.shape[2]} slots is no split")
    return _launch_attend(query, key, value, mask, scale, plan, False, False, None,
                          _contiguous_rope(rope))


def parts_reference(query, key, value, mask, scale: float,
                    splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`launch_parts` computes, in torch's operations in float32 (the CPU's kernel
    and the tests' reference; the sums in another order than the kernel's)."""
    batch, heads, _, head_dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    layout = parts_layout(query.shape, key.shape, splits)
    plan = split_for(batch, kv_heads, slots, splits=splits)
    part = torch.zeros((layout.rows(batch), layout.block_d), dtype=torch.float32,
                       device=query.device)
    stat = torch.zeros((layout.rows(batch), 2), dtype=torch.float32, device=query.device)
    stat[:, 0] = float("-inf")
    scores = torch.einsum("bhd,bhld->bhl", query[:, :, 0].float(),
                          key.float().repeat_interleave(layout.groups, 1)) * scale
    if mask is not None:
        m = mask.expand(batch, heads, 1, slots)[:, :, 0]
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool \
            else scores + m.float()
    values = value.float().repeat_interleave(layout.groups, 1)
    for b in range(batch):
        for h in range(heads):
            g, r = divmod(h, layout.groups)
            for split in range(plan.splits):
                lo = split * plan.slots_per_split
                hi = min(lo + plan.slots_per_split, slots)
                row = ((b * kv_heads + g) * plan.splits + split) * layout.block_r + r
                s = scores[b, h, lo:hi]
                top = s.max()
                if top == float("-inf"):
                    stat[row, 1] = 0.0
                    continue
                p = torch.exp(s - top)
                stat[row] = torch.stack([top, p.sum()])
                part[row, :head_dim] = p @ values[b, h, lo:hi]
    return part, stat


def join_reference(part: torch.Tensor, stat: torch.Tensor, layout: PartsLayout, batch: int,
                   dtype) -> torch.Tensor:
    """The parts joined in split order as the join kernel joins them: ``(B, 1, H, D)``."""
    heads = layout.kv_heads * layout.groups
    out = torch.empty((batch, 1, heads, layout.head_dim), dtype=dtype, device=part.device)
    for b in range(batch):
        for h in range(heads):
            g, r = divmod(h, layout.groups)
            rows = [((b * layout.kv_heads + g) * layout.splits + s) * layout.block_r + r
                    for s in range(layout.splits)]
            top = stat[rows, 0].max()
            top = torch.zeros_like(top) if top == float("-inf") else top
            w = torch.exp(stat[rows, 0] - top)
            total = (w * stat[rows, 1]).sum()
            acc = (w[:, None] * part[rows, :layout.head_dim]).sum(0)
            out[b, 0, h] = (acc / total).to(dtype)
    return out


@torch.library.custom_op("nimble::decode_attention", mutates_args=())
def decode_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """The kernel as an operator ``torch.compile`` traces as one call (on the CPU, where the
    swap never sends a call, the same split in torch's operations: what the CPU tests of
    :mod:`nimble.gemv_prologue_pass` compile)."""
    if not query.is_cuda:
        layout = parts_layout(query.shape, key.shape)
        part, stat = parts_reference(query, key, value, mask, scale, layout.splits)
        return join_reference(part, stat, layout, query.shape[0], query.dtype)
    return launch(query, key, value, mask, scale)


@decode_attention_op.register_fake
def _decode_attention_shape(query, key, value, mask, scale):
    batch, heads, _, head_dim = query.shape
    return query.new_empty((batch, 1, heads, head_dim))


@torch.library.custom_op("nimble::decode_attention_parts", mutates_args=())
def decode_attention_parts_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              mask: Optional[torch.Tensor], scale: float,
                              splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`launch_parts` as an operator: the split's parts, unjoined."""
    if not query.is_cuda:
        return parts_reference(query, key, value, mask, scale, splits)
    return launch_parts(query, key, value, mask, scale, splits)


@decode_attention_parts_op.register_fake
def _decode_attention_parts_shape(query, key, value, mask, scale, splits):
    layout = parts_layout(query.shape, key.shape, splits)
    rows = layout.rows(query.shape[0])
    return (query.new_empty((rows, layout.block_d), dtype=torch.float32),
            query.new_empty((rows, 2), dtype=torch.float32))


# ---- which calls take it --------------------------------------------------------------------

def unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: torch.Tensor | None, dropout: float, kwargs: dict) -> str | None:
    """Why the kernel cannot compute this call as ``sdpa`` would (None: it can)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "not (batch, heads, positions, head size) tensors"
    batch, heads, positions, head_dim = query.shape
    if positions != 1:
        return f"{positions} query positions"
    if not (query.is_cuda and key.is_cuda and value.is_cuda):
        return "not on the GPU"
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtype {query.dtype}"
    if key.shape[-1] != head_dim or value.shape[-1] != head_dim or head_dim > MAX_HEAD_DIM:
        return f"head sizes {head_dim}, {key.shape[-1]}, {value.shape[-1]}"
    if key.shape[:3] != value.shape[:3] or key.shape[0] != batch or \
            key.shape[1] == 0 or heads % key.shape[1]:
        return f"key {tuple(key.shape)} and value {tuple(value.shape)} for {heads} query heads"
    if dropout:
        return "dropout"
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None or \
            kwargs.get("output_attentions"):
        return "a position bias, soft-capping or attention weights asked for"
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or not mask.is_cuda:
            return "a mask that is no 4-d tensor on the GPU"
        if mask.dtype != torch.bool and mask.dtype not in DTYPES:
            return f"a mask of dtype {mask.dtype}"
        try:
            torch.broadcast_shapes(mask.shape, (batch, heads, 1, key.shape[2]))
        except RuntimeError:
            return f"a mask of shape {tuple(mask.shape)}"
        if mask.shape[2] != 1 or mask.shape[3] != key.shape[2]:
            return f"a mask of shape {tuple(mask.shape)}"
    return None


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' attention-function signature: the kernel where :func:`unsupported` finds
    nothing, else ``sdpa``."""
    reason = unsupported(query, key, value, attention_mask, dropout, kwargs)
    if reason is None:
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        return decode_attention_op(query, key, value, attention_mask, scale), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


# ---- the swap -------------------------------------------------------------------------------

def register() -> None:
    """``"nimble_decode"`` in transformers' attention and mask registries (``sdpa``'s masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


@dataclass
class AttentionSwap:
    """A model pointed at ``"nimble_decode"``; :meth:`undo` points it back at ``previous``."""

    model: nn.Module
    previous: str

    def undo(self) -> None:
        _point(self.model, self.previous)


def _point(model: nn.Module, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(name)
    else:
        model.config._attn_implementation = name


def decode_attention(model: nn.Module) -> AttentionSwap:
    """Point ``model`` (a transformers model on ``sdpa``) at ``"nimble_decode"`` (see the
    module docstring); before preparing."""
    if not isinstance(model, nn.Module):
        raise InputError(f"decode_attention takes an nn.Module, got {type(model).__name__}")
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == NAME:
        raise InputError("the model's attention already runs on nimble_decode")
    if current != REPLACES:
        raise InputError(
            f"decode_attention takes a transformers model whose attention runs on "
            f"{REPLACES!r} (its masks and its other calls are sdpa's); this one's is "
            f"{current!r}: load it with attn_implementation={REPLACES!r}")
    register()
    _point(model, NAME)
    log.info("decode_attention: %s's single-query attention on nimble::decode_attention",
             type(model).__name__)
    return AttentionSwap(model, current)
