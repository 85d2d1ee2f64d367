"""tools/experiments/param_access.py: reading which parameters a demangled kernel signature
declares read-only, and lining them up with a task's parameter layout (no GPU, no c++filt)."""
from __future__ import annotations

from helpers import load_tool
from nimble.ir.taskgraph import Access, Buffer, Pointer, Task, TaskGraph

tool = load_tool("experiments/param_access")

POOL = ("void at::native::(anonymous namespace)::max_pool_forward_nchw<c10::Half, int>(int, "
        "c10::Half const*, long, int, c10::Half*, long*)")
ACCESSOR = ("void k<float>(torch::detail::GenericPackedTensorAccessor<torch::detail::TensorAccessor"
            "<c10::ArrayRef<long>, c10::Half const, 2ul, R, int>, B<3ul, int>, c10::Half const, "
            "3ul, R, int>, torch::detail::GenericPackedTensorAccessor<torch::detail::"
            "TensorAccessor<c10::ArrayRef<long>, c10::Half, 2ul, R, int>, B<3ul, int>, c10::Half, "
            "3ul, R, int>, float)")


def test_the_parameters_of_a_signature_are_split_at_its_top_level_commas():
    assert tool.parameters(POOL) == ["int", "c10::Half const*", "long", "int", "c10::Half*",
                                     "long*"]
    assert len(tool.parameters(ACCESSOR)) == 3
    assert tool.parameters("nvjet_sm90_hsh_64x8_64x16_4x1_v_bz_bias_TNT") is None
    assert tool.parameters("void f<(kind)0>(void)") == []


def test_pointers_and_accessors_to_const_are_read_only_and_structs_unknown():
    pool = tool.parameters(POOL)
    assert [tool.read_only(p) for p in pool] == [None, True, None, None, False, False]
    assert [tool.read_only(p) for p in tool.parameters(ACCESSOR)] == [True, False, None]
    assert tool.read_only("float const* __restrict__") is True
    assert tool.read_only("std::array<char*, 2ul>") is None


def test_a_write_through_a_read_only_parameter_becomes_a_read():
    task = Task(0, "kernel", name="_Zpool", param_layout=[(0, 4), (8, 8), (16, 8), (24, 4),
                                                          (32, 8), (40, 8)],
                pointers=[Pointer(8, 0x1000, 0, 0), Pointer(32, 0x2000, 1, 0)],
                accesses=[Access(0, 0, 64, True), Access(1, 0, 64, True)])
    graph = TaskGraph(tasks=[task], buffers=[Buffer(0, "intermediate", 64, 0x1000),
                                             Buffer(1, "intermediate", 64, 0x2000)])
    reads = tool.read_only_pointers(graph, {"_Zpool": POOL})
    assert reads == {0: {0}}
    refined = tool.with_reads(graph, reads)
    assert [a.write for a in refined.tasks[0].accesses] == [False, True]
    assert [a.write for a in graph.tasks[0].accesses] == [True, True]  # the original kept
    # a signature whose parameters do not line up with the layout is left out
    assert tool.read_only_pointers(graph, {"_Zpool": "void f(int)"}) == {}
