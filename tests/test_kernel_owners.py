"""The owners of a prepared graph's Triton kernels (nimble.engine.kernel_owners), on the CPU with
stand-ins for Triton's kernel objects and the driver's kernel nodes: the objects holding the
graph's functions are found and kept alive, the others are not, and nothing is scanned where
Triton was never imported."""
from __future__ import annotations

import gc
import sys
import types
import weakref
from types import SimpleNamespace

import pytest

from nimble.engine import kernel_binaries, kernel_owners
from nimble.ir.taskgraph import TaskKind
from nimble.record import binaries


class _CompiledKernel:
    """Stands in for Triton's CompiledKernel (its module name is what the scan looks at)."""

    def __init__(self, function: int) -> None:
        self.function, self.hash, self.kernel = function, f"h{function}", b"cubin"


_CompiledKernel.__module__ = "triton.compiler.compiler"


@pytest.fixture
def graph_of(monkeypatch):
    """A maker of stand-in prepared graphs whose kernel nodes run ``functions`` (0: a
    library's CUkernel node, no function), with one memset node, the driver's node query stood
    in for."""
    monkeypatch.setitem(sys.modules, "triton", sys.modules.get("triton")
                        or types.ModuleType("triton"))
    monkeypatch.setattr(kernel_owners.driver, "kernel_node_params",
                        lambda node: SimpleNamespace(func=node))
    # what LiveKernel.of asks the driver of a function
    monkeypatch.setattr(kernel_binaries.driver, "function_fingerprint",
                        lambda f: {"NUM_REGS": f % 97})
    monkeypatch.setattr(kernel_binaries.driver, "function_param_layout", lambda f: [(0, 8)])
    monkeypatch.setattr(kernel_binaries.driver, "function_attributes", lambda f, names: {})

    def make(functions):
        """A stand-in prepared graph (its graph, built phases and kept owners)."""
        kinds = [TaskKind.KERNEL] * len(functions) + [TaskKind.MEMSET]
        graph = SimpleNamespace(tasks=[SimpleNamespace(kind=k, name=f"triton_poi_{i}",
                                                       block=(128, 1, 1), shared_mem=0)
                                       for i, k in enumerate(kinds)])
        nodes = list(functions) + [None]
        return SimpleNamespace(graph=graph, builts=[None], built_nodes=lambda phase: nodes,
                               kernel_owners=[], kernel_facts={})
    return make


def test_the_owners_of_the_graphs_functions_are_kept_and_no_others(graph_of):
    mine, theirs, other = (_CompiledKernel(f) for f in (0x1000, 0x1100, 0x2000))
    first, second = graph_of([0x1000, 0]), graph_of([0x1100, 0x1000])
    assert kernel_owners.kernel_functions(first) == {0x1000}
    kernel_owners.keep_owners([first, second])
    assert first.kernel_owners == [mine] and second.kernel_owners == [mine, theirs]
    alive = weakref.ref(mine)
    del mine
    gc.collect()
    assert alive() is not None, "the graph's kernel owner was collected while kept"
    assert other not in first.kernel_owners + second.kernel_owners


def test_the_loaded_kernels_hashes_and_images_are_read_from_the_same_holders(graph_of):
    held = _CompiledKernel(0x3000)
    assert binaries.triton_loaded()[0x3000] == binaries.TritonLoaded("h12288", b"cubin")
    assert binaries.triton_owners({0x3000}) == {0x3000: [held]}


def test_nothing_is_scanned_where_triton_was_never_imported(graph_of, monkeypatch):
    held = _CompiledKernel(0x4000)
    prepared = graph_of([0x4000])
    monkeypatch.delitem(sys.modules, "triton")
    kernel_owners.keep_owners([prepared])
    assert prepared.kernel_owners == [] and binaries.triton_owners({0x4000}) == {}
    assert held.function == 0x4000


def test_a_graph_whose_nodes_cannot_be_read_keeps_nothing_and_warns(graph_of, monkeypatch,
                                                                     caplog):
    from nimble.errors import CudaError

    def refuse(node):
        raise CudaError("cuGraphKernelNodeGetParams", 400, "CUDA_ERROR_INVALID_HANDLE")
    prepared = graph_of([0x5000])
    monkeypatch.setattr(kernel_owners.driver, "kernel_node_params", refuse)
    with caplog.at_level("WARNING", logger="nimble"):
        kernel_owners.keep_owners([prepared])
    assert prepared.kernel_owners == []
    assert "keep the compiled model alive" in caplog.text


def test_what_a_save_needs_of_each_triton_kernel_is_taken_at_the_prepare(graph_of,
                                                                         monkeypatch, caplog):
    """Facts of the graph's Triton kernels (not of a library's kernel), so that a save reads
    them and not the driver: one whose module was closed since is still written down."""
    from nimble.engine import saving

    held = _CompiledKernel(0x6000)
    prepared = graph_of([0x6000, 0x7000])  # 0x7000: no Triton object holds it (a library's)
    kernel_owners.keep_owners([prepared])
    assert list(prepared.kernel_facts) == [0x6000]
    fact = prepared.kernel_facts[0x6000]
    assert (fact.name, fact.triton_hash, fact.held_image, fact.threads) == \
        ("triton_poi_0", "h24576", b"cubin", 128)
    assert held.function == 0x6000

    from nimble.errors import CudaError

    def unloaded(f):
        raise CudaError("cuFuncGetAttribute", 400, "CUDA_ERROR_INVALID_HANDLE", "NUM_REGS")
    monkeypatch.setattr(kernel_binaries.driver, "function_fingerprint", unloaded)
    monkeypatch.setattr(saving.driver, "function_fingerprint", unloaded)
    kernels = saving._Kernels({}, prepared.kernel_facts)
    with caplog.at_level("WARNING", logger="nimble"):
        assert kernels.index(prepared.graph.tasks[0], 0x6000) == 0
    assert kernels.kernels == [fact]  # written from the prepare's facts
    assert "triton_poi_0 of this graph was unloaded after its prepare" in caplog.text


def test_a_kernel_unloaded_before_the_prepare_ends_is_left_out_with_a_warning(graph_of,
                                                                             monkeypatch,
                                                                             caplog):
    from nimble.errors import CudaError

    held = _CompiledKernel(0x8000)
    prepared = graph_of([0x8000])

    def gone(f):
        raise CudaError("cuFuncGetAttribute", 400, "CUDA_ERROR_INVALID_HANDLE",
                        "MAX_THREADS_PER_BLOCK")
    monkeypatch.setattr(kernel_binaries.driver, "function_fingerprint", gone)
    with caplog.at_level("WARNING", logger="nimble"):
        kernel_owners.keep_owners([prepared])
    assert prepared.kernel_facts == {} and prepared.kernel_owners == [held]
    assert "triton_poi_0 of a graph being prepared is no longer loaded" in caplog.text


def test_a_driver_that_answers_otherwise_leaves_the_kernel_to_the_save(graph_of, monkeypatch):
    from nimble.errors import CudaError

    held = _CompiledKernel(0x9000)
    prepared = graph_of([0x9000])

    def old_driver(f):
        raise CudaError("cuFuncGetParamInfo", 500, "CUDA_ERROR_NOT_FOUND")
    monkeypatch.setattr(kernel_binaries.driver, "function_param_layout", old_driver)
    kernel_owners.keep_owners([prepared])  # the prepare goes on
    assert prepared.kernel_facts == {} and prepared.kernel_owners == [held]
