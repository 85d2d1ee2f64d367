"""Typed wrappers for graphs, their nodes, streams and device memory copies.

This module owns the driver calls that read a captured graph (its nodes, their kinds and
parameters, the functions kernels name), that add nodes to a graph Nimble builds and set their
kernel priorities, that change and launch an instantiated graph, and that copy bytes between host
and device; plus :class:`CallPath`, the per-call path's checked functions bound once.  Each is a
thin, checked :func:`~nimble.driver.calls.call`, so the rest of Nimble never names a ``cu*``
function.
"""
from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

from .calls import bindings, call, checked_status, probe
from .stored import StoredNode, set_kernel_node_attributes


# ---- typed wrappers: the rest of Nimble calls these, never a ``cu*`` function by name -------

def stream(handle) -> Any:
    """A ``CUstream`` for ``handle`` (a ``CUstream``, a raw integer handle, or 0/None)."""
    drv = bindings()
    return handle if isinstance(handle, drv.CUstream) else drv.CUstream(int(handle or 0))


def capture_graph(stream_handle) -> Any | None:
    """The graph ``stream_handle`` is capturing into, or None when it is not capturing."""
    drv = bindings()
    info = call("cuStreamGetCaptureInfo", stream(stream_handle))
    if info[0] != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
        return None
    return info[2]


def node_count(graph) -> int:
    """How many nodes ``graph`` holds."""
    return int(call("cuGraphGetNodes", graph, 0)[1])


def graph_nodes(graph) -> list:
    """Every node of ``graph``, in the driver's order (creation order for a captured graph)."""
    count = node_count(graph)
    return list(call("cuGraphGetNodes", graph, count)[0])[:count]


def node_type(node) -> str:
    """``"kernel"``, ``"memset"``, ``"memcpy"``, or the driver's ``CU_GRAPH_NODE_TYPE_*`` name."""
    drv = bindings()
    t = call("cuGraphNodeGetType", node)
    kinds = {drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL: "kernel",
             drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMSET: "memset",
             drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMCPY: "memcpy"}
    return kinds.get(t, getattr(t, "name", str(t)))


def kernel_node_params(node) -> Any:
    """A kernel node's ``CUDA_KERNEL_NODE_PARAMS`` (argument memory owned by the node); for a
    :class:`~nimble.driver.stored.StoredNode`, a fresh struct without arguments."""
    if isinstance(node, StoredNode):
        return node.params()
    return call("cuGraphKernelNodeGetParams", node)


def memset_node_params(node) -> Any:
    """A memset node's ``CUDA_MEMSET_NODE_PARAMS`` (a recorded or a stored node's)."""
    if isinstance(node, StoredNode):
        return node.params()
    return call("cuGraphMemsetNodeGetParams", node)


def memcpy_node_params(node) -> Any:
    """A memcpy node's ``CUDA_MEMCPY3D`` (a recorded or a stored node's)."""
    if isinstance(node, StoredNode):
        return node.params()
    return call("cuGraphMemcpyNodeGetParams", node)


def kernel_function_of(kernel) -> Any:
    """The ``CUfunction`` of a library ``CUkernel`` in the current context."""
    return call("cuKernelGetFunction", kernel)


def function_name(func) -> str:
    """A function's (mangled) name."""
    raw = call("cuFuncGetName", func)
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


class FunctionResources(NamedTuple):
    """What one block of a function takes beyond its launch's dynamic shared memory."""

    registers: int  # per thread
    static_shared: int  # bytes of shared memory per block, fixed at compile time


def function_resources(func) -> FunctionResources:
    """A function's registers per thread and static shared memory per block."""
    attr = bindings().CUfunction_attribute
    return FunctionResources(
        int(call("cuFuncGetAttribute", attr.CU_FUNC_ATTRIBUTE_NUM_REGS, func)),
        int(call("cuFuncGetAttribute", attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func)))


def max_active_blocks(func, threads: int, dynamic_shared: int) -> int:
    """The driver's occupancy of ``func``: its blocks of ``threads`` threads and
    ``dynamic_shared`` bytes of dynamic shared memory one SM holds at once."""
    return int(call("cuOccupancyMaxActiveBlocksPerMultiprocessor", func, threads,
                    dynamic_shared))


def function_param_layout(func) -> list[tuple[int, int]]:
    """``(offset, size)`` of each parameter of ``func``; empty where the driver has no info."""
    layout: list[tuple[int, int]] = []
    while True:
        ok, got = probe("cuFuncGetParamInfo", func, len(layout))
        if not ok:
            return layout
        layout.append((int(got[0]), int(got[1])))


def address_range(address: int) -> tuple[int, int] | None:
    """``(base, size)`` of the device allocation holding ``address``, or None if none does."""
    ok, got = probe("cuMemGetAddressRange", bindings().CUdeviceptr(address))
    return (int(got[0]), int(got[1])) if ok else None


def allow_dynamic_shared(func, nbytes: int) -> None:
    """Let ``func`` launch with ``nbytes`` of dynamic shared memory (raise its cap if lower).

    A library may raise the cap on another handle of the same kernel (cuDNN's training batch
    norm does): the function a captured node names can report a cap below what the node
    launches with, and adding that node to a new graph fails with ``CUDA_ERROR_INVALID_VALUE``.
    The cap is raised to the most the device allows, never to ``nbytes`` alone: the setting is
    shared with the library's own handle, and a lower cap than the library set would make its
    later launches with more shared memory fail (cuDNN then reports
    ``CUDNN_STATUS_EXECUTION_FAILED_CUDART`` in eager code run after a prepare).
    """
    drv = bindings()
    attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if int(call("cuFuncGetAttribute", attr, func)) >= nbytes:
        return
    static = int(call("cuFuncGetAttribute",
                      drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func))
    optin = int(call("cuDeviceGetAttribute",
                     drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                     call("cuCtxGetDevice")))
    call("cuFuncSetAttribute", func, attr, max(nbytes, optin - static), detail=f"{nbytes} bytes")


def add_kernel_node(graph, deps: list, params, detail: str = "") -> Any:
    return call("cuGraphAddKernelNode", graph, deps, len(deps), params, detail=detail)


def add_function_node(graph, deps: list, function, grid: tuple[int, int, int],
                      block: tuple[int, int, int], args: tuple[int, ...] | list[int],
                      detail: str = "") -> Any:
    """Add a kernel node running ``function`` (a ``CUfunction`` of a :class:`Module`) on
    ``grid`` blocks of ``block`` threads, without dynamic shared memory, each of ``args`` passed
    as one 64-bit parameter (an address or a count), after ``deps``."""
    drv = bindings()
    params = drv.CUDA_KERNEL_NODE_PARAMS()
    params.func = function
    params.gridDimX, params.gridDimY, params.gridDimZ = grid
    params.blockDimX, params.blockDimY, params.blockDimZ = block
    params.sharedMemBytes = 0
    # The driver copies the values while adding the node: these locals outlive the call.
    values = (ctypes.c_uint64 * max(len(args), 1))(*args)
    slots = (ctypes.c_void_p * max(len(args), 1))(
        *[ctypes.addressof(values) + 8 * i for i in range(len(args))])
    params.kernelParams = ctypes.addressof(slots) if args else 0
    params.extra = 0
    return add_kernel_node(graph, deps, params, detail=detail)


def kernel_arguments(block: bytes, layout, packed: bool) -> tuple[int, int, list]:
    """``(kernelParams, extra, keep)`` addresses that pass the argument bytes ``block`` to the
    driver: one pointer per parameter of ``layout`` (``(offset, size)`` pairs), or with
    ``packed`` the whole buffer through ``extra``.  ``keep`` holds the ctypes objects the
    addresses point into: the driver copies them while adding or updating the node.
    """
    storage = ctypes.create_string_buffer(block, max(len(block), 1))
    base = ctypes.addressof(storage)
    if packed:
        size = ctypes.c_size_t(len(block))
        # CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE, CU_LAUNCH_PARAM_END
        extra = (ctypes.c_void_p * 5)(1, base, 2, ctypes.addressof(size), 0)
        return 0, ctypes.addressof(extra), [storage, size, extra]
    if not layout:
        return 0, 0, [storage]
    slots = (ctypes.c_void_p * len(layout))(*[base + offset for offset, _ in layout])
    return ctypes.addressof(slots), 0, [storage, slots]


def add_kernel_node_like(graph, deps: list, model, block: bytes, layout, packed: bool,
                         detail: str = "") -> Any:
    """Add a kernel node like ``model`` (a kernel node: its function, launch shape, shared
    memory and launch attributes) with the argument bytes ``block`` (see
    :func:`kernel_arguments`), after ``deps``."""
    params = kernel_node_params(model)
    params.kernelParams, params.extra, keep = kernel_arguments(block, layout, packed)
    if params.sharedMemBytes:
        allow_dynamic_shared(params.func, int(params.sharedMemBytes))
    node = add_kernel_node(graph, deps, params, detail=detail)
    del keep
    copy_kernel_attributes(node, model)
    return node


def set_exec_kernel_arguments(exec_handle, node, block: bytes, layout, packed: bool,
                              detail: str = "") -> None:
    """Give kernel node ``node`` of an instantiated graph the argument bytes ``block`` (see
    :func:`kernel_arguments`), without instantiating it again."""
    params = kernel_node_params(node)
    params.kernelParams, params.extra, keep = kernel_arguments(block, layout, packed)
    set_exec_kernel_params(exec_handle, node, params, detail=detail)
    del keep


_DEVICE_MEMORY_TYPES = (2, 4)  # CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED


def add_memset_node_like(graph, deps: list, model, ctx, move=None, detail: str = "") -> Any:
    """Add a memset node like ``model``, its destination at ``move("dst", address)`` (where it
    was when ``move`` is None), after ``deps``."""
    params = memset_node_params(model)
    if move is not None:
        params.dst = move("dst", int(params.dst))
    return add_memset_node(graph, deps, params, ctx, detail=detail)


def add_memcpy_node_like(graph, deps: list, model, ctx, move=None, detail: str = "") -> Any:
    """Add a memcpy node like ``model``, each end in device memory at ``move("src" or "dst",
    address)`` (where it was when ``move`` is None), after ``deps``."""
    params = memcpy_node_params(model)
    for side in ("src", "dst") if move is not None else ():
        if int(getattr(params, side + "MemoryType")) in _DEVICE_MEMORY_TYPES:
            field_name = side + "Device"
            setattr(params, field_name, move(side, int(getattr(params, field_name))))
    return add_memcpy_node(graph, deps, params, ctx, detail=detail)


def copy_kernel_attributes(dst, src) -> None:
    """Give kernel node ``dst`` the launch attributes of ``src`` (a kernel node, or a
    :class:`~nimble.driver.stored.StoredNode` with the attributes it was saved with)."""
    if isinstance(src, StoredNode):
        set_kernel_node_attributes(dst, src.attributes)
        return
    call("cuGraphKernelNodeCopyAttributes", dst, src)


def stream_priority_range() -> tuple[int, int]:
    """``(least, greatest)`` priority numbers of the current context; ``greatest`` is the
    numerically lower, and the higher priority."""
    least, greatest = call("cuCtxGetStreamPriorityRange")
    return int(least), int(greatest)


def set_kernel_priority(node, priority: int) -> None:
    """Give a kernel node a scheduling priority (see :func:`stream_priority_range`); it holds
    where the exec is instantiated with ``node_priority``."""
    drv = bindings()
    value = drv.CUkernelNodeAttrValue()
    value.priority = int(priority)
    call("cuGraphKernelNodeSetAttribute", node,
         drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PRIORITY, value, detail=f"priority {priority}")


def kernel_priority(node) -> int:
    """A kernel node's priority attribute (see :func:`set_kernel_priority`)."""
    drv = bindings()
    value = call("cuGraphKernelNodeGetAttribute", node,
                 drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PRIORITY)
    return int(value.priority)


def add_memset_node(graph, deps: list, params, ctx, detail: str = "") -> Any:
    return call("cuGraphAddMemsetNode", graph, deps, len(deps), params, ctx, detail=detail)


def add_memcpy_node(graph, deps: list, params, ctx, detail: str = "") -> Any:
    return call("cuGraphAddMemcpyNode", graph, deps, len(deps), params, ctx, detail=detail)


def add_empty_node(graph, deps: list) -> Any:
    return call("cuGraphAddEmptyNode", graph, deps, len(deps))


def add_dependencies(graph, pairs) -> None:
    """Add an edge ``u -> v`` to ``graph`` for each node pair of ``pairs``, after both nodes
    exist (edges against the order the nodes were added in); no call for no pairs."""
    pairs = list(pairs)
    if pairs:
        call("cuGraphAddDependencies", graph, [u for u, _ in pairs], [v for _, v in pairs],
             None, len(pairs))


def add_event_record_node(graph, deps: list, event) -> Any:
    return call("cuGraphAddEventRecordNode", graph, deps, len(deps), event)


def add_event_wait_node(graph, deps: list, event) -> Any:
    return call("cuGraphAddEventWaitNode", graph, deps, len(deps), event)


def add_event_node_like(graph, deps: list, model, detail: str = "") -> Any:
    """Add an event record or event wait node on the same event as ``model`` (a node of either
    type), after ``deps``.  The event stays its owner's (NCCL's, which orders a communicator's
    launches inside and outside graphs through it)."""
    if node_type(model) == "CU_GRAPH_NODE_TYPE_EVENT_RECORD":
        event = call("cuGraphEventRecordNodeGetEvent", model, detail=detail)
        return call("cuGraphAddEventRecordNode", graph, deps, len(deps), event, detail=detail)
    event = call("cuGraphEventWaitNodeGetEvent", model, detail=detail)
    return call("cuGraphAddEventWaitNode", graph, deps, len(deps), event, detail=detail)


def set_exec_kernel_params(exec_handle, node, params, detail: str = "") -> None:
    """Change a kernel node's arguments in an instantiated graph (no re-instantiation)."""
    call("cuGraphExecKernelNodeSetParams", exec_handle, node, params, detail=detail)


def upload(exec_handle, stream_handle) -> None:
    """Upload an exec to the device ahead of its next launch (after it was changed)."""
    call("cuGraphUpload", exec_handle, stream(stream_handle))


def launch(exec_handle, stream_handle) -> None:
    call("cuGraphLaunch", exec_handle, stream(stream_handle))


def stream_synchronize(stream_handle) -> None:
    call("cuStreamSynchronize", stream(stream_handle))


def event_elapsed_ms(start, end) -> float:
    return float(call("cuEventElapsedTime", start, end))


def record_event(event, cu_stream) -> None:
    """Record ``event`` on ``cu_stream`` (a ``CUstream``, as :meth:`Launcher.stream` gives)."""
    call("cuEventRecord", event, cu_stream)


def event_synchronize(event) -> None:
    """Wait until the work before ``event``'s latest record has run."""
    call("cuEventSynchronize", event)


def copy_to_device(address: int, data: bytes) -> None:
    """Synchronous host-to-device copy of ``data`` to ``address``."""
    call("cuMemcpyHtoD", address, data, len(data))


def copy_device(dst: int, src: int, size: int) -> None:
    """Synchronous device-to-device copy of ``size`` bytes."""
    call("cuMemcpyDtoD", dst, src, size)


def copy_to_host(address: int, size: int) -> bytes:
    """Synchronous device-to-host copy of ``size`` bytes at ``address``."""
    buf = ctypes.create_string_buffer(max(size, 1))
    call("cuMemcpyDtoH", ctypes.addressof(buf), address, size)
    return buf.raw[:size]


def fill_bytes_async(address: int, value: int, size: int, stream_handle) -> None:
    """Set ``size`` bytes at ``address`` to ``value``, in stream order."""
    call("cuMemsetD8Async", bindings().CUdeviceptr(address), value, size, stream(stream_handle))


class CallPath:
    """The driver functions a prepared graph's per-call path uses, bound and checked once.

    Attribute lookups on this object are all a call pays: no name lookup in the bindings, no
    argument conversion beyond the driver's own.  ``graph_launch`` is the binding itself, for
    the one caller that reads its ``(CUresult,)`` and passes a failure to
    :func:`~nimble.driver.raise_status` inline (a Python frame is a measurable share of an idle
    call's host time); every other function here is checked.
    """

    __slots__ = ("launch", "graph_launch", "copy", "write64", "record", "wait", "set_context")

    def __init__(self) -> None:
        self.launch = checked_status("cuGraphLaunch")
        self.graph_launch = bindings().cuGraphLaunch
        self.copy = checked_status("cuMemcpyDtoDAsync")
        self.write64 = checked_status("cuStreamWriteValue64")
        self.record = checked_status("cuEventRecord")
        self.wait = checked_status("cuStreamWaitEvent")
        self.set_context = checked_status("cuCtxSetCurrent")


def read_host(address: int, size: int) -> bytes:
    """Bytes of host memory owned by the driver (e.g. a node's copy of kernel parameters)."""
    return ctypes.string_at(address, size)
