"""The node builders of nimble.driver.nodes on stand-in bindings (no GPU): arguments passed as
a launch passed them, copies of recorded nodes with their device ends moved, Nimble's own
kernel nodes with 64-bit arguments."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
from helpers import param_words

from nimble import driver
from nimble.driver import calls


@pytest.fixture
def log(monkeypatch):
    """Stand-in bindings recording what each node-adding call received."""
    added: list = []
    memcpy = SimpleNamespace(srcMemoryType=1, srcDevice=0, srcHost=0x10, dstMemoryType=2,
                             dstDevice=0x2000)

    def add(kind):
        def fn(graph, deps, count, params, *ctx):
            added.append((kind, list(deps), params, ctx))
            return 0, f"{kind} node"
        return fn
    fake = SimpleNamespace(
        CUresult=SimpleNamespace(CUDA_SUCCESS=0), CUDA_KERNEL_NODE_PARAMS=SimpleNamespace,
        cuGraphAddKernelNode=add("kernel"), cuGraphAddMemsetNode=add("memset"),
        cuGraphAddMemcpyNode=add("memcpy"),
        cuGraphKernelNodeGetParams=lambda node: (0, SimpleNamespace(
            func="recorded", sharedMemBytes=0, kernelParams=0, extra=0)),
        cuGraphKernelNodeCopyAttributes=lambda dst, src: (added.append(("attrs", dst, src)),
                                                          (0,))[1],
        cuGraphMemsetNodeGetParams=lambda node: (0, SimpleNamespace(dst=0x1000)),
        cuGraphMemcpyNodeGetParams=lambda node: (0, memcpy))
    monkeypatch.setattr(calls, "_drv", fake)
    return added


def test_arguments_go_as_one_pointer_per_parameter_or_one_packed_buffer():
    block = bytes(range(16))
    params, extra, keep = driver.kernel_arguments(block, [(0, 8), (8, 4), (12, 4)], False)
    slots = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
    assert extra == 0 and [ctypes.string_at(slots[i], 4) for i in range(3)] == \
        [block[0:4], block[8:12], block[12:16]]
    params, extra, keep = driver.kernel_arguments(block, [(0, 16)], True)
    words = ctypes.cast(extra, ctypes.POINTER(ctypes.c_void_p))
    assert params == 0 and words[0] == 1 and words[2] == 2 and not words[4]
    assert ctypes.string_at(words[1], 16) == block
    assert ctypes.c_size_t.from_address(words[3]).value == 16
    assert driver.kernel_arguments(b"", [], False)[:2] == (0, 0)


def test_a_kernel_node_like_a_recorded_one_keeps_its_attributes(log):
    node = driver.add_kernel_node_like("graph", ["a"], "recorded node", bytes(8), [(0, 8)],
                                       False, detail="task 1")
    (kind, deps, params, _), attrs = log
    assert (kind, deps, params.func, node) == ("kernel", ["a"], "recorded", "kernel node")
    assert attrs == ("attrs", "kernel node", "recorded node")


def test_copies_move_only_their_device_ends(log):
    driver.add_memset_node_like("graph", [], "node", "ctx", lambda side, at: at + 0x100)
    driver.add_memcpy_node_like("graph", [], "node", "ctx", lambda side, at: at + 0x100)
    (_, _, memset, ctx), (_, _, memcpy, _) = log
    assert memset.dst == 0x1100 and ctx == ("ctx",)
    assert (memcpy.srcDevice, memcpy.srcHost, memcpy.dstDevice) == (0, 0x10, 0x2100)
    log.clear()
    driver.add_memset_node_like("graph", [], "node", "ctx")  # a built node: already in place
    assert log[0][2].dst == 0x1000


def test_nimbles_own_kernel_nodes_take_64_bit_arguments(log):
    seen = []

    def add(graph, deps, count, params):
        seen.append((param_words(params.kernelParams, 2),
                     (params.gridDimX, params.blockDimX, params.sharedMemBytes, params.extra)))
        return 0, "node"
    calls._drv.cuGraphAddKernelNode = add
    driver.add_function_node("graph", [], "fn", (3, 1, 1), (256, 1, 1), (1 << 40, 7))
    assert seen == [([1 << 40, 7], (3, 256, 0, 0))]
