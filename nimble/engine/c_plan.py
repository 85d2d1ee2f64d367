"""The saved graph as the C runtime reads it: one blob of little-endian 64-bit words.

The manifest is JSON, and the TaskGraph inside it gzipped JSON: more than a small C library
should parse.  So the saver also writes the *C plan* (manifest key ``c_plan``), everything the
C runtime (``nimble/c_runtime/``) needs, already resolved: every pointer of every node as a
*relocation* (a region and an addend), the edges, the arena layout, the inputs' and outputs'
places, the references of the proof at load.  A region is where an address lives in the loading
process:

======= ==========================================================================
NONE    no relocation: the addend is the value (a word that points nowhere Nimble knows)
ARENA   the instance's arena base (aligned to 512 bytes) plus the addend
WEIGHT  the address of weight storage ``index`` (the file's bytes) plus the addend
MEMORY  the address of external memory range ``index`` plus the addend
LOWBITS the instance's copy of low-bits buffer ``index`` (a buffer kept at its recorded
        low 32 address bits, :func:`~nimble.engine.arena_layout.low_word_buffers`: memory
        the loader maps at its recorded address plus a multiple of 4 GiB) plus the addend
======= ==========================================================================

The words are written and read in one fixed order (:class:`PlanWriter`, the C reader's
``plan_*`` functions, and ``tests/c_plan_reader.py``, which reads it back on the CPU):
``docs/c-host.md`` lists it.  Inference graphs only; a graph with a random generator is marked
unsupported (the C runtime refuses it with its reason).
"""
from __future__ import annotations

import math
import struct
from typing import Sequence

from ..analysis.programmatic import waiting_edges
from ..ir.alignment import ALIGNMENT
from ..ir.taskgraph import BufferKind, TaskKind
from .arena_layout import (StateLayout, low_word_buffers, low_word_outside, shared_state_buffers,
                           written_weights)

MAGIC = int.from_bytes(b"NIMBLECP", "little")
VERSION = 1
#: The first version of a plan whose buckets list their programmatic edges (after their
#: edges); no longer written (:data:`SERVED_EDGES_VERSION` is), read for the files that have it.
PROGRAMMATIC_VERSION = 2
#: The version of a plan whose buckets list their low-bits buffers (after their plan's size;
#: their programmatic edges as in version 2, none where none): only a file that has some.
LOW_BITS_VERSION = 3
#: The version of a plan (laid out as version 3) whose programmatic edges are each one a load
#: may build so: into one of Nimble's waiting kernels (:func:`served_edges`).  A plan of
#: version 2 or 3 may list the withdrawn rule's edges between Inductor's kernels, which the C
#: runtime never builds programmatic; every plan with programmatic edges is written so now.
SERVED_EDGES_VERSION = 4
NONE, ARENA, WEIGHT, MEMORY, LOWBITS = 0, 1, 2, 3, 4
KERNEL, MEMSET, MEMCPY, EMPTY = 0, 1, 2, 3
NO_BLOB = (1 << 64) - 1
#: Per dtype, its code as in the C header and its size in bytes (255: a dtype the header does
#: not name, its size 1).
DTYPES = {"float32": (0, 4), "float16": (1, 2), "bfloat16": (2, 2), "float64": (3, 8),
          "int64": (4, 8), "int32": (5, 4), "int16": (6, 2), "int8": (7, 1), "uint8": (8, 1),
          "bool": (9, 1)}
FINGERPRINT = ("MAX_THREADS_PER_BLOCK", "SHARED_SIZE_BYTES", "CONST_SIZE_BYTES",
               "LOCAL_SIZE_BYTES", "NUM_REGS", "BINARY_VERSION")
SETTABLE = ("MAX_DYNAMIC_SHARED_SIZE_BYTES", "NON_PORTABLE_CLUSTER_SIZE_ALLOWED",
            "CLUSTER_SCHEDULING_POLICY_PREFERENCE", "PREFERRED_SHARED_MEMORY_CARVEOUT")


class PlanWriter:
    """Words in order; strings and byte strings as their length, then their bytes padded to 8."""

    def __init__(self) -> None:
        self.words: list[int] = []

    def u(self, *values: int) -> None:
        for v in values:
            v = int(v)
            if v < 0:
                v += 1 << 64  # two's complement: the C side reads int64_t where signed
            if not 0 <= v < 1 << 64:
                raise ValueError(f"{v} does not fit 64 bits")
            self.words.append(v)

    def raw(self, data: bytes) -> None:
        data = bytes(data)
        self.u(len(data))
        padded = data + b"\0" * (-len(data) % 8)
        self.words.extend(struct.unpack(f"<{len(padded) // 8}Q", padded))

    def text(self, value: str) -> None:
        self.raw(value.encode())

    def blob(self, ref) -> None:
        """A blob reference (``[offset, size]`` of the blobs section; none: ``NO_BLOB, 0``)."""
        if ref is None:
            self.u(NO_BLOB, 0)
        else:
            self.u(int(ref[0]), int(ref[1]))

    def getvalue(self) -> bytes:
        return struct.pack(f"<{len(self.words)}Q", *self.words)


def weights_at_low_bits(graph, outside: dict, weights: Sequence[dict]
                        ) -> dict[int, tuple[int, int]]:
    """The weight storages of ``graph`` that a word which may be an integer points into
    (:func:`~nimble.engine.arena_layout.low_word_outside`) and that the C runtime can keep at
    their recorded low address bits as low-bits buffers of their own, their bytes the file's:
    those the graph only reads, whose bytes the file holds whole.  Per buffer, the blob of its
    first bytes."""
    written = set(written_weights(graph))
    found = {}
    for bid in low_word_outside(graph):
        source = outside.get(str(bid), {})
        if "weight" not in source or bid in written:
            continue
        row = weights[int(source["weight"])]
        blob, size = row.get("blob"), graph.buffers[bid].size
        if blob is not None and int(blob[1]) == int(row["size"]) >= size:
            found[bid] = (int(blob[0]), size)
    return found


class Regions:
    """Where each buffer of one bucket's graph lives in the loading process: ``(region,
    index, offset)``, or a reason it cannot be placed by the C runtime.  ``weights`` (the
    manifest's weight rows) lets the weights a word which may be an integer points into be
    low-bits buffers (:func:`weights_at_low_bits`)."""

    def __init__(self, prepared, state: StateLayout, outside: dict, low_start: int = 0,
                 weights: Sequence[dict] = ()) -> None:
        graph = prepared.graph
        self.places: dict[int, tuple[int, int, int]] = {}
        self.unsupported = ""
        for bid, offset in prepared.memplan.offsets.items():
            self.places[bid] = (ARENA, 0, offset)
        for bid, offset in state.private.items():
            self.places[bid] = (ARENA, 0, offset)
        for bid, source in outside.items():
            bid = int(bid)
            if "weight" in source:
                self.places[bid] = (WEIGHT, int(source["weight"]), 0)
            else:
                self.places[bid] = (MEMORY, int(source["memory"]), int(source["offset"]))
        #: The weight storages kept at their low address bits: their first bytes, the file's.
        self.weight_blobs = weights_at_low_bits(graph, outside, weights) if weights else {}
        #: The buffers kept at their low address bits, the plan's low-bits buffers
        #: ``low_start`` on.
        self.low = low_word_buffers(graph) + sorted(self.weight_blobs)
        for k, bid in enumerate(self.low):
            self.places[bid] = (LOWBITS, low_start + k, 0)
        if graph.meta.get("rng") or any(b.kind == BufferKind.RNG for b in graph.buffers):
            self.unsupported = "the graph draws random numbers"
        kept = [bid for bid in low_word_outside(graph)
                if str(bid) in outside and bid not in self.weight_blobs]
        if kept and not self.unsupported:
            self.unsupported = (f"a word that may be an integer points into the weights or "
                                f"external memory of buffer {kept[0]}, which the C runtime "
                                "cannot place at its recorded low address bits")

    def relocation(self, buffer: int, addend: int, value: int) -> tuple[int, int, int]:
        """``(region, index, addend)`` of a word that points ``addend`` bytes into
        ``buffer`` (recorded as ``value``)."""
        if buffer < 0:
            return NONE, 0, value
        place = self.places.get(buffer)
        if place is None:
            self.unsupported = self.unsupported or f"buffer {buffer} has no place"
            return NONE, 0, value
        region, index, offset = place
        return region, index, offset + addend


def _write_kernel_node(w: PlanWriter, task, row: dict, regions: Regions,
                       priority: int | None) -> None:
    w.u(KERNEL, int(row["kernel"]), *task.grid, *task.block, task.shared_mem)
    w.u(1 if priority is not None else 0, priority or 0)
    w.u(1 if task.fields.get("args") == "extra" else 0)
    w.u(len(task.param_layout))
    for offset, size in task.param_layout:
        w.u(offset, size)
    w.raw(task.params)
    w.u(len(task.pointers))
    for p in task.pointers:
        w.u(int(p.location), *regions.relocation(p.buffer, p.offset, p.value))
    attributes = row.get("attributes", {})
    w.u(len(attributes))
    for attr, value in sorted(attributes.items(), key=lambda kv: int(kv[0])):
        w.u(int(attr))
        w.raw(bytes.fromhex(value))


def _endpoint(task, fields: dict, name: str, location: str, regions: Regions
              ) -> tuple[int, int, int]:
    recorded = int(fields[name])
    for p in task.pointers:
        if p.location == location:
            return regions.relocation(p.buffer, p.offset + recorded - p.value, recorded)
    return NONE, 0, recorded


def _write_node(w: PlanWriter, task, row: dict, regions: Regions, priority) -> None:
    if task.kind == TaskKind.KERNEL:
        _write_kernel_node(w, task, row, regions, priority)
    elif task.kind == TaskKind.MEMSET:
        f = row["memset"]
        w.u(MEMSET, *_endpoint(task, f, "dst", "dst", regions))
        w.u(f["value"], f["elementSize"], f["width"], f["height"], f["pitch"])
    elif task.kind == TaskKind.MEMCPY:
        f = row["memcpy"]
        w.u(MEMCPY, *_endpoint(task, f, "srcDevice", "src", regions),
            *_endpoint(task, f, "dstDevice", "dst", regions))
        w.u(*(f[k] for k in ("srcMemoryType", "dstMemoryType",
                             "srcXInBytes", "srcY", "srcZ", "srcPitch", "srcHeight",
                             "dstXInBytes", "dstY", "dstZ", "dstPitch", "dstHeight",
                             "WidthInBytes", "Height", "Depth")))
    else:
        w.u(EMPTY)


def _write_tensor(w: PlanWriter, ref, regions: Regions) -> None:
    w.u(*regions.relocation(ref.buffer, ref.offset, 0))
    code, itemsize = DTYPES.get(ref.dtype, (255, 1))
    extent = 1 + sum((s - 1) * st for s, st in zip(ref.shape, ref.strides)) if all(ref.shape) \
        else 0
    w.u(max(extent, 0) * itemsize, code, len(ref.shape), *ref.shape)
    contiguous = extent == math.prod(ref.shape)
    w.u(1 if contiguous else 0)


def served_edges(prepared) -> list[tuple[int, int]]:
    """The edges of ``prepared``'s graph a plan lists programmatic: those it serves so that end
    in one of Nimble's waiting kernels, as a Python load builds them
    (:func:`nimble.analysis.programmatic.waiting_edges`)."""
    if not prepared.programmatic:
        return []
    edges = set(prepared.schedule.edges()) | set(prepared.late_edges)
    return sorted(waiting_edges(prepared.graph, set(prepared.programmatic) & edges))


def plan_version(preparations: Sequence, manifest: dict | None = None) -> int:
    """The plan version for ``preparations``: :data:`SERVED_EDGES_VERSION` where one of them
    serves programmatic edges (:func:`served_edges`), else :data:`LOW_BITS_VERSION` where one
    keeps a buffer at its low address bits (a weight storage of ``manifest``'s too), else
    :data:`VERSION`."""
    if any(served_edges(p) for p in preparations):
        return SERVED_EDGES_VERSION
    if any(low_word_buffers(p.graph) for p in preparations):
        return LOW_BITS_VERSION
    if manifest is not None and any(
            weights_at_low_bits(p.graph, row["outside"], manifest["weights"])
            for p, row in zip(preparations, manifest["buckets"])):
        return LOW_BITS_VERSION
    return VERSION


def _write_low_bits(w: PlanWriter, graph, state: StateLayout, private: dict,
                    regions: Regions) -> None:
    """Each low-bits buffer: its size, recorded address, whether the proof poisons it (an
    arena buffer: its bytes are the graph's own), and its first bytes (a private copy's, or a
    weight storage's from the file; none: zeroes)."""
    w.u(len(regions.low))
    for bid in regions.low:
        b = graph.buffers[bid]
        copied = bid in state.private and bid not in state.zeroed
        w.u(b.size, b.address, 1 if b.relocatable else 0)
        w.blob(regions.weight_blobs.get(bid) or (private.get(str(bid)) if copied else None))


def _write_bucket(w: PlanWriter, prepared, state: StateLayout, row: dict, version: int,
                  low_start: int, weights: Sequence[dict]) -> tuple[str, int]:
    """One bucket's words; (why the C runtime cannot run it, "" where it can; how many
    low-bits buffers it lists)."""
    graph = prepared.graph
    regions = Regions(prepared, state, row["outside"], low_start, weights)
    private = row["private"]
    w.u(prepared.memplan.arena_bytes)
    if version >= LOW_BITS_VERSION:  # before every place that may name one
        _write_low_bits(w, graph, state, private, regions)
    w.u(len(graph.inputs))
    for ref in graph.inputs:
        _write_tensor(w, ref, regions)
    w.u(len(graph.outputs))
    for ref in graph.outputs:
        _write_tensor(w, ref, regions)
    # a private copy kept at its low address bits is a low-bits buffer instead
    in_arena = sorted((bid, at) for bid, at in state.private.items() if bid not in regions.low)
    w.u(len(in_arena))
    for bid, offset in in_arena:
        w.u(offset, graph.buffers[bid].size)
        w.blob(None if bid in state.zeroed else private.get(str(bid)))
    priorities = prepared.priorities
    w.u(len(graph.tasks))
    for task, node_row in zip(graph.tasks, row["nodes"]):
        _write_node(w, task, node_row, regions,
                    priorities[task.id] if priorities is not None else None)
    edges = sorted(set(prepared.schedule.edges()) | set(prepared.late_edges))
    w.u(len(edges))
    for u, v in edges:
        w.u(u, v)
    if version >= PROGRAMMATIC_VERSION:
        served = served_edges(prepared)
        w.u(len(served))
        for u, v in served:
            w.u(u, v)
    _write_reference(w, row["reference"], prepared, regions)
    return regions.unsupported, len(regions.low)


def _write_reference(w: PlanWriter, reference: dict, prepared, regions: Regions) -> None:
    graph = prepared.graph
    spread = {int(i) for i in reference.get("spread", {})}
    w.u(len(reference["inputs"]))
    for inputs, outputs in zip(reference["inputs"], reference["outputs"]):
        for ref in inputs:
            w.blob(ref)
        for i, ref in enumerate(outputs):
            w.blob(ref)
            w.u(0 if i in spread else 1)  # 1: held bit for bit
    # memory and weights the graph writes: put back before each checked launch, as the
    # Python loader's proof does (nimble.engine.saving.restored_ranges)
    written = shared_state_buffers(graph) + written_weights(graph, prepared.step is not None)
    w.u(len(written))
    for bid in written:
        region, index, offset = regions.relocation(bid, 0, 0)
        w.u(region, index, offset, graph.buffers[bid].size)


def c_plan(manifest: dict, preparations: Sequence, states: Sequence[StateLayout],
           arena_size: int, unsupported: str = "") -> tuple[bytes, str]:
    """The C plan of a saved file (see the module docstring) and, where the C runtime cannot
    run it, why ("" where it can; ``unsupported`` says so from the start)."""
    w = PlanWriter()
    version = plan_version(preparations, manifest)
    w.u(MAGIC, version, manifest["arch"], manifest["driver"])
    w.u(arena_size, ALIGNMENT, manifest["instances"], len(preparations))
    w.u(len(manifest["binaries"]))
    for b in manifest["binaries"]:
        library = b["kind"] == "library"
        ref = (b["offset"], b["size"]) if library else b["blob"]
        w.u(0 if library else 1, int(ref[0]), int(ref[1]))
        w.raw(bytes.fromhex(b["sha256"]))
        w.text(b.get("path", "") if library else "")
    w.u(len(manifest["kernels"]))
    for k in manifest["kernels"]:
        w.u(k["binary"])
        w.text(k["name"])
        w.u(*(k["fingerprint"][n] for n in FINGERPRINT))
        w.u(*(k["attributes"].get(n, 0) for n in SETTABLE))
    for rows in (manifest["weights"], manifest["memory"]):
        w.u(len(rows))
        for r in rows:
            w.u(r["size"])
            w.blob(r.get("blob"))
    low = 0  # low-bits buffers so far: each bucket's are numbered on from the last's
    for prepared, state, row in zip(preparations, states, manifest["buckets"]):
        if prepared.step is not None:
            unsupported = unsupported or "a training step"
        why, listed = _write_bucket(w, prepared, state, row, version, low,
                                    manifest["weights"])
        unsupported, low = why or unsupported, low + listed
    w.text(unsupported)
    return w.getvalue(), unsupported
