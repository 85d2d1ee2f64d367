"""A saved graph (the file ``nm.save`` writes) made on the CPU from a recorded TaskGraph fixture,
for the tests of the loader's checks and of ``nimble inspect`` on machines without a GPU.

The file is structurally what :func:`nimble.engine.saving.save_serving` writes for one bucket
of one instance, saved without its weights: the recording's graph, a schedule with every task on
one stream, the arena plan :func:`~nimble.analysis.memplan.plan_memory` gives for the chain of
tasks, a stored node per task (each kernel pointing at one embedded binary row, each memset and
memcpy with the driver's fields made from the task's decoded fields and pointers), every weight
storage the graph points into by its buffer's name, a memory range per external buffer, the
private copies, and two reference input and output sets of the right byte sizes.  No byte of it
runs: the binary is a stand-in and the reference bytes are patterns.  Everything is
deterministic, so the committed file (``tests/fixtures/saved_<fixture>.nimble.gz``, gzipped to
stay small) is this module's output::

    python tests/saved_fixture.py [FIXTURE]     # rewrites tests/fixtures/saved_FIXTURE.nimble.gz
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import random
import sys
from pathlib import Path

from nimble.analysis.memplan import plan_memory
from nimble.analysis.schedule import Schedule
from nimble.engine.arena_layout import library_scratch, written_externals
from nimble.ir.saved_format import ZEROED_WORKSPACES_VERSION, BlobWriter, SavedFile
from nimble.ir.saved_manifest import FORMAT_NAME, MEMSET_FIELDS
from nimble.ir.taskgraph import BufferKind, TaskGraph, TaskKind

FIXTURE_DIR = Path(__file__).parent / "fixtures"
#: The recording the committed file is made from: 219 tasks with memsets, small inputs.
NAME = "llama_small_float16"
#: What ``treespec_dumps`` writes for a forward that returns one tensor.
ONE_TENSOR_SPEC = '[1, {"type": null, "context": null, "children_spec": []}]'
FINGERPRINT = {"MAX_THREADS_PER_BLOCK": 1024, "SHARED_SIZE_BYTES": 0, "CONST_SIZE_BYTES": 0,
               "LOCAL_SIZE_BYTES": 0, "NUM_REGS": 32, "BINARY_VERSION": 90}
ATTRIBUTES = {"MAX_DYNAMIC_SHARED_SIZE_BYTES": 0, "NON_PORTABLE_CLUSTER_SIZE_ALLOWED": 0,
              "CLUSTER_SCHEDULING_POLICY_PREFERENCE": 0, "PREFERRED_SHARED_MEMORY_CARVEOUT": -1}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1,
             "bool": 1, "float64": 8, "int8": 1}


def fixture_path(name: str = NAME) -> Path:
    return FIXTURE_DIR / f"saved_{name}.nimble.gz"


def _pattern(size: int, seed: int) -> bytes:
    """``size`` bytes: a random 256-byte block of ``seed``, repeated (gzip shrinks it)."""
    block = random.Random(seed).randbytes(256)
    return (block * (size // 256 + 1))[:size]


def _nbytes(ref) -> int:
    size = _ITEMSIZE[ref.dtype]
    for n in ref.shape:
        size *= n
    return size


def _stand_in_binary(graph: TaskGraph) -> bytes:
    """Bytes that name every kernel, as a cubin's string table does (no code)."""
    names = sorted({t.name for t in graph.kernel_tasks()})
    return b"\x7fELF\x02\x01\x01" + b"\0" * 57 + b"\0".join(n.encode() for n in names) + b"\0"


def _pointer(task, location: str) -> int:
    return next((p.value for p in task.pointers if p.location == location), 0)


def _node(task, kernels: dict[str, int]) -> dict:
    f = task.fields
    if task.kind == TaskKind.KERNEL:
        return {"kernel": kernels.setdefault(task.name, len(kernels)), "attributes": {}}
    if task.kind == TaskKind.MEMSET:
        values = (_pointer(task, "dst"), f["value"], f["element_size"], f["width"],
                  f["height"], f["pitch"])
        return {"memset": dict(zip(MEMSET_FIELDS, values))}
    if task.kind == TaskKind.MEMCPY:
        row = {}
        for side in ("src", "dst"):
            row.update({f"{side}XInBytes": 0, f"{side}Y": 0, f"{side}Z": 0, f"{side}LOD": 0,
                        f"{side}MemoryType": f[f"{side}_type"],
                        f"{side}Device": _pointer(task, side),
                        f"{side}Pitch": f["width"], f"{side}Height": f["height"]})
        row.update(WidthInBytes=f["width"], Height=f["height"], Depth=f["depth"])
        return {"memcpy": row}
    raise ValueError(f"task {task.id} is a {task.kind}, which a saved graph does not hold")


def _outside(graph: TaskGraph, plan, private: set[int], blobs: BlobWriter, dtype: str
             ) -> tuple[dict, list, list]:
    """Per pointed buffer outside the arena, its weight storage or memory range; the rows."""
    planned = set(plan.offsets) | set(graph.meta.get("low_word_buffers", []))
    pointed = sorted({p.buffer for t in graph.tasks for p in t.pointers if p.buffer >= 0})
    sources, weights, memory = {}, [], []
    for bid in pointed:
        b = graph.buffers[bid]
        if bid in planned or bid in private or b.kind == BufferKind.RNG:
            continue
        if b.kind == BufferKind.PARAM:
            sources[str(bid)] = {"weight": len(weights)}
            weights.append({"size": b.size, "blob": None, "names": [{
                "name": b.name or f"buffer{bid}", "offset": 0, "dtype": dtype,
                "shape": [b.size // _ITEMSIZE[dtype]], "strides": [1]}]})
        else:
            sources[str(bid)] = {"memory": len(memory), "offset": 0}
            memory.append({"size": b.size, "blob": blobs.add(_pattern(b.size, bid)).as_json()})
    return sources, weights, memory


def _bucket(graph: TaskGraph, blobs: BlobWriter, kernels: dict[str, int], dtype: str
            ) -> tuple[dict, list, list]:
    n = len(graph.tasks)
    schedule = Schedule([0] * n, [list(range(n))], [], 0, 1)
    plan = plan_memory(graph, [(i, i + 1) for i in range(n - 1)])
    private, scratch = set(written_externals(graph)), set(library_scratch(graph))
    sources, weights, memory = _outside(graph, plan, private, blobs, dtype)
    text = json.dumps(graph.to_json(), separators=(",", ":")).encode()
    sets = [[blobs.add(_pattern(_nbytes(r), 100 * s + i)).as_json()
             for i, r in enumerate(graph.inputs)] for s in range(2)]
    outputs = [[blobs.add(_pattern(_nbytes(r), 100 * s + 50 + i)).as_json()
                for i, r in enumerate(graph.outputs)] for s in range(2)]
    row = {
        "graph": blobs.add(gzip.compress(text, compresslevel=6, mtime=0)).as_json(),
        "schedule": dataclasses.asdict(schedule),
        "memplan": {**dataclasses.asdict(plan),
                    "offsets": {str(k): v for k, v in plan.offsets.items()}},
        "priorities": None, "backfill": [], "device_launch": [True], "gather_inputs": True,
        "output_spec": ONE_TENSOR_SPEC if len(graph.outputs) == 1 else None,
        "nodes": [_node(t, kernels) for t in graph.tasks],
        "outside": sources,
        # a workspace's copy without bytes (null), as saving writes it: it starts zeroed
        "private": {str(b): None if b in scratch else
                    blobs.add(_pattern(graph.buffers[b].size, b)).as_json()
                    for b in sorted(private)},
        "reference": {"inputs": sets, "outputs": outputs, "spread": {}},
        "prepare_seconds": {"record": 1.5, "schedule": 0.25, "build": 0.5, "verify": 0.75},
    }
    return row, weights, memory


def saved_file(name: str = NAME) -> SavedFile:
    """The saved file made from fixture ``name`` (see the module docstring)."""
    return saved_file_of(TaskGraph.load(FIXTURE_DIR / f"{name}.json.gz"))


def saved_file_of(graph: TaskGraph) -> SavedFile:
    """The saved file of ``graph`` (see the module docstring)."""
    dtype = graph.outputs[0].dtype if graph.outputs else "float32"
    blobs, kernels = BlobWriter(), {}
    bucket, weights, memory = _bucket(graph, blobs, kernels, dtype)
    binary = _stand_in_binary(graph)
    layouts = {t.name: [list(p) for p in t.param_layout] for t in graph.kernel_tasks()}
    manifest = {
        "format": FORMAT_NAME, "nimble": "0.1.0", "torch": graph.meta.get("torch", ""),
        "arch": 90, "device": graph.meta.get("device", "NVIDIA H100 80GB HBM3"),
        "driver": 13000, "pad": False, "instances": 1, "weights_included": False,
        "binaries": [{"kind": "embedded", "blob": blobs.add(binary).as_json(),
                      "sha256": hashlib.sha256(binary).hexdigest(),
                      "origin": "tests/saved_fixture.py (a stand-in, no code)"}],
        "kernels": [{"name": k, "binary": 0, "fingerprint": dict(FINGERPRINT),
                     "layout": layouts[k], "attributes": dict(ATTRIBUTES)} for k in kernels],
        "weights": weights, "memory": memory, "buckets": [bucket],
    }
    zeroed = any(ref is None for ref in bucket["private"].values())
    return SavedFile(manifest, blobs.getvalue(), version=ZEROED_WORKSPACES_VERSION if zeroed else 1)


def compressed(name: str = NAME) -> bytes:
    """The file made from fixture ``name``, gzipped as committed."""
    return gzip.compress(saved_file(name).to_bytes(), compresslevel=9, mtime=0)


if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else NAME
    out = fixture_path(name)
    out.write_bytes(compressed(name))
    print(f"{out}\t{out.stat().st_size} bytes")
