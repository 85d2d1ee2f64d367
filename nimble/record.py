"""Recording: from a PyTorch module and example inputs to a :class:`Recording`.

``record()`` warms the model up on a side stream (cuDNN autotuning, lazy initialisation), then
captures one forward on a single stream into ``torch.cuda.CUDAGraph(keep_graph=True)`` while

* :class:`~nimble.tracer.OpTracer` notes per ATen op the byte ranges it reads and writes, the graph
  nodes it created and the allocations it made, and
* the caching allocator's history records every allocation with its address and size,

then decodes every node (:mod:`nimble.decode`) and resolves addresses into buffers
(:mod:`nimble.resolve`).  The capture itself is a plain callable (``capture_fn``), so capturing a
forward *and* backward for training reuses all of this.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from . import driver
from .decode import AddressOracle, decode_node
from .errors import CaptureError, InputError, NoGpuError, RecordError
from .progress import say
from .resolve import (RNG_OFFSET, RNG_SEED, AllocEvent, DeviceRange, RawCapture, TensorSpec,
                      build_taskgraph, mark_rng_cells, unresolved_in_pool)
from .taskgraph import BufferKind, TaskGraph


@dataclass
class Recording:
    """A live recording: the TaskGraph plus the CUDA objects needed to rebuild and check it.

    ``torch_graph`` is the captured single-stream graph (the reference); ``nodes[i]`` is the
    ``CUgraphNode`` of task ``i``; ``static_inputs``/``static_outputs`` are the tensors the capture
    read and wrote.
    """

    graph: TaskGraph
    torch_graph: Any
    nodes: list
    static_inputs: list
    static_outputs: list
    output_spec: Any
    seconds: dict = field(default_factory=dict)

    def replay_reference(self, inputs: Sequence) -> list:
        """Run the captured single-stream graph on ``inputs``; return copies of its outputs."""
        for dst, src in zip(self.static_inputs, inputs):
            dst.copy_(src)
        self.torch_graph.replay()
        return [o.clone() for o in self.static_outputs]


def _as_tensor_list(example_inputs) -> list:
    import torch

    if isinstance(example_inputs, torch.Tensor):
        items = [example_inputs]
    elif isinstance(example_inputs, (tuple, list)):
        items = list(example_inputs)
    else:
        raise InputError(
            f"example inputs must be a tensor or a tuple of tensors, got "
            f"{type(example_inputs).__name__}")
    for i, x in enumerate(items):
        if not isinstance(x, torch.Tensor):
            raise InputError(f"input {i} is a {type(x).__name__}; Nimble takes tensors (or a "
                             f"tuple of tensors) as inputs")
        if x.device.type != "cuda":
            raise InputError(f"input {i} is on {x.device}; move it to the GPU first "
                             f"(x.cuda() or x.to('cuda'))")
        if x.layout != torch.strided:
            raise InputError(f"input {i} has layout {x.layout}; only dense tensors are supported")
    return items


def check_module(module) -> None:
    """Raise :class:`InputError` if a parameter or buffer of ``module`` is not on the GPU."""
    import torch

    if not isinstance(module, torch.nn.Module):
        if callable(module):
            return
        raise InputError(f"expected a torch.nn.Module, got {type(module).__name__}")
    for kind, named in (("parameter", module.named_parameters()),
                        ("buffer", module.named_buffers())):
        for name, t in named:
            if t.device.type != "cuda":
                raise InputError(f"{kind} '{name}' is on {t.device}; move the model to the GPU "
                                 f"first (model.cuda())")


def _statics(module, static_inputs) -> list[DeviceRange]:
    """Parameters and buffers (one range per storage) and the inputs, as device ranges."""
    import torch

    ranges: dict[int, DeviceRange] = {}
    if isinstance(module, torch.nn.Module):
        named = list(module.named_parameters(remove_duplicate=False)) + \
            list(module.named_buffers(remove_duplicate=False))
        for name, t in named:
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in ranges:
                ranges[st.data_ptr()] = DeviceRange(st.data_ptr(), st.nbytes(), name,
                                                    BufferKind.PARAM)
    for i, x in enumerate(static_inputs):
        st = x.untyped_storage()
        ranges[st.data_ptr()] = DeviceRange(st.data_ptr(), max(st.nbytes(), 1), f"input{i}",
                                            BufferKind.INPUT)
    return list(ranges.values())


def _snapshot_blocks(snapshot: dict, pool_id=None) -> tuple[list[DeviceRange], list[DeviceRange]]:
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


def _alloc_counter(device: int) -> Callable[[], int]:
    import torch

    def count() -> int:
        return torch._C._cuda_memoryStats(device)["allocation"]["all"]["allocated"]
    return count


def _node_counter() -> Callable[[], int]:
    """A counter of the capturing graph's nodes; the graph is found at the first call."""
    import torch

    state: list = [None]

    def count() -> int:
        if state[0] is None:
            state[0] = driver.capture_graph(torch.cuda.current_stream().cuda_stream)
            if state[0] is None:
                raise CaptureError("the op tracer ran outside of an active stream capture")
        return driver.node_count(state[0])
    return count


def _tensor_spec(t) -> TensorSpec:
    return TensorSpec(t.data_ptr(), list(t.shape), list(t.stride()),
                      str(t.dtype).removeprefix("torch."))


def check_no_host_sync(fn: Callable[[], Any], name: str) -> None:
    """Run ``fn`` once with torch's sync debug mode set to error.

    A forward that synchronises with the host cannot be captured, and a failed capture can leave
    torch's CUDA state (its random generator) unusable for the rest of the process; finding the
    synchronisation before capturing keeps the process healthy.
    """
    import torch

    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise CaptureError(f"the model failed to run on the example inputs: {e}") from e
        raise CaptureError(
            f"the forward of {name} cannot be captured into a CUDA graph: it synchronises with "
            f"the host ({e}). A forward must not synchronise with the host (.item(), .cpu(), "
            "printing a tensor, data-dependent Python control flow) and must keep its work on "
            "the GPU.") from e
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()


def explain_pointer(graph: TaskGraph, raw: RawCapture, task: int, pointer) -> str:
    """One line on an unresolved pointer: where it is, and every allocation near its value."""
    t = graph.tasks[task]
    op = graph.op_of(t)
    where = f"{op.name} [op {op.index}, allocations {raw.ops[op.index].alloc_begin}.." \
            f"{raw.ops[op.index].alloc_end}) in {op.module or '?'}" if op else "no op"
    near = sorted(raw.allocs, key=lambda a: min(abs(pointer.value - a.address),
                                                abs(pointer.value - a.address - a.size)))[:3]
    desc = ", ".join(f"#{a.ordinal} [{a.address:#x}+{a.size:#x})" for a in near)
    return (f"  task {task} {t.short_name} ({where}) param byte {pointer.location} = "
            f"{pointer.value:#x}; nearest allocations during capture: {desc or 'none'}")


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


def record(module, example_inputs, *, warmup: int = 3, name: str | None = None,
           quiet: bool = True, strict: bool = True) -> Recording:
    """Record one forward of ``module`` on ``example_inputs`` (a tensor or tuple of tensors).

    Raises :class:`InputError` for inputs or models not on the GPU, :class:`CaptureError` for a
    forward that cannot be captured (one that synchronises with the host, say), and
    :class:`RecordError` if a node cannot be decoded or a pointer into the captured memory pool
    resolves to no buffer.
    """
    inputs = _as_tensor_list(example_inputs)
    check_module(module)
    driver.ensure_context()
    static_inputs = [x.detach().clone() for x in inputs]

    def forward():
        return module(*static_inputs)

    return record_callable(forward, static_inputs, module=module, warmup=warmup,
                           name=name or type(module).__name__, quiet=quiet, strict=strict,
                           training=bool(getattr(module, "training", False)))


def record_callable(fn: Callable[[], Any], static_inputs: list, *, module=None, warmup: int = 3,
                    name: str = "model", quiet: bool = True, training: bool = False,
                    strict: bool = True) -> Recording:
    """Capture ``fn()`` (which reads ``static_inputs``) and decode it; see :func:`record`.

    With ``strict`` (the default) a pointer into the capture's memory pool that resolves to no
    allocation is a :class:`RecordError`; without it the recording is returned with the pointer
    marked unresolved (for debugging).
    """
    import torch

    if not torch.cuda.is_available():
        raise NoGpuError("no CUDA GPU or driver found (torch.cuda.is_available() is False)")
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    say(f"warming up {name} ({warmup} iterations)", quiet)
    try:
        warm_up(fn, warmup)
    except RuntimeError as e:
        raise CaptureError(f"the model failed to run on the example inputs: {e}") from e
    check_no_host_sync(fn, name)
    seconds["warmup"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    say("capturing one forward on a single stream", quiet)
    captured = _capture(fn, module, name)
    seconds["capture"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    graph, nodes, outputs, out_spec = _decode(
        captured, _statics(module, static_inputs), static_inputs, name, quiet, strict,
        meta={"model": name, "training": training,
              "device": torch.cuda.get_device_name(captured.device), "torch": torch.__version__,
              "batch": int(static_inputs[0].shape[0])
              if static_inputs and static_inputs[0].dim() else 0,
              "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    find_rng_cells(captured.torch_graph, graph, captured.device)
    seconds["decode"] = time.perf_counter() - t0
    graph.meta["record_seconds"] = dict(seconds)
    return Recording(graph, captured.torch_graph, nodes, static_inputs, outputs, out_spec,
                     seconds)


@dataclass
class _Captured:
    """What one capture leaves: the torch graph, the forward's result, and the memory story."""

    torch_graph: Any
    output: Any
    ops: list
    allocs: list[AllocEvent]
    pool: list[DeviceRange]
    externals: list[DeviceRange]  # allocator blocks alive before capture
    device: int


def _clear_blas_workspaces() -> None:
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


def _capture(fn: Callable[[], Any], module, name: str) -> _Captured:
    """Capture ``fn()`` on one stream while tracing ops and logging every allocation."""
    import torch

    from .tracer import ModulePaths, OpTracer

    device = torch.cuda.current_device()
    externals, _ = _snapshot_blocks({"segments": torch.cuda.memory_snapshot()})
    torch_graph = torch.cuda.CUDAGraph(keep_graph=True)
    node_count = _node_counter()
    alloc_count = _alloc_counter(device)
    _clear_blas_workspaces()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             clear_history=True)
    try:
        alloc_base = alloc_count()
        with ModulePaths(module if isinstance(module, torch.nn.Module) else None) as paths:
            tracer = OpTracer(node_count, alloc_count, paths)
            try:
                with torch.cuda.graph(torch_graph):
                    with tracer:
                        out = fn()
            except Exception as e:  # noqa: BLE001 - any failure of capture is reported typed
                torch.cuda.synchronize()
                raise CaptureError(
                    f"the forward of {name} cannot be captured into a CUDA graph: {e}. A forward "
                    "must not synchronise with the host (.item(), .cpu(), printing a tensor, "
                    "data-dependent Python control flow) and must keep its work on the GPU."
                ) from e
        alloc_total = alloc_count() - alloc_base
        snap = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        _clear_blas_workspaces()

    trace = snap.get("device_traces", [[]])[device] if snap.get("device_traces") else []
    allocs = [e for e in trace if e.get("action") == "alloc"]
    if len(allocs) != alloc_total:
        raise RecordError(
            f"the allocator history holds {len(allocs)} allocations but its counter moved by "
            f"{alloc_total}; cannot tell allocations apart (was memory history already enabled?)")
    # The caching allocator hands out blocks rounded up to 512 bytes, and libraries use the
    # slack: cuDNN points a kernel at a 0-byte region just past its requested workspace size.
    alloc_events = [AllocEvent(alloc_base + i, int(e["addr"]), -(-int(e["size"]) // 512) * 512)
                    for i, e in enumerate(allocs)]
    _, pool = _snapshot_blocks(snap, torch_graph.pool())
    return _Captured(torch_graph, out, tracer.ops, alloc_events, pool, externals, device)


def _decode(captured: _Captured, statics: list[DeviceRange], static_inputs: list, name: str,
            quiet: bool, strict: bool, meta: dict) -> tuple[TaskGraph, list, list, Any]:
    """``(graph, nodes, outputs, output spec)``: every node decoded, every address resolved."""
    import torch
    from torch.utils._pytree import tree_flatten

    out_leaves, out_spec = tree_flatten(captured.output)
    outputs = [x for x in out_leaves if isinstance(x, torch.Tensor)]
    if not outputs or len(outputs) != len(out_leaves):
        raise InputError(f"the forward of {name} must return a tensor or a (nested) tuple, list "
                         f"or dict of tensors; got {type(captured.output).__name__}")
    nodes = driver.graph_nodes(driver.bindings().CUgraph(captured.torch_graph.raw_cuda_graph()))
    say(f"decoding {len(nodes)} graph nodes from {len(captured.ops)} ops", quiet)
    oracle = AddressOracle()
    raw_nodes = [decode_node(n, oracle) for n in nodes]
    externals = list(captured.externals)
    pool = captured.pool
    pool_index = {(r.address, r.size) for r in pool}
    for r in oracle.ranges:
        if (r.address, r.size) not in pool_index and not any(
                p.address <= r.address < p.end for p in pool):
            externals.append(DeviceRange(r.address, r.size, f"device allocation@{r.address:#x}"))
    raw = RawCapture(
        ops=captured.ops, nodes=raw_nodes, allocs=captured.allocs, statics=statics,
        externals=[e for e in externals if not any(
            s.address <= e.address < s.end for s in statics)],
        pool=pool, inputs=[_tensor_spec(x) for x in static_inputs],
        outputs=[_tensor_spec(x) for x in outputs],
        meta={**meta, "allocations": len(captured.allocs),
              "pool_bytes": sum(r.size for r in pool)})
    if hasattr(captured.torch_graph, "instantiate"):  # keep_graph=True leaves that to replay
        captured.torch_graph.instantiate()
    graph = build_taskgraph(raw)
    bad = unresolved_in_pool(graph, raw)
    graph.meta["unresolved_in_pool"] = len(bad)
    if bad:
        message = (f"{len(bad)} pointer(s) into the captured memory pool resolve to no "
                   f"allocation:\n" + "\n".join(explain_pointer(graph, raw, t, p)
                                                for t, p in bad[:4]))
        if strict:
            raise RecordError(message)
        graph.meta["unresolved_report"] = message
    return graph, nodes, outputs, out_spec


def find_rng_cells(torch_graph, graph: TaskGraph, device: int) -> int:
    """Find where the captured RNG kernels read the generator's seed and offset; mark them.

    One replay of the captured graph with a distinctive seed and offset shows both: torch's
    replay writes them into the two cells its Philox kernels read, and advances the generator's
    offset by what the whole graph consumes.  Every 8-byte word that a kernel points at in op
    scratch or outside memory is read back; the words holding the seed and the offset are the
    cells (:func:`~nimble.resolve.mark_rng_cells`).  The generator's state is restored.  Returns
    the offset increment per launch (0 for a graph that draws no random numbers), also kept in
    ``graph.meta["rng"]``.
    """
    import torch

    gen = torch.cuda.default_generators[device]
    saved = gen.get_state()
    seed = int.from_bytes(os.urandom(7), "little") | 1 << 56
    offset = 4 * (int.from_bytes(os.urandom(4), "little") | 1 << 32)
    cells: dict[int, str] = {}
    try:
        gen.manual_seed(seed)
        gen.set_offset(offset)
        torch_graph.replay()
        torch.cuda.synchronize()
        increment = gen.get_offset() - offset
        if increment:
            candidates = sorted({p.value for t in graph.tasks for p in t.pointers
                                 if p.buffer >= 0 and graph.buffers[p.buffer].kind in
                                 (BufferKind.SCRATCH, BufferKind.EXTERNAL)
                                 and p.offset + 8 <= graph.buffers[p.buffer].size})
            for value in candidates:
                word = int.from_bytes(driver.copy_to_host(value, 8), "little")
                if word in (seed, offset):
                    cells[value] = RNG_SEED if word == seed else RNG_OFFSET
    finally:
        gen.set_state(saved)
    if not increment:
        return 0
    if set(cells.values()) != {RNG_SEED, RNG_OFFSET}:
        raise RecordError(
            f"the forward draws random numbers (each replay advances the CUDA generator's "
            f"offset by {increment}), but Nimble found no kernel reading the generator's seed "
            "and offset cells; random ops that take their own torch.Generator are not "
            "supported: use the default generator (torch.manual_seed)")
    try:
        mark_rng_cells(graph, cells)
    except ValueError as e:
        raise RecordError(f"cannot isolate the random generator's cells: {e}") from e
    graph.meta["rng"] = {"increment": increment, "cells": len(cells)}
    return increment
