"""build_taskgraph: from a hand-made RawCapture to buffers, pointers and accesses (CPU only)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nimble.analysis.deps import build_dag
from nimble.record.raw import (AllocEvent, DeviceRange, OpRecord, RawCapture, RawNode, TensorSpan,
                               TensorSpec)
from nimble.engine.arena_layout import low_word_buffers
from nimble.record.resolve import build_taskgraph, unresolved_in_pool
from nimble.record.intervals import Intervals
from nimble.ir.taskgraph import Access, BufferKind, Pointer, TaskKind

POOL = 0x7F00_1230_0000  # the capture's private pool: [POOL, POOL + 1 MiB)
W = 0x7E00_0000_0000  # a parameter, 4 KiB
X = 0x7E00_0010_0000  # the graph input, 1 KiB
EXT = 0x7D00_0000_0000  # memory allocated before capture, 4 KiB
STATICS = [DeviceRange(W, 4096, "fc.weight", BufferKind.PARAM),
           DeviceRange(X, 1024, "input0", BufferKind.INPUT)]


def kernel(*pointers: int) -> RawNode:
    """A kernel node whose parameter block holds ``pointers`` at offsets 0, 8, 16..."""
    return RawNode(TaskKind.KERNEL, name="k", short_name="k",
                   pointers=[(8 * i, p) for i, p in enumerate(pointers)])


def op(name, nodes, allocs, *spans) -> OpRecord:
    """Op: node window ``nodes``, alloc window ``allocs``; spans ``(start, size, w)``."""
    return OpRecord(name, "m", nodes[0], nodes[1], allocs[0], allocs[1],
                    spans=[TensorSpan(*s) for s in spans])


def capture(ops, nodes, allocs=(), outputs=(), inputs=((X, 256),), externals=(),
            pool=(POOL, 1 << 20)) -> RawCapture:
    """A RawCapture with the standard statics and pool; allocs are ``(address, size)`` in order,
    or ``(address, size, freed_at)``."""
    return RawCapture(
        ops=list(ops), nodes=list(nodes),
        allocs=[AllocEvent(i, *a) for i, a in enumerate(allocs)],
        statics=list(STATICS), externals=list(externals),
        pool=[DeviceRange(*pool, "pool")],
        inputs=[TensorSpec(a, [n // 4], [1], "float32") for a, n in inputs],
        outputs=[TensorSpec(a, [n // 4], [1], "float32") for a, n in outputs])


def ptr_buffer(graph, task, value) -> int:
    [p] = [p for p in graph.tasks[task].pointers if p.value == value]
    return p.buffer


# ---- 1. same address, two allocations ----------------------------------------------------------

def two_branches_sharing_an_address():
    A, B, C = POOL, POOL + 512, POOL + 1024
    ops = [op("relu", (0, 1), (0, 1), (X, 256, False), (A, 256, True)),
           op("neg", (1, 2), (1, 2), (A, 256, False), (B, 256, True)),  # then A is freed
           op("relu", (2, 3), (2, 3), (X, 256, False), (A, 256, True)),  # A again
           op("neg", (3, 4), (3, 4), (A, 256, False), (C, 256, True))]
    nodes = [kernel(X, A), kernel(A, B), kernel(X, A), kernel(A, C)]
    return capture(ops, nodes, [(A, 256), (B, 256), (A, 256), (C, 256)],
                   outputs=[(B, 256), (C, 256)])


def test_reused_address_is_two_buffers_and_branches_stay_independent():
    g = build_taskgraph(two_branches_sharing_an_address())
    first, second = ptr_buffer(g, 0, POOL), ptr_buffer(g, 2, POOL)
    assert first != second
    assert ptr_buffer(g, 1, POOL) == first and ptr_buffer(g, 3, POOL) == second
    for bid, k in ((first, 0), (second, 2)):
        b = g.buffers[bid]
        assert (b.kind, b.address, b.size, b.op) == (BufferKind.INTERMEDIATE, POOL, 256, k)
    assert Access(second, 0, 256, True) in g.tasks[2].accesses
    assert Access(second, 0, 256, False) in g.tasks[3].accesses
    assert all(a.buffer != first for t in (2, 3) for a in g.tasks[t].accesses)
    assert all(a.buffer != second for t in (0, 1) for a in g.tasks[t].accesses)
    assert build_dag(g).edges() == [(0, 1), (2, 3)]
    assert g.meta["allocations_reused_in_op"] == 0


# ---- 2. scratch --------------------------------------------------------------------------------

def test_unnamed_allocation_is_scratch_per_op():
    A, B, WS = POOL, POOL + 512, POOL + 4096
    ops = [op("mm", (0, 2), (0, 2), (X, 256, False), (W, 4096, False), (A, 256, True)),
           op("mm", (2, 3), (2, 3), (X, 256, False), (W, 4096, False), (B, 256, True))]
    # op 0 allocates the workspace (alloc 1) and two kernels use it; op 1 reuses it unallocated
    nodes = [kernel(X, W, A, WS), kernel(WS + 128), kernel(X, W, B, WS)]
    g = build_taskgraph(capture(ops, nodes, [(A, 256), (WS, 1024), (B, 256)],
                                outputs=[(A, 256), (B, 256)]))
    scratch = [b for b in g.buffers if b.kind == BufferKind.SCRATCH]
    assert [(b.op, b.address, b.size) for b in scratch] == [(0, WS, 1024), (1, WS, 1024)]
    s0, s1 = scratch[0].id, scratch[1].id
    assert Pointer(24, WS, s0, 0) in g.tasks[0].pointers
    assert g.tasks[1].pointers == [Pointer(0, WS + 128, s0, 128)]
    assert Pointer(24, WS, s1, 0) in g.tasks[2].pointers
    assert Access(s0, 0, 1024, True) in g.tasks[0].accesses
    assert g.tasks[1].accesses == [Access(s0, 0, 1024, True)]  # whole buffer, read-write
    assert Access(s1, 0, 1024, True) in g.tasks[2].accesses
    assert not any(a.buffer == s0 for a in g.tasks[2].accesses)
    assert g.meta["unlisted_pointer_accesses"] == 0
    # the ops share only reads of X and W: op 1 waits for nobody, scratch or not
    assert build_dag(g, chain_ops=False).edges() == [(0, 1)]
    assert all(b.kind != BufferKind.SCRATCH for b in g.buffers if b.address in (A, B))


def test_overlapping_scratch_allocations_of_one_op_share_a_buffer():
    A, WS = POOL, POOL + 4096
    ops = [op("conv", (0, 1), (0, 3), (X, 256, False), (A, 256, True))]
    nodes = [kernel(X, A, WS, WS + 128)]  # workspace freed and re-made 128 bytes further in
    g = build_taskgraph(capture(ops, nodes, [(A, 256), (WS, 256), (WS + 128, 256)]))
    [s] = [b for b in g.buffers if b.kind == BufferKind.SCRATCH]
    assert (s.address, s.size, s.op) == (WS, 384, 0)
    assert Pointer(16, WS, s.id, 0) in g.tasks[0].pointers
    assert Pointer(24, WS + 128, s.id, 128) in g.tasks[0].pointers


# ---- 3. params, inputs, outputs ----------------------------------------------------------------

def test_params_inputs_and_outputs_resolve_with_offsets():
    A, T = POOL, POOL + 2048
    ops = [op("addmm", (0, 1), (0, 1), (X, 256, False), (W, 4096, False), (A, 1024, True)),
           op("relu", (1, 2), (2, 2), (A, 1024, False), (T, 256, False))]
    nodes = [kernel(X, W, A), kernel(A + 0, T)]
    g = build_taskgraph(capture(ops, nodes, [(A, 1024), (T, 256)],
                                inputs=[(X, 256), (X + 512, 256)], outputs=[(A + 64, 512)]))
    param, inp, out = ptr_buffer(g, 0, W), ptr_buffer(g, 0, X), ptr_buffer(g, 0, A)
    assert (g.buffers[param].kind, g.buffers[param].name, g.buffers[param].size) == (
        BufferKind.PARAM, "fc.weight", 4096)
    assert (g.buffers[inp].kind, g.buffers[inp].name) == (BufferKind.INPUT, "input0")
    assert g.buffers[out].kind == BufferKind.OUTPUT and g.buffers[out].op == 0
    assert [(r.buffer, r.offset) for r in g.inputs] == [(inp, 0), (inp, 512)]
    [o] = g.outputs
    assert (o.buffer, o.offset, o.shape, o.strides, o.dtype) == (out, 64, [128], [1], "float32")
    # an allocation made between op windows: an intermediate of no op, never made an output
    tmp = g.buffers[ptr_buffer(g, 1, T)]
    assert (tmp.kind, tmp.op, tmp.name) == (BufferKind.INTERMEDIATE, -1, "alloc1")
    assert g.ops[0].accesses == [Access(inp, 0, 256, False), Access(param, 0, 4096, False),
                                 Access(out, 0, 1024, True)]


# ---- 4. unresolved pointers --------------------------------------------------------------------

def test_unknown_pointer_is_unresolved_and_pool_ones_are_flagged():
    A, NOWHERE, HOLE = POOL, 0xDEAD_0000, POOL + 0x8000
    ops = [op("relu", (0, 1), (0, 1), (X, 256, False), (A, 256, True))]
    raw = capture(ops, [kernel(X, A, NOWHERE, HOLE)], [(A, 256)], outputs=[(A, 256)])
    g = build_taskgraph(raw)
    assert g.unresolved_pointers() == [(0, Pointer(16, NOWHERE, -1, 0)),
                                       (0, Pointer(24, HOLE, -1, 0))]
    assert unresolved_in_pool(g, raw) == [(0, Pointer(24, HOLE, -1, 0))]
    assert {a.buffer for a in g.tasks[0].accesses} == {ptr_buffer(g, 0, X), ptr_buffer(g, 0, A)}


def test_stale_words_in_the_pool_where_nothing_lives_are_named_and_left_alone():
    # googlenet's training step: an elementwise functor's ``int 5`` followed by 4 bytes of
    # padding holding the top half of a stale stack pointer; inception_v3's: stale entries
    # past the used part of an array.  Both fall inside the pool where no allocation lives.
    seg, A = 0x7F53_FA00_0000, 0x7F53_FA00_0000 + 512
    padded, stale = 0x7F54_0000_0005, 0x7F53_FB00_0000
    ops = [op("relu", (0, 1), (0, 1), (X, 256, False), (A, 256, True))]
    raw = capture(ops, [kernel(X, A, padded, stale)], [(A, 256)], outputs=[(A, 256)],
                  pool=(seg, 0x620_0000))
    g = build_taskgraph(raw)
    assert unresolved_in_pool(g, raw) == [(0, Pointer(16, padded, -1, 0)),
                                          (0, Pointer(24, stale, -1, 0))]
    assert {a.buffer for a in g.tasks[0].accesses} == {ptr_buffer(g, 0, X), ptr_buffer(g, 0, A)}


def freed_workspace_then(freed_at: int):
    """op 0 allocates a tensor A and a workspace WS (freed when ``freed_at`` allocations had
    been made); op 1 writes B; op 2 (allocation window from 3) writes C and carries a word inside
    WS's old bytes: cuDNN's ``int 4`` channel count with the top half of an old address as
    padding."""
    A, WS, B, C = POOL, POOL + 0x1000, POOL + 0x2_0000, POOL + 0x3_0000
    word = WS + 4
    ops = [op("conv", (0, 1), (0, 2), (X, 256, False), (A, 256, True)),
           op("relu", (1, 2), (2, 3), (A, 256, False), (B, 256, True)),
           op("transform", (2, 3), (3, 4), (B, 256, False), (C, 256, True))]
    nodes = [kernel(X, A, WS), kernel(A, B), kernel(B, C, word)]
    raw = capture(ops, nodes, [(A, 256), (WS, 0x1_0000, freed_at), (B, 256), (C, 256)],
                  outputs=[(C, 256)])
    return raw, word


def test_a_word_in_an_allocation_freed_before_the_op_is_no_pointer():
    raw, word = freed_workspace_then(freed_at=2)  # freed before op 1 allocated anything
    g = build_taskgraph(raw)
    assert unresolved_in_pool(g, raw) == []
    assert g.meta["not_pointer_words"] == [[2, 16, word]]
    assert g.meta["words_not_pointers"] == 1
    assert [p.location for p in g.tasks[2].pointers] == [0, 8]  # B and C; the word left out
    assert all(g.buffers[a.buffer].kind != BufferKind.SCRATCH for a in g.tasks[2].accesses)
    assert build_dag(g).edges() == [(0, 1), (1, 2)]  # through A and B only
    # op 0 itself used the workspace while it was allocated
    assert g.buffers[ptr_buffer(g, 0, raw.allocs[1].address)].kind == BufferKind.SCRATCH


def test_a_word_in_an_allocation_freed_when_the_op_may_have_begun_still_resolves():
    # freed at count 3: after op 1's allocation, perhaps inside op 2 before it allocated
    raw, word = freed_workspace_then(freed_at=3)
    g = build_taskgraph(raw)
    assert g.unresolved_pointers() == []
    assert g.meta["words_not_pointers"] == 0
    assert g.buffers[ptr_buffer(g, 2, word)].kind == BufferKind.SCRATCH


BOUNDARY = 0x7F8E_0000_0000  # a 4 GiB boundary inside the pool below
LOW_POOL = (BOUNDARY - 0x10_0000, 0x40_0000)


def word_above_a_4gib_boundary(*, named: bool, workspace: bool, word: int):
    """op 0 allocates T at BOUNDARY - 1 MiB, 2 MiB long (a tensor, or with ``workspace`` a
    workspace no tensor names); op 1 reads X (and T where ``named``), writes B and carries
    ``word``, which falls inside T."""
    T, B = BOUNDARY - 0x10_0000, BOUNDARY + 0x20_0000
    first = op("conv", (0, 1), (0, 1), (X, 256, False)) if workspace else \
        op("conv", (0, 1), (0, 1), (X, 256, False), (T, 0x20_0000, True))
    spans = [(X, 256, False), (B, 256, True)] + ([(T, 0x20_0000, False)] if named else [])
    ops = [first, op("add", (1, 2), (1, 2), *spans)]
    nodes = [kernel(X, T), kernel(X, B, word)]
    return capture(ops, nodes, [(T, 0x20_0000), (B, 256)], outputs=[(B, 256)], pool=LOW_POOL)


def test_a_word_in_a_tensor_the_op_does_not_name_is_no_pointer():
    # dropout backward's ``float scale`` (1.25f = 0x3fa00000) under a padding word's stale top
    # half, landing inside a live activation; and a stale entry naming the graph input
    A, B = POOL, POOL + 0x1000
    word = A + 0x80
    ops = [op("relu", (0, 1), (0, 1), (X, 256, False), (A, 256, True)),
           op("scale", (1, 2), (1, 2), (W, 256, False), (B, 256, True))]
    raw = capture(ops, [kernel(X, A), kernel(W, B, word, X)], [(A, 256), (B, 256)],
                  outputs=[(A, 256), (B, 256)])
    g = build_taskgraph(raw)
    assert g.unresolved_pointers() == []
    assert g.meta["not_pointer_words"] == [[1, 16, word], [1, 24, X]]
    assert g.meta["words_not_pointers"] == 2
    assert build_dag(g).edges() == []  # the two ops share nothing


def test_a_padded_integer_over_a_tensor_the_op_does_not_name_is_no_pointer():
    word = BOUNDARY + 0x40  # int 64 under the top half of an address
    raw = word_above_a_4gib_boundary(named=False, workspace=False, word=word)
    g = build_taskgraph(raw)
    assert g.meta["not_pointer_words"] == [[1, 16, word]]
    assert g.meta["words_not_pointers"] == 1


def test_a_low_word_into_a_tensor_the_op_names_is_a_pointer():
    word = BOUNDARY + 0x40
    g = build_taskgraph(word_above_a_4gib_boundary(named=True, workspace=False, word=word))
    assert g.unresolved_pointers() == []
    assert g.meta["words_not_pointers"] == 0
    assert g.tasks[1].pointers[2].offset == 0x10_0040
    # it may still be an integer under stale padding: its buffer keeps its low 32 bits
    assert g.tasks[1].pointers[2].buffer in g.meta["low_word_buffers"]


def test_a_low_word_that_is_a_whole_pointer_parameter_keeps_no_low_bits():
    raw = word_above_a_4gib_boundary(named=True, workspace=False, word=BOUNDARY + 0x40)
    raw.nodes[1].param_layout = [(0, 8), (8, 8), (16, 8)]  # three pointer-sized parameters
    g = build_taskgraph(raw)
    assert g.tasks[1].pointers[2].buffer >= 0
    assert g.tasks[1].pointers[2].buffer not in g.meta["low_word_buffers"]


def test_a_word_inside_an_element_of_the_ops_tensors_is_no_pointer():
    """threshold_backward's functor: the int 5 under a padding word's stale top half lands 5 bytes
    into a float tensor the op reads (seen on googlenet's training step)."""
    T, B = BOUNDARY - 0x10_0000, BOUNDARY + 0x20_0000
    ops = [op("conv", (0, 1), (0, 1), (X, 256, False), (T, 0x20_0000, True, 4)),
           op("threshold_backward", (1, 2), (1, 2), (T, 0x20_0000, False, 4),
              (B, 256, True, 4))]
    for word, pointer in ((BOUNDARY + 5, False), (BOUNDARY + 8, True)):
        nodes = [kernel(X, T), kernel(T, B, word)]
        g = build_taskgraph(capture(ops, nodes, [(T, 0x20_0000), (B, 256)], outputs=[(B, 256)],
                                    pool=LOW_POOL))
        assert (g.meta["not_pointer_words"] == []) is pointer, hex(word)
    # a byte tensor may be pointed into anywhere
    ops[1].spans[0].element = 1
    g = build_taskgraph(capture(ops, [kernel(X, T), kernel(T, B, BOUNDARY + 5)],
                                [(T, 0x20_0000), (B, 256)], outputs=[(B, 256)], pool=LOW_POOL))
    assert g.meta["not_pointer_words"] == []


OTHER_POOL = 0x7D10_0000_0000  # another graph's pool in torch's allocator, 2 MiB
LIBRARY = 0x7D20_A2A0_0000  # cuDNN's own memory (cudaMalloc'd by the library), 64 KiB


def words_outside_the_capture(kernel_name: str):
    """op 0 writes A; its kernel carries a word in OTHER_POOL's free bytes (dropout's 1.25f
    scale under a padding word's stale top half) and one into library memory."""
    A = POOL
    free_word, library_word = OTHER_POOL + 0x3FA0_0000 % 0x20_0000, LIBRARY + 0x40
    node = kernel(X, A, free_word, library_word)
    node.name = kernel_name
    raw = capture([op("scale", (0, 1), (0, 1), (X, 256, False), (A, 256, True))], [node],
                  [(A, 256)], outputs=[(A, 256)],
                  externals=[DeviceRange(LIBRARY, 0x1_0000, "device allocation@0x7d20a2a00000")])
    raw.allocator = [DeviceRange(OTHER_POOL, 0x20_0000)]
    return build_taskgraph(raw), free_word, library_word


def test_a_word_in_free_allocator_memory_is_no_pointer():
    g, free_word, library_word = words_outside_the_capture("cudnn::bn_bw_1C11_kernel_new")
    assert g.meta["not_pointer_words"] == [[0, 16, free_word]]
    assert g.unresolved_pointers() == []
    assert g.buffers[g.tasks[0].pointers[2].buffer].kind == BufferKind.EXTERNAL  # cuDNN's own


LIBRARY_AT_BOUNDARY = 0x7D40_0000_0000  # a library's 64 MiB that begins at a 4 GiB boundary


@pytest.mark.parametrize("offset, pointer", [(2, False), (4, False), (0, True), (0x200, True),
                                             (0x20_0010, True)])
def test_a_low_word_into_library_memory_at_a_4gib_boundary(offset, pointer):
    """A cutlass wgrad kernel's int 2 under a stale top half read as 2 bytes into such memory;
    the graph's private copy of it then rewrote the int (googlenet's training step, one
    stream, a wrong gradient).  Offsets a block starts from, or 2 MiB and more past the
    boundary, stay pointers."""
    A = POOL
    word = LIBRARY_AT_BOUNDARY + offset
    node = kernel(X, A, word)
    node.name = "cutlass__5x_cudnn::Kernel"
    g = build_taskgraph(capture(
        [op("convolution_backward", (0, 1), (0, 1), (X, 256, False), (A, 256, True))], [node],
        [(A, 256)], outputs=[(A, 256)],
        externals=[DeviceRange(LIBRARY_AT_BOUNDARY, 0x400_0000,
                               "device allocation@0x7d4000000000")]))
    external = [a for a in g.tasks[0].accesses
                if g.buffers[a.buffer].kind == BufferKind.EXTERNAL]
    assert (g.meta["not_pointer_words"] == []) is pointer
    assert bool(external) is pointer
    assert (word in [p.value for p in g.tasks[0].pointers]) is pointer
    assert g.meta["padded_words_in_external"] == (0 if pointer else 1)
    # a pointer that may still be an int under stale padding: a private copy of the memory
    # (the kernel writes it) keeps the low 32 bits
    low = [external[0].buffer] if pointer and offset < 0x20_0000 else []
    assert _externals(g, g.meta["low_word_buffers"]) == low
    assert _externals(g, low_word_buffers(g)) == low


def _externals(g, buffers) -> list[int]:
    return sorted(b for b in buffers if g.buffers[b].kind == BufferKind.EXTERNAL)


def test_a_block_aligned_int_in_a_struct_keeps_the_low_bits_of_the_library_memory_it_hits():
    """cuDNN's ``region_transform`` kernels of inception_v3's backward carry the ints 0x600
    and 0x800 under a stale top half in their 112-byte struct argument; a library's 64 MiB that
    began at a 4 GiB boundary took them for pointers into it (block-aligned, so no rule vetoes
    them), and the arena's private copy of that memory rewrote them: the training step faulted
    in its proof.  Such memory's private copy keeps its low 32 bits, memory the graph only
    reads is used where it is."""
    A = POOL
    written, read = LIBRARY_AT_BOUNDARY, LIBRARY_AT_BOUNDARY + (8 << 32)
    nodes = []
    for word in (written + 0x600, read + 0x800):
        node = kernel(X, A, word)
        node.name = "internal::region_transform_ABC_val"
        node.param_layout = [(0, 112)]
        nodes.append(node)
    g = build_taskgraph(capture(
        [op("convolution_backward", (0, 1), (0, 1), (X, 256, False), (A, 256, True)),
         op("convolution_backward", (1, 2), (1, 1), (X, 256, False), (A, 256, True))], nodes,
        [(A, 256)], outputs=[(A, 256)],
        externals=[DeviceRange(written, 0x400_0000, "device allocation@0x7d4000000000"),
                   DeviceRange(read, 0x400_0000, "device allocation@0x7d4800000000")]))
    ones = [p.buffer for t in g.tasks for p in t.pointers if p.location == 16]
    assert len(ones) == 2 and _externals(g, g.meta["low_word_buffers"]) == sorted(ones)
    # the kernels' words count as writes (a library kernel's unlisted pointer): both would get
    # a private copy, each keeping its low bits
    assert _externals(g, low_word_buffers(g)) == sorted(ones)
    g.tasks[1].accesses = [a for a in g.tasks[1].accesses if a.buffer != ones[1]]
    assert _externals(g, low_word_buffers(g)) == [ones[0]]  # the other is used where it is


CACHED_BLOCK = 0x9_8720_0000  # a 32 MiB block torch cached before the recording, low in memory


@pytest.mark.parametrize("name, offset, pointer", [
    ("cudnn::winograd_nonfused::winogradForwardData9x9_5x5", 0x144_298F, False),
    ("cudnn::winograd_nonfused::winogradForwardData9x9_5x5", 0x144_2986, False),
    ("cudnn::winograd_nonfused::winogradForwardData9x9_5x5", 0x144_2984, True),
    ("cudnn::winograd_nonfused::winogradForwardData9x9_5x5", 0, True),
    ("at::native::vectorized_elementwise_kernel<4, ...>", 0x144_298F, True)])
def test_a_library_kernels_unaligned_word_into_memory_from_before_the_recording(name, offset,
                                                                                pointer):
    """Under a pool at a low address, two 32-bit integers of a cuDNN winograd kernel read
    ``0x9_8864_298f``, inside a block torch had cached before the recording; relocating it gave
    inception_v3's training step a wrong gradient on one stream.  A library lays such memory
    out in words of 4 bytes and more (cuDNN's sm90 kernels point at counters 4 bytes apart);
    ATen's kernels (a bool tensor held as a plain attribute) may point anywhere in it."""
    A = POOL
    word = CACHED_BLOCK + offset
    node = kernel(X, A, word)
    node.name = name
    g = build_taskgraph(capture(
        [op("convolution_backward", (0, 1), (0, 1), (X, 256, False), (A, 256, True))], [node],
        [(A, 256)], outputs=[(A, 256)],
        externals=[DeviceRange(CACHED_BLOCK, 0x200_0000, "block@0x987200000")]))
    assert (word in [p.value for p in g.tasks[0].pointers]) is pointer
    assert (g.meta["not_pointer_words"] == [[0, 16, word]]) is not pointer
    assert g.meta["unaligned_words_in_external"] == (0 if pointer else 1)


# ATen kernel names as the driver reports them (mangled; dropout backward's scale kernel and an
# elementwise division, each of which carried 1.25f under a stale top half on googlenet's and
# inception_v3's training steps) and as a demangler writes them.
ATEN_KERNEL_NAMES = [
    "_ZN2at6native29vectorized_elementwise_kernelILi4EZNS0_43_GLOBAL__N__50f1b6c4_10_Dropout_cu_"
    "0e96ed3819masked_scale_kernelIbffEEvRNS_6TensorERKS4_S7_T1_EUlfbE_St5arrayIPcLm3EEEEviT0_S8_",
    "_ZN2at6native18elementwise_kernelILi128ELi2EZNS0_22gpu_kernel_impl_nocastINS0_13BUnaryFunctor"
    "IfffNS0_15binary_internal10MulFunctorIfEEEEEEvRNS_18TensorIteratorBaseERKT_EUliE_EEviT1_",
    "void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor<...>>",
]


@pytest.mark.parametrize("name", ATEN_KERNEL_NAMES, ids=["mangled-dropout", "mangled-div",
                                                         "demangled"])
def test_an_aten_kernels_word_in_library_memory_is_no_pointer(name):
    """Relocating such a word into a graph's own copy of the library memory rewrote dropout
    backward's scale: gradients 1e24 off, refused by the proof (finding A of 2026-11-25)."""
    g, free_word, library_word = words_outside_the_capture(name)
    assert g.meta["not_pointer_words"] == [[0, 16, free_word], [0, 24, library_word]]
    assert all(g.buffers[a.buffer].kind != BufferKind.EXTERNAL for a in g.tasks[0].accesses)


def test_an_aten_kernels_word_in_another_ops_workspace_is_no_pointer():
    """dropout backward's 1.25f scale under a padding word's stale top half, 26 MiB into the
    workspace of an earlier convolution; a cuDNN kernel's word there stays a pointer."""
    WS, A = POOL, POOL + 0x8_0000
    word = WS + 0x1000
    for name, pointer in ([(n, False) for n in ATEN_KERNEL_NAMES]
                          + [("cudnn::bn_bw_1C11_kernel_new", True)]):
        ops = [op("conv", (0, 1), (0, 1), (X, 256, False)),
               op("dropout_backward", (1, 2), (1, 2), (X, 256, False), (A, 256, True))]
        node = kernel(X, A, word)
        node.name = name
        g = build_taskgraph(capture(ops, [kernel(X, WS), node], [(WS, 0x1_0000), (A, 256)],
                                    outputs=[(A, 256)]))
        assert (g.meta["not_pointer_words"] == []) is pointer, name


def test_a_block_aligned_word_into_another_ops_workspace_is_a_pointer():
    # a library workspace that an earlier op allocated and every later call shares
    word = BOUNDARY  # 1 MiB into the workspace: a multiple of the allocator's 512 bytes
    g = build_taskgraph(word_above_a_4gib_boundary(named=False, workspace=True, word=word))
    assert g.unresolved_pointers() == []
    assert g.buffers[g.tasks[1].pointers[2].buffer].kind == BufferKind.SCRATCH


def test_an_unaligned_low_word_into_another_ops_workspace_is_no_pointer():
    word = BOUNDARY + 4
    g = build_taskgraph(word_above_a_4gib_boundary(named=False, workspace=True, word=word))
    assert g.meta["not_pointer_words"] == [[1, 16, word]]
    assert g.meta["words_not_pointers"] == 1


def test_a_memset_at_a_low_address_is_an_address():
    T = BOUNDARY - 0x10_0000
    ops = [op("zero", (0, 1), (0, 1), (T, 0x20_0000, True)),
           op("fill", (1, 2), (1, 1))]
    nodes = [kernel(T), RawNode(TaskKind.MEMSET, ranges=[("dst", BOUNDARY + 4, 16, True)])]
    g = build_taskgraph(capture(ops, nodes, [(T, 0x20_0000)], outputs=[(T, 0x20_0000)],
                                pool=LOW_POOL))
    assert g.unresolved_pointers() == []
    assert g.meta["words_not_pointers"] == 0


# ---- 5. memcpy / memset ------------------------------------------------------------------------

def test_memcpy_and_memset_ranges_are_exact():
    A = POOL
    ops = [op("copy_", (0, 3), (0, 1), (X, 1024, False), (EXT, 64, False), (A, 1024, True))]
    nodes = [RawNode(TaskKind.MEMCPY, ranges=[("src", X + 128, 256, False),
                                               ("dst", A + 64, 256, True)]),
             RawNode(TaskKind.MEMSET, ranges=[("dst", A, 64, True)]),
             RawNode(TaskKind.MEMCPY, ranges=[("src", EXT + 8, 32, False),
                                               ("dst", A + 320, 32, True)])]
    g = build_taskgraph(capture(ops, nodes, [(A, 1024)],
                                externals=[DeviceRange(EXT, 4096)]))
    inp, out = ptr_buffer(g, 0, X + 128), ptr_buffer(g, 0, A + 64)
    ext = ptr_buffer(g, 2, EXT + 8)
    assert (g.buffers[ext].kind, g.buffers[ext].name) == (BufferKind.EXTERNAL, f"external@{EXT:#x}")
    assert g.tasks[0].pointers == [Pointer("src", X + 128, inp, 128),
                                   Pointer("dst", A + 64, out, 64)]
    assert g.tasks[0].accesses == [Access(inp, 128, 256, False), Access(out, 64, 256, True)]
    assert g.tasks[1].accesses == [Access(out, 0, 64, True)]
    assert g.tasks[2].accesses == [Access(ext, 8, 32, False), Access(out, 320, 32, True)]
    # disjoint byte ranges: without op chaining nothing orders the three copies
    assert build_dag(g, chain_ops=False).edges() == []


# ---- 6. tasks outside every op -----------------------------------------------------------------

def test_unattributed_task():
    A = POOL
    ops = [op("relu", (0, 1), (0, 1), (X, 256, False), (A, 256, True))]
    g = build_taskgraph(capture(ops, [kernel(X, A), kernel(A)], [(A, 256)]))
    t = g.tasks[1]
    assert t.op == -1 and g.op_of(t) is None
    assert g.meta["unattributed_tasks"] == 1
    assert t.pointers == [Pointer(0, A, ptr_buffer(g, 0, A), 0)]
    assert t.accesses == [Access(t.pointers[0].buffer, 0, 256, True)]  # unlisted: whole, rw
    assert g.meta["unlisted_pointer_accesses"] == 1
    assert build_dag(g).edges() == [(0, 1)]


def test_unattributed_task_between_ops_sees_allocations_of_its_time():
    A, B = POOL, POOL + 512
    ops = [op("relu", (0, 1), (0, 1), (X, 256, False), (A, 256, True)),
           # node 1 (outside every op) reads A; then A is freed and reallocated by op 1
           op("relu", (2, 3), (1, 2), (X, 256, False), (A, 256, True)),
           op("neg", (3, 4), (2, 3), (A, 256, False), (B, 256, True))]
    nodes = [kernel(X, A), kernel(A), kernel(X, A), kernel(A, B)]
    g = build_taskgraph(capture(ops, nodes, [(A, 256), (A, 256), (B, 256)]))
    assert ptr_buffer(g, 1, A) == ptr_buffer(g, 0, A) != ptr_buffer(g, 2, A)
    assert (0, 1) in build_dag(g).edges()


# ---- 7. views ----------------------------------------------------------------------------------

def test_view_span_gives_offset_access():
    A, B = POOL, POOL + 2048
    ops = [op("relu", (0, 1), (0, 1), (X, 256, False), (A, 1024, True)),
           op("add_", (1, 2), (1, 1), (A + 256, 128, True), (W + 1024, 128, False)),
           op("neg", (2, 3), (1, 2), (A + 512, 4096, False), (B, 128, True))]
    nodes = [kernel(X, A), kernel(A + 256, W + 1024), kernel(A + 512, B)]
    g = build_taskgraph(capture(ops, nodes, [(A, 1024), (B, 128)]))
    a, param = ptr_buffer(g, 0, A), ptr_buffer(g, 1, W + 1024)
    assert g.ops[1].accesses == [Access(a, 256, 128, True), Access(param, 1024, 128, False)]
    assert Pointer(0, A + 256, a, 256) in g.tasks[1].pointers
    assert g.tasks[1].accesses == g.ops[1].accesses
    assert Access(a, 512, 512, False) in g.ops[2].accesses  # clipped at the buffer's end
    # byte-exact: the neg reads [512, 1024), which the add_ at [256, 384) never touches
    assert build_dag(g, chain_ops=False).edges() == [(0, 1), (0, 2)]


# ---- the interval map under the live-allocation index ------------------------------------------

@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), max_size=25))
def test_intervals_match_a_byte_map(inserts):
    index, model = Intervals(), {}
    for value, (start, size) in enumerate(inserts):
        index.insert(start, start + size, value)
        model.update({x: value for x in range(start, start + size)})
    assert [index.find(x) for x in range(60)] == [model.get(x) for x in range(60)]


def test_pointer_just_past_an_ops_own_workspace_belongs_to_it():
    """cuDNN points at a zero-byte region 32 bytes past the end of the workspace it asked for."""
    A, W = POOL, POOL + 4096
    ops = [op("conv", (0, 1), (0, 2), (X, 256, False), (A, 256, True))]
    g = build_taskgraph(capture(ops, [kernel(X, A, W, W + 512 + 32)],
                                [(A, 256), (W, 512)]))
    scratch = [b for b in g.buffers if b.kind == "scratch"]
    assert len(scratch) == 1 and scratch[0].address == W
    past = g.tasks[0].pointers[3]
    assert (past.buffer, past.offset) == (scratch[0].id, 512 + 32)
    assert g.unresolved_pointers() == []
    # far past the end, or past another op's allocation, it stays unresolved
    g = build_taskgraph(capture(ops, [kernel(X, A, W, W + 512 + 4096)], [(A, 256), (W, 512)]))
    assert len(g.unresolved_pointers()) == 1


def test_a_tensors_one_past_the_end_pointer_names_that_tensor():
    """inception_v3's training step: a reduction handed its input's one-past-the-end pointer,
    which is where a later allocation begins."""
    A, B = POOL, POOL + 1024
    ops = [op("relu", (0, 1), (0, 1), (X, 256, False), (A, 1024, True)),
           op("mean", (1, 2), (1, 2), (A, 1024, False), (B + 1024, 256, True)),
           op("neg", (2, 3), (2, 3), (X, 256, False), (B, 256, True))]
    g = build_taskgraph(capture(ops, [kernel(X, A), kernel(A, B + 1024, A + 1024), kernel(X, B)],
                                [(A, 1024), (B + 1024, 256), (B, 256)]))
    assert g.unresolved_pointers() == []
    past = next(p for p in g.tasks[1].pointers if p.value == A + 1024)
    assert (past.buffer, past.offset) == (ptr_buffer(g, 0, A), 1024)
    # the same for an input (a static, outside the pool) the op reads
    ops[1] = op("mean", (1, 2), (1, 2), (X, 256, False), (B + 1024, 256, True))
    g = build_taskgraph(capture(ops, [kernel(X, A), kernel(X, B + 1024, X + 256), kernel(X, B)],
                                [(A, 1024), (B + 1024, 256), (B, 256)]))
    past = next(p for p in g.tasks[1].pointers if p.value == X + 256)
    assert (past.buffer, past.offset) == (ptr_buffer(g, 0, X), 256)


# ---- 8. one op reusing its own bytes -----------------------------------------------------------

def test_allocations_one_op_reuses_inside_its_window_are_one_buffer():
    """A fused op frees a 1 KiB temporary and allocates its 256-byte output at the same address.

    A pointer to that address cannot say which allocation a kernel meant: the kernel that wrote
    the temporary must get all 1 KiB, or its arena slot is too small (seen: a transformer layer's
    GEMM writing past the end of the arena).
    """
    T, OUT2 = POOL, POOL + 4096
    ops = [op("fused_layer", (0, 2), (0, 2), (X, 256, False), (T, 256, True)),
           op("neg", (2, 3), (2, 3), (T, 256, False), (OUT2, 256, True))]
    # node 0 writes the 1 KiB temporary at T; node 1 reduces it into the output, also at T
    nodes = [kernel(X, T), kernel(T, T + 512), kernel(T, OUT2)]
    g = build_taskgraph(capture(ops, nodes, [(T, 1024), (T, 256), (OUT2, 256)],
                                outputs=[(OUT2, 256)]))
    region = ptr_buffer(g, 0, T)
    assert ptr_buffer(g, 1, T) == ptr_buffer(g, 1, T + 512) == region
    b = g.buffers[region]
    assert (b.kind, b.address, b.size, b.op) == (BufferKind.INTERMEDIATE, T, 1024, 0)
    assert Access(region, 0, 1024, True) in g.tasks[0].accesses
    assert Access(region, 0, 1024, True) in g.tasks[1].accesses
    # a later op reads only the output's bytes, exactly
    assert Access(region, 0, 256, False) in g.tasks[2].accesses
    assert g.meta["allocations_reused_in_op"] == 2
    assert g.unresolved_pointers() == []


def test_allocations_of_different_ops_at_one_address_stay_apart():
    """Address reuse across ops is the allocator's normal business: two buffers, not a region."""
    g = build_taskgraph(two_branches_sharing_an_address())
    assert g.meta["allocations_reused_in_op"] == 0
    assert len({b.id for b in g.buffers if b.address == POOL}) == 2


# ---- 9. random generator cells ------------------------------------------------------------------

def test_rng_cells_become_read_only_rng_buffers():
    """Two RNG ops read the generator's seed and offset cells, which the first one allocated."""
    SEED, OFF, A, B = POOL, POOL + 512, POOL + 1024, POOL + 2048
    ops = [op("native_dropout", (0, 1), (0, 3), (X, 256, False), (A, 256, True)),
           op("rand_like", (1, 2), (3, 4), (B, 256, True))]
    nodes = [kernel(X, A, SEED, OFF), kernel(SEED, OFF, B)]
    from nimble.record.resolve import RNG_OFFSET, RNG_SEED, mark_rng_cells
    g = build_taskgraph(capture(ops, nodes, [(SEED, 512), (OFF, 512), (A, 256), (B, 256)]))
    assert {g.buffers[p.buffer].kind for t in g.tasks for p in t.pointers
            if p.value in (SEED, OFF)} == {BufferKind.SCRATCH}
    marked = mark_rng_cells(g, {SEED: RNG_SEED, OFF: RNG_OFFSET})
    assert len(marked) == 4  # one scratch buffer per op and cell
    for bid in marked:
        b = g.buffers[bid]
        assert b.kind == BufferKind.RNG and b.size == 8 and b.name in (RNG_SEED, RNG_OFFSET)
    for t in g.tasks:
        assert all(not a.write for a in t.accesses if a.buffer in marked)
    assert build_dag(g, chain_ops=False).edges() == []  # reading the cells orders nothing


def test_rng_cell_shared_with_other_data_is_refused():
    import pytest

    from nimble.record.resolve import RNG_SEED, mark_rng_cells
    SEED = POOL
    ops = [op("weird", (0, 1), (0, 1), (X, 256, False))]
    g = build_taskgraph(capture(ops, [kernel(X, SEED, SEED + 64)], [(SEED, 512)]))
    with pytest.raises(ValueError, match="cannot tell the cell"):
        mark_rng_cells(g, {SEED: RNG_SEED})


def test_tasks_outside_every_op_write_the_output_buffers_themselves():
    """Without op records (a capture the tracer did not see), pointers still resolve to the
    graph's outputs, and every kernel is ordered after the one it reads from."""
    raw = two_branches_sharing_an_address()
    raw.ops = []
    g = build_taskgraph(raw)
    outputs = {r.buffer for r in g.outputs}
    assert all(g.buffers[b].kind == BufferKind.OUTPUT for b in outputs)
    written = {a.buffer for t in g.tasks for a in t.accesses if a.write}
    assert outputs <= written
    from nimble.analysis.deps import reachability

    reach = reachability(build_dag(g))
    for u, v in [(0, 1), (2, 3)]:  # each reader after its writer
        assert reach[u] >> v & 1
