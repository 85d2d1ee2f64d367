"""Which words of a kernel's parameter block are pointers it may read (no GPU)."""
from __future__ import annotations

import pytest
from helpers import FIXTURE_PATHS, fixture_ids

from nimble.record.decode import dead_pointer_slot
from nimble.ir.taskgraph import TaskGraph, TaskKind

CAT = "void at::native::(anonymous namespace)::CatArrayBatchedCopy_vectorized<...>"
LAYOUT = [(0, 8), (8, 2720), (2728, 32), (2760, 4), (2764, 4)]  # as recorded on the H100


def test_only_the_first_grid_y_entries_of_cats_input_array_are_live():
    grid = (264, 3, 1)
    assert not dead_pointer_slot(CAT, grid, LAYOUT, 0)  # the output
    assert [dead_pointer_slot(CAT, grid, LAYOUT, 8 + 8 * i) for i in range(5)] == \
        [False, False, False, True, True]
    assert dead_pointer_slot(CAT, grid, LAYOUT, 8 + 2720 - 8)
    assert not dead_pointer_slot(CAT, grid, LAYOUT, 2728)  # the output's sizes and strides
    assert not dead_pointer_slot("gemm_kernel", grid, LAYOUT, 8 + 8 * 4)


@pytest.mark.parametrize("path", FIXTURE_PATHS, ids=fixture_ids())
def test_recorded_pointers_are_never_in_dead_slots_and_every_live_input_is_found(path):
    g = TaskGraph.load(path)
    for t in g.tasks:
        if t.kind != TaskKind.KERNEL:
            continue
        for p in t.pointers:
            assert not dead_pointer_slot(t.name, t.grid, t.param_layout, p.location), \
                f"task {t.id} ({t.short_name}) keeps a stale pointer at byte {p.location}"
        if "CatArrayBatchedCopy" in t.name:
            start = t.param_layout[1][0]
            found = {p.location for p in t.pointers if p.buffer >= 0}
            assert {start + 8 * i for i in range(t.grid[1])} <= found


def test_a_word_in_a_parameter_no_pointer_fits_is_not_a_pointer():
    from nimble.record.decode import in_pointerless_param

    # cuDNN's nchwToNhwcKernel: a 68-byte dims struct, then the input and output pointers
    layout = [(0, 68), (72, 8), (80, 8)]
    assert [in_pointerless_param(layout, off) for off in (0, 32, 64, 72, 80)] == \
        [True, True, True, False, False]
    # bn_bw: four 4-byte ints, then a 104-byte descriptor (8-aligned: may hold pointers)
    layout = [(0, 4), (4, 4), (8, 4), (12, 4), (16, 104), (120, 8)]
    assert [in_pointerless_param(layout, off) for off in (0, 8, 16, 112, 120)] == \
        [True, True, False, False, False]
    assert not in_pointerless_param([], 0)  # no layout known


def test_a_packed_buffer_may_end_inside_its_last_parameter_only():
    from nimble.errors import RecordError
    from nimble.record.decode import passed_layout

    nccl = [(0, 4096)]  # ncclDevKernelArgs4K, as NCCL 2.28 declares it
    assert passed_layout(nccl, 192) == [(0, 192)]
    assert passed_layout(nccl, 4096) == nccl
    layout = [(0, 8), (8, 4), (16, 64)]
    assert passed_layout(layout, 80) == layout
    assert passed_layout(layout, 40) == [(0, 8), (8, 4), (16, 24)]
    for short in (16, 10, 0):  # the last parameter, or more, left out whole
        with pytest.raises(RecordError, match="parameters end at byte 80"):
            passed_layout(layout, short)
    assert passed_layout([], 24) == []
