"""The saver's own arithmetic on the CPU (nimble.engine.saving): external memory merged into
ranges, copy endpoints written as recorded, and the graphs of a file of several."""
from __future__ import annotations

from types import SimpleNamespace

from nimble.engine import saving
from nimble.ir.saved_format import BlobWriter
from nimble.ir.taskgraph import Pointer, Task, TaskKind


def test_external_memory_is_merged_into_ranges_each_start_placed(monkeypatch):
    monkeypatch.setattr(saving.driver, "copy_to_host", lambda address, size: bytes(size))
    outside = saving._Outside(BlobWriter(), with_weights=True)
    graph = SimpleNamespace(buffers=[SimpleNamespace(size=s) for s in (100, 50, 10, 64)])
    prepared = SimpleNamespace(graph=graph, bases=[1000, 1080, 2000, 1000])
    for bid in range(4):  # 1000-1100 and 1080-1130 overlap; 2000-2010 apart; 1000-1064 inside
        assert outside.external(prepared, bid) == {"memory_at": prepared.bases[bid]}
    rows, where = outside.memory_rows()
    assert [r["size"] for r in rows] == [130, 10]
    assert where == {1000: (0, 0), 1080: (0, 80), 2000: (1, 0)}


def test_a_copy_endpoint_is_written_where_it_was_recorded():
    task = Task(0, TaskKind.MEMSET, pointers=[Pointer("dst", 0x5000 + 16, 3, 16)])
    bases = [0] * 3 + [0x9000]
    fields = {"dst": 0x9000 + 16 + 4, "value": 0}  # the served node: relocated, 4 bytes in
    assert saving._unrelocated(task, fields, bases, {"dst": "dst"})["dst"] == 0x5000 + 16 + 4
    assert saving._unrelocated(task, fields, bases, {"src": "srcDevice"}) == fields


def test_the_graphs_of_a_file_of_several_number_their_buckets_in_order():
    def serving(buckets: int, instances: int = 1):
        return SimpleNamespace(buckets=[None] * buckets, instances=instances, pad=False)
    rows = saving._graph_rows([("prefill/1", serving(2)), ("decode/1", serving(1, 3))])
    assert rows == [{"name": "prefill/1", "buckets": [0, 1], "instances": 1, "pad": False},
                    {"name": "decode/1", "buckets": [2], "instances": 3, "pad": False}]
