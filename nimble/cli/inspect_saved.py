"""``nimble inspect FILE`` on a saved graph (``nm.save``, ``nimble save``): what it holds, read
without torch or a GPU.

The whole file is read and checked as a load checks it before the GPU (the container's
checksum and version, every field of the manifest: :mod:`nimble.ir.saved_manifest`), and each
bucket's TaskGraph decoded from its gzipped JSON; a file that does not hold is one line naming
what is wrong.  The summary: the format version, the saving process's Nimble and torch, its GPU
and driver, the instances and padding, per bucket its input and output shapes, tasks, streams
and arena, the kernels and where their binaries come from (library files by name, embedded
images with their bytes), the weights (included or not) and the file's size.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..errors import LoadError
from ..ir.saved_format import MAGIC, SavedFile
from ..ir.saved_graph_check import UndecodableGraph, bucket_graph
from ..ir.saved_manifest import check_manifest
from ..ir.taskgraph import TaskGraph
from .common import Fail

MIB = 2**20


def is_saved_graph(path: str) -> bool:
    """Whether the file at ``path`` starts as a saved graph does (its 8-byte magic)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def _fail(path: str, e: LoadError) -> Fail:
    return Fail(f"{path}: a saved graph that does not hold: {str(e).removeprefix('the file: ')}")


def _graph(saved: SavedFile, k: int, path: str) -> TaskGraph:
    try:
        return bucket_graph(saved, k)
    except UndecodableGraph as e:
        raise Fail(f"{path}: a saved graph whose bucket {k} holds a graph that does not decode "
                   f"({' '.join(str(e).split())}); the file is damaged, save the model "
                   "again") from None


def _tensors(refs) -> list[dict]:
    return [{"dtype": r.dtype, "shape": list(r.shape)} for r in refs]


def _bucket(row: dict, graph: TaskGraph) -> dict:
    return {"inputs": _tensors(graph.inputs), "outputs": _tensors(graph.outputs),
            "tasks": len(graph.tasks), "streams": len(row["schedule"]["streams"]),
            "arena_bytes": row["memplan"]["arena_bytes"],
            # library memory the graph writes: the bytes the file holds of its private copies,
            # and the workspaces' copies it holds none of (they start zeroed)
            "private_bytes": sum(ref[1] for ref in (row.get("private") or {}).values()
                                 if ref is not None),
            "zeroed_bytes": sum(graph.buffers[int(bid)].size
                                for bid, ref in (row.get("private") or {}).items()
                                if ref is None),
            "training_step": row.get("step") is not None,
            # edges the saving process served programmatic: a load builds those into Nimble's
            # waiting kernels so (nimble.engine.loading.LOAD_WAITING_EDGES)
            "programmatic_edges": len(row.get("programmatic") or ())}


#: The embedded images a summary names one by one, the largest first.
LARGEST_IMAGES = 3


def _binaries(manifest: dict) -> dict:
    """Where the kernels' binaries come from: per library file (by name) its kernels and
    containers; the embedded images' count, kernels, bytes in the file and bytes unpacked (an
    image stored LZ4-packed says its size), and the largest of them each with its bytes,
    origin (the file or module it was taken from), kernels and one kernel's name: what a file
    larger than its weights carries."""
    rows = manifest["binaries"]
    kernels = Counter(k["binary"] for k in manifest["kernels"])
    named = {k["binary"]: k["name"] for k in reversed(manifest["kernels"])}
    libraries: dict[str, dict] = {}
    embedded = {"images": 0, "kernels": 0, "bytes": 0, "unpacked_bytes": 0}
    images = []
    for i, row in enumerate(rows):
        if row["kind"] == "library":
            lib = libraries.setdefault(row["name"], {"name": row["name"], "kernels": 0,
                                                     "containers": 0})
            lib["kernels"] += kernels[i]
            lib["containers"] += 1
        else:
            embedded["images"] += 1
            embedded["kernels"] += kernels[i]
            stored, unpacked = row["blob"][1], row.get("image_size", row["blob"][1])
            embedded["bytes"] += stored
            embedded["unpacked_bytes"] += unpacked
            images.append({"bytes": stored, "unpacked_bytes": unpacked,
                           "origin": row.get("origin", ""),
                           "kernels": kernels[i], "example": named.get(i, "")})
    images.sort(key=lambda r: -r["bytes"])
    return {"libraries": sorted(libraries.values(), key=lambda r: (-r["kernels"], r["name"])),
            "embedded": embedded, "largest_images": images[:LARGEST_IMAGES]}


def _contents(saved: SavedFile, file_bytes: int) -> dict:
    """The file's bytes by what they hold: each kind's blobs (a byte string stored once counts
    once, for the first kind that names it), the manifest, the C plan, and the rest (the header,
    the section table and alignment): what a file larger than its weights carries."""
    m = saved.manifest
    kinds: dict[str, list] = {
        "weights": [w["blob"] for w in m.get("weights", [])],
        "external_memory": [r["blob"] for r in m.get("memory", [])],
        "library_memory": [ref for row in m["buckets"]
                           for ref in (row.get("private") or {}).values()],
        "kernel_images": [row["blob"] for row in m["binaries"] if row["kind"] != "library"],
        "references": [ref for row in m["buckets"] for part in ("inputs", "outputs")
                       for refs in row["reference"][part] for ref in refs],
        "graphs": [row["graph"] for row in m["buckets"]],
    }
    seen: set = set()
    out = {}
    for kind, refs in kinds.items():
        unique = {tuple(r) for r in refs if r is not None} - seen
        seen |= unique
        out[kind] = sum(size for _, size in unique)
    out["manifest"] = saved.sections.get("manifest", (0, 0))[1]
    out["c_plan"] = saved.sections.get("c_plan", (0, 0))[1]
    out["other"] = file_bytes - sum(out.values())
    return out


def saved_summary(path: str) -> dict:
    """The numbers of the saved graph at ``path`` (see the module docstring); :class:`Fail` for
    a file that does not hold."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise Fail(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        saved = SavedFile.from_bytes(data, "the file")
        check_manifest(saved.manifest, len(saved.blobs), "the file")
    except LoadError as e:
        raise _fail(path, e) from None
    m = saved.manifest
    weights = m.get("weights", [])
    c_runtime = m.get("c_runtime")
    return {
        "kind": "saved graph", "format_version": saved.version, "file_bytes": len(data),
        "nimble": m.get("nimble", ""), "torch": m.get("torch", ""),
        "arch": m["arch"], "device": m.get("device", ""), "driver": m["driver"],
        "instances": m.get("instances", 1), "pad": m.get("pad", False),
        "buckets": [_bucket(row, _graph(saved, k, path)) for k, row in enumerate(m["buckets"])],
        "kernels": len(m["kernels"]), "binaries": _binaries(m),
        "weights_included": m.get("weights_included", True), "weight_storages": len(weights),
        "weight_bytes": sum(w["size"] for w in weights),
        "memory_bytes": sum(r["size"] for r in m.get("memory", [])),
        "c_runtime": c_runtime if isinstance(c_runtime, str) else None,
        "graphs": [{"name": g["name"], "buckets": g["buckets"]} for g in m.get("graphs") or []],
        "generator": m.get("generator"),
        "contents": _contents(saved, len(data)),
    }


#: The tensors a bucket's line names one by one (a training step's outputs are its output and a
#: gradient per parameter: the rest are counted; ``--json`` lists every one).
SHOWN_TENSORS = 4


def _shapes(tensors: list[dict]) -> str:
    shown = ", ".join(f"{t['dtype']} {t['shape']}" for t in tensors[:SHOWN_TENSORS]) or "none"
    rest = len(tensors) - SHOWN_TENSORS
    return shown + (f" and {rest} more" if rest > 0 else "")


def _size(n: int) -> str:
    """Bytes as MiB, or KiB under one MiB (a few KiB of library memory would read 0.0 MiB)."""
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n / 1024:.1f} KiB"


def _image_bytes(images: dict) -> str:
    """The MiB embedded images take in the file, and unpacked where they are packed."""
    stored, unpacked = images["bytes"], images["unpacked_bytes"]
    return f"{stored / MIB:.2f} MiB" + \
        (f" ({unpacked / MIB:.2f} MiB unpacked)" if unpacked != stored else "")


def format_saved(path: str, s: dict) -> str:
    """The text report of :func:`saved_summary`'s numbers."""
    driver = f"{s['driver'] // 1000}.{s['driver'] % 1000 // 10}"
    lines = [f"{path}: saved graph (format version {s['format_version']}), "
             f"{s['file_bytes'] / MIB:.1f} MiB",
             f"  saved by nimble {s['nimble'] or '?'}, torch {s['torch'] or '?'} on "
             f"{s['device'] or 'a GPU'} (sm_{s['arch']}), CUDA driver {driver}",
             f"  instances: {s['instances']}, pad: {'yes' if s['pad'] else 'no'}"]
    if s["generator"]:
        g = s["generator"]
        lines.append(f"  a Generator: batch sizes {g['batch_sizes']}, prompt buckets "
                     f"{g['prompt_buckets']}, cache length {g['max_cache_len']} "
                     "(nimble.generate.Generator.load reads it)")
    for g in s["graphs"]:
        lines.append(f"  graph {g['name']}: buckets {g['buckets']}")
    for k, b in enumerate(s["buckets"]):
        kind = " (a training step)" if b["training_step"] else ""
        lines += [f"  bucket {k}{kind}: inputs {_shapes(b['inputs'])} -> outputs "
                  f"{_shapes(b['outputs'])}",
                  f"    tasks: {b['tasks']}, streams: {b['streams']}, arena: "
                  f"{b['arena_bytes'] / MIB:.1f} MiB"]
        if b["programmatic_edges"]:
            lines.append(f"    programmatic edges: {b['programmatic_edges']} (into Nimble's "
                         "waiting kernels, built so at load)")
        if b["private_bytes"]:
            lines.append(f"    private copies of library memory: {_size(b['private_bytes'])}, "
                         "in the file")
        if b["zeroed_bytes"]:
            lines.append(f"    workspaces: {_size(b['zeroed_bytes'])}, zeroed at load (not in "
                         "the file)")
    lines.append(f"  kernels: {s['kernels']}")
    for lib in s["binaries"]["libraries"]:
        lines.append(f"    {lib['name']}: {lib['kernels']} kernels in {lib['containers']} "
                     f"fatbin container{'s' * (lib['containers'] != 1)}")
    e = s["binaries"]["embedded"]
    if e["images"]:
        lines.append(f"    embedded: {e['kernels']} kernels in {e['images']} "
                     f"image{'s' * (e['images'] != 1)}, {_image_bytes(e)}")
        if e["images"] > 1:
            for image in s["binaries"]["largest_images"]:
                lines.append(f"      {_image_bytes(image)}, {image['kernels']} "
                             f"kernel{'s' * (image['kernels'] != 1)} ({image['example'][:48]}"
                             f"), from {image['origin'] or 'the saving process'}")
    where = "included" if s["weights_included"] else "not included: load with model=..."
    lines.append(f"  weights: {s['weight_storages']} storages, {s['weight_bytes'] / MIB:.1f} "
                 f"MiB, {where}")
    if s["memory_bytes"]:
        lines.append(f"  external memory: {s['memory_bytes'] / MIB:.1f} MiB")
    if s["c_runtime"]:
        lines.append(f"  C runtime: {s['c_runtime']}")
    parts = sorted(s["contents"].items(), key=lambda kv: -kv[1])
    lines.append("  the file's bytes: " + ", ".join(
        f"{kind.replace('_', ' ')} {_size(n)}" for kind, n in parts if n))
    return "\n".join(lines) + "\n"
