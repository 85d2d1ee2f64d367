"""From a scheduled, planned TaskGraph to one instantiated, explicit CUDA graph.

Every node of the recorded graph is added again to a new graph (``cuGraphCreate``), with

* its parameters *relocated*: each pointer into a buffer the memory plan moved (inputs, outputs,
  intermediates, scratch) is rewritten to the buffer's place in the arena, at the same offset, also
  when it sits inside a struct; memcpy and memset nodes have their source and destination moved
  the same way;
* its launch attributes copied from the recorded node (cluster shape, priority, ...);
* as dependencies exactly the final edges of the schedule: each stream's order plus the
  synchronization edges.  CUDA runs the branches of a graph concurrently, so those edges *are*
  the stream partitioning; the stream of each node is kept for inspection.

Relocation itself (:func:`buffer_bases`, :func:`relocate_params`, :func:`relocated`) is plain data
and tested without a GPU.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from .. import driver
from . import kernels
from ..analysis.deps import dag_from_edges
from ..errors import BuildError, CudaError
from ..analysis.memplan import MemPlan
from ..ir.taskgraph import Pointer, Task, TaskGraph, TaskKind


# ---- relocation (no GPU) --------------------------------------------------------------------

def buffer_bases(graph: TaskGraph, plan: MemPlan | None, arena_base: int) -> list[int]:
    """The address every buffer has when the built graph runs.

    Buffers with an arena offset move into the arena at ``arena_base``; the others (parameters,
    external memory) stay where they were recorded.  Without a plan nothing moves.
    """
    bases = [b.address for b in graph.buffers]
    if plan is not None:
        for bid, offset in plan.offsets.items():
            bases[bid] = arena_base + offset
    return bases


def relocated(pointer: Pointer, bases: Sequence[int]) -> int:
    """The value ``pointer`` takes once its buffer lives at ``bases[buffer]``.

    An unresolved pointer (buffer -1) keeps its recorded value: it points at memory Nimble does
    not own, and the proof in ``prepare()`` shows whether that is right.
    """
    if pointer.buffer < 0:
        return pointer.value
    return bases[pointer.buffer] + pointer.offset


def relocate_params(task: Task, bases: Sequence[int]) -> bytes:
    """A kernel task's parameter block with every pointer rewritten for ``bases``."""
    block = bytearray(task.params)
    for p in task.pointers:
        if not isinstance(p.location, int):
            raise BuildError(f"task {task.id}: kernel pointer at non-numeric location "
                             f"{p.location!r}")
        if p.location < 0 or p.location + 8 > len(block):
            raise BuildError(f"task {task.id}: pointer at byte {p.location} lies outside its "
                             f"{len(block)}-byte parameter block")
        block[p.location:p.location + 8] = relocated(p, bases).to_bytes(8, "little")
    return bytes(block)


def predecessors(n: int, edges: Sequence[tuple[int, int]]) -> list[list[int]]:
    """``preds[v]``: the tasks with an edge into ``v``, sorted, from a list of edges."""
    return dag_from_edges(n, edges, BuildError).preds


class InputGather(NamedTuple):
    """One input copied in by the graph itself: ``nbytes`` from ``*cell`` to ``dst``."""

    cell: int  # device address of 8 bytes holding the source address, written before each launch
    dst: int  # the input's slot in the arena
    nbytes: int


GATHER_BLOCK = 256
GATHER_MAX_BLOCKS = 1024


def gather_grid(nbytes: int) -> int:
    """Blocks for one gather: a 16-byte vector per thread, grid-stride beyond the cap."""
    return max(1, min(GATHER_MAX_BLOCKS, -(-nbytes // (16 * GATHER_BLOCK))))


def chain_edges(n: int) -> list[tuple[int, int]]:
    """The recorded order as edges: every task after the one before it (one stream)."""
    return [(i, i + 1) for i in range(n - 1)]


# ---- graph construction (GPU) ---------------------------------------------------------------

@dataclass
class BuiltGraph:
    """An explicit CUDA graph, one node per task of ``span`` (task ``t`` is ``nodes[t -
    span.start]``), owned together with its exec."""

    graph: driver.Graph
    exec: driver.GraphExec
    nodes: list
    span: range = range(0)
    #: True when the exec was instantiated for device launch (cheaper host launches too).
    device_launch: bool = False
    #: Why a requested device-launchable instantiation was refused ("" when it was not).
    device_launch_refusal: str = ""
    #: The module of Nimble's kernels the graph's gather nodes run (kept alive with the exec).
    module: driver.Module | None = None
    #: The module of the timestamp nodes of an instrumented graph (see :func:`build_graph`).
    stamp_module: driver.Module | None = None

    def launch(self, stream) -> None:
        """Launch on ``stream`` (a ``CUstream`` or its integer handle)."""
        driver.launch(self.exec.handle, stream)

    def close(self) -> None:
        """Free the exec and the graph (idempotent)."""
        self.exec.close()
        self.graph.close()
        for module in (self.module, self.stamp_module):
            if module is not None:
                module.close()


def kernel_arguments(task: Task, block: bytes) -> tuple[int, int, list]:
    """``(kernelParams, extra, keep)`` addresses that pass ``block`` to the driver as recorded.

    A task recorded from a ``kernelParams`` launch gets a pointer per parameter; one recorded
    from an ``extra`` launch gets the packed buffer back.  ``keep`` holds the ctypes objects the
    addresses point into: the driver copies them while adding or updating the node.
    """
    storage = ctypes.create_string_buffer(block, max(len(block), 1))
    base = ctypes.addressof(storage)
    if task.fields.get("args") == "extra":
        size = ctypes.c_size_t(len(block))
        extra = (ctypes.c_void_p * 5)(1, base, 2, ctypes.addressof(size), 0)
        return 0, ctypes.addressof(extra), [storage, size, extra]
    if not task.param_layout:
        return 0, 0, [storage]
    slots = (ctypes.c_void_p * len(task.param_layout))(
        *[base + offset for offset, _ in task.param_layout])
    return ctypes.addressof(slots), 0, [storage, slots]


def _add_kernel(graph, task: Task, recorded_node, bases: Sequence[int], deps: list):
    params = driver.kernel_node_params(recorded_node)
    params.kernelParams, params.extra, keep = kernel_arguments(task, relocate_params(task, bases))
    if params.sharedMemBytes:
        driver.allow_dynamic_shared(params.func, int(params.sharedMemBytes))
    node = driver.add_kernel_node(graph, deps, params, detail=f"task {task.id} ({task.short_name})")
    del keep
    driver.copy_kernel_attributes(node, recorded_node)
    return node


def _moved(task: Task, location: str, recorded_value: int, bases: Sequence[int]) -> int:
    for p in task.pointers:
        if p.location == location:
            return recorded_value + relocated(p, bases) - p.value
    return recorded_value


def _add_memset(graph, task: Task, recorded_node, bases: Sequence[int], deps: list, ctx,
                move: bool = True):
    params = driver.memset_node_params(recorded_node)
    if move:
        params.dst = _moved(task, "dst", int(params.dst), bases)
    return driver.add_memset_node(graph, deps, params, ctx, detail=f"task {task.id} (memset)")


def _add_memcpy(graph, task: Task, recorded_node, bases: Sequence[int], deps: list, ctx,
                move: bool = True):
    params = driver.memcpy_node_params(recorded_node)
    # A pointer row's value is where the copy starts; the struct's base moves by the same delta.
    for side in ("src", "dst") if move else ():
        if int(getattr(params, side + "MemoryType")) in (2, 4):  # device or unified memory
            field_name = side + "Device"
            setattr(params, field_name, _moved(task, side, int(getattr(params, field_name)),
                                               bases))
    return driver.add_memcpy_node(graph, deps, params, ctx, detail=f"task {task.id} (memcpy)")


def _add_timestamp(graph, function, slot: int, deps: list):
    """A one-thread node writing the GPU's nanosecond timer to ``slot``, after ``deps``."""
    drv = driver.bindings()
    params = drv.CUDA_KERNEL_NODE_PARAMS()
    params.func = function
    params.gridDimX = params.gridDimY = params.gridDimZ = 1
    params.blockDimX = params.blockDimY = params.blockDimZ = 1
    params.sharedMemBytes = 0
    value = ctypes.c_uint64(slot)
    slots = (ctypes.c_void_p * 1)(ctypes.addressof(value))
    params.kernelParams = ctypes.addressof(slots)
    params.extra = 0
    return driver.add_kernel_node(graph, deps, params, detail="timestamp")


def stamp_slots(span: range, stamps: int) -> dict[int, tuple[int, int]]:
    """``task -> (start slot, end slot)`` in a stamp buffer at ``stamps``: 16 bytes per task of
    ``span``, in task order (start, then end)."""
    return {t: (stamps + 16 * k, stamps + 16 * k + 8) for k, t in enumerate(span)}


def _add_gather(graph, function, gather: InputGather):
    drv = driver.bindings()
    params = drv.CUDA_KERNEL_NODE_PARAMS()
    params.func = function
    params.gridDimX, params.gridDimY, params.gridDimZ = gather_grid(gather.nbytes), 1, 1
    params.blockDimX, params.blockDimY, params.blockDimZ = GATHER_BLOCK, 1, 1
    params.sharedMemBytes = 0
    values = (ctypes.c_uint64 * 3)(gather.cell, gather.dst, gather.nbytes)
    slots = (ctypes.c_void_p * 3)(*[ctypes.addressof(values) + 8 * i for i in range(3)])
    params.kernelParams = ctypes.addressof(slots)
    params.extra = 0
    return driver.add_kernel_node(graph, [], params, detail="input gather")


def add_task_node(graph, task: Task, recorded_node, bases: Sequence[int], deps: list, ctx,
                  node_relocated: bool = False):
    """Add ``task`` to ``graph`` (a raw ``CUgraph``), relocated for ``bases``, after ``deps``.

    ``node_relocated``: ``recorded_node`` is a node of a graph Nimble built already (its memset
    and memcpy endpoints sit where ``bases`` puts them); kernel arguments are always rebuilt from
    the task's recorded block.
    """
    if task.kind == TaskKind.KERNEL:
        return _add_kernel(graph, task, recorded_node, bases, deps)
    if task.kind == TaskKind.MEMSET:
        return _add_memset(graph, task, recorded_node, bases, deps, ctx, not node_relocated)
    if task.kind == TaskKind.MEMCPY:
        return _add_memcpy(graph, task, recorded_node, bases, deps, ctx, not node_relocated)
    if task.kind == "other:CU_GRAPH_NODE_TYPE_EMPTY":
        return driver.add_empty_node(graph, deps)
    raise BuildError(f"task {task.id} is a {task.kind} node, which Nimble cannot rebuild yet")


def instantiate(owned: driver.Graph, device_launch: bool, upload_stream,
                node_priority: bool = False) -> tuple[driver.GraphExec, bool, str]:
    """``(exec, device_launchable, refusal)``: device-launchable where asked and allowed.

    A device-launchable exec lives on the GPU once uploaded, so each host launch is a short
    constant-cost submission instead of a walk over the graph (on an H100, 5-15 µs against
    20-30 µs for inception_v3).  Where the driver refuses (a node type it cannot launch from the
    device), the plain exec is used and the refusal is returned for the caller to report.
    """
    refusal = ""
    if device_launch:
        try:
            return driver.GraphExec.instantiate(owned, device_launch=True,
                                                upload_stream=upload_stream,
                                                node_priority=node_priority), True, ""
        except CudaError as e:
            refusal = str(e)
    return driver.GraphExec.instantiate(owned, upload_stream=upload_stream,
                                        node_priority=node_priority), False, refusal


def build_graph(graph: TaskGraph, recorded_nodes: Sequence, bases: Sequence[int],
                edges: Sequence[tuple[int, int]], *, device_launch: bool = True,
                upload_stream=None, gathers: Sequence[InputGather] = (),
                gather_module: driver.Module | None = None,
                span: range | None = None, stamps: int = 0,
                stamp_module: driver.Module | None = None, start_stamps: bool = True,
                nodes_relocated: bool = False, only: set[int] | None = None,
                priorities: Sequence[int] | None = None,
                stamped: set[int] | None = None,
                late_edges: Sequence[tuple[int, int]] = ()) -> BuiltGraph:
    """Build and instantiate the explicit graph of ``graph`` with ``edges`` as its dependencies.

    ``recorded_nodes[t]`` is task ``t``'s node in the captured graph (its function, launch
    attributes and parameter layout are taken from there); ``bases`` says where every buffer lives
    (:func:`buffer_bases`).  With ``device_launch`` the exec is made device-launchable where the
    driver allows (see :func:`instantiate`); ``upload_stream`` uploads it there. Each of
    ``gathers`` becomes a ``nimble_gather_input`` node (from ``gather_module``, which the result
    then owns, as it owns ``stamp_module``) that every root task waits for: the graph copies its
    own inputs in before anything else runs.  ``span`` (default: every task) builds one phase of a
    phased graph (the forward or the backward of a training step): only its tasks, and only the
    edges between them; the phase before it has finished when it is launched.  With ``stamps`` (the
    device address of 16 bytes per task of the span, see :func:`stamp_slots`) each task gets two
    ``nimble_timestamp`` nodes from ``stamp_module``: one beside it, after the same predecessors
    (its start; with ``start_stamps=False`` only the first root gets one), and one after it (its
    end).  Neither is anything's predecessor, so the schedule's own chains are not lengthened.
    ``nodes_relocated`` says that ``recorded_nodes`` are those of a graph Nimble built (see
    :func:`add_task_node`).  ``only`` keeps just those tasks of the span (a set closed under
    predecessors, for step-through); the others get no node (``nodes`` holds None for them).
    ``priorities`` (a driver priority number per task of the graph, see
    :mod:`nimble.analysis.priorities`) is given to each kernel node, and the exec honours it.  ``stamped``
    limits the stamps to those tasks.  The first root's start is stamped in any case: it dates
    the run, and the other roots start with it.  ``late_edges`` (``(u, v)`` task ids, either
    order, see :mod:`nimble.analysis.backfill`) are added once every node exists, where both tasks have
    a node; a task's start stamp waits for them too.
    """
    n = len(graph.tasks)
    if len(recorded_nodes) != n:
        raise BuildError(f"{len(recorded_nodes)} recorded nodes for {n} tasks")
    span = range(n) if span is None else span
    preds = predecessors(n, edges)
    ctx = driver.current_context()
    owned = driver.Graph.create()
    nodes: list = []
    first = span.start
    try:
        function = gather_module.function(kernels.GATHER_INPUT) if gathers else None
        gather_nodes = [_add_gather(owned.handle, function, g) for g in gathers]
        # Nimble's own nodes (gathers, stamps) are tiny: at the top priority they never wait
        # behind a big kernel, so a stamp is taken when its task ends.
        top = min(priorities, default=0) if priorities is not None else None
        if top is not None:
            for node in gather_nodes:
                driver.set_kernel_priority(node, top)
        stamp = stamp_module.function(kernels.TIMESTAMP) if stamps else None
        slots = stamp_slots(span, stamps) if stamps else {}
        dated = False  # the first root's start is always stamped: it dates the run
        start_stamp: dict[int, Any] = {}
        for tid in span:
            if only is not None and tid not in only:
                nodes.append(None)
                continue
            task = graph.tasks[tid]
            deps = [nodes[u - first] for u in preds[tid]
                    if u >= first and nodes[u - first] is not None] or list(gather_nodes)
            nodes.append(add_task_node(owned.handle, task, recorded_nodes[tid], bases, deps,
                                       ctx, nodes_relocated))
            if priorities is not None and task.kind == TaskKind.KERNEL:
                driver.set_kernel_priority(nodes[-1], priorities[tid])
            if stamps:
                mine = stamped is None or tid in stamped
                added = [_add_timestamp(owned.handle, stamp, slots[tid][1], [nodes[-1]])] \
                    if mine else []
                if (start_stamps and mine) or (not dated and all(u < first for u in preds[tid])):
                    added.append(_add_timestamp(owned.handle, stamp, slots[tid][0], deps))
                    start_stamp[tid] = added[-1]
                    dated = True
                if top is not None:
                    for node in added:
                        driver.set_kernel_priority(node, top)
        late = [(nodes[u - first], nodes[v - first]) for u, v in late_edges
                if u in span and v in span and nodes[u - first] is not None
                and nodes[v - first] is not None]
        late += [(nodes[u - first], start_stamp[v]) for u, v in late_edges
                 if v in start_stamp and u in span and nodes[u - first] is not None]
        driver.add_dependencies(owned.handle, late)
        exec_, on_device, refusal = instantiate(owned, device_launch, upload_stream,
                                                priorities is not None)
    except BaseException:
        owned.close()
        for module in (gather_module, stamp_module):
            if module is not None:
                module.close()
        raise
    return BuiltGraph(owned, exec_, nodes, span, device_launch=on_device,
                      device_launch_refusal=refusal, module=gather_module,
                      stamp_module=stamp_module if stamps else None)


def tasks_reading(graph: TaskGraph, buffers: set[int]) -> list[Task]:
    """The tasks with a pointer into any of ``buffers``."""
    return [t for t in graph.tasks if any(p.buffer in buffers for p in t.pointers)]


def repoint(built: BuiltGraph, graph: TaskGraph, bases: Sequence[int], buffers: set[int],
            stream) -> int:
    """Re-point the instantiated graph's tasks at ``buffers``' new ``bases``, in place.

    Only kernel arguments change (``cuGraphExecKernelNodeSetParams``): launches already queued
    keep the old ones, the next launch uses the new.  A device-launchable exec is uploaded again
    on ``stream``.  Returns the number of nodes changed; raises :class:`BuildError` for a memcpy
    or memset task, whose endpoints Nimble does not re-point.
    """
    tasks = [t for t in tasks_reading(graph, buffers) if t.id in built.span]
    for task in tasks:
        if task.kind != TaskKind.KERNEL:
            raise BuildError(f"task {task.id} is a {task.kind} node reading a weight that moved; "
                             "Nimble re-points kernel arguments only: call prepare() again")
    changed = 0
    for task in tasks:
        node = built.nodes[task.id - built.span.start]
        params = driver.kernel_node_params(node)
        params.kernelParams, params.extra, keep = kernel_arguments(
            task, relocate_params(task, bases))
        driver.set_exec_kernel_params(built.exec.handle, node, params,
                                      detail=f"task {task.id} ({task.short_name})")
        del keep
        changed += 1
    if changed and built.device_launch:
        driver.upload(built.exec.handle, stream)
    return changed
