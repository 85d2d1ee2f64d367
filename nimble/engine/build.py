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

What :func:`build_graph` builds beyond that (one phase of a training step, input gathers, node
priorities, late edges, timestamp nodes, the proof's delay nodes, a subset of the tasks) is a
:class:`GraphSpec`; the builds of a prepared graph's phases all go through
:class:`nimble.engine.rebuild.PhaseBuilder`.  Relocation itself (:func:`buffer_bases`,
:func:`relocate_params`, :func:`relocated`) is plain data and tested without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet as Set, Any, NamedTuple, Sequence

from .. import driver
from . import kernels
from .prefetch_nodes import add_prefetch_nodes, turn_off_moved
from ..analysis.deps import dag_from_edges
from ..analysis.orders import chain
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
    #: None for a graph built never to launch (:attr:`GraphSpec.instantiate`).
    exec: driver.GraphExec | None
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
    #: The module of the delay nodes of a fuzz copy (see :class:`DelaySpec`).
    delay_module: driver.Module | None = None
    #: The module and the nodes of the weight prefetches (:mod:`nimble.engine.prefetch`).
    prefetch_module: driver.Module | None = None
    prefetch_nodes: list = field(default_factory=list)
    #: The edges built programmatic: the spec's, less those out of a root of this graph.
    programmatic: frozenset = frozenset()

    def launch(self, stream) -> None:
        """Launch on ``stream`` (a ``CUstream`` or its integer handle)."""
        if self.exec is None:
            raise BuildError("this graph was built to be cloned, not launched: it has no exec")
        driver.launch(self.exec.handle, stream)

    def close(self) -> None:
        """Free the exec and the graph (idempotent)."""
        if self.exec is not None:
            self.exec.close()
        self.graph.close()
        for module in (self.module, self.stamp_module, self.delay_module,
                       self.prefetch_module):
            if module is not None:
                module.close()


def _packed(task: Task) -> bool:
    """The task was recorded from an ``extra`` launch (one packed argument buffer)."""
    return task.fields.get("args") == "extra"


def _add_kernel(graph, task: Task, recorded_node, bases: Sequence[int], deps: list):
    return driver.add_kernel_node_like(graph, deps, recorded_node, relocate_params(task, bases),
                                       task.param_layout, _packed(task),
                                       detail=f"task {task.id} ({task.short_name})")


def _mover(task: Task, bases: Sequence[int]):
    """``move(location, recorded address) -> address`` for the endpoints of a memset or memcpy
    task: a pointer row's value is where the copy starts, and the struct's base moves by the
    same delta."""
    def move(location: str, recorded_value: int) -> int:
        for p in task.pointers:
            if p.location == location:
                return recorded_value + relocated(p, bases) - p.value
        return recorded_value
    return move


def stamp_slots(span: range, stamps: int) -> dict[int, tuple[int, int]]:
    """``task -> (start slot, end slot)`` in a stamp buffer at ``stamps``: 16 bytes per task of
    ``span``, in task order (start, then end)."""
    return {t: (stamps + 16 * k, stamps + 16 * k + 8) for k, t in enumerate(span)}


def add_task_node(graph, task: Task, recorded_node, bases: Sequence[int], deps: list, ctx,
                  node_relocated: bool = False):
    """Add ``task`` to ``graph`` (a raw ``CUgraph``), relocated for ``bases``, after ``deps``.

    ``node_relocated``: ``recorded_node`` is a node of a graph Nimble built already (its memset
    and memcpy endpoints sit where ``bases`` puts them); kernel arguments are always rebuilt from
    the task's recorded block.
    """
    if task.kind == TaskKind.KERNEL:
        return _add_kernel(graph, task, recorded_node, bases, deps)
    move = None if node_relocated else _mover(task, bases)
    if task.kind == TaskKind.MEMSET:
        return driver.add_memset_node_like(graph, deps, recorded_node, ctx, move,
                                           detail=f"task {task.id} (memset)")
    if task.kind == TaskKind.MEMCPY:
        return driver.add_memcpy_node_like(graph, deps, recorded_node, ctx, move,
                                           detail=f"task {task.id} (memcpy)")
    if task.kind == "other:CU_GRAPH_NODE_TYPE_EMPTY":
        return driver.add_empty_node(graph, deps)
    if task.kind in TaskKind.EVENTS:
        return driver.add_event_node_like(graph, deps, recorded_node,
                                          detail=f"task {task.id} ({task.kind})")
    raise BuildError(f"task {task.id} is a {task.kind} node, which Nimble cannot rebuild yet")


def instantiate(owned: driver.Graph, device_launch: bool, upload_stream,
                node_priority: bool = False) -> tuple[driver.GraphExec, bool, str]:
    """``(exec, device_launchable, refusal)``: device-launchable where asked and allowed.

    A device-launchable exec lives on the GPU once uploaded, so each host launch is a short
    constant-cost submission instead of a walk over the graph.  Where the driver refuses (a
    node type it cannot launch from the device), the plain exec is used and the refusal is
    returned for the caller to report.
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


def chained_copy(base: BuiltGraph, order: Sequence[int]) -> BuiltGraph:
    """A copy of ``base`` (a phase built with no edges between its tasks) whose tasks run one
    after another in ``order``: ``base``'s graph cloned, the chain's edges added, instantiated
    for host launch (a verification copy, launched a few times: the device-launchable upload
    would cost more than it saves).  The clone keeps ``base``'s relocated nodes, so a few
    serial orders of one phase cost one build (the proof's, :mod:`nimble.engine.fuzz`);
    ``base`` owns the modules and must outlive the copy."""
    start = base.span.start
    graph, nodes = base.graph.clone(base.nodes)
    try:
        driver.add_dependencies(graph.handle, [(nodes[u - start], nodes[v - start])
                                               for u, v in chain(order)])
        exec_ = driver.GraphExec.instantiate(graph)
    except BaseException:
        graph.close()
        raise
    return BuiltGraph(graph, exec_, nodes, base.span)


@dataclass(frozen=True)
class StampSpec:
    """The ``nimble_timestamp`` nodes of an instrumented graph (see :class:`GraphSpec`)."""

    #: Device address of 16 bytes per task of the span (:func:`stamp_slots`).
    address: int
    #: False: only the ends are stamped (and the first root's start, which dates the run).
    start_stamps: bool = True
    #: The tasks stamped (None: every task of the span).
    tasks: Set[int] | None = None


@dataclass(frozen=True)
class DelaySpec:
    """The ``nimble_delay`` nodes of a fuzz copy (see :class:`GraphSpec`).

    Each delayed task waits for a one-thread node that spins for the nanoseconds in slot
    ``task`` of the table (a u32 per task of the graph, 0: no delay), and that node waits for
    the task's predecessors: the task starts late by what the table says when the node runs,
    and no other order changes.
    """

    #: Device address of a u32 per task of the graph, indexed by task id.
    table: int
    #: The tasks given a delay node (None: every task of the span).
    tasks: Set[int] | None = None


@dataclass(frozen=True)
class GraphSpec:
    """What :func:`build_graph` builds from a recorded (or built) graph's nodes.

    ``edges`` are the dependencies (the schedule's: each stream's order and the syncs).
    ``span`` (None: every task) builds one phase of a phased graph (the forward or the backward
    of a training step): only its tasks, and only the edges between them; the phase before it
    has finished when it is launched.
    """

    edges: Sequence[tuple[int, int]]
    span: range | None = None
    #: Make the exec device-launchable where the driver allows (see :func:`instantiate`).
    device_launch: bool = True
    #: Where the exec is uploaded at instantiation (None: on its first launch).
    upload_stream: Any = None
    #: Each becomes a ``nimble_gather_input`` node that every root task waits for: the graph
    #: copies its own inputs in before anything else runs.
    gathers: Sequence[InputGather] = ()
    #: A driver priority number per task of the graph (:mod:`nimble.analysis.priorities`) for
    #: each kernel node; the exec honours them.  None: no node priorities.
    priorities: Sequence[int] | None = None
    #: ``(u, v)`` task ids in either order (:mod:`nimble.analysis.backfill`), added once every
    #: node exists, where both tasks have a node; a task's start stamp waits for them too.
    late_edges: Sequence[tuple[int, int]] = ()
    #: Keep just these tasks of the span (a set closed under predecessors, for step-through);
    #: the others get no node (``nodes`` holds None for them).
    only: Set[int] | None = None
    #: The nodes given are those of a graph Nimble built (see :func:`add_task_node`).
    nodes_relocated: bool = False
    #: Two timestamp nodes per stamped task: one beside it, after the same predecessors (its
    #: start), and one after it (its end).  Neither is anything's predecessor, so the
    #: schedule's own chains are not lengthened.  The first root's start is stamped in any
    #: case: it dates the run, and the other roots start with it.
    stamps: StampSpec | None = None
    #: A delay node before each delayed task (:class:`DelaySpec`); for verification copies only.
    delays: DelaySpec | None = None
    #: Weight prefetches beside the tasks (:class:`nimble.analysis.prefetch.Prefetch`), each
    #: after its anchor task, at the device's least priority; nothing waits for them.
    prefetch: Sequence = ()
    #: False: the graph alone, with no exec (the base that the serial orders' copies clone:
    #: instantiating a graph never launched costs as much as one launched).
    instantiate: bool = True
    #: Edges of ``edges`` built as programmatic ones (:mod:`nimble.analysis.programmatic`):
    #: ``v`` may start while ``u`` ends.  Left out before a task with a delay node.
    programmatic: Set[tuple[int, int]] = frozenset()


class _Assembly:
    """The nodes of one graph under construction: the span's tasks and Nimble's own nodes."""

    def __init__(self, handle, graph: TaskGraph, recorded_nodes: Sequence,
                 bases: Sequence[int], spec: GraphSpec, span: range,
                 preds: list[list[int]]) -> None:
        self.handle, self.graph, self.recorded_nodes = handle, graph, recorded_nodes
        self.bases, self.spec, self.span, self.preds = bases, spec, span, preds
        self.ctx = driver.current_context()
        self.nodes: list = []
        self.gather_nodes: list = []
        # Tasks whose node waits on another node of this graph: only an edge out of one of
        # them is built programmatic (an edge out of a root stays full; docs/findings.md, "A
        # programmatic edge out of a graph's root").
        self.entered: set[int] = set()
        self.programmatic: set[tuple[int, int]] = set()  # the edges built so
        self.start_stamp: dict[int, Any] = {}
        self.dated = False  # the first root's start is always stamped: it dates the run
        # Nimble's own nodes (gathers, stamps) are tiny: at the top priority they never wait
        # behind a big kernel, so a stamp is taken when its task ends.
        self.top = min(spec.priorities, default=0) if spec.priorities is not None else None

    def node(self, task: int):
        """``task``'s node, or None where it has none (outside the span, or left out)."""
        return self.nodes[task - self.span.start] if task in self.span else None

    def _on_top(self, nodes: list) -> None:
        if self.top is not None:
            for node in nodes:
                driver.set_kernel_priority(node, self.top)

    def add_gathers(self, module: driver.Module | None) -> None:
        function = module.function(kernels.GATHER_INPUT) if self.spec.gathers else None
        self.gather_nodes = [
            driver.add_function_node(self.handle, [], function, (gather_grid(g.nbytes), 1, 1),
                                     (GATHER_BLOCK, 1, 1), tuple(g), detail="input gather")
            for g in self.spec.gathers]
        self._on_top(self.gather_nodes)

    def add_tasks(self, stamp_module: driver.Module | None,
                  delay_module: driver.Module | None = None) -> None:
        spec = self.spec
        stamp = stamp_module.function(kernels.TIMESTAMP) if spec.stamps else None
        delay = delay_module.function(kernels.DELAY) if spec.delays else None
        slots = stamp_slots(self.span, spec.stamps.address) if spec.stamps else {}
        for tid in self.span:
            if spec.only is not None and tid not in spec.only:
                self.nodes.append(None)
                continue
            task = self.graph.tasks[tid]
            before = [u for u in self.preds[tid]
                      if u >= self.span.start and self.node(u) is not None]
            delayed = delay is not None and (spec.delays.tasks is None or tid in spec.delays.tasks)
            early = [] if delayed else [u for u in before
                                        if (u, tid) in spec.programmatic and u in self.entered]
            deps = [self.node(u) for u in before if u not in early] or (
                [] if early else list(self.gather_nodes))
            if delayed:
                deps = [self._add_delay(tid, delay, deps)]
            if deps or early:
                self.entered.add(tid)
            node = add_task_node(self.handle, task, self.recorded_nodes[tid], self.bases, deps,
                                 self.ctx, spec.nodes_relocated)
            if early:
                driver.add_programmatic_dependencies(self.handle,
                                                     [(self.node(u), node) for u in early])
                self.programmatic.update((u, tid) for u in early)
            self.nodes.append(node)
            if spec.priorities is not None and task.kind == TaskKind.KERNEL:
                driver.set_kernel_priority(node, spec.priorities[tid])
            if stamp is not None:
                self._add_stamps(tid, node, deps, stamp, slots[tid])

    def _add_delay(self, tid: int, function, deps: list):
        node = driver.add_function_node(self.handle, deps, function, (1, 1, 1), (1, 1, 1),
                                        (self.spec.delays.table, tid), detail="delay")
        self._on_top([node])
        return node

    def _add_stamps(self, tid: int, node, deps: list, function, slots: tuple[int, int]) -> None:
        stamps = self.spec.stamps
        mine = stamps.tasks is None or tid in stamps.tasks
        added = [_add_timestamp(self.handle, function, slots[1], [node])] if mine else []
        root = all(u < self.span.start for u in self.preds[tid])
        if (stamps.start_stamps and mine) or (not self.dated and root):
            added.append(_add_timestamp(self.handle, function, slots[0], deps))
            self.start_stamp[tid] = added[-1]
            self.dated = True
        self._on_top(added)

    def add_prefetches(self, module: driver.Module | None) -> list:
        if not self.spec.prefetch:
            return []
        least = driver.stream_priority_range()[0] if self.spec.priorities is not None else None
        return add_prefetch_nodes(self.handle, module.function(kernels.PREFETCH),
                                  self.spec.prefetch, self.bases, self.node,
                                  list(self.gather_nodes), least)

    def add_late_edges(self) -> None:
        late = [(self.node(u), self.node(v)) for u, v in self.spec.late_edges
                if self.node(u) is not None and self.node(v) is not None]
        late += [(self.node(u), self.start_stamp[v]) for u, v in self.spec.late_edges
                 if v in self.start_stamp and self.node(u) is not None]
        driver.add_dependencies(self.handle, late)


def _add_timestamp(graph, function, slot: int, deps: list):
    """A one-thread node writing the GPU's nanosecond timer to ``slot``, after ``deps``."""
    return driver.add_function_node(graph, deps, function, (1, 1, 1), (1, 1, 1), (slot,),
                                    detail="timestamp")


def build_graph(graph: TaskGraph, recorded_nodes: Sequence, bases: Sequence[int],
                spec: GraphSpec) -> BuiltGraph:
    """Build and instantiate the explicit graph of ``graph`` that ``spec`` describes.

    ``recorded_nodes[t]`` is task ``t``'s node in the captured graph (its function, launch
    attributes and parameter layout are taken from there); ``bases`` says where every buffer
    lives (:func:`buffer_bases`).  The modules of Nimble's own kernels that the gathers and
    stamps run are loaded here and owned by the result.
    """
    n = len(graph.tasks)
    if len(recorded_nodes) != n:
        raise BuildError(f"{len(recorded_nodes)} recorded nodes for {n} tasks")
    span = range(n) if spec.span is None else spec.span
    preds = predecessors(n, spec.edges)
    owned = driver.Graph.create()
    gather_module = stamp_module = delay_module = prefetch_module = None
    try:
        gather_module = kernels.load(kernels.GATHER_SOURCE) if spec.gathers else None
        stamp_module = kernels.load(kernels.TIMESTAMP_SOURCE) if spec.stamps else None
        delay_module = kernels.load(kernels.DELAY_SOURCE) if spec.delays else None
        prefetch_module = kernels.load(kernels.PREFETCH_SOURCE) if spec.prefetch else None
        assembly = _Assembly(owned.handle, graph, recorded_nodes, bases, spec, span, preds)
        assembly.add_gathers(gather_module)
        assembly.add_tasks(stamp_module, delay_module)
        prefetch_nodes = assembly.add_prefetches(prefetch_module)
        assembly.add_late_edges()
        exec_, on_device, refusal = instantiate(owned, spec.device_launch, spec.upload_stream,
                                                spec.priorities is not None) \
            if spec.instantiate else (None, False, "")
    except BaseException:
        owned.close()
        for module in (gather_module, stamp_module, delay_module, prefetch_module):
            if module is not None:
                module.close()
        raise
    return BuiltGraph(owned, exec_, assembly.nodes, span, device_launch=on_device,
                      device_launch_refusal=refusal, module=gather_module,
                      stamp_module=stamp_module, delay_module=delay_module,
                      prefetch_module=prefetch_module, prefetch_nodes=prefetch_nodes,
                      programmatic=frozenset(assembly.programmatic))


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
        driver.set_exec_kernel_arguments(
            built.exec.handle, built.nodes[task.id - built.span.start],
            relocate_params(task, bases), task.param_layout, _packed(task),
            detail=f"task {task.id} ({task.short_name})")
        changed += 1
    if built.prefetch_nodes:
        turned_off = turn_off_moved(built.exec.handle, built.prefetch_nodes, buffers)
    else:
        turned_off = 0
    if (changed or turned_off) and built.device_launch:
        driver.upload(built.exec.handle, stream)
    return changed
