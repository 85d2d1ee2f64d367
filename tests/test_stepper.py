"""Step-through's choices (nimble.debug.step_through) on recorded fixtures and stand-in data (no GPU)."""
from __future__ import annotations

import pytest
import torch
from helpers import FIXTURE_DIR

from nimble.analysis.deps import build_dag
from nimble.errors import InputError
from nimble.engine.prepared import single_stream_schedule
from nimble.analysis.schedule import assign_phased
from nimble.debug.step_through import Snapshot, ancestor_closure, select_tasks
from nimble.ir.taskgraph import Access, Op, TaskGraph

_GRAPHS: dict = {}


def _load(name: str):
    if name not in _GRAPHS:
        g = TaskGraph.load(FIXTURE_DIR / f"{name}.json.gz")
        _GRAPHS[name] = (g, assign_phased(build_dag(g), g.meta.get("phases") or []))
    return _GRAPHS[name]


def test_tasks_are_named_by_id_op_or_module():
    g, _ = _load("googlenet")
    assert select_tasks(g, task=5) == [5]
    op = next(t.op for t in g.tasks if t.op >= 0)
    assert select_tasks(g, op=op) == [t.id for t in g.tasks if t.op == op]
    module = next(o.module for o in g.ops if "." in o.module)
    top = module.split(".")[0]
    inside = select_tasks(g, module=top)
    assert set(select_tasks(g, module=module)) <= set(inside)
    assert all(g.ops[g.tasks[t].op].module.startswith(top) for t in inside)
    for bad in ({}, {"task": 1, "op": 1}, {"task": len(g.tasks)}, {"module": "no.such"}):
        with pytest.raises(InputError):
            select_tasks(g, **bad)


@pytest.mark.parametrize("name", ["googlenet", "resnet50_train"])
def test_the_closure_holds_every_task_a_target_waits_for_and_nothing_after(name):
    g, s = _load(name)
    n = len(g.tasks)
    target = n - 3
    keep, span = ancestor_closure(s, [target], n)
    assert target in keep and all(t in span and t <= target for t in keep)
    # closed: every in-phase edge into a kept task comes from a kept task
    for u, v in s.edges():
        if v in keep and u in span:
            assert u in keep
    # and with one stream it is the whole prefix of the phase
    single = single_stream_schedule(n, g.meta.get("phases"))
    keep1, _ = ancestor_closure(single, [target], n)
    assert keep1 == set(range(span.start, target + 1))


def test_targets_in_two_phases_are_refused():
    g, s = _load("resnet50_train")
    fwd, _ = g.meta["phases"]
    with pytest.raises(InputError, match="more than one phase"):
        ancestor_closure(s, [0, fwd + 1], len(g.tasks))


def test_a_snapshot_reads_buffers_as_bytes_tensors_and_op_outputs():
    g = TaskGraph()
    g.ops = [Op(0, "aten::add", "m", [Access(0, 0, 8, False), Access(1, 8, 8, True)])]
    data = torch.arange(4, dtype=torch.float32).view(torch.uint8)
    snap = Snapshot(g, {0}, {0: data[:8].clone(), 1: data.clone()})
    assert torch.equal(snap.tensor(1, torch.float32, [2, 2]),
                       torch.arange(4, dtype=torch.float32).view(2, 2))
    [out] = snap.op_outputs(0)
    assert torch.equal(out.view(torch.float32), torch.tensor([2.0, 3.0]))
