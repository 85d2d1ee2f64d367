"""Decoding the nodes of a captured CUDA graph (driver level) into :class:`RawNode` data.

For kernels: the function and its names, launch shape, the parameter block as the kernel sees it
(each parameter at the offset ``cuFuncGetParamInfo`` gives), and every device pointer inside it,
also inside structs: every 8-byte-aligned word that the driver recognises as a device address
(``cuMemGetAddressRange``).  For memcpy/memset nodes: their exact byte ranges.
"""
from __future__ import annotations

import bisect
import ctypes
from typing import Any, Callable, NamedTuple

from .. import driver
from ..errors import RecordError
from ..ir.kernel_names import short_kernel_name
from .raw import DeviceRange, RawNode
from ..ir.taskgraph import TaskKind


class PointerArrayRule(NamedTuple):
    """A kernel family whose parameter ``param`` starts with a fixed-size pointer array of which
    only the first ``live(grid)`` entries are read; the host leaves the rest uninitialised, so
    they hold stale addresses that would otherwise look like real accesses."""

    name_part: str
    param: int
    live: Callable[[tuple[int, int, int]], int]


# ATen's cat: ``CatArrInputTensorMetadata.input[batch]`` comes first in parameter 1, and block
# row ``blockIdx.y`` copies input ``blockIdx.y``, so exactly ``gridDim.y`` entries are live.
POINTER_ARRAY_RULES = (PointerArrayRule("CatArrayBatchedCopy", 1, lambda grid: grid[1]),)


def dead_pointer_slot(name: str, grid: tuple[int, int, int], layout: list[tuple[int, int]],
                      offset: int) -> bool:
    """Whether the 8 bytes at ``offset`` of the parameter block are a never-read array entry."""
    for rule in POINTER_ARRAY_RULES:
        if rule.name_part in name and rule.param < len(layout):
            start, size = layout[rule.param]
            if start + 8 * rule.live(grid) <= offset < start + size:
                return True
    return False


def in_pointerless_param(layout: list[tuple[int, int]], offset: int) -> bool:
    """Whether the 8 bytes at ``offset`` lie in a parameter that cannot hold a pointer: one
    whose size is not a multiple of 8 (a struct with a pointer in it is 8-aligned, so its size
    is), such as cuDNN's 68-byte dimension structs, whose integers sit under stale padding."""
    for start, size in layout:
        if start <= offset < start + size:
            return size % 8 != 0 or offset + 8 > start + size
    return False


_MIN_DEVICE_ADDRESS = 1 << 16
_MAX_DEVICE_ADDRESS = 1 << 57


class AddressOracle:
    """Answers "is this a device address?" with the driver, caching the allocations it finds."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ranges: list[DeviceRange] = []
        self._misses: set[int] = set()

    def range_of(self, value: int) -> DeviceRange | None:
        if not _MIN_DEVICE_ADDRESS <= value < _MAX_DEVICE_ADDRESS or value in self._misses:
            return None
        i = bisect.bisect_right(self._starts, value) - 1
        if i >= 0 and self._ranges[i].address <= value < self._ranges[i].end:
            return self._ranges[i]
        found = driver.address_range(value)
        if found is None:
            self._misses.add(value)
            return None
        r = DeviceRange(*found)
        base = r.address
        k = bisect.bisect_left(self._starts, base)
        self._starts.insert(k, base)
        self._ranges.insert(k, r)
        return r

    @property
    def ranges(self) -> list[DeviceRange]:
        return list(self._ranges)


def decode_node(node, oracle: AddressOracle) -> RawNode:
    node_type = driver.node_type(node)
    if node_type == "kernel":
        return _decode_kernel(node, oracle)
    if node_type == "memset":
        return _decode_memset(node)
    if node_type == "memcpy":
        return _decode_memcpy(node)
    return RawNode(kind=f"other:{node_type}", fields={"node_type": node_type})


def node_signature(node) -> tuple[str, str, bytes]:
    """``(kind, kernel name, parameter block)`` of a node, as :func:`decode_node` reads them:
    what a second capture of the same work must reproduce (see :mod:`nimble.record.twin`)."""
    node_type = driver.node_type(node)
    if node_type != "kernel":
        known = node_type in ("memset", "memcpy")
        return (node_type if known else f"other:{node_type}"), "", b""
    launch = read_kernel_launch(node)
    return TaskKind.KERNEL, launch.name, launch.block


class KernelLaunch(NamedTuple):
    """What a kernel node launches: its params, the function's name and parameter layout, and
    the argument block with how it was passed (``"params"`` or ``"extra"``)."""

    params: Any
    name: str
    layout: list
    block: bytes
    how: str


def read_kernel_launch(node) -> KernelLaunch:
    """A kernel node's launch as the driver holds it (shared by the decoder and the twin)."""
    params = driver.kernel_node_params(node)
    func = kernel_function(params)
    layout = driver.function_param_layout(func)
    block, how = read_param_block(params, layout)
    if how == "extra":
        layout = passed_layout(layout, len(block))
    return KernelLaunch(params, driver.function_name(func), layout, block, how)


def kernel_function(params):
    """The ``CUfunction`` of kernel node params (which may carry a ``CUkernel`` instead)."""
    func = params.func
    if func is not None and int(func) != 0:
        return func
    kern = params.kern
    if kern is not None and int(kern) != 0:
        return driver.kernel_function_of(kern)
    raise RecordError("a kernel node has neither a function nor a kernel handle")


# ``extra`` keys of a launch (cuda.h): a packed argument buffer and a pointer to its size.
_LAUNCH_PARAM_END = 0
_LAUNCH_PARAM_BUFFER_POINTER = 1
_LAUNCH_PARAM_BUFFER_SIZE = 2
_MAX_EXTRA_ENTRIES = 64


def extra_buffer(extra: int) -> bytes:
    """The packed argument buffer of a launch that passes its arguments through ``extra``.

    ``extra`` is the address of the ``void*`` key/value array (``CU_LAUNCH_PARAM_BUFFER_POINTER``,
    ``CU_LAUNCH_PARAM_BUFFER_SIZE``, ended by ``CU_LAUNCH_PARAM_END``); the buffer holds every
    argument at its ABI offset, exactly as a ``kernelParams`` launch would lay them out.
    """
    def word(i: int) -> int:  # one at a time: the array may end right after its END key
        return ctypes.c_void_p.from_address(extra + 8 * i).value or 0

    buffer = size = None
    for i in range(0, 2 * _MAX_EXTRA_ENTRIES, 2):
        key = word(i)
        if key == _LAUNCH_PARAM_END:
            break
        if key == _LAUNCH_PARAM_BUFFER_POINTER:
            buffer = word(i + 1)
        elif key == _LAUNCH_PARAM_BUFFER_SIZE:
            size = ctypes.c_size_t.from_address(word(i + 1)).value
        else:
            raise RecordError(f"a kernel node's 'extra' array holds key {key:#x}, which Nimble "
                              "does not know (only the argument buffer and its size)")
    if buffer is None or size is None:
        raise RecordError("a kernel node's 'extra' array lacks the argument buffer or its size")
    return driver.read_host(buffer, size) if size else b""


def passed_layout(layout: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The parameters a packed argument buffer of ``size`` bytes passes: ``layout``, with its last
    parameter cut to the buffer's end where the buffer ends inside it.

    NCCL's kernels declare one 4 KiB argument struct and pass only the bytes their work fills
    (192 for one all-reduce); the driver takes such a launch, and the kernel reads no further.
    A buffer that ends before the last parameter starts would leave whole parameters unset, and
    is an error.
    """
    if not layout:
        return layout
    end = max(off + n for off, n in layout)
    if size >= end:
        return layout
    *head, (last_off, _) = sorted(layout)
    if size <= last_off or (head and size < max(off + n for off, n in head)):
        raise RecordError(f"a kernel's packed argument buffer holds {size} bytes, but its "
                          f"parameters end at byte {end}")
    return [*head, (last_off, size - last_off)]


def read_param_block(params, layout: list[tuple[int, int]]) -> tuple[bytes, str]:
    """``(block, how)``: the kernel's parameters at their offsets, read from the node's own copy.

    ``how`` is ``"params"`` for a ``kernelParams`` launch and ``"extra"`` for one whose
    arguments came as a packed buffer (cuBLASLt and runtime-compiled kernels launch that way);
    which parameters such a buffer passes is :func:`passed_layout`'s to say.
    """
    array = int(params.kernelParams or 0)
    extra = int(params.extra or 0)
    if array == 0 and extra:
        return extra_buffer(extra), "extra"
    if not layout:
        return b"", "params"
    if array == 0:
        raise RecordError("a kernel node with parameters passes neither kernelParams nor extra")
    block = bytearray(max(off + size for off, size in layout))
    slots = (ctypes.c_void_p * len(layout)).from_address(array)
    for i, (off, size) in enumerate(layout):
        block[off:off + size] = driver.read_host(slots[i], size)
    return bytes(block), "params"


def _decode_kernel(node, oracle: AddressOracle) -> RawNode:
    params, name, layout, block, how = read_kernel_launch(node)
    opaque = how == "extra" and not layout
    if opaque and block:
        layout = [(0, len(block))]  # no per-parameter info: the buffer is one opaque argument
    grid = (int(params.gridDimX), int(params.gridDimY), int(params.gridDimZ))
    pointers = []
    for off in range(0, len(block) - 7, 8):
        value = int.from_bytes(block[off:off + 8], "little")
        if oracle.range_of(value) is not None and not dead_pointer_slot(name, grid, layout, off) \
                and (opaque or not in_pointerless_param(layout, off)):
            pointers.append((off, value))
    return RawNode(
        kind=TaskKind.KERNEL, name=name, short_name=short_kernel_name(name), grid=grid,
        block=(int(params.blockDimX), int(params.blockDimY), int(params.blockDimZ)),
        shared_mem=int(params.sharedMemBytes), param_layout=layout, params=block,
        pointers=pointers, fields={"args": how} if how != "params" else {})


def _decode_memset(node) -> RawNode:
    p = driver.memset_node_params(node)
    dst, width, height = int(p.dst), int(p.width), max(int(p.height), 1)
    element, pitch = int(p.elementSize), int(p.pitch)
    extent = (height - 1) * pitch + width * element
    fields = {"value": int(p.value), "element_size": element, "width": width,
              "height": height, "pitch": pitch}
    return RawNode(kind=TaskKind.MEMSET, name="memset", short_name="memset",
                   ranges=[("dst", dst, extent, True)], fields=fields)


# ``CU_MEMORYTYPE_DEVICE`` and ``CU_MEMORYTYPE_UNIFIED``: the memcpy sides that are device memory
_DEVICE_MEMORY_TYPES = (2, 4)


def _copy_side(p, side: str) -> tuple[int, int, int]:
    """``(memory type, start address, byte extent)`` of one side of a CUDA_MEMCPY3D."""
    g = lambda f: int(getattr(p, side + f) or 0)  # noqa: E731 - a field reader
    mtype = int(getattr(p, side + "MemoryType"))
    base = g("Device") if mtype in _DEVICE_MEMORY_TYPES else g("Host")
    pitch, height = g("Pitch"), max(g("Height"), 1)
    start = base + g("XInBytes") + g("Y") * pitch + g("Z") * height * pitch
    depth, rows = max(int(p.Depth), 1), max(int(p.Height), 1)
    extent = ((depth - 1) * height + (rows - 1)) * pitch + int(p.WidthInBytes)
    return mtype, start, extent


def _decode_memcpy(node) -> RawNode:
    p = driver.memcpy_node_params(node)
    src_type, src, src_extent = _copy_side(p, "src")
    dst_type, dst, dst_extent = _copy_side(p, "dst")
    ranges = []
    if src_type in _DEVICE_MEMORY_TYPES:
        ranges.append(("src", src, src_extent, False))
    if dst_type in _DEVICE_MEMORY_TYPES:
        ranges.append(("dst", dst, dst_extent, True))
    fields = {"src_type": src_type, "dst_type": dst_type, "width": int(p.WidthInBytes),
              "height": int(p.Height), "depth": int(p.Depth)}
    return RawNode(kind=TaskKind.MEMCPY, name="memcpy", short_name="memcpy", ranges=ranges,
                   fields=fields)
