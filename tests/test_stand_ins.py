"""Stand-ins for a module's parameters while a training step is captured (nimble/record/
stand_ins.py), on the CPU: every holder of a parameter sees its stand-in (tied weights one,
an RNN's own list of weights too), the stand-ins share the parameters' storage and get their
gradients, the originals come back after, an error included; and the recorder captures a DDP's
step on them, refusing a step whose gradients differ from its warm-up's."""
from __future__ import annotations

import pytest
import torch

from nimble.errors import CaptureError
from nimble.record import recorder
from nimble.record.gradient_average import GradientAverage
from nimble.record.stand_ins import parameter_stand_ins


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.rnn = torch.nn.LSTM(4, 4, batch_first=True)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, ids):
        out, _ = self.rnn(self.embed(ids))
        return self.head(out * self.frozen).sum()


def _targets(model):
    return [p for p in model.parameters() if p.requires_grad]


def test_every_holder_sees_the_stand_in_and_the_originals_come_back():
    torch.manual_seed(0)
    model = _Tied()
    ids = torch.randint(0, 10, (2, 5))
    params = _targets(model)
    want = torch.autograd.grad(model(ids), params)
    before = {n: p for n, p in model.named_parameters()}
    flat_before = list(model.rnn._flat_weights)
    with parameter_stand_ins(model, params) as fresh:
        assert len(fresh) == len(params)
        assert all(s is not p and s.data_ptr() == p.data_ptr() and s.is_leaf
                   and s.requires_grad for s, p in zip(fresh, params))
        assert model.head.weight is model.embed.weight  # tied: one stand-in
        assert model.embed.weight is fresh[params.index(before["embed.weight"])]
        assert all(any(w is s for s in fresh) for w in model.rnn._flat_weights)
        assert model.frozen is before["frozen"]  # not a target: left alone
        got = torch.autograd.grad(model(ids), fresh)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert {n: p for n, p in model.named_parameters()} == before
    assert all(a is b for a, b in zip(model.rnn._flat_weights, flat_before))


def test_the_originals_come_back_after_an_error():
    model = torch.nn.Linear(3, 3)
    weight = model.weight
    with pytest.raises(RuntimeError, match="boom"):
        with parameter_stand_ins(model, [weight]):
            assert model.weight is not weight
            raise RuntimeError("boom")
    assert model.weight is weight


class _Released:
    def __init__(self, results) -> None:
        self.results, self.released = results, False

    def release(self) -> None:
        self.released = True


def _cpu_capture(seen: list):
    """A stand-in for the recorder's GPU capture: the step's gradients with respect to the
    targets it is given, on the CPU."""
    def capture_step(module, static_inputs, targets, warm, name, quiet, average):
        seen.append(list(targets.tensors))
        out = module(*static_inputs).sum()
        grads = torch.autograd.grad(out, targets.tensors, allow_unused=True)
        seen_released.append(_Released([out, grads]))
        return seen_released[-1]
    seen_released: list = []
    capture_step.released = seen_released
    return capture_step


def test_a_ddps_step_is_captured_on_stand_ins_and_a_plain_one_on_its_parameters(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    x = torch.randn(2, 3)
    params = _targets(model)
    targets = recorder._GradTargets([], params, list(params))
    warm = recorder._WarmStep(0.0, [0], [], [False] * len(params))
    seen: list = []
    monkeypatch.setattr(recorder, "_capture_step", _cpu_capture(seen))
    plain = recorder._capture_step_of(model, [x], targets, warm, "Net", True, GradientAverage())
    assert seen[-1] == params and all(g is not None for g in plain.results[1])
    ddp = GradientAverage(held_accumulators=True)
    held = recorder._capture_step_of(model, [x], targets, warm, "Net", True, ddp)
    assert all(not any(s is p for p in params) for s in seen[-1])  # stand-ins differentiated
    assert all(g is not None for g in held.results[1]) and not held.released
    assert _targets(model) == params and all(a is b for a, b in zip(_targets(model), params))


class _Listed(torch.nn.Module):
    """A weight reached through a plain list, not its attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 3))
        self.listed = [self.w]

    def forward(self, x):
        return (x @ self.listed[0]).sum()


def test_a_parameter_reached_other_than_through_its_attribute_is_refused(monkeypatch):
    model = _Listed()
    params = _targets(model)
    targets = recorder._GradTargets([], params, list(params))
    warm = recorder._WarmStep(0.0, [0], [], [False])
    capture = _cpu_capture([])
    monkeypatch.setattr(recorder, "_capture_step", capture)
    with pytest.raises(CaptureError, match=r"1 parameter\(s\) \(w\) got a gradient in the "
                                           r"warm-up but none on the stand-ins"):
        recorder._capture_step_of(model, [torch.randn(2, 3)], targets, warm, "Listed", True,
                                  GradientAverage(held_accumulators=True))
    assert capture.released[-1].released
    assert model.w is params[0]
