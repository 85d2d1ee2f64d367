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
        if data.get("format") != FORMAT_NAME:
            raise ValueError(f"not a Nimble TaskGraph (format={data.get('format')!r})")
        version = data.get("version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"TaskGraph format version {version} is not supported (this Nimble reads "
                f"version {FORMAT_VERSION}); re-record the model with tools/record_fixture.py")
        g = cls(meta=dict(data.get("meta", {})))
        g.buffers = [Buffer(*row) for row in data["buffers"]]
        g.ops = [Op(o["index"], o["name"], o.get("module", ""),
                    [Access(*a) for a in o.get("accesses", [])]) for o in data["ops"]]
        g.tasks = [_task_from_json(t) for t in data["tasks"]]
        g.inputs = [TensorRef(**r) for r in data.get("inputs", [])]
        g.outputs = [TensorRef(**r) for r in data.get("outputs", [])]
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


def _task_from_json(d: dict) -> Task:
    return Task(
        id=d["id"], kind=d["kind"], op=d.get("op", -1), name=d.get("name", ""),
        short_name=d.get("short_name", ""), grid=tuple(d.get("grid", (1, 1, 1))),
        block=tuple(d.get("block", (1, 1, 1))), shared_mem=d.get("shared_mem", 0),
        param_layout=[tuple(p) for p in d.get("param_layout", [])],
        params=bytes.fromhex(d.get("params", "")),
        pointers=[Pointer(*p) for p in d.get("pointers", [])],
        accesses=[Access(*a) for a in d.get("accesses", [])],
        fields=dict(d.get("fields", {})), duration_us=d.get("duration_us"),
    )
