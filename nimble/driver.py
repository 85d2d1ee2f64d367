"""The only module that calls ``cuda.bindings.driver``.

Every driver call goes through :func:`call` (or :func:`probe`, for calls whose failure is an
answer), which unwraps the ``(CUresult, *values)`` tuple and raises :class:`CudaError` naming the
call and the ``CUDA_ERROR_*`` code.  Every handle Nimble creates has exactly one owner here; it is
freed by an idempotent ``close()`` or, failing that, by a ``weakref.finalize`` that never raises.

Importing this module does not touch the GPU: the bindings are imported on first use.
"""
from __future__ import annotations

import ctypes
import weakref
from typing import Any

from .errors import CudaError, NoGpuError

_drv: Any = None


def bindings():
    """The ``cuda.bindings.driver`` module (imported on first use)."""
    global _drv
    if _drv is None:
        try:
            from cuda.bindings import driver
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise NoGpuError(
                "cuda-bindings is not installed: pip install cuda-bindings (the CUDA driver API "
                f"for Python) to record or run models ({e})") from e
        _drv = driver
    return _drv


def _error_name(code) -> str:
    drv = bindings()
    try:
        err, name = drv.cuGetErrorName(code)
        if err == drv.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - the name is a courtesy; the code is still reported
        pass
    return getattr(code, "name", f"CUresult({int(code)})")


def _unwrap(result, name: str, detail: str = ""):
    code = result[0]
    if code != _drv.CUresult.CUDA_SUCCESS:
        raise CudaError(name, int(code), _error_name(code), detail)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def call(name: str, *args, detail: str = ""):
    """Call driver function ``name``; return its values (none, one, or a tuple); raise on error."""
    return _unwrap(getattr(bindings(), name)(*args), name, detail)


def checked(name: str):
    """Driver function ``name`` bound once, checked like :func:`call` (for per-call paths)."""
    fn = getattr(bindings(), name)

    def checked_call(*args, detail: str = ""):
        return _unwrap(fn(*args), name, detail)
    checked_call.__name__ = name
    return checked_call


def probe(name: str, *args):
    """Call a driver function whose failure is an expected answer: ``(ok, values)``."""
    result = getattr(bindings(), name)(*args)
    if result[0] != _drv.CUresult.CUDA_SUCCESS:
        return False, None
    return True, (result[1] if len(result) == 2 else result[1:] if len(result) > 2 else None)


def ensure_context() -> Any:
    """Initialise the driver and make torch's primary context current on this thread.

    Raises :class:`NoGpuError` where there is no GPU or driver.
    """
    try:
        import torch
    except ImportError as e:  # pragma: no cover
        raise NoGpuError(f"torch is not importable: {e}") from e
    if not torch.cuda.is_available():
        raise NoGpuError(
            "no CUDA GPU or driver found (torch.cuda.is_available() is False). Nimble records "
            "and runs models on NVIDIA GPUs; `nimble inspect` works on saved recordings without one.")
    torch.cuda.init()
    drv = bindings()
    call("cuInit", 0)
    ctx = call("cuCtxGetCurrent")
    if ctx is None or int(ctx) == 0:
        dev = call("cuDeviceGet", torch.cuda.current_device())
        ctx = call("cuDevicePrimaryCtxRetain", dev)
        # The reference is kept: torch may not have made its own yet (its CUDA init is lazy),
        # and releasing the only one would destroy the context under us.
        call("cuCtxSetCurrent", ctx)
    return ctx if isinstance(ctx, drv.CUcontext) else drv.CUcontext(int(ctx))


# ---- typed wrappers: the rest of Nimble calls these, never a ``cu*`` function by name -------

def stream(handle) -> Any:
    """A ``CUstream`` for ``handle`` (a ``CUstream``, a raw integer handle, or 0/None)."""
    drv = bindings()
    return handle if isinstance(handle, drv.CUstream) else drv.CUstream(int(handle or 0))


def current_context() -> Any:
    """The ``CUcontext`` current on this thread."""
    return call("cuCtxGetCurrent")


def synchronize_context() -> None:
    """Wait for all work in the current context."""
    call("cuCtxSynchronize")


def device_supports_stream_writes(ordinal: int) -> bool:
    """Whether the GPU takes 64-bit stream memory writes (``cuStreamWriteValue64``)."""
    drv = bindings()
    attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
    return bool(call("cuDeviceGetAttribute", attr, call("cuDeviceGet", ordinal)))


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
    """A kernel node's ``CUDA_KERNEL_NODE_PARAMS`` (argument memory owned by the node)."""
    return call("cuGraphKernelNodeGetParams", node)


def memset_node_params(node) -> Any:
    """A memset node's ``CUDA_MEMSET_NODE_PARAMS``."""
    return call("cuGraphMemsetNodeGetParams", node)


def memcpy_node_params(node) -> Any:
    """A memcpy node's ``CUDA_MEMCPY3D``."""
    return call("cuGraphMemcpyNodeGetParams", node)


def kernel_function_of(kernel) -> Any:
    """The ``CUfunction`` of a library ``CUkernel`` in the current context."""
    return call("cuKernelGetFunction", kernel)


def function_name(func) -> str:
    """A function's (mangled) name."""
    raw = call("cuFuncGetName", func)
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


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


def copy_kernel_attributes(dst, src) -> None:
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


def add_event_record_node(graph, deps: list, event) -> Any:
    return call("cuGraphAddEventRecordNode", graph, deps, len(deps), event)


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
    argument conversion beyond the driver's own.
    """

    __slots__ = ("launch", "copy", "write64", "record", "wait", "set_context")

    def __init__(self) -> None:
        self.launch = checked("cuGraphLaunch")
        self.copy = checked("cuMemcpyDtoDAsync")
        self.write64 = checked("cuStreamWriteValue64")
        self.record = checked("cuEventRecord")
        self.wait = checked("cuStreamWaitEvent")
        self.set_context = checked("cuCtxSetCurrent")


def read_host(address: int, size: int) -> bytes:
    """Bytes of host memory owned by the driver (e.g. a node's copy of kernel parameters)."""
    return ctypes.string_at(address, size)


def _quiet(fn_name: str, handle) -> None:
    """Finalizer body: free a handle, never raise (the driver may already be shut down)."""
    try:
        drv = bindings()
        getattr(drv, fn_name)(handle)
    except Exception:  # noqa: BLE001 - finalizers must not raise
        pass


class _Owned:
    """A driver handle with one owner: ``close()`` frees it once; a finalizer covers the rest."""

    _destroy = ""

    def __init__(self, handle) -> None:
        self.handle = handle
        self._finalizer = weakref.finalize(self, _quiet, self._destroy, handle)

    def close(self) -> None:
        """Free the handle now (idempotent)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __int__(self) -> int:
        return int(self.handle)


class Graph(_Owned):
    """An owned ``CUgraph`` built by Nimble."""

    _destroy = "cuGraphDestroy"

    @classmethod
    def create(cls) -> "Graph":
        return cls(call("cuGraphCreate", 0))


class GraphExec(_Owned):
    """An owned ``CUgraphExec``."""

    _destroy = "cuGraphExecDestroy"

    @classmethod
    def instantiate(cls, graph: Graph, *, device_launch: bool = False,
                    upload_stream=None, node_priority: bool = False) -> "GraphExec":
        """Instantiate ``graph``.

        ``device_launch`` makes the exec launchable from the device too: the driver keeps the
        whole graph on the GPU, and a host launch becomes a short, constant-cost submission.
        ``upload_stream`` uploads the exec there right away, so the first launch costs no more
        than the others.  ``node_priority`` makes the kernel nodes' own priorities count (see
        :func:`set_kernel_priority`) instead of the launch stream's.  A refusal raises
        :class:`CudaError` naming the driver's reason and node.
        """
        drv = bindings()
        flags = 0
        kinds = drv.CUgraphInstantiate_flags
        if node_priority:
            flags |= int(kinds.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY)
        if not device_launch and upload_stream is None:
            return cls(call("cuGraphInstantiate", graph.handle, flags))
        params = drv.CUDA_GRAPH_INSTANTIATE_PARAMS()
        if device_launch:
            flags |= int(kinds.CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH)
        if upload_stream is not None:
            flags |= int(kinds.CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD)
            params.hUploadStream = upload_stream
        params.flags = flags
        result = drv.cuGraphInstantiateWithParams(graph.handle, params)
        detail = ""
        if result[0] != drv.CUresult.CUDA_SUCCESS:
            reason = getattr(params.result_out, "name", str(params.result_out))
            detail = f"{reason}, at node {int(params.hErrNode_out):#x}" \
                if params.hErrNode_out is not None and int(params.hErrNode_out) else reason
        return cls(_unwrap(result, "cuGraphInstantiateWithParams", detail))


# Device memory Nimble allocated and still holds, ``{address: size}``: a recording made while
# another prepared graph lives must not take that graph's arena for a library's memory.
_nimble_memory: dict[int, int] = {}


def nimble_memory() -> list[tuple[int, int]]:
    """``(address, size)`` of every device allocation Nimble holds now (arenas and the like)."""
    return list(_nimble_memory.items())


def _hold(owner, address: int, size: int) -> None:
    _nimble_memory[address] = size
    weakref.finalize(owner, _nimble_memory.pop, address, None)


class DeviceMemory(_Owned):
    """An owned ``cuMemAlloc`` allocation: the static arena."""

    _destroy = "cuMemFree"

    def __init__(self, handle, size: int) -> None:
        super().__init__(handle)
        self.size = size
        _hold(self, int(handle), max(int(size), 1))
        # memory that lives as long as the arena does (whatever keeps the arena alive, such as an
        # output tensor viewing it, keeps these alive too)
        self.companions: list = []

    def close(self) -> None:
        """Free the arena and its companions now (idempotent)."""
        for companion in self.companions:
            companion.close()
        _nimble_memory.pop(int(self.handle), None)
        super().close()

    @classmethod
    def allocate(cls, size: int) -> "DeviceMemory":
        return cls(call("cuMemAlloc", max(int(size), 1)), int(size))

    @property
    def address(self) -> int:
        return int(self.handle)


_FOUR_GIB = 1 << 32


def _unmap_quietly(steps: list) -> None:
    """Finalizer body of :class:`LowBitsMemory`: undo its mapping steps, newest first."""
    for fn_name, args in reversed(steps):
        try:
            getattr(bindings(), fn_name)(*args)
        except Exception:  # noqa: BLE001 - finalizers must not raise
            pass


class LowBitsMemory:
    """Device memory at an address whose low 32 bits the caller chose (``cuMemAddressReserve``
    plus ``cuMemCreate``/``cuMemMap``), owned like every handle here.

    A buffer that a kernel word may point into *or* that the word may merely resemble (a 32-bit
    integer whose padding holds the top half of an old address; see :mod:`nimble.resolve`) lives
    here, at its recorded address plus a multiple of 4 GiB: relocating the word then rewrites only
    its top half, which is right for a pointer and harmless for an integer.
    """

    def __init__(self, address: int, size: int, steps: list) -> None:
        self.address = address
        self.size = size
        self._finalizer = weakref.finalize(self, _unmap_quietly, steps)
        _hold(self, address, max(size, 1))

    @classmethod
    def allocate(cls, size: int, low_bits: int, device: int) -> "LowBitsMemory":
        drv = bindings()
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        grain = int(call("cuMemGetAllocationGranularity", prop,
                         drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        low_bits %= _FOUR_GIB
        first = low_bits - low_bits % grain
        span = -(-(low_bits + max(int(size), 1) - first) // grain) * grain
        reserve = 2 * _FOUR_GIB + span  # room for a 4 GiB-aligned window and the span after it
        steps: list = []
        try:
            va = int(call("cuMemAddressReserve", reserve, 0, 0, 0))
            steps.append(("cuMemAddressFree", (va, reserve)))
            window = -(-va // _FOUR_GIB) * _FOUR_GIB
            handle = call("cuMemCreate", span, prop, 0)
            steps.append(("cuMemRelease", (handle,)))
            call("cuMemMap", window + first, span, 0, handle, 0)
            steps.append(("cuMemUnmap", (window + first, span)))
            access = drv.CUmemAccessDesc()
            access.location = prop.location
            access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            call("cuMemSetAccess", window + first, span, [access], 1)
        except BaseException:
            _unmap_quietly(steps)
            raise
        return cls(window + low_bits, int(size), steps)

    def close(self) -> None:
        """Unmap and free now (idempotent)."""
        _nimble_memory.pop(self.address, None)
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


class Module(_Owned):
    """An owned ``CUmodule`` (Nimble's own kernels, from PTX)."""

    _destroy = "cuModuleUnload"

    @classmethod
    def load_data(cls, image: bytes, detail: str = "") -> "Module":
        return cls(call("cuModuleLoadData", image, detail=detail))

    def function(self, name: str):
        """The ``CUfunction`` called ``name`` in this module."""
        return call("cuModuleGetFunction", self.handle, name.encode(), detail=name)


class Event(_Owned):
    """An owned ``CUevent`` (timing enabled unless ``timing=False``)."""

    _destroy = "cuEventDestroy"

    @classmethod
    def create(cls, timing: bool = True) -> "Event":
        drv = bindings()
        flags = drv.CUevent_flags.CU_EVENT_DEFAULT if timing else \
            drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        return cls(call("cuEventCreate", int(flags)))
