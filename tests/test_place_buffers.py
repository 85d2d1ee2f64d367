"""Where a prepared graph puts every buffer (``nimble.engine.prepared._place_buffers``), with the
driver's memory calls stood in for: the arena's plan, the private copies of library memory, and
the copies a word that may be an integer points into, which keep their recorded low 32 bits."""
from __future__ import annotations

from types import SimpleNamespace

from nimble.analysis.memplan import plan_memory
from nimble.engine import prepared
from nimble.engine.arena_layout import low_word_buffers, own_layout
from nimble.ir.taskgraph import TaskGraph

from helpers import FIXTURE_DIR

FOUR_GIB = 1 << 32


class _FakeLowBits:
    def __init__(self, size: int, low_bits: int) -> None:
        self.size = size
        self.address = 7 * FOUR_GIB + low_bits % FOUR_GIB


def _place(monkeypatch, graph: TaskGraph):
    import torch

    calls = []
    monkeypatch.setattr(prepared.driver.LowBitsMemory, "allocate",
                        classmethod(lambda cls, size, low, device: _FakeLowBits(size, low)))
    monkeypatch.setattr(prepared.driver, "stream", lambda handle: "stream")
    monkeypatch.setattr(prepared.driver, "fill_bytes_async",
                        lambda dst, value, size, stream: calls.append(("fill", dst, size)))
    monkeypatch.setattr(prepared.driver, "copy_to_device",
                        lambda dst, data: calls.append(("upload", dst, len(data))))
    monkeypatch.setattr(prepared.driver, "copy_device",
                        lambda dst, src, size: calls.append(("copy", dst, src, size)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(prepared, "_rng_cells", lambda graph, device, at: ({}, None))
    order = [(i, i + 1) for i in range(len(graph.tasks) - 1)]
    plan = plan_memory(graph, order)
    layout = own_layout(graph, plan)
    arena = SimpleNamespace(address=1 << 44, companions=[])
    base, bases, _ = prepared._place_buffers(graph, plan, layout, arena,
                                             SimpleNamespace(index=0), low_word_buffers(graph))
    return layout, arena, base, bases, calls


def test_a_private_copy_that_an_integer_may_point_into_keeps_its_low_bits(monkeypatch):
    """inception_v3's averaged training step (the recording whose rebuilt graph faulted): the
    64 MiB of library memory cuDNN's ints 0x600 and 0x800 resemble pointers into gets its
    private copy at its recorded low 32 bits, filled from the library's bytes; every other
    private copy sits in the arena where the layout says."""
    graph = TaskGraph.load(FIXTURE_DIR / "inception_v3_train_averaged_fault.json.gz")
    [kept] = low_word_buffers(graph)
    layout, arena, base, bases, calls = _place(monkeypatch, graph)
    recorded = graph.buffers[kept].address
    assert bases[kept] % FOUR_GIB == recorded % FOUR_GIB and bases[kept] != recorded
    assert [c.address for c in arena.companions] == [bases[kept]]
    assert ("copy", bases[kept], recorded, graph.buffers[kept].size) in calls
    for bid, at in layout.private.items():
        if bid != kept:
            assert bases[bid] == base + at
    filled_or_copied = {c[1] for c in calls}
    assert filled_or_copied == {bases[b] for b in layout.private}


def test_saving_writes_a_workspaces_copy_without_bytes_and_any_other_copy_with_them(
        monkeypatch):
    """What ``save`` writes of each private copy: inception_v3 bf16's convolution workspace
    (a block of torch's allocator only cuDNN writes) as null, since its copy starts zeroed
    wherever it is built; resnet50's training step's cuDNN batch-norm buffers (library memory,
    whose bytes carry state) byte for byte."""
    from nimble.engine import saving
    from nimble.ir.saved_format import BlobWriter

    read = []
    monkeypatch.setattr(saving.driver, "copy_to_host",
                        lambda address, size: read.append(address) or bytes(size))
    for name, want in (("inception_v3_bfloat16", {"679": None}),
                       ("resnet50_train", {"326": 25344, "327": 4, "576": 25344, "577": 4})):
        graph = TaskGraph.load(FIXTURE_DIR / f"{name}.json.gz")
        plan = plan_memory(graph, [(i, i + 1) for i in range(len(graph.tasks) - 1)])
        stand_in = SimpleNamespace(graph=graph, memplan=plan, low_bits=[],
                                   bases=[b.address for b in graph.buffers],
                                   weights=SimpleNamespace(bindings=[]))
        read.clear()
        _, private = saving._placement(stand_in, saving._Outside(BlobWriter(), False))
        assert {bid: None if ref is None else ref[1] for bid, ref in private.items()} == want
        # only the copies written with their bytes were read from the GPU
        assert sorted(read) == sorted(graph.buffers[int(bid)].address
                                      for bid, ref in private.items() if ref is not None)
