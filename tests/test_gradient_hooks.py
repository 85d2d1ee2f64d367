"""A parameter's gradient hook runs once per training call, as in eager (no GPU).

A prepared training step computes its gradients in a captured ``torch.autograd.grad``, and
autograd then hands them to the parameters through Nimble's ``autograd.Function``
(:mod:`nimble.engine.autograd`).  Both run a parameter's ``register_hook`` hooks, so the
recording sets them aside (:func:`nimble.record.capture.gradient_hooks_set_aside`).  These
tests play that sequence on the CPU with the same two autograd calls.
"""
from __future__ import annotations

import torch

from nimble.record.capture import gradient_hooks_set_aside


def _model_and_hook():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    calls: list[str] = []
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: (calls.append(name), g * 2)[1])
    return model, calls


def _hand_off(model, x, captured_grads):
    """What a prepared training call does after its backward graph: return the graph's
    gradients to autograd for the parameters."""
    params = list(model.parameters())

    class Step(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *ps):
            return model(x).detach()

        @staticmethod
        def backward(ctx, grad_out):
            return (None, *captured_grads)

    model.zero_grad(set_to_none=True)
    Step.apply(x, *params).sum().backward()
    return [p.grad.clone() for p in params]


def _captured(model, x, set_aside: bool):
    params = list(model.parameters())
    if set_aside:
        with gradient_hooks_set_aside(params):
            return torch.autograd.grad(model(x).sum(), params)
    return torch.autograd.grad(model(x).sum(), params)


def test_hooks_run_once_when_set_aside_in_the_captured_backward():
    model, calls = _model_and_hook()
    x = torch.randn(5, 4)
    model(x).sum().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    calls.clear()

    got = _hand_off(model, x, _captured(model, x, set_aside=True))
    assert sorted(calls) == ["bias", "weight"]
    assert all(torch.equal(a, b) for a, b in zip(got, eager))

    twice = _hand_off(model, x, _captured(model, x, set_aside=False))
    assert all(torch.equal(a, 2 * b) for a, b in zip(twice, eager))  # the defect it prevents


def test_hooks_come_back_after_and_one_added_meanwhile_is_kept():
    model, calls = _model_and_hook()
    params = list(model.parameters())
    with gradient_hooks_set_aside(params):
        assert all(not p._backward_hooks for p in params)
        params[0].register_hook(lambda g: (calls.append("new"), g)[1])
    torch.autograd.grad(model(torch.randn(2, 4)).sum(), params)
    assert calls.count("new") == 1 and calls.count("weight") == 1 and calls.count("bias") == 1


def test_tensors_without_hooks_are_left_as_they_are():
    t = torch.zeros(2, requires_grad=True)
    with gradient_hooks_set_aside([t]):
        pass
    assert not t._backward_hooks
