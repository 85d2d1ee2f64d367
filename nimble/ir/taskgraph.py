"""The TaskGraph IR: a model's recorded GPU work as plain data.

A TaskGraph holds no CUDA handles and imports nothing from CUDA, so a recording made on a GPU
machine can be saved, loaded and analysed anywhere.  The format is documented in
``docs/taskgraph-format.md``.

Vocabulary:

* a **buffer** is one allocation (not one address): two allocations that the caching allocator put
  at the same address are two buffers;
* an **access** is a byte range of one buffer that a task reads, or reads and writes;
* a **task** is one node of the recorded CUDA graph (a kernel, a memcpy or a memset), attributed to
  the ATen **op** that created it and the module that ran the op.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

from . import json_fields as jf

FORMAT_NAME = "nimble.taskgraph"
FORMAT_VERSION = 1


class TaskKind:
    """Kinds of task; a node of any other CUDA graph node type is recorded as ``other:<TYPE>``."""

    KERNEL = "kernel"
    MEMCPY = "memcpy"
    MEMSET = "memset"
    # Event nodes of an event outside the graph (NCCL orders a communicator's launches in and
    # out of graphs with them): kept with the collectives, in recorded order.
    EVENT_RECORD = "other:CU_GRAPH_NODE_TYPE_EVENT_RECORD"
    EVENT_WAIT = "other:CU_GRAPH_NODE_TYPE_WAIT_EVENT"
    EVENTS = (EVENT_RECORD, EVENT_WAIT)


class BufferKind:
    """What a buffer holds; decides whether the memory planner may move it."""

    PARAM = "param"  # module parameters and registered buffers: stay where the model has them
    INPUT = "input"  # the recorded input tensors: get a slot in the arena
    OUTPUT = "output"  # allocations whose tensors the forward returns: live until the end
    INTERMEDIATE = "intermediate"  # every other tensor an op allocated during recording
    SCRATCH = "scratch"  # an op-private workspace no tensor names (one buffer per op using it)
    EXTERNAL = "external"  # memory allocated before recording that no known tensor names
    # A random generator's seed or offset cell (8 bytes) that captured RNG kernels read; the
    # engine gives each graph its own cells and writes them before every launch.
    RNG = "rng"

    RELOCATABLE = frozenset({INPUT, OUTPUT, INTERMEDIATE, SCRATCH})
    ALL = (PARAM, INPUT, OUTPUT, INTERMEDIATE, SCRATCH, EXTERNAL, RNG)


#: Name prefix of an external buffer that the caching allocator never handed out: memory a
#: library allocated for itself (cuDNN's batch-norm scratch), found from a kernel's pointer.
LIBRARY_MEMORY = "device allocation@"


@dataclass(slots=True)
class Buffer:
    """One allocation.  ``address`` is where it lived during recording."""

    id: int
    kind: str
    size: int
    address: int
    name: str = ""
    op: int = -1  # the op that allocated it (or, for scratch, the op that uses it); -1 if none

    @property
    def relocatable(self) -> bool:
        return self.kind in BufferKind.RELOCATABLE


@dataclass(slots=True)
class Access:
    """Bytes ``[offset, offset + size)`` of buffer ``buffer``; ``write`` means read-write."""

    buffer: int
    offset: int
    size: int
    write: bool

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(slots=True)
class Pointer:
    """A device address found in a task's parameters.

    For kernels ``location`` is the byte offset of the 8-byte word in the parameter block; for
    memcpy/memset nodes it names the field (``dst``, ``src``).  ``buffer`` is -1 when the address
    resolved to no buffer (an *unresolved* pointer: reported, never ignored).
    """

    location: int | str
    value: int
    buffer: int
    offset: int


@dataclass(slots=True)
class Op:
    """One ATen operator call seen by the recorder, with the byte ranges its schema says it touches."""

    index: int
    name: str
    module: str = ""
    accesses: list[Access] = field(default_factory=list)


@dataclass(slots=True)
class Task:
    """One node of the recorded graph.

    ``params`` is the kernel's parameter block laid out as the kernel sees it (each parameter at its
    offset, ``param_layout`` listing ``(offset, size)`` per parameter).  ``fields`` holds the
    decoded parameters of memcpy/memset nodes (and the node type of ``other:`` tasks).
    """

    id: int
    kind: str
    op: int = -1
    name: str = ""
    short_name: str = ""
    grid: tuple[int, int, int] = (1, 1, 1)
    block: tuple[int, int, int] = (1, 1, 1)
    shared_mem: int = 0
    param_layout: list[tuple[int, int]] = field(default_factory=list)
    params: bytes = b""
    pointers: list[Pointer] = field(default_factory=list)
    accesses: list[Access] = field(default_factory=list)
    fields: dict = field(default_factory=dict)
    duration_us: float | None = None


@dataclass(slots=True)
class TensorRef:
    """A tensor living in a buffer: the graph's inputs and outputs."""

    buffer: int
    offset: int  # bytes from the buffer's start
    shape: list[int]
    strides: list[int]  # in elements
    dtype: str  # torch dtype name without the ``torch.`` prefix, e.g. ``float32``


@dataclass(slots=True)
class TaskGraph:
    """A recorded model: tasks in recorded order, buffers, ops, and the graph's inputs and outputs."""

    tasks: list[Task] = field(default_factory=list)
    buffers: list[Buffer] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    inputs: list[TensorRef] = field(default_factory=list)
    outputs: list[TensorRef] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    # ---- queries ---------------------------------------------------------------------------
    def kernel_tasks(self) -> list[Task]:
        return [t for t in self.tasks if t.kind == TaskKind.KERNEL]

    def unresolved_pointers(self) -> list[tuple[int, Pointer]]:
        """``(task id, pointer)`` for every pointer that resolved to no buffer."""
        return [(t.id, p) for t in self.tasks for p in t.pointers if p.buffer < 0]

    def op_of(self, task: Task) -> Op | None:
        return self.ops[task.op] if 0 <= task.op < len(self.ops) else None

    def validate(self) -> None:
        """Raise ``ValueError`` if ids are not dense or an access leaves its buffer."""
        for i, t in enumerate(self.tasks):
            if t.id != i:
                raise ValueError(f"task at position {i} has id {t.id}")
        for i, b in enumerate(self.buffers):
            if b.id != i:
                raise ValueError(f"buffer at position {i} has id {b.id}")
            if b.kind not in BufferKind.ALL:
                raise ValueError(f"buffer {i} has unknown kind {b.kind!r}")
        for t in self.tasks:
            for a in t.accesses:
                _check_access(a, self.buffers, f"task {t.id}")
        for o in self.ops:
            for a in o.accesses:
                _check_access(a, self.buffers, f"op {o.index}")
        self._validate_phases()

    def _validate_phases(self) -> None:
        """``meta``'s phases (a training step's forward and backward): counts of tasks, inputs
        and outputs that add up to the graph's; buffers it names that exist."""
        phases = self.meta.get("phases")
        if phases:
            for key, what, total in (("phases", "tasks", len(self.tasks)),
                                     ("phase_inputs", "inputs", len(self.inputs)),
                                     ("phase_outputs", "outputs", len(self.outputs))):
                counts = self.meta.get(key, phases if key == "phases" else None)
                if counts is not None and (len(counts) != len(phases) or min(counts) < 0
                                           or sum(counts) != total):
                    raise ValueError(f"meta.{key} {counts} does not split the graph's {total} "
                                     f"{what} into {len(phases)} phases")
        for b in self.meta.get("low_word_buffers", []):
            if not 0 <= b < len(self.buffers):
                raise ValueError(f"meta.low_word_buffers names buffer {b}, which does not exist")
        for u, v in self.meta.get("programmatic_edges", []):
            if not 0 <= u < v < len(self.tasks):
                raise ValueError(f"meta.programmatic_edges holds [{u}, {v}]: an edge runs from an "
                                 f"earlier task to a later one of the graph's {len(self.tasks)}")

    # ---- serialisation ---------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "meta": self.meta,
            "buffers": [[b.id, b.kind, b.size, b.address, b.name, b.op] for b in self.buffers],
            "ops": [
                {"index": o.index, "name": o.name, "module": o.module,
                 "accesses": [_access_row(a) for a in o.accesses]}
                for o in self.ops
            ],
            "tasks": [_task_json(t) for t in self.tasks],
            "inputs": [_tensor_json(r) for r in self.inputs],
            "outputs": [_tensor_json(r) for r in self.outputs],
        }

    @classmethod
    def from_json(cls, data: dict) -> "TaskGraph":
        """The graph in a TaskGraph file's JSON object: every field checked for its type as it
        is read (:class:`~nimble.ir.json_fields.FieldError`, a ``ValueError``, names the first
        that is wrong), then :meth:`validate`-d."""
        data = jf.obj(data, "the file's JSON")
        if data.get("format") != FORMAT_NAME:
            raise ValueError(f"not a Nimble TaskGraph (format={data.get('format')!r})")
        version = data.get("version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"TaskGraph format version {version} is not supported (this Nimble reads "
                f"version {FORMAT_VERSION}); re-record the model with tools/record_fixture.py")
        top = ""  # the path of the top level
        g = cls(meta=jf.member(data, "meta", top, _meta_from_json, {}))
        g.buffers = jf.member(data, "buffers", top, _rows(_buffer_from_json))
        g.ops = jf.member(data, "ops", top, _rows(_op_from_json))
        g.tasks = jf.member(data, "tasks", top, _rows(_task_from_json))
        g.inputs = jf.member(data, "inputs", top, _rows(_tensor_from_json), [])
        g.outputs = jf.member(data, "outputs", top, _rows(_tensor_from_json), [])
        g.validate()
        return g

    def save(self, path: str | Path) -> Path:
        """Write gzip-compressed JSON (``.json.gz``) or plain JSON (any other suffix)."""
        path = Path(path)
        text = json.dumps(self.to_json(), separators=(",", ":"))
        if path.suffix == ".gz":
            with gzip.open(path, "wt", encoding="utf-8", compresslevel=9) as f:
                f.write(text)
        else:
            path.write_text(text, encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "TaskGraph":
        path = Path(path)
        with open(path, "rb") as f:
            magic = f.read(2)
        opener = gzip.open if magic == b"\x1f\x8b" else open
        with opener(path, "rt", encoding="utf-8") as f:
            return cls.from_json(json.load(f))


def _check_access(a: Access, buffers: list[Buffer], where: str) -> None:
    if not 0 <= a.buffer < len(buffers):
        raise ValueError(f"{where}: access names buffer {a.buffer}, which does not exist")
    b = buffers[a.buffer]
    if a.offset < 0 or a.size < 0 or a.end > b.size:
        raise ValueError(
            f"{where}: access [{a.offset}, {a.end}) leaves buffer {b.id} of {b.size} bytes")


def _access_row(a: Access) -> list:
    return [a.buffer, a.offset, a.size, a.write]


def _tensor_json(r: TensorRef) -> dict:
    return {"buffer": r.buffer, "offset": r.offset, "shape": list(r.shape),
            "strides": list(r.strides), "dtype": r.dtype}


def _task_json(t: Task) -> dict:
    d = {"id": t.id, "kind": t.kind, "op": t.op}
    if t.kind == TaskKind.KERNEL:
        d.update(name=t.name, short_name=t.short_name, grid=list(t.grid), block=list(t.block),
                 shared_mem=t.shared_mem, param_layout=[list(p) for p in t.param_layout],
                 params=t.params.hex())
    d["pointers"] = [[p.location, p.value, p.buffer, p.offset] for p in t.pointers]
    d["accesses"] = [_access_row(a) for a in t.accesses]
    if t.fields:
        d["fields"] = t.fields
    if t.duration_us is not None:
        d["duration_us"] = t.duration_us
    return d


# ---- reading, every field checked for its type (nimble.ir.json_fields) ---------------------

def _rows(read):
    """A reader of an array, each item read by ``read(item, where)``."""
    return lambda value, where: jf.items(value, where, read)


# The readers below first try the exact types json.loads makes (``type(v) is int`` leaves out
# bool, as :func:`jf.integer` does) over a whole array at once; only an array with something
# else in it is read item by item, which names the first wrong field.  The two agree on every
# value both accept: the fast one is the slow one without building each item's path.

_JUST_INT = {int}


def _ints(value, where: str, length: int | None = None) -> list[int]:
    if type(value) is list and (length is None or len(value) == length) and \
            (not value or set(map(type, value)) == _JUST_INT):
        return list(value)
    return jf.items(value, where, jf.integer, length)


def _int_pairs(value, where: str) -> list[list[int]]:
    return jf.items(value, where, lambda row, w: _ints(row, w, 2))


def _dim3(value, where: str) -> tuple[int, int, int]:
    return tuple(_ints(value, where, 3))


def _access_from_json(row, where: str) -> Access:
    row = jf.array(row, where, 4)
    return Access(jf.integer(row[0], f"{where}[0]"), jf.integer(row[1], f"{where}[1]"),
                  jf.integer(row[2], f"{where}[2]"), jf.flag(row[3], f"{where}[3]"))


def _plain_access(row) -> bool:
    return type(row) is list and len(row) == 4 and type(row[0]) is int and \
        type(row[1]) is int and type(row[2]) is int and type(row[3]) is bool


def _accesses(value, where: str) -> list[Access]:
    if type(value) is list and all(_plain_access(row) for row in value):
        return [Access(*row) for row in value]
    return jf.items(value, where, _access_from_json)


def _pointer_from_json(row, where: str) -> Pointer:
    """``[location, value, buffer, offset]``; a kernel's location is a byte offset, a memcpy's
    or memset's the name of its field."""
    row = jf.array(row, where, 4)
    location = row[0] if isinstance(row[0], str) else jf.integer(row[0], f"{where}[0]")
    return Pointer(location, jf.integer(row[1], f"{where}[1]"),
                   jf.integer(row[2], f"{where}[2]"), jf.integer(row[3], f"{where}[3]"))


def _plain_pointer(row) -> bool:
    return type(row) is list and len(row) == 4 and type(row[0]) in (int, str) and \
        type(row[1]) is int and type(row[2]) is int and type(row[3]) is int


def _pointers(value, where: str) -> list[Pointer]:
    if type(value) is list and all(_plain_pointer(row) for row in value):
        return [Pointer(*row) for row in value]
    return jf.items(value, where, _pointer_from_json)


def _plain_buffer(row) -> bool:
    n = len(row) if type(row) is list else 0
    return 4 <= n <= 6 and type(row[0]) is int and type(row[1]) is str and \
        type(row[2]) is int and type(row[3]) is int and (n < 5 or type(row[4]) is str) and \
        (n < 6 or type(row[5]) is int)


def _buffer_from_json(row, where: str) -> Buffer:
    """``[id, kind, size, address, name, op]`` (``name`` and ``op`` may be left off)."""
    if _plain_buffer(row):
        return Buffer(*row)
    row = jf.array(row, where, (4, 6))
    read = (jf.integer, jf.text, jf.integer, jf.integer, jf.text, jf.integer)
    return Buffer(*(r(v, f"{where}[{i}]") for i, (r, v) in enumerate(zip(read, row))))


def _op_from_json(d, where: str) -> Op:
    d = jf.obj(d, where)
    return Op(jf.member(d, "index", where, jf.integer), jf.member(d, "name", where, jf.text),
              jf.member(d, "module", where, jf.text, ""),
              jf.member(d, "accesses", where, _accesses, []))


def _tensor_from_json(d, where: str) -> TensorRef:
    d = jf.obj(d, where)
    return TensorRef(buffer=jf.member(d, "buffer", where, jf.integer),
                     offset=jf.member(d, "offset", where, jf.integer),
                     shape=jf.member(d, "shape", where, _ints),
                     strides=jf.member(d, "strides", where, _ints),
                     dtype=jf.member(d, "dtype", where, jf.text))


def _params(value, where: str) -> bytes:
    hex_text = jf.text(value, where)
    try:
        return bytes.fromhex(hex_text)
    except ValueError:
        raise jf.FieldError(f"{where} is not bytes in hexadecimal") from None


def _scalars(value, where: str) -> dict:
    """An object of leaf values (a memcpy's or memset's decoded parameters)."""
    return {k: jf.scalar(v, f"{where}.{k}") for k, v in jf.obj(value, where).items()}


_SCALAR_TYPES = frozenset({str, int, float, bool, type(None)})


def _plain_dim3(d: dict, key: str):
    """``d[key]`` as a launch dimension where it is three ints, (1, 1, 1) where absent, else
    None (the slow reader names what is wrong)."""
    if key not in d:
        return (1, 1, 1)
    value = d[key]
    if type(value) is list and len(value) == 3 and set(map(type, value)) == _JUST_INT:
        return tuple(value)
    return None


def _plain_task(d) -> Task | None:
    """The task of a row whose every field has the exact type json.loads makes, read without
    building each field's path; None for any other row, which :func:`_task_from_json` then
    reads field by field, naming the first wrong one."""
    if type(d) is not dict:
        return None
    get = d.get
    tid, kind, op = get("id"), get("kind"), get("op", -1)
    name, short, shared = get("name", ""), get("short_name", ""), get("shared_mem", 0)
    if type(tid) is not int or type(kind) is not str or type(op) is not int or \
            type(name) is not str or type(short) is not str or type(shared) is not int:
        return None
    grid, block = _plain_dim3(d, "grid"), _plain_dim3(d, "block")
    layout, params = get("param_layout", []), get("params", "")
    pointers, accesses = get("pointers", []), get("accesses", [])
    fields, duration = get("fields", {}), get("duration_us")
    if grid is None or block is None or type(params) is not str or \
            type(layout) is not list or not all(
                type(p) is list and len(p) == 2 and type(p[0]) is int and type(p[1]) is int
                for p in layout) or \
            type(pointers) is not list or not all(map(_plain_pointer, pointers)) or \
            type(accesses) is not list or not all(map(_plain_access, accesses)) or \
            type(fields) is not dict or not all(type(v) in _SCALAR_TYPES
                                                for v in fields.values()) or \
            not (duration is None or type(duration) in (int, float)):
        return None
    try:
        raw = bytes.fromhex(params)
    except ValueError:
        return None
    return Task(tid, kind, op, name, short, grid, block, shared, [tuple(p) for p in layout],
                raw, [Pointer(*row) for row in pointers], [Access(*row) for row in accesses],
                dict(fields), duration)


def _task_from_json(d, where: str) -> Task:
    plain = _plain_task(d)
    return plain if plain is not None else _task_fields(d, where)


def _task_fields(d, where: str) -> Task:
    """A task read field by field, each checked for its type (a wrong one named by its path)."""
    d = jf.obj(d, where)

    def get(key: str, read, default=...):
        return jf.member(d, key, where, read, default)
    return Task(
        id=get("id", jf.integer), kind=get("kind", jf.text), op=get("op", jf.integer, -1),
        name=get("name", jf.text, ""), short_name=get("short_name", jf.text, ""),
        grid=get("grid", _dim3, (1, 1, 1)), block=get("block", _dim3, (1, 1, 1)),
        shared_mem=get("shared_mem", jf.integer, 0),
        param_layout=[tuple(p) for p in get("param_layout", _int_pairs, [])],
        params=get("params", _params, b""),
        pointers=get("pointers", _pointers, []),
        accesses=get("accesses", _accesses, []),
        fields=get("fields", _scalars, {}),
        duration_us=get("duration_us", jf.optional(jf.number), None),
    )


#: The fields of ``meta`` that Nimble reads back, each with its reader; any other is kept as
#: it is (a note of the recording's, only shown).
_META = {"model": jf.optional(jf.text), "training": jf.flag, "batch": jf.integer, "pool_bytes": jf.integer,
         "phases": _ints, "phase_inputs": _ints, "phase_outputs": _ints,
         "low_word_buffers": _ints, "pool_segments": _int_pairs, "rng": jf.obj,
         "triton_launches": jf.integer, "words_not_pointers": jf.integer,
         "programmatic_edges": _int_pairs}


def _meta_from_json(value, where: str) -> dict:
    meta = dict(jf.obj(value, where))
    for key, read in _META.items():
        if key in meta:
            meta[key] = read(meta[key], f"{where}.{key}")
    return meta
