"""Which buffer an address of a capture names, and which kernel words are no pointers.

:class:`AddressResolver` replays the allocator's allocations in order, groups an op's
overlapping allocations into regions, creates buffers as addresses are met, and decides (by the
rules in :mod:`nimble.record.resolve`'s docstring) which kernel words are pointers and which are
padded integers or stale entries; :func:`padded_int_like` is the test for the latter.
:func:`~nimble.record.resolve.build_taskgraph` drives it.
"""
from __future__ import annotations

import bisect

from .intervals import Intervals, range_index
from .raw import RawCapture
from ..ir.alignment import ALIGNMENT
from ..ir.taskgraph import Buffer, BufferKind


# How far past the end of an op's own allocation a pointer may lie and still belong to it.
_PAST_END_SLACK = 256
# A library's kernel reaches memory from before the recording (the library's own, a workspace
# torch cached) at offsets aligned to at least this (nimble/record/resolve.py).  Not more:
# cuDNN's sm90 kernels keep 4-byte counters in their workspaces, 4, 8 or 12 bytes past a
# multiple of 16.
_LIBRARY_ALIGNMENT = 4
# A 32-bit integer followed by 4 bytes of padding that hold the top half of an old address
# reads as an address at most this far above a 4 GiB boundary.
_PADDED_INT_LIMIT = 1 << 21


def padded_int_like(value: int) -> bool:
    """Whether ``value`` could be a small 32-bit integer under a padding word's stale top half."""
    return (value & 0xFFFF_FFFF) < _PADDED_INT_LIMIT


class AddressResolver:
    """Addresses of one raw capture resolved to buffers, op by op in capture order: the
    allocations made so far are live (:meth:`advance`), and buffers are made as they are met."""

    def __init__(self, raw: RawCapture) -> None:
        self.raw = raw
        self.buffers: list[Buffer] = []
        self.live = Intervals()
        self._alloc_pos = 0
        self._allocs = sorted(raw.allocs, key=lambda a: a.ordinal)
        self._statics = range_index(raw.statics)
        self._externals = range_index(raw.externals)
        self._allocator = range_index(raw.allocator)
        self._pool = range_index(raw.pool)
        self.static_buffer = [self.new_buffer(r.kind, r.size, r.address, r.name)
                              for r in raw.statics]
        self.external_buffer: dict[int, int] = {}
        self.tensor_buffer: dict[int, int] = {}  # region (its first allocation) -> buffer id
        self.alloc_op: list[int] = self._alloc_ops()
        self.region, self.extent = self._regions()
        self.stats = {"allocations_reused_in_op": sum(
                          1 for i, rep in enumerate(self.region)
                          if rep != i or self.members(i) > 1),
                      "unlisted_pointer_accesses": 0, "op_accesses_without_pointer": 0,
                      "twin_unmoved_words": 0, "padded_words_in_external": 0,
                      "unaligned_words_in_external": 0}
        self.not_pointer_words: list[list[int]] = []  # [task, location, value]
        self.low_word_buffers: set[int] = set()

    def unmoved(self, task: int, location, value: int) -> bool:
        """Whether a kernel word of ``task`` points into the capture's pool yet kept its value
        when the work was captured again at other addresses (:mod:`nimble.record.twin`): no
        pointer."""
        moved = self.raw.moved_words
        return (moved is not None and isinstance(location, int) and location not in moved[task]
                and self._pool.find(value) is not None)

    def _alloc_ops(self) -> list[int]:
        begins = [op.alloc_begin for op in self.raw.ops]
        owner = []
        for a in self._allocs:
            i = bisect.bisect_right(begins, a.ordinal) - 1
            inside = i >= 0 and a.ordinal < self.raw.ops[i].alloc_end
            owner.append(i if inside else -1)
        return owner

    def _regions(self) -> tuple[list[int], dict[int, tuple[int, int, int]]]:
        """Per allocation, its region's first allocation; per region ``(start, end, members)``.

        A region joins the allocations one op made inside its own window whose bytes overlap,
        directly or through others; every other allocation is a region of its own.
        """
        region = list(range(len(self._allocs)))

        def root(i: int) -> int:
            while region[i] != i:
                region[i] = region[region[i]]
                i = region[i]
            return i

        by_op: dict[int, list[int]] = {}
        for i, k in enumerate(self.alloc_op):
            if k >= 0:
                by_op.setdefault(k, []).append(i)
        for members in by_op.values():
            members.sort(key=lambda i: self._allocs[i].address)
            end, last = -1, -1
            for i in members:
                a = self._allocs[i]
                if a.address < end:
                    x, y = root(i), root(last)
                    region[max(x, y)] = min(x, y)
                if a.address + a.size > end:
                    end, last = a.address + a.size, i
        extent: dict[int, tuple[int, int, int]] = {}
        for i in range(len(region)):
            rep = region[i] = root(i)
            a = self._allocs[i]
            start, stop, n = extent.get(rep, (a.address, a.address + a.size, 0))
            extent[rep] = (min(start, a.address), max(stop, a.address + a.size), n + 1)
        return region, extent

    def members(self, index: int) -> int:
        """How many allocations share ``index``'s region."""
        return self.extent[self.region[index]][2]

    def new_buffer(self, kind: str, size: int, address: int, name: str, op: int = -1) -> int:
        """Add a buffer; its id."""
        bid = len(self.buffers)
        self.buffers.append(Buffer(bid, kind, size, address, name, op))
        return bid

    def advance(self, time: int) -> None:
        """Make every allocation with ordinal < ``time`` visible."""
        while self._alloc_pos < len(self._allocs) and self._allocs[self._alloc_pos].ordinal < time:
            a = self._allocs[self._alloc_pos]
            self.live.insert(a.address, a.address + max(a.size, 1), self._alloc_pos)
            self._alloc_pos += 1

    def not_a_pointer(self, value: int, where: tuple[str, int], k: int, named: set[int]) -> bool:
        """Whether a kernel word of op ``k`` that falls at ``where`` (as :meth:`locate` says) is
        better taken for a padded integer or a stale entry (see :mod:`nimble.record.resolve`)."""
        if k < 0:
            return False
        covering = [s for s in self.raw.ops[k].spans if s.start <= value < s.start + s.size]
        if covering and all((value - s.start) % s.element for s in covering):
            return True  # inside an element of every tensor of the op it falls in
        kind, ref = where
        if kind == "buffer":
            buffer = self.buffers[ref]
            if buffer.kind == BufferKind.EXTERNAL:
                padded = padded_int_like(value) and (value - buffer.address) % ALIGNMENT != 0
                self.stats["padded_words_in_external"] += padded
                return padded
            return buffer.kind == BufferKind.INPUT and ref not in named
        rep = self.region[ref]
        if self.alloc_op[rep] == k:
            return False  # the op's own allocation
        freed = self._allocs[ref].freed_at
        if freed is not None and freed < self.raw.ops[k].alloc_begin:
            return True
        if rep in self.tensor_buffer:
            return self.tensor_buffer[rep] not in named
        return padded_int_like(value) and (value - self._allocs[ref].address) % ALIGNMENT != 0

    def unaligned_in_external(self, buffer: Buffer, value: int) -> bool:
        """Whether a library kernel's word ``value`` falls in ``buffer``, memory from before
        the recording, at an offset a library does not use (counted in the graph's meta)."""
        unaligned = (buffer.kind == BufferKind.EXTERNAL
                     and (value - buffer.address) % _LIBRARY_ALIGNMENT != 0)
        self.stats["unaligned_words_in_external"] += unaligned
        return unaligned

    def in_allocator_free(self, address: int) -> bool:
        """Whether ``address`` lies in torch's allocator memory outside every live block."""
        return self._allocator.find(address) is not None and self.locate(address) is None

    def locate(self, address: int):
        """``('alloc', index)``, ``('buffer', id)`` or None for an address at the current time."""
        hit = self.live.find(address)
        if hit is not None:
            return ("alloc", hit)
        hit = self._statics.find(address)
        if hit is not None:
            return ("buffer", self.static_buffer[hit])
        hit = self._externals.find(address)
        if hit is not None:
            if hit not in self.external_buffer:
                r = self.raw.externals[hit]
                self.external_buffer[hit] = self.new_buffer(
                    BufferKind.EXTERNAL, r.size, r.address, r.name or f"external@{r.address:#x}")
            return ("buffer", self.external_buffer[hit])
        return None

    def tensor_alloc_buffer(self, index: int, op: int) -> int:
        """The buffer of the region of allocation ``index``, which a tensor lives in."""
        rep = self.region[index]
        if rep not in self.tensor_buffer:
            start, end, _ = self.extent[rep]
            self.tensor_buffer[rep] = self.new_buffer(
                BufferKind.INTERMEDIATE, end - start, start,
                f"op{op}:{self.raw.ops[op].name}" if op >= 0 else f"alloc{index}", op)
        return self.tensor_buffer[rep]

    def just_past_own_allocation(self, k: int, address: int):
        """``('alloc', index)`` of an allocation op ``k`` made that ends just below ``address``.

        cuDNN hands kernels pointers to zero-byte regions aligned up past the end of the
        workspace it asked for; they belong to that workspace, not to whatever lies beyond it.
        """
        op = self.raw.ops[k]
        for index in range(len(self._allocs)):
            a = self._allocs[index]
            if op.alloc_begin <= a.ordinal < op.alloc_end and \
                    a.address + a.size <= address < a.address + a.size + _PAST_END_SLACK:
                return ("alloc", index)
        return None

    def just_past_live(self, address: int):
        """``('alloc', index)`` of a live allocation ending exactly at ``address`` (or
        ``('buffer', id)`` of such an input or parameter).

        A kernel may be handed a tensor's one-past-the-end pointer (ATen's reductions carry
        one); it names that tensor, not the block after.
        """
        hit = self.live.find(address - 1)
        if hit is not None:
            a = self._allocs[hit]
            if a.address + a.size == address:
                return ("alloc", hit)
        hit = self._statics.find(address - 1)
        if hit is not None and self.raw.statics[hit].end == address:
            return ("buffer", self.static_buffer[hit])
        return None
