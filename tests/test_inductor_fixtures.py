"""Recorded ``torch.compile``'d models (Inductor's Triton kernels traced by their launches):
the argument roles give read-only accesses, so the branches stay independent."""
from __future__ import annotations

import pytest

from helpers import FIXTURE_DIR
from nimble.analysis.deps import build_dag
from nimble.analysis.schedule import assign_phased, check_schedule
from nimble.ir.taskgraph import TaskGraph

INDUCTOR = sorted(FIXTURE_DIR.glob("*_inductor.json.gz"))


def test_two_compiled_models_are_recorded():
    assert len(INDUCTOR) >= 2


@pytest.mark.parametrize("path", INDUCTOR, ids=[p.name.split(".")[0] for p in INDUCTOR])
def test_triton_launches_are_ops_that_read_their_inputs_and_write_their_outputs(path):
    g = TaskGraph.load(path)
    triton = [op for op in g.ops if "::" not in op.name]
    assert len(triton) == g.meta["triton_launches"] > 0
    assert all(op.name.startswith("triton_") for op in triton)
    # Each kernel writes something and most read more than they write: in_ptr arguments are
    # reads, not the whole-buffer read-writes an unknown kernel would get.
    assert all(any(a.write for a in op.accesses) for op in triton)
    reads = sum(not a.write for op in triton for a in op.accesses)
    assert reads > sum(a.write for op in triton for a in op.accesses)
    assert g.meta["unattributed_tasks"] == 0
    for t in g.tasks:
        if t.op >= 0 and g.ops[t.op] in triton:
            assert t.name == g.ops[t.op].name  # the kernel launched is the one traced


@pytest.mark.parametrize("path", INDUCTOR, ids=[p.name.split(".")[0] for p in INDUCTOR])
def test_the_inception_branches_of_a_compiled_model_run_side_by_side(path):
    g = TaskGraph.load(path)
    dag = build_dag(g)
    schedule = assign_phased(dag, g.meta.get("phases") or [], max_streams=None)
    check_schedule(dag, schedule)
    assert schedule.width >= 4 and len(schedule.streams) >= 4
