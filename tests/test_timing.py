"""time_recording's bookkeeping (the GPU measurement itself is replaced)."""
from __future__ import annotations

import types

import pytest

from nimble.engine import task_timing
from nimble.ir.synthetic import branchy_graph


def test_time_recording_measures_on_recorded_addresses_and_stores_durations(monkeypatch):
    torch = pytest.importorskip("torch")
    g = branchy_graph(stages=1, branches=2, depth=1)
    for t in g.tasks:
        t.duration_us = None
    seen = {}

    def fake(graph, nodes, bases, stream, repeats):
        seen.update(nodes=nodes, bases=bases, repeats=repeats)
        return [float(t.id) + 0.5 for t in graph.tasks]

    monkeypatch.setattr(task_timing, "measure_task_durations", fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=0))
    rec = types.SimpleNamespace(graph=g, nodes=["n"] * len(g.tasks))
    got = task_timing.time_recording(rec, repeats=3)
    assert got == [t.id + 0.5 for t in g.tasks]
    assert [t.duration_us for t in g.tasks] == got
    assert seen["bases"] == [b.address for b in g.buffers] and seen["repeats"] == 3
