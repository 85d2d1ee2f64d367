"""A bucket of a saved graph held against its decoded TaskGraph, before a load uses it: a stored
node per task and of its kind, every buffer id the graph's and every buffer a task points into
placed (the arena plan, a weight or memory range, a private copy) with room for it, the
reference blobs of the inputs' and outputs' byte sizes, a training step's layout within the
graph's inputs and outputs.  The manifest itself is checked first
(:func:`nimble.ir.saved_manifest.check_manifest`); a bucket that does not fit its graph is one
:class:`~nimble.errors.LoadError` naming the field, on any machine: no torch, no driver.
"""
from __future__ import annotations

import gzip
import json
import zlib
from typing import Callable

from ..errors import LoadError
from . import json_fields as jf
from .saved_manifest import NODE_KINDS, _fail, damaged
from .taskgraph import BufferKind, TaskGraph
from .waiting_kernels import may_be_programmatic, writers


class UndecodableGraph(LoadError):
    """A bucket's graph blob that is not a gzipped JSON TaskGraph; the message is the
    decoder's, for the caller to say where."""


def bucket_graph(saved, k: int) -> TaskGraph:
    """Bucket ``k``'s TaskGraph, decoded from its gzipped JSON in ``saved`` (a
    :class:`~nimble.ir.saved_format.SavedFile` whose manifest passed ``check_manifest``);
    :class:`UndecodableGraph` for bytes that are not one."""
    try:
        return TaskGraph.from_json(json.loads(gzip.decompress(
            saved.blob_view(saved.manifest["buckets"][k]["graph"]))))
    except (ValueError, OSError, EOFError, zlib.error, RecursionError) as e:
        raise UndecodableGraph(str(e)) from None


def _placed(manifest: dict, row: dict, graph: TaskGraph, where: str) -> set[int]:
    """The buffers bucket ``row`` places, each checked to be the graph's and to fit where it
    is put: the arena plan, a weight storage or memory range, a private copy's bytes."""
    buffers, plan = graph.buffers, row["memplan"]
    weights = [w["size"] for w in manifest.get("weights", [])]
    memory = [r["size"] for r in manifest.get("memory", [])]

    def size_of(field: str, bid: str) -> int:
        if int(bid) >= len(buffers):
            raise _fail(f"{field}['{bid}']", f"names buffer {bid}, but the graph has "
                                             f"{len(buffers)} buffers")
        return buffers[int(bid)].size

    for bid, at in plan["offsets"].items():
        size = size_of(f"{where}.memplan.offsets", bid)
        if at + size > plan["arena_bytes"]:
            raise _fail(f"{where}.memplan.offsets['{bid}']", f"puts buffer {bid} ({size} bytes) "
                        f"at {at}, past the {plan['arena_bytes']}-byte arena")
    for bid, source in row["outside"].items():
        size = size_of(f"{where}.outside", bid)
        room = weights[source["weight"]] if "weight" in source else \
            memory[source["memory"]] - source["offset"]
        if size > room:
            raise _fail(f"{where}.outside['{bid}']", f"puts buffer {bid} ({size} bytes) where "
                                                     f"{room} bytes are left")
    for bid, blob in row["private"].items():
        size = size_of(f"{where}.private", bid)
        if blob is not None and blob[1] != size:
            raise _fail(f"{where}.private['{bid}']", f"is {blob[1]} bytes for buffer {bid}'s "
                                                     f"{size}")
    return {int(b) for key in ("outside", "private") for b in row[key]} | \
        {int(b) for b in plan["offsets"]} | set(graph.meta.get("low_word_buffers", []))


def _against_graph(manifest: dict, k: int, graph: TaskGraph,
                   itemsize: Callable[[str], int | None]) -> None:
    where = f"buckets[{k}]"
    row = manifest["buckets"][k]
    if len(row["nodes"]) != len(graph.tasks):
        raise _fail(where, f"has {len(row['nodes'])} stored nodes for the {len(graph.tasks)} "
                           "tasks of its graph")
    for t, node in zip(graph.tasks, row["nodes"]):
        kind = next(key for key in NODE_KINDS if key in node)
        if NODE_KINDS[kind] != t.kind:
            raise _fail(f"{where}.nodes[{t.id}]", f"is a {kind} node, but task {t.id} of the "
                                                  f"graph is a {t.kind}")
    placed = _placed(manifest, row, graph, where)
    for t in graph.tasks:
        for p in t.pointers:
            if p.buffer >= 0 and p.buffer not in placed and \
                    graph.buffers[p.buffer].kind != BufferKind.RNG:
                raise _fail(where, f"does not place buffer {p.buffer}, which task {t.id} "
                                   "points into (neither its arena plan nor outside nor private "
                                   "names it)")
    _references(row["reference"], graph, where, itemsize)
    recorded = {tuple(e) for e in graph.meta.get("programmatic_edges", [])}
    written = writers(graph)
    for i, edge in enumerate(row.get("programmatic", [])):
        u, v = edge
        if tuple(edge) not in recorded and not may_be_programmatic(graph, u, v, written):
            raise _fail(f"{where}.programmatic[{i}]", f"makes {u} -> {v} programmatic, an "
                        "edge the recording's capture did not launch so, nor one into a "
                        "kernel of Nimble's that waits for its predecessor")
    if row.get("step") is not None:
        _step(row["step"], graph, f"{where}.step")


def _references(reference: dict, graph: TaskGraph, where: str,
                itemsize: Callable[[str], int | None]) -> None:
    for side, refs in (("inputs", graph.inputs), ("outputs", graph.outputs)):
        for s, blobs in enumerate(reference[side]):
            at = f"{where}.reference.{side}[{s}]"
            if len(blobs) != len(refs):
                raise _fail(at, f"has {len(blobs)} tensors for the graph's {len(refs)} {side}")
            for i, (blob, r) in enumerate(zip(blobs, refs)):
                element = itemsize(r.dtype)
                if element is None:
                    raise _fail(f"{where}'s graph", f"has {side[:-1]} {i} of dtype {r.dtype!r}, "
                                                    "which torch here does not know")
                size = element
                for n in r.shape:
                    size *= n
                if blob[1] != size:
                    raise _fail(f"{at}[{i}]", f"is {blob[1]} bytes for the {size} of "
                                              f"{r.dtype} {list(r.shape)}")
    outputs = len(graph.outputs)
    for key, named in (("spread", map(int, reference["spread"])),
                       ("gradients", reference.get("gradients", []))):
        for i in named:
            if i >= outputs:
                raise _fail(f"{where}.reference.{key}", f"names output {i}, but the graph has "
                                                        f"{outputs}")


def _step(step: dict, graph: TaskGraph, where: str) -> None:
    """A training step's layout within the graph's inputs and outputs."""
    ins, outs = step["forward_inputs"], step["forward_outputs"]
    for key, count, limit, of in (
            ("forward_inputs", ins, len(graph.inputs), "the graph's inputs"),
            ("forward_outputs", outs, len(graph.outputs), "the graph's outputs")):
        if count > limit:
            raise _fail(f"{where}.{key}", f"is {count}, more than the {limit} of {of}")
    for key, limit in (("differentiable", outs), ("inputs_with_grad", ins),
                       ("grad_output_of", len(graph.outputs))):
        for i, value in enumerate(step[key]):
            if value >= limit:
                raise _fail(f"{where}.{key}[{i}]", f"is {value}, past the {limit} it indexes")
    targets = len(step["inputs_with_grad"]) + len(step["param_names"])
    if len(step["grad_output_of"]) != targets:
        raise _fail(f"{where}.grad_output_of", f"has {len(step['grad_output_of'])} items for "
                                               f"{targets} gradient targets")


def check_bucket_graph(manifest: dict, k: int, graph: TaskGraph,
                       itemsize: Callable[[str], int | None], path: str = "the file") -> None:
    """Raise :class:`LoadError` where bucket ``k`` of ``manifest`` (which passed
    :func:`check_manifest`) does not fit ``graph``, its decoded TaskGraph (see the module
    docstring); ``itemsize(dtype name)`` is the bytes of one element, None for a dtype unknown
    here."""
    try:
        _against_graph(manifest, k, graph, itemsize)
    except jf.FieldError as e:
        raise damaged(path, e) from None
