"""Memory outside the arena that a kernel word which may be an integer points into, placed by a
load from a file (``nimble.engine.loaded_memory``): the file's weights and external memory keep their
recorded low 32 bits, a model's weight at other low bits is the proof's to judge (refused
without it), and the C plan says the C runtime cannot run such a graph; the driver's memory
calls stood in for."""
from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest

from helpers import FIXTURE_DIR
from nimble.engine import loaded_memory
from nimble.engine.arena_layout import (ambiguous_targets, low_word_buffers, low_word_outside,
                                        written_externals)
from nimble.errors import LoadError
from nimble.ir.taskgraph import BufferKind, TaskGraph

FOUR_GIB = 1 << 32


def _read_only_fault_graph() -> tuple[TaskGraph, int]:
    """inception_v3's faulting averaged step with its writes to the 64 MiB of library memory
    that cuDNN's ints resemble pointers into turned into reads: memory the graph uses where it
    is, which a load from a file places anew."""
    graph = TaskGraph.load(FIXTURE_DIR / "inception_v3_train_averaged_fault.json.gz")
    [kept] = low_word_buffers(graph)
    for t in graph.tasks:
        t.accesses = [dataclasses.replace(a, write=False) if a.buffer == kept else a
                      for a in t.accesses]
    return graph, kept


def test_memory_used_where_it_is_that_an_integer_may_point_into_keeps_its_low_bits_at_load():
    graph, kept = _read_only_fault_graph()
    assert kept not in written_externals(graph) and kept not in low_word_buffers(graph)
    assert ambiguous_targets(graph, {kept}) == {kept}
    assert low_word_outside(graph) == [kept]


def test_the_resolvers_list_names_outside_memory_too():
    graph = TaskGraph.load(FIXTURE_DIR / "resnet50.json.gz")
    param = next(b.id for b in graph.buffers if b.kind == "param")
    assert low_word_outside(graph) == []
    graph.meta["low_word_buffers"] = [param]
    assert low_word_outside(graph) == [param] and param not in low_word_buffers(graph)


class _FakeLowBits:
    def __init__(self, size: int, low_bits: int) -> None:
        self.size, self.address = size, 9 * FOUR_GIB + low_bits % FOUR_GIB


@pytest.fixture
def stand_in_driver(monkeypatch):
    copies = {}
    monkeypatch.setattr(loaded_memory.driver.LowBitsMemory, "allocate",
                        classmethod(lambda cls, size, low, device: _FakeLowBits(size, low)))
    monkeypatch.setattr(loaded_memory.driver, "copy_to_device",
                        lambda address, data: copies.__setitem__(address, bytes(data)))
    monkeypatch.setattr(loaded_memory, "on_device",
                        lambda view, device, empty: pytest.fail("placed without its low bits"))
    return copies


def _saved(graph: TaskGraph, bid: int, source: dict) -> tuple[dict, SimpleNamespace]:
    manifest = {"buckets": [{"outside": {str(bid): source}}],
                "memory": [{"size": 96, "blob": [0, 64]}],
                "weights": [{"size": 64, "blob": [0, 64],
                             "names": [{"name": "conv.weight", "offset": 0}]}]}
    saved = SimpleNamespace(blob_view=lambda ref: memoryview(bytes(range(64))))
    return manifest, saved


def test_a_files_external_memory_range_is_placed_at_its_recorded_low_bits(stand_in_driver):
    graph, kept = _read_only_fault_graph()
    recorded = graph.buffers[kept].address
    manifest, saved = _saved(graph, kept, {"memory": 0, "offset": 32})
    low = loaded_memory.low_bits_rows(manifest, [(graph, None)])
    assert low == {("memory", 0): recorded - 32}
    addresses, keep = loaded_memory.place_memory(manifest, saved, SimpleNamespace(index=0), low)
    assert (addresses[0] + 32) % FOUR_GIB == recorded % FOUR_GIB
    assert keep[0].size == 96 and stand_in_driver[addresses[0]] == bytes(range(64)) + bytes(32)


def test_a_files_weight_storage_is_placed_at_its_recorded_low_bits(stand_in_driver):
    graph, kept = _read_only_fault_graph()
    recorded = graph.buffers[kept].address
    manifest, saved = _saved(graph, kept, {"weight": 0})
    low = loaded_memory.low_bits_rows(manifest, [(graph, None)])
    addresses, keep = loaded_memory.place_weights(manifest, saved, None, SimpleNamespace(index=0), low)
    assert addresses[0] % FOUR_GIB == recorded % FOUR_GIB and addresses[0] == keep[0].address
    assert stand_in_driver[addresses[0]] == bytes(range(64))


def test_a_models_weight_at_other_low_bits_is_the_proofs_to_judge_or_refused(caplog):
    row = {"names": [{"name": "conv.weight"}]}
    recorded = 0x7F00_0000_0000
    loaded_memory.model_low_bits(row, recorded + 5 * FOUR_GIB, recorded, verify=False)  # same bits
    with caplog.at_level(logging.WARNING, logger="nimble"):
        loaded_memory.model_low_bits(row, recorded + 0x200, recorded, verify=True)
    assert "conv.weight" in caplog.text and "proof" in caplog.text
    with pytest.raises(LoadError, match="conv.weight.*verify=True"):
        loaded_memory.model_low_bits(row, recorded + 0x200, recorded, verify=False)


def test_the_c_plan_says_the_c_runtime_cannot_place_such_memory():
    from nimble.engine.c_plan import Regions

    graph, kept = _read_only_fault_graph()
    graph.meta.pop("rng", None)  # the step's dropout: a reason of its own, said first
    graph.buffers = [dataclasses.replace(b, kind=BufferKind.EXTERNAL)
                     if b.kind == BufferKind.RNG else b for b in graph.buffers]
    prepared = SimpleNamespace(graph=graph, memplan=SimpleNamespace(offsets={}))
    state = SimpleNamespace(private={})
    regions = Regions(prepared, state, {str(kept): {"memory": 0, "offset": 0}})
    assert "low address bits" in regions.unsupported and str(kept) in regions.unsupported
    assert Regions(prepared, state, {}).unsupported == ""


def _regions_graph():
    graph, kept = _read_only_fault_graph()
    graph.meta.pop("rng", None)
    graph.buffers = [dataclasses.replace(b, kind=BufferKind.EXTERNAL)
                     if b.kind == BufferKind.RNG else b for b in graph.buffers]
    graph.buffers[kept] = dataclasses.replace(graph.buffers[kept], kind=BufferKind.PARAM)
    prepared = SimpleNamespace(graph=graph, memplan=SimpleNamespace(offsets={}), programmatic=())
    return graph, kept, prepared, SimpleNamespace(private={})


def test_the_c_plan_keeps_a_weight_an_integer_may_point_into_at_its_low_bits():
    from nimble.engine.c_plan import LOW_BITS_VERSION, LOWBITS, Regions, plan_version

    graph, kept, prepared, state = _regions_graph()
    size = graph.buffers[kept].size
    outside = {str(kept): {"weight": 0}}
    weights = [{"size": size, "blob": [4096, size]}]
    regions = Regions(prepared, state, outside, low_start=2, weights=weights)
    assert regions.unsupported == "" and regions.low[-1] == kept
    assert regions.places[kept] == (LOWBITS, 2 + len(regions.low) - 1, 0)
    assert regions.weight_blobs == {kept: (4096, size)}  # its bytes: the file's weight
    assert plan_version([prepared], {"buckets": [{"outside": outside}],
                                     "weights": weights}) == LOW_BITS_VERSION
    # without the weight's bytes whole in the file (saved with weights=False), it cannot
    short = [{"size": size, "blob": None}]
    assert "low address bits" in Regions(prepared, state, outside, weights=short).unsupported
    assert "low address bits" in Regions(prepared, state, outside).unsupported


def test_the_c_plan_leaves_a_weight_the_graph_writes_where_it_cannot_place_it():
    from nimble.engine.c_plan import Regions

    graph, kept, prepared, state = _regions_graph()
    task = next(t for t in graph.tasks if any(a.buffer == kept for a in t.accesses))
    task.accesses = [dataclasses.replace(a, write=True) if a.buffer == kept else a
                     for a in task.accesses]
    size = graph.buffers[kept].size
    regions = Regions(prepared, state, {str(kept): {"weight": 0}},
                      weights=[{"size": size, "blob": [0, size]}])
    assert "low address bits" in regions.unsupported and str(kept) in regions.unsupported
