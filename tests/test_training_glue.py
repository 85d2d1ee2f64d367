"""The autograd glue of training calls (nimble.engine.autograd), on the CPU with stand-in graphs.

The stand-in forward and backward "graphs" compute ``y = x @ w`` and its gradients into fixed
tensors, as the real ones write into the arena, and the forward scribbles over the gradient
buffer first, as the arena plan lets a real forward do.  So these tests pin down what users see
of ``.grad`` (set, accumulated, zeroed either way), and the refusals, without a GPU.
"""
from __future__ import annotations

import pytest
import torch

from nimble.errors import InputError, NimbleError
from nimble.record.recorder import StepLayout
from nimble.engine.autograd import TrainingStep


class _Forward:
    """``y = x @ w`` into a fixed output; keeps ``x`` as the saved activation."""

    def __init__(self, w: torch.Tensor, grad_buffer: torch.Tensor) -> None:
        self.w = w
        self.outputs = [torch.empty(4, 3)]
        self.saved = torch.empty(4, 5)
        self.grad_buffer = grad_buffer
        self.return_copies = False

    def run_flat(self, inputs):
        (x,) = inputs
        self.grad_buffer.fill_(float("nan"))  # the arena bytes of the gradient are reused
        with torch.no_grad():
            self.saved.copy_(x)
            torch.matmul(x, self.w, out=self.outputs[0])
        return self.outputs


class _Backward:
    """``dw = x^T @ dy`` (and ``dx = dy @ w^T``) into fixed outputs."""

    def __init__(self, forward: _Forward, grad_buffer: torch.Tensor) -> None:
        self.forward = forward
        self.outputs = [grad_buffer, torch.empty(4, 5)]

    def run_flat(self, inputs):
        (dy,) = inputs
        with torch.no_grad():
            torch.matmul(self.forward.saved.t(), dy, out=self.outputs[0])
            if len(self.outputs) > 1:
                torch.matmul(dy, self.forward.w.t(), out=self.outputs[1])
        return self.outputs


def _prepared(with_input_grad: bool = False):
    w = torch.nn.Parameter(torch.randn(5, 3))
    grad_buffer = torch.empty(5, 3)
    fwd = _Forward(w, grad_buffer)
    bwd = _Backward(fwd, grad_buffer)
    if with_input_grad:
        layout = StepLayout(1, 1, [0], [0], [w], [2, 1])
    else:
        layout = StepLayout(1, 1, [0], [], [w], [1])
        bwd.outputs = bwd.outputs[:1]
    return TrainingStep(fwd, bwd, layout, ["w"]), w


def _loss(step: TrainingStep, x: torch.Tensor) -> torch.Tensor:
    out = step([x], lambda flat: flat[0])
    return (out * torch.arange(12.0).view(4, 3)).sum()


def _expected(w: torch.Tensor, xs) -> torch.Tensor:
    ref = w.detach().clone().requires_grad_()
    for x in xs:
        ((x @ ref) * torch.arange(12.0).view(4, 3)).sum().backward()
    return ref.grad


def test_grad_is_set_then_accumulated_across_forwards_that_reuse_the_arena():
    step, w = _prepared()
    xs = [torch.randn(4, 5) for _ in range(3)]
    for x in xs:
        _loss(step, x).backward()
    assert torch.allclose(w.grad, _expected(w, xs), atol=1e-5)


def test_zero_grad_both_ways_then_one_step_gives_that_steps_gradient():
    step, w = _prepared()
    x = torch.randn(4, 5)
    for set_to_none in (False, True):
        _loss(step, torch.randn(4, 5)).backward()
        if set_to_none:
            w.grad = None
        else:
            w.grad.zero_()
        _loss(step, x).backward()
        assert torch.allclose(w.grad, _expected(w, [x]), atol=1e-5)


def test_a_fresh_grad_is_adopted_without_a_copy_and_released_before_the_next_forward():
    step, w = _prepared()
    x = torch.randn(4, 5)
    _loss(step, x).backward()
    arena = step.backward.outputs[0].data_ptr()
    assert w.grad.data_ptr() == arena  # adopted: a view, as make_graphed_callables gives
    kept = w.grad
    step([torch.randn(4, 5)], lambda flat: flat[0])
    # moved out before the forward reused the bytes, with the step's gradient intact
    assert w.grad.data_ptr() != arena
    assert torch.allclose(w.grad, _expected(w, [x]), atol=1e-5)
    assert torch.isnan(kept).all()  # a reference kept past the next forward sees the arena


def test_input_gradients_are_copies_and_inputs_needing_unprepared_grads_are_refused():
    step, w = _prepared(with_input_grad=True)
    x = torch.randn(4, 5, requires_grad=True)
    _loss(step, x).backward()
    want = torch.arange(12.0).view(4, 3) @ w.detach().t()
    assert torch.allclose(x.grad, want, atol=1e-5)
    assert x.grad.data_ptr() != step.backward.outputs[1].data_ptr()
    plain, _ = _prepared()
    with pytest.raises(InputError, match="requires grad"):
        plain([torch.randn(4, 5, requires_grad=True)], lambda flat: flat[0])


def test_backward_after_another_forward_or_twice_is_refused():
    step, _ = _prepared()
    first = _loss(step, torch.randn(4, 5))
    _loss(step, torch.randn(4, 5))
    with pytest.raises(NimbleError, match="another forward"):
        first.backward()
    once = _loss(step, torch.randn(4, 5))
    once.backward(retain_graph=True)
    with pytest.raises(NimbleError, match="second backward"):
        once.backward()


def test_a_dropped_output_and_no_grad_calls_need_no_backward():
    step, w = _prepared()
    step([torch.randn(4, 5)], lambda flat: flat[0])  # dropped
    with torch.no_grad():
        assert step([torch.randn(4, 5)], lambda flat: flat[0]).grad_fn is None
    x = torch.randn(4, 5)
    _loss(step, x).backward()
    assert torch.allclose(w.grad, _expected(w, [x]), atol=1e-5)


def test_outputs_are_new_tensor_objects_each_call():
    step, _ = _prepared()
    a = step([torch.randn(4, 5)], lambda flat: flat[0])
    b = step([torch.randn(4, 5)], lambda flat: flat[0])
    assert a is not b and a.grad_fn is not b.grad_fn
