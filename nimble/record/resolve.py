"""From a raw capture to a TaskGraph: buffers by allocation, pointers and byte ranges resolved.

This half of recording is plain data in, plain data out (no CUDA, no torch), so it is tested on
the CPU.  Its inputs (:class:`~nimble.record.raw.RawCapture`), gathered on the GPU by
:mod:`nimble.record.recorder`, are:

* the ops the tracer saw, each with its window of graph nodes and of allocator allocations, and
  the absolute byte spans its schema says it reads and writes;
* the allocator's allocation events during capture, in order (their ordinal is the allocator's
  allocation counter, the same counter the tracer reads around each op);
* every graph node decoded, with the device pointers found in its parameters;
* tensors that existed before capture (parameters, module buffers, inputs) and other device
  memory that was allocated before capture.

Address → buffer: an address used by op *k* belongs to the latest allocation made before the end
of op *k*'s window that covers it, so two allocations the caching allocator put at one address
stay two buffers.  An allocation some tensor lives in is an intermediate (or an output); one that no
tensor names but kernels point into is **scratch**, and every op using it gets its own scratch
buffer, because a library workspace carries nothing from one call to the next.

Allocations one op makes *inside its own window* that overlap in address (a fused op such as
``aten::_transformer_encoder_layer_fwd`` frees an internal temporary and allocates the next one,
or its output, in the same bytes) form one **region**: a pointer into those bytes cannot say which
of them a kernel meant, so they become one buffer spanning all of them, and the op's own tasks
get read-write access to all of it.  Resolved to the latest allocation alone, such a pointer
could name a buffer smaller than the temporary a kernel writes through it.

Not every word that looks like an address is one.  A 32-bit integer or float followed by 4 bytes
of padding that hold the top half of an old address reads as an address near other addresses:
cuDNN's layout transforms carry a channel count that way (``0x7f8e_00000004`` for 4 channels), and
ATen's dropout backward its scale (``0x7fea_3fa00000``: 1.25f); ATen's elementwise kernels also
keep stale entries past the used part of their pointer arrays.  Resolving such a word makes
relocation rewrite the integer, and adds false dependencies.  So a kernel word of op *k* is taken
for a pointer only where a kernel of op *k* could use the memory:

* not in an allocation freed before op *k* began (no kernel may touch freed memory);
* not in a tensor (of the capture, or a graph input) that op *k* neither names among its
  arguments and results nor allocated itself;
* not inside an element (``0x7f76_00000005`` in a float tensor the op names is the int 5);
* not in memory torch's allocator holds but no live block covers (free memory, or another
  graph's pool such as ``make_graphed_callables``': no kernel of this capture uses it, and
  taking its bytes for library memory would relocate an integer);
* for ATen's own kernels (they reach only tensors, their op's own workspaces and the random
  generator's cells), not in library memory nor in a workspace another op allocated (a padded
  float scale can land in a cuDNN workspace);
* not in another op's workspace, nor in memory from before the recording (a library's own
  allocation), less than 2 MiB above a 4 GiB boundary at an offset no block starts from
  (512-aligned): there a padded integer is likelier than a pointer.  A library's allocation
  of 64 MiB that began at a 4 GiB boundary took ``0x7f24_00000002`` (a cutlass wgrad kernel's
  int 2 under a stale top half) for a pointer into it; its private copy in the arena then
  rewrote the int, and googlenet's training step computed a wrong gradient on one stream;
* for a library's kernel (cuDNN, cuBLAS, CUTLASS...), not in memory from before the recording
  at an offset that is no multiple of 4: libraries lay out their own memory and their
  workspaces in words of 4 bytes and more (cuDNN's sm90 kernels point at 4-byte counters 4, 8
  or 12 bytes past a multiple of 16; nothing finer was seen).  Under a pool at a low
  address, two 32-bit integers of a cuDNN winograd kernel read ``0x9_8864_298f``, 21 MB into
  a 32 MiB block torch had cached before the recording; relocating it gave inception_v3's
  training step a wrong gradient on one stream.

The value rules hold while the pool lies where integers seldom reach (``0x7f66_...``); a pool
the driver put at a low address (``0x7_0600_0000``) is hit by pairs of small integers.  So a
second capture of the same work at other addresses (:mod:`nimble.record.twin`) vetoes first: a
word into the pool that kept its value there, while every pool allocation moved, is no pointer.

Such words are not listed among the task's pointers and keep their recorded value; the graph
lists them as ``meta["not_pointer_words"]`` (``[task, byte offset, value]``, their count as
``meta["words_not_pointers"]``).  A real pointer taken for one would keep pointing into the
recorded pool, which the proof in ``prepare()`` poisons, so the mistake cannot pass unseen.

A word that may be either (less than 2 MiB above a 4 GiB boundary, inside a struct argument, in a
buffer the op may use) stays a pointer, and its buffer is listed in ``meta["low_word_buffers"]``:
the engine places such a buffer at its recorded address plus a multiple of 4 GiB, so relocation
rewrites only the word's top half, which is right for a pointer and harmless for the integer.
Memory from before the recording is listed too: where the graph gets a private copy of it, the
copy keeps the low 32 bits, since a block-aligned small int (which no rule above vetoes) may read
as a pointer into library memory that begins at a 4 GiB boundary (docs/design.md, "Which words of
a kernel are pointers").
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir.kernel_names import library_kernel, short_kernel_name
from .raw import OpRecord, RawCapture, TensorSpec
from .intervals import range_index
from .pointers import AddressResolver, padded_int_like
from ..ir.taskgraph import (LIBRARY_MEMORY, Access, Buffer, BufferKind, Op, Pointer, Task,
                           TaskGraph, TensorRef)


_ATEN_KERNEL = "at::native::"  # ATen's own kernels reach only tensors and ATen's workspaces


def _is_aten_kernel(name: str) -> bool:
    """Whether a kernel is one of ATen's own, by its name as the driver reports it (mangled:
    ``_ZN2at6native29vectorized_elementwise_kernel...``) or already demangled."""
    return _ATEN_KERNEL in name or short_kernel_name(name).startswith(_ATEN_KERNEL)


def _library_memory(buffer: Buffer) -> bool:
    return buffer.kind == BufferKind.EXTERNAL and buffer.name.startswith(LIBRARY_MEMORY)


def _merge_accesses(accesses: list[Access]) -> list[Access]:
    merged: dict[tuple[int, int, int], Access] = {}
    for a in accesses:
        key = (a.buffer, a.offset, a.size)
        if key in merged:
            merged[key].write = merged[key].write or a.write
        else:
            merged[key] = Access(a.buffer, a.offset, a.size, a.write)
    return list(merged.values())


def build_taskgraph(raw: RawCapture) -> TaskGraph:
    """Resolve a raw capture into a TaskGraph (see the module docstring for the rules)."""
    r = AddressResolver(raw)
    node_op = _op_of_each_node(raw)
    graph = TaskGraph(meta=dict(raw.meta))
    graph.tasks = [Task(i, n.kind, op=node_op[i], name=n.name, short_name=n.short_name,
                        grid=n.grid, block=n.block, shared_mem=n.shared_mem,
                        param_layout=list(n.param_layout), params=n.params, fields=dict(n.fields))
                   for i, n in enumerate(raw.nodes)]
    tasks_of_op: dict[int, list[int]] = {}
    for i, k in enumerate(node_op):
        tasks_of_op.setdefault(k, []).append(i)

    # Tasks outside every op are resolved where they were recorded: before the first op that
    # begins after them, with only the allocations made by then visible.
    loose = sorted(tasks_of_op.get(-1, []))
    for k, op in enumerate(raw.ops):
        if loose and loose[0] < op.node_begin:
            r.advance(op.alloc_begin)
            here = [t for t in loose if t < op.node_begin]
            loose = loose[len(here):]
            _resolve_tasks(r, graph, -1, here)
        r.advance(op.alloc_end)
        graph.ops.append(Op(k, op.name, op.module, _op_accesses(r, op)))
        _resolve_tasks(r, graph, k, tasks_of_op.get(k, []))

    r.advance(1 << 62)
    # The graph's outputs are tensors: a task outside every op that points into one writes that
    # tensor's buffer (not a scratch buffer at the same address).
    for spec in raw.outputs:
        where = r.locate(spec.address)
        if where is not None and where[0] == "alloc":
            r.tensor_alloc_buffer(where[1], r.alloc_op[where[1]])
    _resolve_tasks(r, graph, -1, loose)

    graph.inputs = [_tensor_ref(r, s, None) for s in raw.inputs]
    graph.outputs = [_tensor_ref(r, s, BufferKind.OUTPUT) for s in raw.outputs]
    graph.buffers = r.buffers
    graph.meta.update(r.stats)
    graph.meta["not_pointer_words"] = r.not_pointer_words
    graph.meta["words_not_pointers"] = len(r.not_pointer_words)
    graph.meta["low_word_buffers"] = sorted(r.low_word_buffers)
    graph.meta["unattributed_tasks"] = len(tasks_of_op.get(-1, []))
    graph.validate()
    return graph


def _op_of_each_node(raw: RawCapture) -> list[int]:
    """Per node, the op whose window holds it (-1: outside every op)."""
    node_op = [-1] * len(raw.nodes)
    for k, op in enumerate(raw.ops):
        for n in range(op.node_begin, min(op.node_end, len(raw.nodes))):
            node_op[n] = k
    return node_op


def _buffer_at(r: AddressResolver, address: int) -> int | None:
    """The buffer a tensor at ``address`` lives in, at the current time; None if none."""
    where = r.locate(address)
    if where is None:
        return None
    kind, ref = where
    return r.tensor_alloc_buffer(ref, r.alloc_op[ref]) if kind == "alloc" else ref


def _op_accesses(r: AddressResolver, op: OpRecord) -> list[Access]:
    """The accesses the byte spans of ``op``'s tensors make, one per span in a known buffer."""
    accesses = []
    for span in op.spans:
        bid = _buffer_at(r, span.start)
        if bid is None:
            continue
        b = r.buffers[bid]
        offset = span.start - b.address
        accesses.append(Access(bid, offset, min(span.size, b.size - offset), span.write))
    return _merge_accesses(accesses)


def _tensor_ref(r: AddressResolver, spec: TensorSpec, kind: str | None) -> TensorRef:
    """A graph input (``kind`` None) or output, its buffer marked ``kind`` if an intermediate."""
    bid = _buffer_at(r, spec.address)
    if bid is None:
        raise ValueError(f"graph {kind or 'tensor'} at {spec.address:#x} is in no known buffer")
    if kind is not None and r.buffers[bid].kind == BufferKind.INTERMEDIATE:
        r.buffers[bid].kind = kind
    return TensorRef(bid, spec.address - r.buffers[bid].address, list(spec.shape),
                     list(spec.strides), spec.dtype)


_Word = tuple[int | str, int]  # (location in the parameter block, value)


@dataclass
class _OpWords:
    """Where the pointer-like words of one op's tasks point, before they become pointers."""

    words: dict[int, list[_Word]]  # per task, the words that may be pointers
    # value -> ("region", first allocation) | ("buffer", id) | None
    located: dict[int, tuple[str, int] | None] = field(default_factory=dict)
    not_pointers: set[int] = field(default_factory=set)
    others_workspace: set[int] = field(default_factory=set)  # in a workspace another op made
    scratch_regions: set[int] = field(default_factory=set)
    own_reused: set[int] = field(default_factory=set)  # tensor buffers the op allocated twice
    scratch_of: dict[int, int] = field(default_factory=dict)  # scratch region -> its buffer

    def buffer_of(self, r: AddressResolver, value: int) -> int:
        """The buffer ``value`` points into; -1 for none."""
        where = self.located[value]
        if where is None:
            return -1
        kind, ref = where
        if kind == "region":
            return self.scratch_of[ref] if ref in self.scratch_of else r.tensor_buffer[ref]
        return ref


def _resolve_tasks(r: AddressResolver, graph: TaskGraph, k: int, task_ids: list[int]) -> None:
    """Pointers and accesses of op ``k``'s tasks (``k`` = -1: tasks outside every op)."""
    if not task_ids:
        return
    op_words = _OpWords(_words_that_moved(r, task_ids))
    named = {a.buffer for a in graph.ops[k].accesses} if k >= 0 else set()
    for t in task_ids:
        _locate_words(r, k, named, t, op_words)
    op_words.scratch_of = _scratch_buffers(r, k, op_words.scratch_regions)

    op_accesses = graph.ops[k].accesses if k >= 0 else []
    by_buffer: dict[int, list[Access]] = {}
    for a in op_accesses:
        by_buffer.setdefault(a.buffer, []).append(a)
    seen_buffers: set[int] = set()
    for t in task_ids:
        task = graph.tasks[t]
        task.accesses = _word_pointers(r, t, task, op_words, by_buffer, seen_buffers) \
            + _copy_pointers(r, t, task, op_words, seen_buffers)

    # An op access that no task's parameters point at (memory reached indirectly) is given to
    # every task of the op, so that ordering stays safe.
    missing = [a for a in op_accesses if a.buffer not in seen_buffers]
    if missing:
        r.stats["op_accesses_without_pointer"] += len(missing)
        for t in task_ids:
            graph.tasks[t].accesses.extend(missing)
    for t in task_ids:
        graph.tasks[t].accesses = _merge_accesses(graph.tasks[t].accesses)


def _words_that_moved(r: AddressResolver, task_ids: list[int]) -> dict[int, list[_Word]]:
    """Per task, its pointer-like words less those the twin capture vetoes (noted as such)."""
    words: dict[int, list[_Word]] = {}
    for t in task_ids:
        words[t] = []
        for location, value in r.raw.nodes[t].pointers:
            if r.unmoved(t, location, value):
                r.not_pointer_words.append([t, location, value])
                r.stats["twin_unmoved_words"] += 1
            else:
                words[t].append((location, value))
    return words


def _locate_words(r: AddressResolver, k: int, named: set[int], t: int,
                  op_words: _OpWords) -> None:
    """Locate task ``t``'s words and copy addresses not located yet, into ``op_words``."""
    copy_ends = {s for _, s, _, _ in r.raw.nodes[t].ranges}  # memcpy/memset addresses are addresses
    for v in [v for _, v in op_words.words[t]] + list(copy_ends):
        if v in op_words.located:
            continue
        where = r.locate(v)
        if where is None and k >= 0:
            where = r.just_past_own_allocation(k, v)
        if where is None:
            where = r.just_past_live(v)
        if v not in copy_ends and (where is not None and r.not_a_pointer(v, where, k, named)
                                   or where is None and r.in_allocator_free(v)):
            op_words.not_pointers.add(v)
            where = None
        if where is not None and where[0] == "alloc":
            rep = r.region[where[1]]
            where = ("region", rep)
            if rep not in r.tensor_buffer:
                op_words.scratch_regions.add(rep)
                if r.alloc_op[rep] not in (k, -1):
                    op_words.others_workspace.add(v)
            elif k >= 0 and r.alloc_op[rep] == k and r.members(rep) > 1:
                op_words.own_reused.add(r.tensor_buffer[rep])
        op_words.located[v] = where


def _scratch_buffers(r: AddressResolver, k: int, scratch_regions: set[int]) -> dict[int, int]:
    """A scratch buffer of op ``k`` per region it uses; regions that overlap (made by other ops
    at one address) share one."""
    scratch_of: dict[int, int] = {}
    groups: list[list] = []  # [start, end, regions]
    for rep in sorted(scratch_regions, key=lambda j: r.extent[j][0]):
        start, end, _ = r.extent[rep]
        if groups and start < groups[-1][1]:
            groups[-1][1] = max(groups[-1][1], end)
            groups[-1][2].append(rep)
        else:
            groups.append([start, end, [rep]])
    for start, end, reps in groups:
        bid = r.new_buffer(BufferKind.SCRATCH, end - start, start, f"scratch:op{k}", k)
        for rep in reps:
            scratch_of[rep] = bid
    return scratch_of


def _no_pointer_for_kernel(r: AddressResolver, op_words: _OpWords, value: int, bid: int,
                          aten_kernel: bool, library: bool) -> bool:
    """The rules that depend on which kernel holds the word (the module docstring): ATen's
    kernels reach no library memory nor another op's workspace; a library's kernel reaches
    memory from before the recording only at offsets of whole 4-byte words."""
    buffer = r.buffers[bid] if bid >= 0 else None
    if aten_kernel:
        return value in op_words.others_workspace or (
            buffer is not None and _library_memory(buffer))
    return library and buffer is not None and r.unaligned_in_external(buffer, value)


def _word_pointers(r: AddressResolver, t: int, task: Task, op_words: _OpWords,
                   by_buffer: dict[int, list[Access]], seen_buffers: set[int]) -> list[Access]:
    """Add task ``t``'s kernel words that are pointers to its pointers; their accesses."""
    node = r.raw.nodes[t]
    accesses: list[Access] = []
    aten_kernel = _is_aten_kernel(node.name)
    library = library_kernel(node.name)
    whole_params = {off for off, size in node.param_layout if size == 8}
    for location, value in op_words.words[t]:
        bid = op_words.buffer_of(r, value)
        if value in op_words.not_pointers or _no_pointer_for_kernel(
                r, op_words, value, bid, aten_kernel, library):
            r.not_pointer_words.append([t, location, value])
            continue
        if bid < 0:
            task.pointers.append(Pointer(location, value, -1, 0))
            continue
        b = r.buffers[bid]
        task.pointers.append(Pointer(location, value, bid, value - b.address))
        seen_buffers.add(bid)
        if (b.relocatable or b.kind == BufferKind.EXTERNAL) and padded_int_like(value) \
                and location not in whole_params:
            # a pointer, or an integer under stale padding: wherever the buffer (or a private
            # copy of memory from before the recording) goes, its low 32 bits stay
            r.low_word_buffers.add(bid)
        if b.kind == BufferKind.SCRATCH or bid in op_words.own_reused:
            accesses.append(Access(bid, 0, b.size, True))
        elif bid in by_buffer:
            accesses.extend(by_buffer[bid])
        else:
            r.stats["unlisted_pointer_accesses"] += 1
            accesses.append(Access(bid, 0, b.size, True))
    return accesses


def _copy_pointers(r: AddressResolver, t: int, task: Task, op_words: _OpWords,
                   seen_buffers: set[int]) -> list[Access]:
    """Add the addresses of memcpy/memset task ``t`` to its pointers; their exact accesses."""
    accesses: list[Access] = []
    for location, start, size, write in r.raw.nodes[t].ranges:
        bid = op_words.buffer_of(r, start)
        if bid < 0:
            task.pointers.append(Pointer(location, start, -1, 0))
            continue
        b = r.buffers[bid]
        offset = start - b.address
        task.pointers.append(Pointer(location, start, bid, offset))
        seen_buffers.add(bid)
        accesses.append(Access(bid, offset, min(size, b.size - offset), write))
    return accesses


def unresolved_in_pool(graph: TaskGraph, raw: RawCapture) -> list[tuple[int, Pointer]]:
    """Words of kernel arguments that fall inside the capture's memory pool but in no
    allocation live at their op.

    No kernel can read through such a word (nothing is allocated there), so it is a stale
    value the host left in an argument struct: uninitialised padding or array entries beyond
    the ones in use (ATen's elementwise functors carry such entries), which are left as they
    are.  A resolver bug would look the same; the proof in ``prepare()`` poisons the recorded
    pool, so a real read through one fails it.
    """
    pool = range_index(raw.pool)
    return [(t, p) for t, p in graph.unresolved_pointers() if pool.find(p.value) is not None]


RNG_SEED = "rng seed"
RNG_OFFSET = "rng offset"


def mark_rng_cells(graph: TaskGraph, cells: dict[int, str]) -> list[int]:
    """Turn the buffers that captured RNG kernels read their seed and offset from into RNG cells.

    ``cells`` maps the recorded address of each 8-byte cell to its role (:data:`RNG_SEED` or
    :data:`RNG_OFFSET`).  Under capture, torch's Philox kernels read the seed and offset through
    pointers into two small tensors of the generator's, which ``torch.cuda.graph``'s replay
    refills before each launch; the resolver saw them as op scratch.  Each buffer starting at a
    cell becomes kind ``rng`` of 8 bytes, named by its role, and every access of it a read.
    Returns the ids of the buffers marked.  Raises ``ValueError`` if a kernel points into such a
    buffer anywhere but at the cell.
    """
    pointed: dict[int, set[int]] = {}
    for t in graph.tasks:
        for p in t.pointers:
            if p.buffer >= 0:
                pointed.setdefault(p.buffer, set()).add(p.value)
    marked: list[int] = []
    for b in graph.buffers:
        values = pointed.get(b.id, set())
        if not values & cells.keys():
            continue
        if values != {b.address} or b.address not in cells:
            raise ValueError(
                f"buffer {b.id} ({b.name}) holds a random generator's cell but kernels point into "
                f"it at {sorted(hex(v) for v in values)}: cannot tell the cell from other data")
        b.kind, b.name, b.size = BufferKind.RNG, cells[b.address], 8
        marked.append(b.id)
    ids = set(marked)
    for holder in [*graph.tasks, *graph.ops]:
        holder.accesses = _merge_accesses(
            [Access(a.buffer, 0, 8, False) if a.buffer in ids else a for a in holder.accesses])
    graph.validate()
    return marked
