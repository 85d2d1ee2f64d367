"""The driver handles Nimble owns: graphs, execs, events, modules and device memory.

Every handle Nimble creates has exactly one owner here (:class:`Graph`, :class:`GraphExec`,
:class:`Event`, :class:`Module`, :class:`DeviceMemory`, :class:`LowBitsMemory`); it is freed by an
idempotent ``close()`` or, failing that, by a ``weakref.finalize`` that never raises.  This module
also owns the one record of the device memory Nimble holds (``_nimble_memory``, read through
:func:`nimble_memory`), which recording consults so it never takes a live arena for a library's.
"""
from __future__ import annotations

import weakref
from typing import Iterable, Sequence

from .calls import _unwrap, bindings, call


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

    def copy_without(self, nodes) -> "Graph":
        """A copy of this graph without ``nodes`` (nodes of this graph) and their edges."""
        copy = Graph(call("cuGraphClone", self.handle))
        try:
            for node in nodes:
                call("cuGraphDestroyNode", call("cuGraphNodeFindInClone", node, copy.handle))
        except BaseException:
            copy.close()
            raise
        return copy

    def clone(self, nodes: Sequence) -> tuple["Graph", list]:
        """A copy of this graph, and the copy's node for each of ``nodes`` (nodes of this
        graph, in order)."""
        copy = Graph(call("cuGraphClone", self.handle))
        try:
            return copy, [call("cuGraphNodeFindInClone", node, copy.handle) for node in nodes]
        except BaseException:
            copy.close()
            raise


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


def close_all(*groups: Iterable) -> None:
    """``close()`` every owner of each group, group by group (users before what they use:
    launchers, then graphs, then the memory they point into)."""
    for group in groups:
        for owner in group:
            owner.close()


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
    integer whose padding holds the top half of an old address; see :mod:`nimble.record.resolve`) lives
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
