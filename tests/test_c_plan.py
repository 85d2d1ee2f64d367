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
        elif t.kind == TaskKind.MEMCPY:
            ends = {p.location: p.value for p in t.pointers}
            f = t.fields
            nodes.append({"memcpy": {
                "srcDevice": ends["src"], "dstDevice": ends["dst"],
                "srcMemoryType": f["src_type"], "dstMemoryType": f["dst_type"],
                "srcXInBytes": 0, "srcY": 0, "srcZ": 0, "srcPitch": 0, "srcHeight": 0,
                "dstXInBytes": 0, "dstY": 0, "dstZ": 0, "dstPitch": 0, "dstHeight": 0,
                "WidthInBytes": f["width"], "Height": f["height"], "Depth": f["depth"]}})
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


#: Every recorded inference fixture: the zoo's models (fp32, and fp16/bf16 where recorded), on
#: Inductor's kernels, the decoders; a C plan of each is what ``nimble save`` writes beside it.
C_PLAN_FIXTURES = ["branchy", "efficientnet_b0", "gemm_chains", "googlenet", "googlenet_bfloat16",
                   "googlenet_float16", "googlenet_inductor", "gpt2_float16", "inception_v3",
                   "inception_v3_bfloat16", "inception_v3_float16", "inception_v3_inductor",
                   "llama_small_float16", "mobilenet_v2", "nasnetalarge", "pnasnet5large",
                   "resnet50"]


@pytest.mark.parametrize("name", C_PLAN_FIXTURES)
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
        elif task.kind == TaskKind.MEMCPY:
            for p in task.pointers:
                assert resolve(node[p.location], ARENA, weights, memory) == \
                    bases[p.buffer] + p.offset
    for ref, tensor in zip(graph.inputs + graph.outputs, bucket["inputs"] + bucket["outputs"]):
        assert resolve(tensor["place"], ARENA, weights, memory) == bases[ref.buffer] + ref.offset
        assert tensor["shape"] == list(ref.shape)
    assert bucket["edges"] == [(i, i + 1) for i in range(len(graph.tasks) - 1)]
    assert bucket["plan_bytes"] == prepared.memplan.arena_bytes
    assert sorted(off for off, _, _ in bucket["private"]) == sorted(state.private.values())


def test_buffers_kept_at_their_low_bits_are_low_bits_regions_of_a_version_3_plan():
    """An arena buffer and a private copy of library memory kept at their low address bits
    (the faulting inception_v3 training fixture's 64 MiB, found from its words; an arena
    buffer listed by hand): the plan is of version 3, lists both with their recorded addresses
    (the proof poisons the arena buffer, not the copy, which starts from the library's bytes),
    leaves the copy out of the arena's private copies, and every word into them relocates to
    the instance's copy at the same offset."""
    from nimble.engine.arena_layout import low_word_buffers
    from nimble.engine.c_plan import LOW_BITS_VERSION, LOWBITS

    prepared, state, manifest, bases, nweights, nmemory = _stand_in(
        "inception_v3_train_averaged_fault")
    prepared.step = None  # the words, as an inference graph would have them
    graph = prepared.graph
    arena_buffer = next(b.id for b in graph.buffers if b.relocatable and b.size
                        and any(p.buffer == b.id for t in graph.tasks for p in t.pointers))
    graph.meta["low_word_buffers"] = [arena_buffer]
    low = low_word_buffers(graph)
    assert len(low) == 2 and arena_buffer in low
    data, why = c_plan(manifest, [prepared], [state], state.size)
    assert why == "the graph draws random numbers"  # its dropout: the only reason
    plan = read_plan(data)
    bucket = plan["buckets"][0]
    assert plan["version"] == LOW_BITS_VERSION
    listed = bucket["low_bits"]
    assert [(e["size"], e["address"]) for e in listed] == [
        (graph.buffers[b].size, graph.buffers[b].address) for b in low]
    assert [e["poison"] for e in listed] == [int(graph.buffers[b].relocatable) for b in low]
    copy = low.index(next(b for b in low if b in state.private))
    assert listed[copy]["blob"] == (0, 8)  # the private copy's bytes, as saved
    assert len(bucket["private"]) == len(state.private) - 1
    copies = [0x1_0000_0000 * (k + 1) + graph.buffers[b].address % (1 << 32)
              for k, b in enumerate(low)]
    for b, at in zip(low, copies):
        bases[b] = at
    weights = [WEIGHT0 + (i << 28) for i in range(nweights)]
    memory = [MEMORY0 + (i << 28) for i in range(nmemory)]
    relocated = 0
    rng = {b.id for b in graph.buffers if b.kind == BufferKind.RNG}
    for task, node in zip(graph.tasks, bucket["nodes"]):
        if task.kind == TaskKind.KERNEL and not rng & {p.buffer for p in task.pointers}:
            assert relocated_args(node, ARENA, weights, memory, copies) == \
                relocate_params(task, bases)
            relocated += sum(place[0] == LOWBITS for _, place in node["relocs"])
    assert relocated >= 2


def test_a_graph_the_c_runtime_cannot_run_says_why():
    prepared, state, manifest, *_ = _stand_in("googlenet")
    prepared.graph.meta["rng"] = {"increment": 4, "cells": 2}
    data, why = c_plan(manifest, [prepared], [state], state.size)
    assert why == "the graph draws random numbers" and read_plan(data)["unsupported"] == why
    del prepared.graph.meta["rng"]
    prepared.step = object()
    assert c_plan(manifest, [prepared], [state], state.size)[1] == "a training step"


def test_a_plan_lists_only_the_served_edges_into_nimbles_waiting_kernels():
    """Of the edges a prepare serves programmatic, a plan lists those into one of Nimble's
    waiting kernels that are edges of the built graph (as a Python load builds them), and is
    then of version 4, the only version the C runtime builds programmatic; none left, the plan
    stays of version 1."""
    from test_programmatic import _waiting_graph

    from nimble.engine.c_plan import SERVED_EDGES_VERSION, VERSION, plan_version, served_edges

    graph = _waiting_graph()  # 0 -> 1 into Nimble's GEMV; 0 -> 5 a user's "attend"; 0 -> 2 a
    # GEMV whose weight task 0 writes
    listed = [(0, 1), (0, 5), (0, 2)]
    prepared = SimpleNamespace(graph=graph, programmatic=frozenset(listed),
                               schedule=SimpleNamespace(edges=lambda: listed[1:]),
                               late_edges=[(0, 1)])
    assert served_edges(prepared) == [(0, 1)]
    assert plan_version([prepared]) == SERVED_EDGES_VERSION
    prepared.late_edges = []  # (0, 1) no edge of the built graph
    assert served_edges(prepared) == [] and plan_version([prepared]) == VERSION
