"""Relocation and graph-shape decisions of ``nimble.engine.build``, on recorded fixtures (no GPU)."""
from __future__ import annotations

import pytest
from helpers import FIXTURE_PATHS, fixture_ids

from nimble.engine import kernels
from nimble.engine.build import (GATHER_MAX_BLOCKS, InputGather, buffer_bases, chain_edges, gather_grid,
                          predecessors, relocate_params, relocated)
from nimble.analysis.deps import build_dag, transitive_reduction
from nimble.errors import BuildError
from nimble.analysis.memplan import plan_memory
from nimble.analysis.schedule import assign_streams
from nimble.ir.taskgraph import TaskGraph, TaskKind

ARENA = 0x7F00_0000_0000


@pytest.mark.parametrize("path", FIXTURE_PATHS, ids=fixture_ids())
def test_relocation_moves_every_planned_pointer_and_nothing_else(path):
    g = TaskGraph.load(path)
    dag = build_dag(g)
    schedule = assign_streams(dag, reduced=transitive_reduction(dag))
    plan = plan_memory(g, schedule.edges())
    bases = buffer_bases(g, plan, ARENA)
    moved = 0
    for task in g.tasks:
        if task.kind != TaskKind.KERNEL:
            continue
        block = relocate_params(task, bases)
        assert len(block) == len(task.params)
        at = {p.location: p for p in task.pointers}
        for p in task.pointers:
            value = int.from_bytes(block[p.location:p.location + 8], "little")
            assert value == relocated(p, bases)
            if p.buffer >= 0 and p.buffer in plan.offsets:
                assert ARENA <= value < ARENA + plan.arena_bytes + g.buffers[p.buffer].size
                moved += value != p.value
            else:
                assert value == p.value  # parameters and unresolved pointers stay put
        untouched = [i for i in range(len(block))
                     if not any(loc <= i < loc + 8 for loc in at)]
        assert all(block[i] == task.params[i] for i in untouched)
    assert moved > 0


def test_pointer_outside_its_block_is_a_build_error():
    g = TaskGraph.load(FIXTURE_PATHS[0])
    task = next(t for t in g.tasks if t.kind == TaskKind.KERNEL and t.pointers)
    bad = type(task.pointers[0])(len(task.params) - 4, task.pointers[0].value,
                                 task.pointers[0].buffer, task.pointers[0].offset)
    task.pointers.append(bad)
    with pytest.raises(BuildError, match="outside"):
        relocate_params(task, [b.address for b in g.buffers])


def test_edges_must_go_forward_and_chains_are_the_recorded_order():
    assert predecessors(4, chain_edges(4)) == [[], [0], [1], [2]]
    assert predecessors(3, [(0, 2), (1, 2), (0, 2)]) == [[], [], [0, 1]]
    with pytest.raises(BuildError, match="forward"):
        predecessors(3, [(2, 1)])


@pytest.mark.parametrize("nbytes,blocks", [(0, 1), (1, 1), (4096, 1), (4097, 2),
                                           (299 * 299 * 3 * 4, 262), (1 << 30, GATHER_MAX_BLOCKS)])
def test_gather_grid_covers_the_input_with_16_byte_vectors_up_to_a_cap(nbytes, blocks):
    assert gather_grid(nbytes) == blocks


def test_the_gather_kernel_source_matches_what_build_passes_it():
    text = kernels.source("gather_input.ptx").decode()
    entry = text[text.index(".entry " + kernels.GATHER_INPUT):]
    params = entry[:entry.index(")")]
    assert params.count(".param .u64") == len(InputGather._fields) == 3
    assert ".version" in text and ".target" in text
