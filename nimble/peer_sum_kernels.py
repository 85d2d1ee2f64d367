"""The kernel of :mod:`nimble.peer_sum`: a sum (or a gathering) over the ranks of one host
through memory every rank maps.  Imports Triton.

Each rank's buffer (:class:`nimble.peer_sum.PeerSumLayout`) holds, in int32 words, a flag per
sending rank and program, then a call counter per program, then two slots of data from
``DATA_AT`` bytes on.  Every call launches all ``PROGRAMS`` programs (the blocks of ``x``
shared out among them, ``BLOCK`` elements each), so every program counts every call and all
of a call's programs hold the same count.  A program of a call:

1. counts the call (its counter, local: each rank counts alike, its calls being the same);
2. copies its blocks of ``x`` into its own buffer's slot of that count's parity;
3. writes the count into its flag in every rank's buffer (a release at system scope, after a
   barrier of the program's threads: its copies are seen before its flag);
4. waits until every rank's flag in its own buffer holds the count (an acquire at system scope);
5. reads its blocks from every rank's slot, in rank order, sums in float32 and writes ``out``
   (with ``GATHER``, writes each rank's blocks in their place of ``out``, ``ranks x n``: an
   all-gather).

One wait a call is enough: a rank writes a slot again two calls later, after its kernel of the
call between has ended; a program of that kernel passed its wait, so every peer had begun that
call, so had ended the call before, the last to read the slot.  (Which blocks a program owns
may change from call to call with ``BLOCK``: the argument holds for the whole slot.)  The flags
are compared in wrapping arithmetic, so the counter may wrap.  Every rank adds in the same
order: the ranks' sums are equal bit for bit.  The programs are few (all resident at once), so
no program waits for a peer's that cannot start.  Compiled with ``WAITS``, every program waits
for its predecessor (``griddepcontrol.wait``, :mod:`nimble.kernel_waits`) after reading its own
buffer's address and before anything else: behind a programmatic edge the kernel launches
while the projection before it ends, and the argument above holds from the wait on.  The
flags are written and awaited one peer at a time, each a scalar: a spin over a vector of flags
does not compile with Triton 3.6.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _data(base, slot, offsets, DATA_AT: tl.constexpr, BLOCK: tl.constexpr,
          element: tl.constexpr):
    """Pointers to a block of a rank's slot, from its buffer's address (an int64)."""
    pointers = (base + DATA_AT).to(tl.pointer_type(element)) + slot + offsets
    # the address comes from memory, so Triton cannot see its alignment: the layout's
    return tl.max_contiguous(tl.multiple_of(pointers, 16), BLOCK)


# the rank is not specialized on (Triton would compile rank 1 apart, as a value of 1): every
# rank runs one binary, and no rank's first call loads a module while a peer's kernel spins
@triton.jit(do_not_specialize=["rank"])
def nimble_peer_sum_kernel(x_ptr, out_ptr, table_ptr, n, rank, slot_elements,
                           RANKS: tl.constexpr,
                           PROGRAMS: tl.constexpr, DATA_AT: tl.constexpr, BLOCK: tl.constexpr,
                           WAITS: tl.constexpr, GATHER: tl.constexpr):
    pid = tl.program_id(0)
    element = x_ptr.dtype.element_ty
    # the table is the graph's constant: this rank's entry read before the wait
    own = tl.load(table_ptr + rank)
    if WAITS:  # behind a programmatic edge: the predecessor's writes, the last call's counter
        tl.extra.cuda.gdc_wait()
    counters = own.to(tl.pointer_type(tl.int32)) + RANKS * PROGRAMS + pid
    count = tl.load(counters) + 1
    slot = (count & 1) * slot_elements
    for start in range(pid * BLOCK, n, PROGRAMS * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        inside = offsets < n
        tl.store(_data(own, slot, offsets, DATA_AT, BLOCK, element),
                 tl.load(x_ptr + offsets, mask=inside), mask=inside)
    tl.debug_barrier()
    # one scalar flag at a time: a spin over a vector of flags (a loop carrying a tensor)
    # fails Triton 3.6's layout pass
    for peer in tl.static_range(RANKS):
        theirs = tl.load(table_ptr + peer).to(tl.pointer_type(tl.int32)) + rank * PROGRAMS + pid
        tl.atomic_xchg(theirs, count, sem="release", scope="sys")
    for peer in tl.static_range(RANKS):
        mine = own.to(tl.pointer_type(tl.int32)) + peer * PROGRAMS + pid
        seen = tl.atomic_add(mine, 0, sem="acquire", scope="sys")
        while seen - count < 0:  # wrapping arithmetic: the count may wrap
            seen = tl.atomic_add(mine, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    for start in range(pid * BLOCK, n, PROGRAMS * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        inside = offsets < n
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for peer in tl.static_range(RANKS):
            # past the L1: a peer's writes reach this GPU's view of its memory, not its L1
            part = tl.load(_data(tl.load(table_ptr + peer), slot, offsets, DATA_AT, BLOCK,
                                 element), mask=inside, cache_modifier=".cv")
            if GATHER:  # each rank's tensor in its place, rank after rank
                tl.store(out_ptr + peer * n + offsets, part, mask=inside)
            else:
                total += part.to(tl.float32)
        if not GATHER:
            tl.store(out_ptr + offsets, total.to(element), mask=inside)
    tl.store(counters, count)
