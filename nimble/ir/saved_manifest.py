"""The manifest of a saved graph (``docs/saved-format.md``) checked whole before a load uses it.

:func:`check_manifest` reads every field of the manifest that the loader reads, for its type
(with :mod:`nimble.ir.json_fields`) and its range: every index names a row that exists, every
blob reference lies inside the blobs section and has the size its row says, every stored node
is of one known kind with the driver fields it needs
(:func:`nimble.ir.saved_graph_check.check_bucket_graph` then holds each bucket against its
decoded TaskGraph).

It refuses with one :class:`~nimble.errors.LoadError` naming the field (``buckets[0].nodes
[3].kernel is a string ('3'), not an integer``), before anything of the file is allocated, on
any machine: plain JSON, no torch, no driver.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from ..errors import LoadError
from . import json_fields as jf
from .taskgraph import TaskKind

#: The manifest's ``format``.
FORMAT_NAME = "nimble.saved-graph"
#: Where a kernel's binary comes from: a fatbin container of a library file, or the blobs.
BINARY_KINDS = ("library", "embedded")
#: How an embedded image may be stored besides as it is: ``lz4``, a fatbin container of one
#: LZ4-compressed ELF entry, which the driver unpacks (``nimble.record.fatbin_pack``).
PACKINGS = ("lz4",)
#: A stored memset's and memcpy's fields, as the driver's parameter structs name them
#: (:mod:`nimble.driver.stored`).
MEMSET_FIELDS = ("dst", "value", "elementSize", "width", "height", "pitch")
MEMCPY_FIELDS = tuple(f"{side}{name}" for side in ("src", "dst")
                      for name in ("XInBytes", "Y", "Z", "LOD", "MemoryType", "Device",
                                   "Pitch", "Height")) + ("WidthInBytes", "Height", "Depth")
#: ``CU_MEMORYTYPE_DEVICE`` and ``CU_MEMORYTYPE_UNIFIED``: a stored memcpy copies device memory.
DEVICE_MEMORY_TYPES = (2, 4)
#: The bytes of a launch attribute's value (``CUlaunchAttributeValue``).
LAUNCH_ATTRIBUTE_BYTES = 64
#: The kinds of stored node, each the key that holds it, and the task kind it stands for.
NODE_KINDS = {"kernel": TaskKind.KERNEL, "memset": TaskKind.MEMSET,
              "memcpy": TaskKind.MEMCPY, "empty": "other:CU_GRAPH_NODE_TYPE_EMPTY"}
SCHEDULE_KEYS = ("stream_of", "streams", "sync_edges", "reduced_edges", "width")
SCHEDULE_OPTIONAL = ("phases", "barrier_edges")
MEMPLAN_KEYS = ("offsets", "arena_bytes", "buffer_bytes", "lower_bound_bytes", "alignment")
BACKFILL_KEYS = ("phase", "anchor", "deferred", "moved", "idle_us", "work_us")
REQUIRED = ("format", "arch", "driver", "binaries", "kernels", "buckets")

Read = Callable[[Any, str], Any]


def _fail(where: str, what: str) -> jf.FieldError:
    return jf.FieldError(f"{where} {what}")


def damaged(path: str, e: jf.FieldError) -> LoadError:
    """The LoadError of the file at ``path`` for the field error ``e``."""
    return LoadError(f"{path}: {e}: the file is damaged, or not written by a Nimble this one "
                     "reads; save the model again")


def _at_least(low: int, what: str) -> Read:
    def read(value: Any, where: str) -> int:
        n = jf.integer(value, where)
        if n < low:
            raise _fail(where, f"is {n}, {what}")
        return n
    return read


_natural = _at_least(0, "a negative count or size")
_positive = _at_least(1, "not a positive integer")


def _int32(value: Any, where: str) -> int:
    """A driver's ``int`` (a function attribute, which the load sets or compares)."""
    n = jf.integer(value, where)
    if not -1 << 31 <= n < 1 << 31:
        raise _fail(where, f"is {n}, which does not fit in a 32-bit integer")
    return n


def _index(count: int, what: str) -> Read:
    """A reader of an index into ``count`` rows of ``what``."""
    def read(value: Any, where: str) -> int:
        i = jf.integer(value, where)
        if not 0 <= i < count:
            raise _fail(where, f"is {i}, but there are {count} {what}"
                        + (f" (0 to {count - 1})" if count else ""))
        return i
    return read


def _blob(blobs_size: int, size: int | None = None) -> Read:
    """A reader of a blob reference ``[offset, size]`` inside ``blobs_size`` bytes (of exactly
    ``size`` bytes where given)."""
    def read(value: Any, where: str) -> tuple[int, int]:
        row = jf.array(value, where, 2)
        offset, length = (jf.integer(v, f"{where}[{i}]") for i, v in enumerate(row))
        if offset < 0 or length < 0:
            raise _fail(where, f"is [{offset}, {length}], a blob reference with a negative "
                               "offset or size")
        if offset + length > blobs_size:
            raise _fail(where, f"is [{offset}, {length}], which runs past the {blobs_size}-byte "
                               "blobs section")
        if size is not None and length != size:
            raise _fail(where, f"is [{offset}, {length}]: {length} bytes for {size}")
        return offset, length
    return read


def _keyed(read: Read) -> Read:
    """A reader of an object keyed by ids written as decimal strings (``{"12": ...}``)."""
    def keyed(value: Any, where: str) -> dict[int, Any]:
        out = {}
        for key, item in jf.obj(value, where).items():
            if not re.fullmatch("[0-9]+", key):
                raise _fail(where, f"has a key {key!r}, which is not an id (a whole number)")
            out[int(key)] = read(item, f"{where}[{key!r}]")
        return out
    return keyed


def _only(row: dict, allowed: tuple[str, ...], where: str) -> None:
    for key in row:
        if key not in allowed:
            raise _fail(where, f"has a key {key!r} that this Nimble does not know")


def _list(read: Read, length: int | None = None) -> Read:
    """A reader of an array, each item read by ``read`` (of exactly ``length`` items)."""
    return lambda value, where: jf.items(value, where, read, length)


def _some(read: Read) -> Read:
    """A reader of a non-empty array, each item read by ``read``."""
    def some(value: Any, where: str) -> list:
        if not jf.array(value, where):
            raise _fail(where, "is an empty array")
        return jf.items(value, where, read)
    return some


def _hex(size: int, what: str) -> Read:
    """A reader of ``size`` bytes in hexadecimal (``what`` they are, for the message)."""
    def read(value: Any, where: str) -> str:
        text = jf.text(value, where)
        if not re.fullmatch(f"[0-9a-fA-F]{{{2 * size}}}", text):
            raise _fail(where, f"is not {what} ({size} bytes in hexadecimal)")
        return text
    return read


def _values(read: Read) -> Read:
    """A reader of an object of named values, each read by ``read``."""
    return lambda value, where: {k: read(v, f"{where}.{k}")
                                 for k, v in jf.obj(value, where).items()}


# ---- the rows shared by every bucket -------------------------------------------------------

def _binary(blobs_size: int, path: str) -> Read:
    def read(value: Any, where: str) -> None:
        row = jf.obj(value, where)
        kind = jf.member(row, "kind", where, jf.text)
        if kind not in BINARY_KINDS:
            raise LoadError(f"{path}: {where}.kind is {kind!r}, a kind of kernel binary this "
                            "Nimble does not know: load the file with the Nimble that saved it")
        jf.member(row, "sha256", where, _hex(32, "a SHA-256 digest"))
        if kind == "embedded":
            jf.member(row, "blob", where, _blob(blobs_size))
            jf.member(row, "origin", where, jf.text, "")
            packed = jf.member(row, "packed", where, _packing, None)
            # a packed image says its size unpacked
            jf.member(row, "image_size", where, _natural, None if packed is None else ...)
            return
        for key in ("path", "name"):
            jf.member(row, key, where, jf.text)
        file_size = jf.member(row, "file_size", where, _natural)
        offset = jf.member(row, "offset", where, _natural)
        if offset + jf.member(row, "size", where, _positive) > file_size:
            raise _fail(where, f"names bytes past the end of its {file_size}-byte library file")
    return read


def _packing(value: Any, where: str) -> str:
    packing = jf.text(value, where)
    if packing not in PACKINGS:
        raise _fail(where, f"is {packing!r}, not a packing this Nimble reads "
                           f"({', '.join(PACKINGS)})")
    return packing


def _kernel(binaries: int) -> Read:
    def read(value: Any, where: str) -> None:
        row = jf.obj(value, where)
        if not jf.member(row, "name", where, jf.text):
            raise _fail(f"{where}.name", "is empty")
        jf.member(row, "binary", where, _index(binaries, "binaries"))
        jf.member(row, "fingerprint", where, _values(_int32))
        jf.member(row, "layout", where, _list(_list(_natural, 2)), [])
        jf.member(row, "attributes", where, _values(_int32), {})
    return read


def _weight_name(size: int) -> Read:
    def read(value: Any, where: str) -> None:
        row = jf.obj(value, where)
        jf.member(row, "name", where, jf.text)
        if jf.member(row, "offset", where, _natural) > size:
            raise _fail(f"{where}.offset", f"lies past its {size}-byte storage")
        jf.member(row, "shape", where, _list(_natural))
        jf.member(row, "strides", where, _list(jf.integer))
        jf.member(row, "dtype", where, jf.text)
    return read


def _weight(blobs_size: int, included: bool) -> Read:
    def read(value: Any, where: str) -> int:
        row = jf.obj(value, where)
        size = jf.member(row, "size", where, _natural)
        jf.member(row, "names", where, _some(_weight_name(size)))
        blob = jf.member(row, "blob", where, jf.optional(_blob(blobs_size, size)), None)
        if blob is None and included:
            raise _fail(f"{where}.blob", "is null, but weights_included is true")
        return size
    return read


def _memory(blobs_size: int) -> Read:
    def read(value: Any, where: str) -> int:
        row = jf.obj(value, where)
        size = jf.member(row, "size", where, _natural)
        jf.member(row, "blob", where, _blob(blobs_size, size))
        return size
    return read


# ---- a bucket ------------------------------------------------------------------------------

def _driver_fields(names: tuple[str, ...]) -> Read:
    """A reader of a stored memset's or memcpy's fields: each a 64-bit unsigned integer."""
    def read(value: Any, where: str) -> None:
        row = jf.obj(value, where)
        for name in names:
            if jf.member(row, name, where, _natural) >= 1 << 64:
                raise _fail(f"{where}.{name}", "does not fit in 64 bits")
        if "elementSize" in row and row["elementSize"] not in (1, 2, 4):
            raise _fail(f"{where}.elementSize", f"is {row['elementSize']}, not 1, 2 or 4")
        for side in ("src", "dst"):
            kind = row.get(f"{side}MemoryType", DEVICE_MEMORY_TYPES[0])
            if kind not in DEVICE_MEMORY_TYPES:
                raise _fail(f"{where}.{side}MemoryType", f"is {kind}, not device memory "
                            f"({' or '.join(map(str, DEVICE_MEMORY_TYPES))})")
    return read


_attributes = _keyed(_hex(LAUNCH_ATTRIBUTE_BYTES, "a launch attribute's value"))


def _node(kernels: int) -> Read:
    """A reader of one stored node; returns its kind."""
    def read(value: Any, where: str) -> str:
        row = jf.obj(value, where)
        kinds = [k for k in NODE_KINDS if k in row]
        if len(kinds) != 1:
            raise _fail(where, f"holds {' and '.join(map(repr, kinds)) or 'none'} of the node "
                               f"kinds {', '.join(NODE_KINDS)}: exactly one is required")
        kind = kinds[0]
        if kind == "kernel":
            jf.member(row, "kernel", where, _index(kernels, "kernels"))
            jf.member(row, "attributes", where, _attributes, {})
        elif kind == "empty":
            if row["empty"] is not True:
                raise _fail(f"{where}.empty", f"is {jf.describe(row['empty'])}, not true")
        else:
            _driver_fields(MEMSET_FIELDS if kind == "memset" else MEMCPY_FIELDS)(
                row[kind], f"{where}.{kind}")
        return kind
    return read


def _schedule(n: int) -> Read:
    def read(value: Any, where: str) -> None:
        row = jf.obj(value, where)
        _only(row, SCHEDULE_KEYS + SCHEDULE_OPTIONAL, where)
        task = _index(n, "tasks in the bucket")
        edges = _list(_list(task, 2))
        streams = jf.member(row, "streams", where, _list(_list(task)))
        stream_of = jf.member(row, "stream_of", where, _list(_index(len(streams), "streams"), n))
        for s, tasks in enumerate(streams):
            for i, t in enumerate(tasks):
                if stream_of[t] != s:
                    raise _fail(f"{where}.streams[{s}][{i}]", f"is task {t}, which stream_of "
                                f"puts on stream {stream_of[t]}")
        listed = [t for tasks in streams for t in tasks]
        if len(listed) != n or len(set(listed)) != n:
            raise _fail(f"{where}.streams", f"do not hold each of the bucket's {n} tasks once")
        jf.member(row, "sync_edges", where, edges)
        jf.member(row, "reduced_edges", where, _natural)
        jf.member(row, "width", where, _natural)
        phases = jf.member(row, "phases", where, _list(_natural), [])
        if phases and sum(phases) != n:
            raise _fail(f"{where}.phases", f"count {sum(phases)} tasks for the bucket's {n}")
        jf.member(row, "barrier_edges", where, edges, [])
    return read


def _forward_edge(n: int) -> Read:
    """A reader of ``[u, v]``: two of the bucket's ``n`` tasks, ``u`` recorded before ``v``."""
    task = _list(_index(n, "tasks in the bucket"), 2)

    def read(value: Any, where: str) -> list:
        u, v = task(value, where)
        if not u < v:
            raise _fail(where, f"goes from task {u} back to task {v}")
        return [u, v]
    return read


def _memplan(value: Any, where: str) -> None:
    row = jf.obj(value, where)
    _only(row, MEMPLAN_KEYS, where)
    arena = jf.member(row, "arena_bytes", where, _natural)
    for bid, at in jf.member(row, "offsets", where, _keyed(_natural)).items():
        if at > arena:
            raise _fail(f"{where}.offsets['{bid}']", f"is {at}, past the {arena}-byte arena")
    jf.member(row, "buffer_bytes", where, _natural)
    jf.member(row, "lower_bound_bytes", where, _natural)
    jf.member(row, "alignment", where, _positive)


def _picked(n: int) -> Read:
    """A reader of one phase's backfill: what was timed and the late edges kept, if any."""
    task = _index(n, "tasks in the bucket")

    def kept(value: Any, where: str) -> None:
        row = jf.obj(value, where)
        _only(row, BACKFILL_KEYS, where)
        jf.member(row, "phase", where, _natural)
        jf.member(row, "anchor", where, task)
        jf.member(row, "deferred", where, _list(task))
        jf.member(row, "moved", where, _natural)
        jf.member(row, "idle_us", where, jf.number)
        jf.member(row, "work_us", where, jf.number)

    def read(value: Any, where: str) -> None:
        row = jf.obj(value, where)
        jf.member(row, "phase", where, _natural)
        jf.member(row, "plain_ms", where, jf.number)
        jf.member(row, "trial_ms", where, _list(jf.number))
        jf.member(row, "kept", where, jf.optional(kept))
    return read


def _source(weights: list[int], memory: list[int]) -> Read:
    """A reader of where one buffer outside the arena comes from; returns the bytes there."""
    def read(value: Any, where: str) -> int:
        row = jf.obj(value, where)
        if "weight" in row:
            return weights[jf.member(row, "weight", where, _index(len(weights),
                                                                  "weight storages"))]
        if "memory" not in row:
            raise _fail(where, "names neither a 'weight' nor a 'memory'")
        i = jf.member(row, "memory", where, _index(len(memory), "memory ranges"))
        offset = jf.member(row, "offset", where, _natural)
        if offset > memory[i]:
            raise _fail(f"{where}.offset", f"is {offset}, past the {memory[i]} bytes of "
                                           f"memory[{i}]")
        return memory[i] - offset
    return read


def _reference(blobs_size: int) -> Read:
    def read(value: Any, where: str) -> None:
        row = jf.obj(value, where)
        sets = _some(_list(_blob(blobs_size)))
        inputs = jf.member(row, "inputs", where, sets)
        outputs = jf.member(row, "outputs", where, sets)
        if len(outputs) != len(inputs):
            raise _fail(f"{where}.outputs", f"has {len(outputs)} sets for {len(inputs)} input "
                                            "sets")
        jf.member(row, "spread", where, _keyed(jf.number))
        jf.member(row, "gradients", where, _list(_natural), [])
    return read


def _step(value: Any, where: str) -> None:
    """A training step's autograd layout (its indices against the graph: saved_graph_check)."""
    row = jf.obj(value, where)
    for key in ("forward_inputs", "forward_outputs"):
        jf.member(row, key, where, _natural)
    for key in ("differentiable", "inputs_with_grad"):
        jf.member(row, key, where, _list(_natural))
    jf.member(row, "grad_output_of", where, _list(_at_least(-1, "neither an output nor -1")))
    jf.member(row, "param_names", where, _list(jf.text))


def _bucket(manifest: dict, blobs_size: int, weights: list[int], memory: list[int]) -> Read:
    kernels = len(manifest["kernels"])

    def read(value: Any, where: str) -> None:
        row = jf.obj(value, where)
        jf.member(row, "graph", where, _blob(blobs_size))
        n = len(jf.member(row, "nodes", where, _list(_node(kernels))))
        jf.member(row, "schedule", where, _schedule(n))
        jf.member(row, "memplan", where, _memplan)
        jf.member(row, "priorities", where,
                  jf.optional(_list(jf.integer, n)), None)
        jf.member(row, "backfill", where, _list(_picked(n)), [])
        jf.member(row, "device_launch", where, _list(jf.flag), [])
        jf.member(row, "programmatic", where, _list(_forward_edge(n)), [])
        jf.member(row, "gather_inputs", where, jf.flag, True)
        jf.member(row, "output_spec", where, jf.optional(jf.text), None)
        jf.member(row, "outside", where, _keyed(_source(weights, memory)))
        # null: a workspace's copy, stored without bytes (it starts zeroed at load)
        jf.member(row, "private", where, _keyed(jf.optional(_blob(blobs_size))))
        jf.member(row, "reference", where, _reference(blobs_size))
        jf.member(row, "step", where, jf.optional(_step), None)
        jf.member(row, "prepare_seconds", where, _values(jf.number), {})
    return read


# ---- several graphs in one file (a Generator's steps) ---------------------------------------

def _graphs(buckets: int) -> Read:
    """A reader of ``graphs``: each a name, its buckets' indices, instances and pad, every
    bucket in exactly one graph, every name once."""
    def graph(value: Any, where: str) -> dict:
        row = jf.obj(value, where)
        _only(row, ("name", "buckets", "instances", "pad"), where)
        jf.member(row, "name", where, jf.text)
        jf.member(row, "buckets", where, _some(_index(buckets, "bucket")))
        jf.member(row, "instances", where, _positive, 1)
        jf.member(row, "pad", where, jf.flag, False)
        return row

    def graphs(value: Any, where: str) -> list:
        rows = _some(graph)(value, where)
        owned = sorted(b for row in rows for b in row["buckets"])
        if owned != list(range(buckets)):
            raise _fail(where, f"hold buckets {owned}, not each of the {buckets} once")
        names = [row["name"] for row in rows]
        if len(set(names)) != len(names):
            raise _fail(where, "name a graph twice")
        return rows
    return graphs


def _generator(names: set[str]) -> Read:
    """A reader of ``generator``: a Generator's limits, and per batch size its two graphs."""
    def read(value: Any, where: str) -> dict:
        row = jf.obj(value, where)
        jf.member(row, "max_cache_len", where, _positive)
        jf.member(row, "prompt_buckets", where, _some(_positive))
        batches = jf.member(row, "batch_sizes", where, _some(_positive))
        jf.member(row, "pad_id", where, jf.integer, 0)
        steps = jf.member(row, "steps", where, jf.obj)
        for batch in batches:
            pair = jf.member(steps, str(batch), f"{where}.steps", jf.obj)
            for role in ("prefill", "decode"):
                name = jf.member(pair, role, f"{where}.steps.{batch}", jf.text)
                if name not in names:
                    raise _fail(f"{where}.steps.{batch}.{role}", f"names no graph ({name!r})")
        return row
    return read


def _ranks(value: Any, where: str) -> dict:
    """``peer_sums``: the rank that saved a graph summing over the ranks, and their count."""
    row = jf.obj(value, where)
    ranks = jf.member(row, "ranks", where, _positive)
    rank = jf.member(row, "rank", where, _natural)
    if rank >= ranks:
        raise _fail(f"{where}.rank", f"is {rank}, not below ranks ({ranks})")
    return row


# ---- the whole manifest --------------------------------------------------------------------

def _check(m: dict, blobs_size: int, path: str) -> None:
    for key in REQUIRED:
        if key not in m:
            raise jf.FieldError(f"the manifest has no {key!r}")
    fmt = m["format"]
    if fmt != FORMAT_NAME:
        raise LoadError(f"{path} is not a saved Nimble graph (its manifest's format is "
                        f"{fmt!r}, not {FORMAT_NAME!r})")
    for key in ("nimble", "torch", "device"):
        jf.member(m, key, "", jf.text, "")
    jf.member(m, "arch", "", _positive)
    jf.member(m, "driver", "", _natural)
    jf.member(m, "pad", "", jf.flag, False)
    jf.member(m, "instances", "", _positive, 1)
    included = jf.member(m, "weights_included", "", jf.flag, True)
    binaries = jf.member(m, "binaries", "", _list(_binary(blobs_size, path)))
    jf.member(m, "kernels", "", _list(_kernel(len(binaries))))
    weights = jf.member(m, "weights", "", _list(_weight(blobs_size, included)), [])
    memory = jf.member(m, "memory", "", _list(_memory(blobs_size)), [])
    buckets = jf.member(m, "buckets", "", _some(_bucket(m, blobs_size, weights, memory)))
    graphs = jf.member(m, "graphs", "", jf.optional(_graphs(len(buckets))), None)
    names = {g["name"] for g in graphs} if graphs else set()
    jf.member(m, "generator", "", jf.optional(_generator(names)), None)
    jf.member(m, "peer_sums", "", jf.optional(_ranks), None)


def graph_rows(manifest: dict) -> list[dict]:
    """The servings of a checked manifest: its ``graphs``, or one of every bucket."""
    return manifest.get("graphs") or [
        {"name": "model", "buckets": list(range(len(manifest["buckets"]))),
         "instances": manifest.get("instances", 1), "pad": manifest.get("pad", False)}]


def check_manifest(manifest: Any, blobs_size: int, path: str = "the file") -> None:
    """Raise :class:`LoadError` naming the first field of ``manifest`` (a saved file's, with a
    blobs section of ``blobs_size`` bytes) of the wrong type or out of range (see the module
    docstring); ``path`` names the file in the message."""
    try:
        _check(jf.obj(manifest, "the manifest"), blobs_size, path)
    except jf.FieldError as e:
        raise damaged(path, e) from None
