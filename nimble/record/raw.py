"""What a capture hands the resolver: traced ops with their byte spans, the allocation history,
decoded graph nodes, and the memory that existed before (:class:`RawCapture`).

Plain data, no GPU: :mod:`nimble.record.capture`, :mod:`nimble.record.tracer` and
:mod:`nimble.record.decode` fill it in on the GPU machine;
:func:`nimble.record.resolve.build_taskgraph` turns it into a TaskGraph anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir.taskgraph import BufferKind


@dataclass(slots=True)
class TensorSpan:
    """Absolute bytes ``[start, start + size)`` an op reads (or writes, if ``write``)."""

    start: int
    size: int
    write: bool
    element: int = 1  # the tensor's element size: a kernel points at whole elements


@dataclass(slots=True)
class OpRecord:
    """One traced ATen op: its node window, allocation window and byte spans."""

    name: str
    module: str
    node_begin: int
    node_end: int
    alloc_begin: int
    alloc_end: int
    spans: list[TensorSpan] = field(default_factory=list)


@dataclass(slots=True)
class AllocEvent:
    """One allocation during capture; ``ordinal`` is the allocator's allocation counter.

    ``freed_at`` is the allocation counter when the block was freed during capture (how many
    allocations had been made by then), or None if it was still allocated at the end.
    """

    ordinal: int
    address: int
    size: int
    freed_at: int | None = None


@dataclass(slots=True)
class DeviceRange:
    """Device memory not allocated during capture: a parameter, an input, or other memory."""

    address: int
    size: int
    name: str = ""
    kind: str = BufferKind.EXTERNAL

    @property
    def end(self) -> int:
        return self.address + self.size

    def overlaps(self, other: "DeviceRange") -> bool:
        """Whether the two ranges share a byte."""
        return self.address < other.end and other.address < self.end


@dataclass(slots=True)
class RawNode:
    """A decoded graph node.  ``pointers``: ``(location, value)`` of device addresses in its
    parameters; ``ranges``: ``(location, start, size, write)`` exact ranges of memcpy/memset."""

    kind: str
    name: str = ""
    short_name: str = ""
    grid: tuple[int, int, int] = (1, 1, 1)
    block: tuple[int, int, int] = (1, 1, 1)
    shared_mem: int = 0
    param_layout: list[tuple[int, int]] = field(default_factory=list)
    params: bytes = b""
    pointers: list[tuple[int | str, int]] = field(default_factory=list)
    ranges: list[tuple[str, int, int, bool]] = field(default_factory=list)
    fields: dict = field(default_factory=dict)


@dataclass(slots=True)
class TensorSpec:
    """A graph input or output as an absolute address plus layout."""

    address: int
    shape: list[int]
    strides: list[int]
    dtype: str


@dataclass(slots=True)
class RawCapture:
    ops: list[OpRecord]
    nodes: list[RawNode]
    allocs: list[AllocEvent]
    statics: list[DeviceRange]  # parameters, module buffers and inputs (kind param / input)
    externals: list[DeviceRange]  # other memory allocated before capture
    pool: list[DeviceRange]  # the capture's private memory pool: an address here must resolve
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    meta: dict = field(default_factory=dict)
    # torch's allocator segments outside the pool when the capture began: an address in them
    # that no block of ``externals`` covers is memory the allocator holds free (or in another
    # graph's pool), which no kernel of this capture may use
    allocator: list[DeviceRange] = field(default_factory=list)
    # per node, the byte offsets of pointer-like kernel words that moved in a second capture at
    # other addresses (nimble.record.twin); None: no such evidence, the value rules alone decide
    moved_words: list[frozenset[int]] | None = None
