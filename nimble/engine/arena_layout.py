"""Where a prepared graph's bytes live in its arena, and how several graphs share one arena.

An arena starts with the plan's buffers (:class:`~nimble.analysis.memplan.MemPlan`, offsets from
the aligned base); after them each graph keeps its *state*: an 8-byte cell per input (the
address its gather node reads), the random generator's seed and offset cells, and a private copy
of every library-owned buffer and library workspace it writes (:func:`written_externals`).

Graphs that are never launched at the same time (the shape buckets of one model instance, whose
calls are serialized) share one arena: every graph's plan starts at the base, in a *shared
region* as large as the largest plan, and each graph's state gets a region of its own after it,
since a cell or a library copy must survive the other graphs' launches
(:func:`shared_layout`).  One graph alone is the same layout with one state.

Plain arithmetic on TaskGraphs and plans: no GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..analysis.memplan import MemPlan
from ..ir.alignment import ALIGNMENT, align_up
from ..ir.kernel_names import collective_kernel, library_kernel
from ..ir.taskgraph import LIBRARY_MEMORY, BufferKind, TaskGraph, TaskKind
from ..record.pointers import padded_int_like


def written_externals(graph: TaskGraph) -> list[int]:
    """Memory outside the arena that the graph writes and that each graph gets a private copy
    of: library-owned memory (never handed out by torch's allocator), and blocks of torch's
    allocator that only libraries' kernels write (:func:`library_scratch`).

    cuDNN's training batch norm keeps a partial-sum buffer and a grid semaphore of its own
    (per handle) that every such kernel writes; a graph that kept pointing there would share
    them with every other graph and eager call, and lose them if cuDNN reallocated.  A GEMM or
    convolution workspace that torch cached before the recording (32 MiB, written by a cuDNN
    implicit-GEMM convolution of inception_v3 in bf16) is the same: torch may free it and hand
    its bytes to a tensor, and graphs of other models or instances, running beside this one,
    use it too.  Memory from torch's allocator that ATen or Triton kernels write may be a
    tensor the model updates on purpose (a cache held as a plain attribute), so it stays shared
    (:func:`shared_state`).
    """
    scratch = set(library_scratch(graph))
    shared = set(collective_memory(graph))
    return [b.id for b in _written_outside(graph) if b.id not in shared
            and (b.name.startswith(LIBRARY_MEMORY) or b.id in scratch)]


def low_word_buffers(graph: TaskGraph) -> list[int]:
    """The buffers that keep their recorded low 32 address bits wherever the graph puts them
    (``meta["low_word_buffers"]``, :mod:`nimble.record.resolve`): arena buffers, and private
    copies of memory from before the recording (:func:`written_externals`).  Memory from
    before the recording that the graph uses where it is keeps every bit anyway.  A private
    copy that a word which may be an integer points into is one of them even where the
    recording does not list it (one made before the resolver listed memory from before the
    recording, or a saved file of then)."""
    private = set(written_externals(graph))
    listed = set(graph.meta.get("low_word_buffers", [])) | ambiguous_targets(graph, private)
    return sorted(b for b in listed if graph.buffers[b].relocatable or b in private)


def low_word_outside(graph: TaskGraph) -> list[int]:
    """The weight storages and memory from before the recording that the graph uses where they
    are (so prepare keeps every bit of their addresses) but that a load from a file places
    anew, and that a word which may as well be a 32-bit integer points into: the load keeps
    their recorded low 32 bits, as :func:`low_word_buffers` does for the arena's
    (:mod:`nimble.engine.loading`)."""
    private = set(written_externals(graph))
    outside = {b.id for b in graph.buffers if not b.relocatable and b.id not in private
               and b.kind in (BufferKind.PARAM, BufferKind.EXTERNAL)}
    listed = set(graph.meta.get("low_word_buffers", [])) | ambiguous_targets(graph, outside)
    return sorted(listed & outside)


def ambiguous_targets(graph: TaskGraph, buffers: set[int]) -> set[int]:
    """The buffers of ``buffers`` that a kernel word points into which may as well be a 32-bit
    integer under a stale top half (not a whole 8-byte parameter)."""
    found: set[int] = set()
    for t in graph.tasks:
        whole = {offset for offset, size in t.param_layout or () if size == 8}
        found.update(p.buffer for p in t.pointers
                     if p.buffer in buffers and isinstance(p.location, int)
                     and p.location not in whole and padded_int_like(p.value))
    return found


def collective_memory(graph: TaskGraph) -> list[int]:
    """External buffers that NCCL's collective kernels access
    (:func:`~nimble.ir.kernel_names.collective_kernel`): the communicator's own memory, whose
    FIFOs and step counters the other ranks' kernels read and write through mapped pointers,
    and tensors allocated before the recording that a collective reduces in place.  Neither
    may move to a private copy: a rank's kernels would then meet its peers' nowhere."""
    return sorted({a.buffer for t in graph.tasks
                   if t.kind == TaskKind.KERNEL and collective_kernel(t.name)
                   for a in t.accesses if graph.buffers[a.buffer].kind == BufferKind.EXTERNAL})


def communicator_memory(graph: TaskGraph) -> list[int]:
    """The part of :func:`collective_memory` that NCCL allocated itself (no tensor): state that
    lives on across launches and ranks, which a proof must neither snapshot nor restore."""
    return [b for b in collective_memory(graph)
            if graph.buffers[b].name.startswith(LIBRARY_MEMORY)]


def library_scratch(graph: TaskGraph) -> list[int]:
    """Blocks of torch's allocator, outside the arena, that only libraries' kernels write
    (:func:`~nimble.ir.kernel_names.library_kernel`): workspaces, whose bytes carry nothing from one
    call to the next, so that a private copy starts zeroed instead of copied."""
    writers: dict[int, list] = {}
    for t in graph.tasks:
        for a in t.accesses:
            if a.write and a.size > 0:
                writers.setdefault(a.buffer, []).append(t)
    return [b.id for b in _written_outside(graph) if not b.name.startswith(LIBRARY_MEMORY)
            and all(t.kind == TaskKind.KERNEL and library_kernel(t.name) for t in writers[b.id])]


def zeroed_copies(graph: TaskGraph) -> frozenset[int]:
    """The private copies (:func:`written_externals`) that start zeroed wherever they are built
    (prepare, a load, the C runtime) instead of from the library's bytes: workspaces
    (:func:`library_scratch`), of which a saved file therefore holds no bytes."""
    return frozenset(library_scratch(graph)).intersection(written_externals(graph))


def shared_state_buffers(graph: TaskGraph) -> list[int]:
    """The buffers of the memory from torch's allocator, outside the arena, that the graph's
    ATen or Triton kernels write: state the model updates on purpose (a static cache's keys,
    values and position counters), which stays shared and which the proof restores before
    every launch (:mod:`nimble.engine.proof`)."""
    skipped = set(written_externals(graph)) | set(communicator_memory(graph))
    return [b.id for b in _written_outside(graph) if b.id not in skipped]


def written_weights(graph: TaskGraph, training: bool = False) -> list[int]:
    """The weight buffers a run of the graph may change, put back after every run that only
    checks the graph: those it writes by its accesses and, for a training step, every weight
    it points to, since cuDNN's batch norm updates the running statistics through arguments
    its schema does not mark as written (no access records those writes)."""
    written = {a.buffer for t in graph.tasks for a in t.accesses
               if a.write and a.size > 0 and graph.buffers[a.buffer].kind == BufferKind.PARAM}
    if training:
        written |= {p.buffer for t in graph.tasks for p in t.pointers
                    if p.buffer >= 0 and graph.buffers[p.buffer].kind == BufferKind.PARAM}
    return sorted(written)


def shared_state(graph: TaskGraph) -> list[tuple[int, int]]:
    """``(address, size)`` as recorded of every :func:`shared_state_buffers` buffer."""
    return [(graph.buffers[b].address, graph.buffers[b].size)
            for b in shared_state_buffers(graph)]


def _written_outside(graph: TaskGraph) -> list:
    """The external buffers (allocated before the recording) that some task writes."""
    written = {a.buffer for t in graph.tasks for a in t.accesses if a.write and a.size > 0}
    return [b for b in graph.buffers
            if b.kind == BufferKind.EXTERNAL and b.id in written and b.size > 0]


@dataclass(frozen=True)
class StateLayout:
    """Where one graph keeps its state (offsets from the arena's aligned base)."""

    plan_bytes: int  # the graph's own plan, at offset 0
    cells_at: int  # an 8-byte cell per graph input
    rng_at: int  # the generator's seed and offset cells
    private: dict[int, int]  # buffer -> offset of its private copy (:func:`written_externals`)
    end: int  # the first byte after the state
    # the private copies that start zeroed instead of copied (:func:`zeroed_copies`)
    zeroed: frozenset[int]

    @property
    def size(self) -> int:
        """Bytes to allocate for an arena holding only this graph, alignment slack included."""
        return self.end + ALIGNMENT


def state_layout(graph: TaskGraph, plan_bytes: int, at: int) -> StateLayout:
    """The state of ``graph`` (whose plan takes ``plan_bytes``) placed from offset ``at``."""
    cells_at = align_up(at, 8)
    rng_at = cells_at + 8 * len(graph.inputs)
    private_at, private = rng_at + (16 if graph.meta.get("rng") else 0), {}
    for bid in written_externals(graph):
        private_at = align_up(private_at)
        private[bid] = private_at
        private_at += graph.buffers[bid].size
    return StateLayout(plan_bytes, cells_at, rng_at, private, private_at, zeroed_copies(graph))


def own_layout(graph: TaskGraph, plan: MemPlan) -> StateLayout:
    """The layout of an arena that holds one graph: its plan, then its state."""
    return state_layout(graph, plan.arena_bytes, plan.arena_bytes)


@dataclass(frozen=True)
class SharedArena:
    """One arena for graphs that never run at the same time: each graph's plan from the base,
    in a region as large as the largest plan, then each graph's state in a region of its own."""

    shared_bytes: int  # the largest plan
    states: list[StateLayout]  # per graph, in the order given
    size: int  # bytes to allocate, alignment slack included

    @property
    def state_bytes(self) -> int:
        """Everything allocated beyond the shared region: the states, their alignment and the
        base's alignment slack."""
        return self.size - self.shared_bytes


def shared_layout(graphs: Sequence[TaskGraph], plans: Sequence[MemPlan]) -> SharedArena:
    """The states of ``graphs`` (planned as ``plans``) one after another past the largest plan;
    for one graph, exactly :func:`own_layout`."""
    if len(graphs) != len(plans) or not graphs:
        raise ValueError(f"{len(graphs)} graphs for {len(plans)} plans: give one plan per graph")
    shared = max(p.arena_bytes for p in plans)
    states, at = [], shared
    for graph, plan in zip(graphs, plans):
        state = state_layout(graph, plan.arena_bytes, at)
        states.append(state)
        at = state.end
    return SharedArena(shared, states, at + ALIGNMENT)
