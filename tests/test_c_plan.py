"""The C plan (nimble/engine/c_plan.py) on recorded fixtures, on the CPU: every relocation it
writes, applied as the C runtime applies it, gives the parameter blocks, copy endpoints and
tensor addresses that Python's build gives for the same memory."""
from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from c_plan_reader import read_plan, relocated_args, resolve
from helpers import FIXTURE_DIR
from nimble.analysis.memplan import plan_memory
from nimble.engine.arena_layout import own_layout, written_externals
from nimble.engine.build import _mover, buffer_bases, chain_edges, relocate_params
from nimble.engine.c_plan import MAGIC, c_plan
from nimble.engine.prepared import single_stream_schedule
from nimble.ir.taskgraph import BufferKind, TaskGraph, TaskKind

ARENA, WEIGHT0, MEMORY0 = 0x7F00_0000_0000, 0x6000_0000_0000, 0x5000_0000_0000


def _stand_in(name: str):
    """A prepared graph as c_plan reads it, its manifest rows, and where every buffer lives."""
    graph = TaskGraph.load(FIXTURE_DIR / f"{name}.json.gz")
    n = len(graph.tasks)
    plan = plan_memory(graph, chain_edges(n))
    state = own_layout(graph, plan)
    bases = buffer_bases(graph, plan, ARENA)
    for bid, at in state.private.items():
        bases[bid] = ARENA + at
    private, planned = set(written_externals(graph)), set(plan.offsets)
    pointed = sorted({p.buffer for t in graph.tasks for p in t.pointers if p.buffer >= 0})
    outside, weights, memory = {}, [], []
    for bid in pointed:
        b = graph.buffers[bid]
        if bid in planned or bid in private or b.kind == BufferKind.RNG:
            continue
        if b.kind == BufferKind.PARAM:
            outside[str(bid)] = {"weight": len(weights)}
            bases[bid] = WEIGHT0 + (len(weights) << 28)
            weights.append({"size": b.size, "blob": None})
        else:
            outside[str(bid)] = {"memory": len(memory), "offset": 64}
            bases[bid] = MEMORY0 + (len(memory) << 28) + 64
            memory.append({"size": b.size + 64, "blob": [0, 8]})
    nodes = []
    for t in graph.tasks:
        if t.kind == TaskKind.KERNEL:
            nodes.append({"kernel": 0, "attributes": {"4": (b"\1" * 64).hex()}})
        elif t.kind == TaskKind.MEMSET:
            dst = next(p.value for p in t.pointers if p.location == "dst")
            f = t.fields
            nodes.append({"memset": {"dst": dst, "value": f["value"],
                                     "elementSize": f["element_size"], "width": f["width"],
                                     "height": f["height"], "pitch": f["pitch"]}})
        else:
            nodes.append({"empty": True})
    reference = {"inputs": [[[0, 8] for _ in graph.inputs]],
                 "outputs": [[[0, 8] for _ in graph.outputs]], "spread": {}}
    manifest = {
        "arch": 90, "driver": 13000, "instances": 2,
        "binaries": [{"kind": "embedded", "blob": [0, 16],
                      "sha256": hashlib.sha256(b"x").hexdigest()}],
        "kernels": [{"binary": 0, "name": "k", "layout": [],
                     "fingerprint": dict.fromkeys(
                         ["MAX_THREADS_PER_BLOCK", "SHARED_SIZE_BYTES", "CONST_SIZE_BYTES",
                          "LOCAL_SIZE_BYTES", "NUM_REGS", "BINARY_VERSION"], 7),
                     "attributes": {"MAX_DYNAMIC_SHARED_SIZE_BYTES": -1}}],
        "weights": weights, "memory": memory,
        "buckets": [{"outside": outside, "private": {str(b): [0, 8] for b in private},
                     "nodes": nodes, "reference": reference}]}
    prepared = SimpleNamespace(graph=graph, memplan=plan, schedule=single_stream_schedule(n),
                               priorities=list(range(n)), late_edges=[], step=None,
                               programmatic=frozenset())
    return prepared, state, manifest, bases, len(weights), len(memory)


@pytest.mark.parametrize("name", ["googlenet", "inception_v3", "resnet50", "gpt2_float16"])
def test_every_relocation_of_the_c_plan_gives_what_the_python_build_gives(name):
    prepared, state, manifest, bases, nweights, nmemory = _stand_in(name)
    data, why = c_plan(manifest, [prepared], [state], state.size)
    assert why == ""
    plan = read_plan(data)
    assert (plan["magic"], plan["version"], plan["instances"]) == (MAGIC, 1, 2)
    assert plan["kernels"][0]["settable"][0] == -1 and plan["kernels"][0]["fingerprint"] == [7] * 6
    weights = [WEIGHT0 + (i << 28) for i in range(nweights)]
    memory = [MEMORY0 + (i << 28) for i in range(nmemory)]
    bucket = plan["buckets"][0]
    graph = prepared.graph
    for task, node in zip(graph.tasks, bucket["nodes"]):
        if task.kind == TaskKind.KERNEL:
            assert relocated_args(node, ARENA, weights, memory) == relocate_params(task, bases)
            assert node["priority"] == task.id and node["attrs"] == [(4, b"\1" * 64)]
            assert node["packed"] == (task.fields.get("args") == "extra")
        elif task.kind == TaskKind.MEMSET:
            recorded = next(p.value for p in task.pointers if p.location == "dst")
            want = _mover(task, bases)("dst", recorded)
            assert resolve(node["dst"], ARENA, weights, memory) == want
    for ref, tensor in zip(graph.inputs + graph.outputs, bucket["inputs"] + bucket["outputs"]):
        assert resolve(tensor["place"], ARENA, weights, memory) == bases[ref.buffer] + ref.offset
        assert tensor["shape"] == list(ref.shape)
    assert bucket["edges"] == [(i, i + 1) for i in range(len(graph.tasks) - 1)]
    assert bucket["plan_bytes"] == prepared.memplan.arena_bytes
    assert sorted(off for off, _, _ in bucket["private"]) == sorted(state.private.values())


def test_a_graph_the_c_runtime_cannot_run_says_why():
    prepared, state, manifest, *_ = _stand_in("googlenet")
    graph = prepared.graph
    # memory the graph uses where it is keeps its low bits anyway
    graph.meta["low_word_buffers"] = [next(b.id for b in graph.buffers if not b.relocatable)]
    assert c_plan(manifest, [prepared], [state], state.size)[1] == ""
    graph.meta["low_word_buffers"] = [next(b.id for b in graph.buffers if b.relocatable)]
    data, why = c_plan(manifest, [prepared], [state], state.size)
    assert "low 32 address bits" in why and read_plan(data)["unsupported"] == why
    prepared.graph.meta["low_word_buffers"] = []
    prepared.step = object()
    assert c_plan(manifest, [prepared], [state], state.size)[1] == "a training step"
