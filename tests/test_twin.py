"""A second capture at other addresses as evidence for pointers (CPU only).

The case is the one seen on the GPU: a capture pool at a low address (``0x7_xxxx_xxxx``), where
two 32-bit integers of a kernel's arguments, the second of them a 7, read as an address inside a
live buffer that the op names.  The value rules take such a word for a pointer; the twin, where
the word kept its value while every pool allocation moved, says it is none.
"""
from __future__ import annotations

import struct

from nimble.record.raw import (AllocEvent, DeviceRange, OpRecord, RawCapture, RawNode, TensorSpan,
                               TensorSpec)
from nimble.record.resolve import build_taskgraph
from nimble.ir.taskgraph import Access, BufferKind, TaskKind
from nimble.record.twin import TWIN_EVIDENCE, moved_words

POOL = 0x7_0600_0000  # a pool at a low address, as after other memory was reserved and freed
A, B = POOL, POOL + 0x10_0000  # two 1 MiB activations
X = 0x7F00_0000_0000
INT_PAIR = struct.unpack("<Q", struct.pack("<II", 0x0604_0000, 7))[0]  # (100925440, 7)


def conv_node(*words: int) -> RawNode:
    params = b"".join(struct.pack("<Q", w) for w in words)
    return RawNode(TaskKind.KERNEL, name="conv", short_name="conv", params=params,
                   param_layout=[(0, len(params))],
                   pointers=[(8 * i, w) for i, w in enumerate(words) if w >= 1 << 32])


def recorded(moved=None) -> RawCapture:
    """Op 0 writes A; op 1 reads A and writes B, its kernel passing (100925440, 7) as one word."""
    assert A <= INT_PAIR < A + 0x10_0000  # the integers read as an address inside A
    ops = [OpRecord("relu", "m", 0, 1, 0, 1, spans=[TensorSpan(X, 256, False),
                                                    TensorSpan(A, 0x10_0000, True)]),
           OpRecord("conv", "m", 1, 2, 1, 2, spans=[TensorSpan(A, 0x10_0000, False),
                                                    TensorSpan(B, 0x10_0000, True)])]
    nodes = [conv_node(X, A), conv_node(A, B, INT_PAIR)]
    return RawCapture(
        ops=ops, nodes=nodes, allocs=[AllocEvent(0, A, 0x10_0000), AllocEvent(1, B, 0x10_0000)],
        statics=[DeviceRange(X, 1024, "input0", BufferKind.INPUT)], externals=[],
        pool=[DeviceRange(POOL, 1 << 22, "pool")],
        inputs=[TensorSpec(X, [64], [1], "float32")],
        outputs=[TensorSpec(B, [1 << 18], [1], "float32")], moved_words=moved)


def twin_of(raw: RawCapture, shift: int, keep: set[tuple[int, int]]) -> list[tuple]:
    """The twin's node signatures: every pool word moved by ``shift`` except ``(node, offset)``
    in ``keep``."""
    twin = []
    for i, node in enumerate(raw.nodes):
        block = bytearray(node.params)
        for off, value in node.pointers:
            if POOL <= value < POOL + (1 << 22) and (i, off) not in keep:
                block[off:off + 8] = struct.pack("<Q", value + shift)
        twin.append((node.kind, node.name, bytes(block)))
    return twin


def test_value_rules_alone_take_the_integer_pair_for_a_pointer_into_a_live_buffer():
    g = build_taskgraph(recorded())
    assert [p.location for p in g.tasks[1].pointers] == [0, 8, 16]
    assert g.meta["words_not_pointers"] == 0


def test_a_word_the_twin_left_in_place_is_no_pointer():
    raw = recorded()
    moved, evidence = moved_words(raw.nodes, twin_of(raw, 1 << 33, keep={(1, 16)}))
    assert evidence == TWIN_EVIDENCE
    assert moved == [frozenset({8}), frozenset({0, 8})]
    raw.moved_words = moved
    g = build_taskgraph(raw)
    assert [p.location for p in g.tasks[1].pointers] == [0, 8]
    assert g.meta["not_pointer_words"] == [[1, 16, INT_PAIR]]
    assert g.meta["twin_unmoved_words"] == 1
    a, b = (g.tasks[1].pointers[i].buffer for i in (0, 1))
    assert sorted(g.tasks[1].accesses, key=lambda x: x.buffer) == sorted(
        [Access(a, 0, 0x10_0000, False), Access(b, 0, 0x10_0000, True)], key=lambda x: x.buffer)


def test_words_outside_the_pool_are_never_vetoed():
    raw = recorded()
    raw.moved_words, _ = moved_words(raw.nodes, twin_of(raw, 1 << 33, keep=set()))
    g = build_taskgraph(raw)
    assert [p.location for p in g.tasks[0].pointers] == [0, 8]  # the input X stayed, still a pointer
    assert g.tasks[0].pointers[0].value == X


def test_a_twin_of_other_work_gives_no_evidence():
    raw = recorded()
    twin = twin_of(raw, 1 << 33, keep=set())
    assert moved_words(raw.nodes, twin[:1]) == (None, "the twin capture has 1 nodes, the first 2")
    other = [twin[0], (TaskKind.KERNEL, "gemm", twin[1][2])]
    moved, why = moved_words(raw.nodes, other)
    assert moved is None and why.startswith("node 1 differs")
    shorter = [twin[0], (TaskKind.KERNEL, "conv", twin[1][2][:8])]
    assert moved_words(raw.nodes, shorter)[0] is None
    assert moved_words(raw.nodes, None, "not enough device memory for a second capture") == \
        (None, "not enough device memory for a second capture")
