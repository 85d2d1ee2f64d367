"""tools/experiments/dynamo_overhead.py on the CPU: its switches, its stand-in, and a timed call
through the backend that runs no graph."""
from __future__ import annotations

import pytest

from helpers import load_tool

torch = pytest.importorskip("torch")

tool = load_tool("experiments/dynamo_overhead")


def test_the_switches_and_their_defaults():
    args = tool.parse([])
    assert (args.blocks, args.calls, args.training) == (16, 3000, False)
    assert tool.parse(["--training"]).training
    assert tool.parse(["--blocks", "2", "--calls", "5"]).blocks == 2


def test_every_way_is_a_guard_filter_of_torch_compiler_or_the_default():
    ways = tool.guard_filters()
    assert ways["default"] is None
    assert all(callable(f) for name, f in ways.items() if name != "default")


def test_the_stand_in_has_fourteen_weights_a_block_and_a_call_through_the_backend_is_timed():
    model, x = tool.stand_in(2)
    assert sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers()) == 2 * 14
    for guard_filter in (None, tool.guard_filters()["skip_guard_on_inbuilt_nn_modules_unsafe"]):
        assert tool.per_call_us(model, x, guard_filter, calls=5) > 0


def test_the_saved_run_returns_what_the_graph_gave_at_its_prepare():
    model, x = tool.stand_in(1)
    request = type("R", (), {"compiled": model, "args": (x,), "training": False})()
    run = tool._prepare(request)
    with torch.no_grad():
        torch.testing.assert_close(run(()), model(x))


def test_a_training_step_through_the_backend_and_directly_gives_every_parameter_a_gradient():
    model, x = tool.stand_in(1)
    model.train()
    assert tool.direct_us(model, x, calls=3, training=True) > 0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    model.zero_grad(set_to_none=True)
    assert tool.per_call_us(model, x, None, calls=3, training=True) > 0
    assert all(p.grad is not None for p in model.parameters())
