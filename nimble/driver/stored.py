"""Graph nodes rebuilt from stored descriptions, and kernels loaded from their binaries.

A saved graph (:mod:`nimble.engine.saving`) holds no driver handles: each node is written down
as plain values (a kernel's launch shape and launch attributes, a memset's or memcpy's fields)
and each kernel as the bytes of the fatbin or cubin that holds it.  This module reads those
values off a live node (:func:`kernel_node_attributes`, :func:`memset_fields`,
:func:`memcpy_fields`, :func:`function_fingerprint`), loads the binaries back
(:class:`Library`), and makes :class:`StoredNode` objects that the node-building functions of
:mod:`nimble.driver.nodes` take wherever they take a recorded node.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

from ..errors import NimbleError
from .calls import bindings, call, probe
from .handles import _Owned

# The launch attribute value is a C union of 64 bytes (cuda.h: CUlaunchAttributeValue).
ATTRIBUTE_BYTES = 64

#: Launch attributes that hold a handle or an address of the saving process: a node that sets
#: one cannot be written down.
_PROCESS_BOUND_ATTRIBUTES = ("CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW",
                             "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_EVENT",
                             "CU_LAUNCH_ATTRIBUTE_LAUNCH_COMPLETION_EVENT")
#: Attributes the builder sets itself (the schedule's priorities) or that do not apply to a node
#: Nimble builds.
_SKIPPED_ATTRIBUTES = ("CU_LAUNCH_ATTRIBUTE_PRIORITY", "CU_LAUNCH_ATTRIBUTE_IGNORE",
                       "CU_LAUNCH_ATTRIBUTE_DEVICE_UPDATABLE_KERNEL_NODE",
                       "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION")

#: Function attributes that identify a kernel's binary beyond its name (read-only ones).
FINGERPRINT_ATTRIBUTES = ("MAX_THREADS_PER_BLOCK", "SHARED_SIZE_BYTES", "CONST_SIZE_BYTES",
                          "LOCAL_SIZE_BYTES", "NUM_REGS", "BINARY_VERSION")
#: Function attributes a library may have set on its handle that a launch depends on.
SETTABLE_ATTRIBUTES = ("MAX_DYNAMIC_SHARED_SIZE_BYTES", "NON_PORTABLE_CLUSTER_SIZE_ALLOWED",
                       "CLUSTER_SCHEDULING_POLICY_PREFERENCE",
                       "PREFERRED_SHARED_MEMORY_CARVEOUT")


class ProcessBoundNode(NimbleError):
    """A node whose launch attributes name a handle or address of this process."""


def kernel_node_attributes(node) -> dict[int, bytes]:
    """``{attribute id: the 64 bytes of its value}`` for every launch attribute of kernel node
    ``node`` that is set (not all zeros), except those the builder sets itself.  Raises
    :class:`ProcessBoundNode` for an attribute that holds a handle or an address."""
    drv = bindings()
    found: dict[int, bytes] = {}
    for name in dir(drv.CUlaunchAttributeID):
        if not name.startswith("CU_LAUNCH_ATTRIBUTE_") or name in _SKIPPED_ATTRIBUTES:
            continue
        attr = getattr(drv.CUlaunchAttributeID, name)
        ok, value = probe("cuGraphKernelNodeGetAttribute", node, attr)
        if not ok:
            continue
        raw = ctypes.string_at(value.getPtr(), ATTRIBUTE_BYTES)
        if not any(raw):
            continue
        if name in _PROCESS_BOUND_ATTRIBUTES:
            raise ProcessBoundNode(f"its launch attribute {name} names memory or an event of "
                                   "this process")
        found[int(attr)] = raw
    return found


def set_kernel_node_attributes(node, attributes: dict[int, bytes]) -> None:
    """Give kernel node ``node`` each launch attribute of ``attributes`` (as
    :func:`kernel_node_attributes` read them)."""
    drv = bindings()
    for attr, raw in attributes.items():
        value = drv.CUkernelNodeAttrValue()
        ctypes.memmove(value.getPtr(), bytes(raw), ATTRIBUTE_BYTES)
        call("cuGraphKernelNodeSetAttribute", node, drv.CUlaunchAttributeID(attr), value,
             detail=f"launch attribute {attr}")


def function_attributes(func, names) -> dict[str, int]:
    """``{name: value}`` of the ``CU_FUNC_ATTRIBUTE_<name>`` attributes of ``func``."""
    attr = bindings().CUfunction_attribute
    return {n: int(call("cuFuncGetAttribute", getattr(attr, f"CU_FUNC_ATTRIBUTE_{n}"), func,
                        detail=n)) for n in names}


def function_fingerprint(func) -> dict[str, int]:
    """What identifies a kernel's binary beside its name: registers, static shared, constant
    and local memory, the thread limit and the binary's version."""
    return function_attributes(func, FINGERPRINT_ATTRIBUTES)


def set_function_attributes(func, values: dict[str, int]) -> None:
    """Set each of ``values`` (a subset of :data:`SETTABLE_ATTRIBUTES`) on ``func`` where it
    differs from what the function has."""
    attr = bindings().CUfunction_attribute
    have = function_attributes(func, values)
    for name, value in values.items():
        if have[name] != value:
            call("cuFuncSetAttribute", func, getattr(attr, f"CU_FUNC_ATTRIBUTE_{name}"),
                 int(value), detail=f"{name} = {value}")


_MEMSET_FIELDS = ("dst", "value", "elementSize", "width", "height", "pitch")
_MEMCPY_FIELDS = tuple(f"{side}{name}" for side in ("src", "dst")
                       for name in ("XInBytes", "Y", "Z", "LOD", "MemoryType", "Device",
                                    "Pitch", "Height")) + ("WidthInBytes", "Height", "Depth")


def memset_fields(node) -> dict[str, int]:
    """A memset node's parameters as plain integers."""
    p = call("cuGraphMemsetNodeGetParams", node)
    return {f: int(getattr(p, f)) for f in _MEMSET_FIELDS}


def memcpy_fields(node) -> dict[str, int]:
    """A device-to-device memcpy node's parameters as plain integers; ValueError for a copy
    from or to host memory or an array, which names memory of this process only."""
    p = call("cuGraphMemcpyNodeGetParams", node)
    for side in ("src", "dst"):
        kind = int(getattr(p, side + "MemoryType"))
        if kind not in (2, 4):  # CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED
            raise ValueError(f"a memcpy whose {side} is memory type {kind}, not device memory")
    return {f: int(getattr(p, f)) for f in _MEMCPY_FIELDS}


def _memset_params(fields: dict[str, int]):
    p = bindings().CUDA_MEMSET_NODE_PARAMS()
    for f in _MEMSET_FIELDS:
        setattr(p, f, int(fields[f]))
    return p


def _memcpy_params(fields: dict[str, int]):
    drv = bindings()
    p = drv.CUDA_MEMCPY3D()
    for f in _MEMCPY_FIELDS:
        value = int(fields[f])
        setattr(p, f, drv.CUmemorytype(value) if f.endswith("MemoryType") else value)
    return p


@dataclass
class StoredNode:
    """A node described by plain values, standing where the builder takes a recorded node.

    ``kind`` is ``"kernel"``, ``"memset"`` or ``"memcpy"``.  A kernel has its ``function`` (a
    ``CUfunction`` loaded by :class:`Library`), launch shape, dynamic shared memory and launch
    attributes; a memset or memcpy its parameters (addresses as recorded: the builder moves
    them).
    """

    kind: str
    function: Any = None
    grid: tuple = (1, 1, 1)
    block: tuple = (1, 1, 1)
    shared_mem: int = 0
    attributes: dict = field(default_factory=dict)
    fields: dict = field(default_factory=dict)

    def params(self):
        """A fresh parameter struct of this node (the caller fills in what it changes)."""
        if self.kind == "memset":
            return _memset_params(self.fields)
        if self.kind == "memcpy":
            return _memcpy_params(self.fields)
        p = bindings().CUDA_KERNEL_NODE_PARAMS()
        p.func = self.function
        p.gridDimX, p.gridDimY, p.gridDimZ = (int(v) for v in self.grid)
        p.blockDimX, p.blockDimY, p.blockDimZ = (int(v) for v in self.block)
        p.sharedMemBytes = int(self.shared_mem)
        return p


class Library(_Owned):
    """An owned ``CUlibrary`` loaded from a fatbin, cubin or PTX image in memory."""

    _destroy = "cuLibraryUnload"

    @classmethod
    def load_data(cls, image: bytes, detail: str = "") -> "Library":
        # The driver reads the image during the call; ``image`` outlives it.
        return cls(call("cuLibraryLoadData", image, None, None, 0, None, None, 0,
                        detail=detail))

    def kernel_names(self) -> list[str]:
        """The names of every kernel in the library."""
        count = int(call("cuLibraryGetKernelCount", self.handle))
        kernels = call("cuLibraryEnumerateKernels", count, self.handle) if count else []
        names = []
        for k in list(kernels)[:count]:
            raw = call("cuKernelGetName", k)
            names.append(raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw))
        return names

    def function(self, name: str):
        """The ``CUfunction`` of kernel ``name`` in the current context; None if the library
        has no kernel of that name."""
        ok, kernel = probe("cuLibraryGetKernel", self.handle, name.encode())
        if not ok:
            return None
        return call("cuKernelGetFunction", kernel, detail=name)


def device_architecture(ordinal: int) -> int:
    """The device's compute capability as ``10 * major + minor`` (90 for an H100 or H200)."""
    attr = bindings().CUdevice_attribute
    device = call("cuDeviceGet", ordinal)
    major = int(call("cuDeviceGetAttribute",
                     attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device))
    minor = int(call("cuDeviceGetAttribute",
                     attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device))
    return 10 * major + minor


def driver_version() -> int:
    """``cuDriverGetVersion``: 1000 * major + 10 * minor (13000 for CUDA 13.0)."""
    return int(call("cuDriverGetVersion"))
