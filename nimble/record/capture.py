"""CUDA graph capture with the memory story: warm-up, traced phased capture.

:func:`capture` captures one or more *phases* (a forward; or a forward, then its backward) into
``torch.cuda.CUDAGraph`` objects that share one memory pool, while

* :class:`~nimble.record.tracer.OpTracer` notes per ATen op the byte ranges it reads and writes,
  the graph nodes it created (numbered on through the phases) and the allocations it made, and
* the caching allocator's history records every allocation with its address and size,

so that :mod:`nimble.record.recorder` can decode the nodes and resolve every address to a
buffer.  Memory a later phase reads from an earlier one (the activations a forward saves for its
backward) is then one buffer with accesses in both.  The phases are then captured once more at other
addresses (:mod:`nimble.record.twin`), which tells pointers from integers that resemble them.
A phase that synchronises with the host is caught while it is captured
(:mod:`nimble.record.host_sync`: the path judged is the path captured).
"""
from __future__ import annotations

import contextlib
import gc
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from .. import driver
from .compiled import is_compiled
from ..errors import CaptureError, RecordError
from .host_sync import (CAPTURE_ERROR_MODE, capture_failure, exception_site, library_roots,
                        sync_errors_raised)
from ..ir.alignment import align_up
from .raw import AllocEvent, DeviceRange
from .twin import capture_twin

def snapshot_blocks(snapshot: dict, pool_id=None) -> tuple[list[DeviceRange], list[DeviceRange]]:
    """``(active blocks outside the pool, segments of the pool)`` from an allocator snapshot."""
    blocks, pool = [], []
    for seg in snapshot.get("segments", []):
        in_pool = pool_id is not None and tuple(seg.get("segment_pool_id", ())) == tuple(pool_id)
        if in_pool:
            pool.append(DeviceRange(seg["address"], seg["total_size"], "graph pool"))
            continue
        address = seg["address"]
        for blk in seg.get("blocks", []):
            start = blk.get("address", address)
            if blk.get("state") == "active_allocated":
                blocks.append(DeviceRange(start, blk["size"], f"block@{start:#x}"))
            address = start + blk["size"]
    return blocks, pool


def allocator_segments(snapshot: dict) -> list[DeviceRange]:
    """Every segment torch's caching allocator holds, as an allocator snapshot lists them."""
    return [DeviceRange(seg["address"], seg["total_size"], f"segment@{seg['address']:#x}")
            for seg in snapshot.get("segments", [])]


def alloc_counter(device: int) -> Callable[[], int]:
    """The caching allocator's count of allocations so far on ``device``."""
    import torch

    def count() -> int:
        return torch._C._cuda_memoryStats(device)["allocation"]["all"]["allocated"]
    return count


def node_counter(offset: int = 0) -> Callable[[], int]:
    """A counter of the capturing graph's nodes, plus ``offset`` (the nodes of the graphs
    captured before it); the graph is found at the first call."""
    import torch

    state: list = [None]

    def count() -> int:
        if state[0] is None:
            state[0] = driver.capture_graph(torch.cuda.current_stream().cuda_stream)
            if state[0] is None:
                raise CaptureError("the op tracer ran outside of an active stream capture")
        return offset + driver.node_count(state[0])
    return count


def warm_up(fn: Callable[[], Any], iterations: int) -> None:
    """Run ``fn`` on a side stream (as torch's graph docs require before capture)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iterations):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


@contextlib.contextmanager
def gradient_hooks_set_aside(tensors: Sequence) -> Iterator[None]:
    """Take the gradient hooks (``tensor.register_hook``) off ``tensors`` while a training step
    is warmed up and captured, and put them back after.

    ``torch.autograd.grad`` runs a target's hooks, so a captured backward would hold them (a
    gradient scaled, clipped or all-reduced), and autograd runs them again when it hands the
    prepared backward's gradients to the parameters: applied twice.  Set aside, they run once,
    at that hand-off, as in eager.  A hook added meanwhile is kept, after the old ones.
    """
    saved = [(t, t._backward_hooks) for t in tensors if getattr(t, "_backward_hooks", None)]
    for t, _ in saved:
        t._backward_hooks = None
    try:
        yield
    finally:
        for t, hooks in saved:
            added = t._backward_hooks or {}
            hooks.update(added)
            t._backward_hooks = hooks


@contextlib.contextmanager
def quiet_backward() -> Iterator[None]:
    """Silence what torch says about a backward run on a side stream or under capture.

    The autograd engine's device thread starts without a current CUDA context (torch then sets
    the primary one, and says so), and a backward on the warm-up stream does not match the
    stream of the parameters' gradient-accumulation nodes (unused here: the recorded backward
    computes gradients with ``torch.autograd.grad``).  Neither is the user's concern.
    """
    import torch

    setter = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no "
                                "current CUDA context")
        warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream")
        if setter is not None:
            setter(False)
        try:
            yield
        finally:
            if setter is not None:
                setter(True)


@dataclass
class Phase:
    """One part of the work captured into its own graph: ``run(previous result) -> result``."""

    name: str  # "forward", "backward": for messages
    run: Callable[[Any], Any]


@dataclass
class Captured:
    """What a capture leaves: the torch graphs, each phase's result, and the memory story."""

    torch_graphs: list
    results: list  # per phase
    node_counts: list[int]  # per phase
    ops: list
    allocs: list[AllocEvent]
    pool: list[DeviceRange]
    externals: list[DeviceRange]  # allocator blocks alive before capture
    device: int
    allocator: list[DeviceRange] = field(default_factory=list)  # its segments before capture
    twin: list | None = None  # node signatures of a second capture (see nimble.record.twin)
    twin_note: str = ""  # why there is no twin

    def release(self) -> None:
        """Free the graphs of a capture that will not be used (their hold on the pool)."""
        _free_graphs(self.torch_graphs)
        self.torch_graphs, self.results = [], []


def clear_blas_workspaces() -> None:
    """Drop torch's cached cuBLAS/cuBLASLt workspaces (one per handle and stream).

    Before a capture, so that the workspaces its GEMMs use are allocated inside it, where the
    recording sees them as op scratch and the arena takes them over; a workspace cached from an
    earlier capture on the same stream lives in *that* capture's pool and would be shared by the
    new graph without being owned by it.  After the capture, so that later work does not keep
    using a workspace inside this capture's pool (torch's cudagraph trees do the same).
    """
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


_FREE_ACTIONS = ("free_requested", "free", "free_completed")


def alloc_events_from_trace(trace: Sequence[dict], alloc_base: int) -> list[AllocEvent]:
    """The allocations of an allocator history (``_snapshot()["device_traces"][device]``), in
    order, numbered from ``alloc_base``, each with the allocation count at its free.

    The caching allocator hands out blocks rounded up to 512 bytes, and libraries use the
    slack (cuDNN points a kernel at a 0-byte region just past its requested workspace size),
    so each size is rounded up as well.  A free is taken at its request, the point after which
    no newly captured kernel may use the block (its completion may wait on stream events).
    """
    events: list[AllocEvent] = []
    live: dict[int, AllocEvent] = {}
    for entry in trace:
        action = entry.get("action")
        if action == "alloc":
            event = AllocEvent(alloc_base + len(events), int(entry["addr"]),
                               align_up(int(entry["size"])))
            events.append(event)
            live[event.address] = event
        elif action in _FREE_ACTIONS:
            event = live.pop(int(entry["addr"]), None)
            if event is not None:
                event.freed_at = alloc_base + len(events)
    return events


def capture(phases: Sequence[Phase], module, name: str) -> Captured:
    """Capture each phase into its own graph (one shared pool), tracing ops and allocations."""
    import torch

    device = torch.cuda.current_device()
    before = {"segments": torch.cuda.memory_snapshot()}
    externals, _ = snapshot_blocks(before)
    count_allocs = alloc_counter(device)
    clear_blas_workspaces()
    # A garbage collection during capture may free an old graph's arena (cuMemFree), which a
    # global-mode capture forbids: the capture is invalidated, and torch's random generator is
    # left believing it is still capturing.  Collect first, and not at all while capturing.
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             clear_history=True)
    try:
        alloc_base = count_allocs()
        traced = _capture_traced(phases, module, name, count_allocs)
        alloc_total = count_allocs() - alloc_base
        snap = torch.cuda.memory._snapshot(device)
    finally:
        if collecting:
            gc.enable()
        torch.cuda.memory._record_memory_history(enabled=None)
        clear_blas_workspaces()

    # While this capture's pool is held, a second capture lies at other addresses.
    twin, twin_note = capture_twin(phases, clear_blas_workspaces)
    # Segments the allocator took since (the twin's, if it keeps them cached) are torch's
    # memory, never a library's: a padded integer pointing into one must not be relocated.
    since = allocator_segments({"segments": torch.cuda.memory_snapshot()})
    trace = snap.get("device_traces", [[]])[device] if snap.get("device_traces") else []
    alloc_events = alloc_events_from_trace(trace, alloc_base)
    if len(alloc_events) != alloc_total:
        raise RecordError(
            f"the allocator history holds {len(alloc_events)} allocations but its counter moved "
            f"by {alloc_total}; cannot tell allocations apart (was memory history already "
            "enabled?)")
    _, pool = snapshot_blocks(snap, traced.graphs[0].pool())
    # Another prepared graph's arena counts as allocator memory: none of this capture's.
    others = [DeviceRange(a, n, f"nimble@{a:#x}") for a, n in driver.nimble_memory()]
    return Captured(traced.graphs, traced.results, traced.node_counts, traced.ops, alloc_events,
                    pool, externals, device, allocator_segments(before) + others + [
                        s for s in since if not any(s.overlaps(p) for p in pool)],
                    twin, twin_note)


@dataclass
class _TracedPhases:
    """The phases captured under the op tracer: per phase its graph, result and node count."""

    graphs: list = field(default_factory=list)
    results: list = field(default_factory=list)
    node_counts: list[int] = field(default_factory=list)
    ops: list = field(default_factory=list)  # of every phase, in order


def _capture_traced(phases: Sequence[Phase], module, name: str,
                    count_allocs: Callable[[], int]) -> _TracedPhases:
    """Capture each phase into a graph of its own (the first one's pool shared), tracing its
    ops; a phase that cannot be captured raises :class:`CaptureError`."""
    import torch

    from .tracer import ModulePaths, OpTracer

    traced = _TracedPhases()
    value = None
    # Module hooks never fire inside compiled code, and torch warns that they fire twice
    # around a compiled module: a compiled module's tasks are named by their kernels.
    with ModulePaths(module if isinstance(module, torch.nn.Module) else None,
                     enabled=not is_compiled(module)) as paths:
        for phase in phases:
            torch_graph = torch.cuda.CUDAGraph(keep_graph=True)
            tracer = OpTracer(node_counter(sum(traced.node_counts)), count_allocs, paths)
            caller_stream = torch.cuda.current_stream()
            try:
                with torch.cuda.graph(torch_graph,
                                      pool=traced.graphs[0].pool() if traced.graphs else None,
                                      capture_error_mode=CAPTURE_ERROR_MODE):
                    with tracer, sync_errors_raised():
                        value = phase.run(value)
            except Exception as e:  # noqa: BLE001 - any failure of capture is reported typed
                # A capture that failed to end leaves its stream current (torch restores the
                # caller's stream only after ending the capture).
                torch.cuda.set_stream(caller_stream)
                torch.cuda.synchronize()
                _free_graphs(traced.graphs + [torch_graph])
                raise capture_failure(e, phase.name, name,
                                      exception_site(e, library_roots()),
                                      _op_named(tracer.ops[-1]) if tracer.ops else "") from e
            traced.graphs.append(torch_graph)
            traced.results.append(value)
            traced.node_counts.append(driver.node_count_of(torch_graph.raw_cuda_graph()))
            traced.ops += tracer.ops
    return traced


def _op_named(op) -> str:
    """A traced op as an error names it: its ATen name and the module it ran in."""
    return f"{op.name} in {op.module}" if op.module else op.name


def _free_graphs(graphs: Sequence) -> None:
    """Free the graphs of a capture that failed (their nodes and their hold on the pool); a
    graph whose capture never ended has nothing to free."""
    for graph in graphs:
        with contextlib.suppress(RuntimeError):
            graph.reset()
