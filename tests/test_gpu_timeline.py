"""The real timeline on the GPU: timestamp nodes inside the multi-stream run (nimble.timeline)."""
from __future__ import annotations

import pytest

from conftest import zoo_model

pytestmark = pytest.mark.gpu


def test_branchy_timeline_measures_every_task_and_shows_concurrency():
    import torch

    import nimble

    model, x = zoo_model("branchy")
    nm = nimble.Nimble(model).prepare(x, relaunches=4)
    fresh = torch.randn_like(x)
    want = nm(fresh).clone()
    timeline = nm.trace(fresh)
    n = len(nm.graph.tasks)
    assert len(timeline.times) == n
    assert all(0.0 <= start <= end for start, end in timeline.times)
    [phase] = timeline.summary()["phases"]
    assert phase["streams"] == len(nm.schedule.streams) > 1
    assert phase["concurrency"] > 1.0  # branches really ran side by side
    assert 0 < timeline.plain_us and 0 < timeline.instrumented_us
    # the prepared graph is untouched and still right
    assert torch.equal(nm(fresh), want)
    slices = [e for e in timeline.to_chrome()["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == n


def test_a_training_step_is_traced_phase_by_phase():
    import torch

    import nimble

    tv = pytest.importorskip("torchvision")
    model = tv.models.resnet18(num_classes=10).cuda().train()
    x = torch.randn(8, 3, 32, 32, device="cuda")
    nm = nimble.Nimble(model).prepare(x, training=True, relaunches=2)
    rows = nm.trace().summary()["phases"]
    assert [r["name"] for r in rows] == ["forward", "backward"]
    assert all(r["makespan_us"] > 0 for r in rows)
