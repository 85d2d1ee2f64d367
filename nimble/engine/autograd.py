"""Training calls: a prepared forward graph and backward graph joined by autograd.

``prepare(training=True)`` records a training step as two graphs sharing one arena
(:func:`nimble.record.recorder.record_step`).  A call launches the forward graph inside an
``autograd.Function`` whose inputs are the model's inputs and its trainable parameters, so its
outputs carry a ``grad_fn``; that function's backward copies the incoming gradients in, launches
the backward graph, and hands autograd one gradient per input and parameter.  Autograd then does
what it does in eager: a parameter's ``.grad`` is set when it is ``None`` and accumulated into
when it is not, so ``zero_grad()`` (either ``set_to_none``), gradient accumulation and every
optimizer work unchanged.

The gradients the backward graph writes live in the arena.  Autograd adopts a gradient as a
parameter's ``.grad`` when the parameter has none (no copy, as in eager and as with
``make_graphed_callables``), so after ``zero_grad()`` (``set_to_none=True``, the default) a
``.grad`` is a view into the arena, valid until the next call.  The arena plan lets the next
forward reuse those bytes, so before a forward launches, every ``.grad`` that is still such a view
(the user kept gradients to accumulate, or zeroed them in place) is moved to memory of its own:
accumulation then adds to the right values.  A reference to a ``.grad`` kept past
``zero_grad(set_to_none=True)`` sees the arena change, as with ``make_graphed_callables``.

The arena holds one step's activations.  A second forward before the first one's backward
overwrites them, so that backward, or a second backward through one forward, raises
:class:`~nimble.errors.NimbleError` rather than computing gradients from the wrong activations.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

from ..errors import InputError, NimbleError

_FUNCTION: list = []


def _step_function():
    """The ``torch.autograd.Function`` of a training call (made on first use: no torch import
    when Nimble is imported)."""
    if _FUNCTION:
        return _FUNCTION[0]
    import torch
    from torch.autograd.function import once_differentiable

    class NimbleStep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, step: "TrainingStep", *args):
            outputs, generation = step.run_forward(args[:step.forward_inputs])
            ctx.step = step
            ctx.generation = generation
            differentiable = step.differentiable
            ctx.mark_non_differentiable(
                *[o for i, o in enumerate(outputs) if i not in differentiable])
            return tuple(outputs)

        @staticmethod
        @once_differentiable
        def backward(ctx, *grad_outputs):
            return (None, *ctx.step.run_backward(ctx.generation, grad_outputs))

    _FUNCTION.append(NimbleStep)
    return NimbleStep


class TrainingStep:
    """The per-call state of a prepared training step: both launchers, the layout, the count of
    forwards (to refuse a backward whose activations were overwritten)."""

    def __init__(self, forward, backward, layout, param_names: Sequence[str]) -> None:
        self.forward = forward  # Launcher of the forward graph
        self.backward = backward  # Launcher of the backward graph
        self.layout = layout  # record.StepLayout
        self.param_names = list(param_names)
        self.params = list(layout.params)
        self.forward_inputs = layout.forward_inputs
        self.differentiable = frozenset(layout.differentiable)
        self._with_grad = frozenset(layout.inputs_with_grad)
        self._generation = 0
        self._backward_done = True
        self._guard = threading.Lock()
        # Where the backward graph writes each parameter's gradient (None: no gradient).
        first, outs = layout.forward_outputs, backward.outputs
        self._grad_addresses = [None if k < 0 else outs[k - first].data_ptr()
                                for k in layout.grad_output_of[len(layout.inputs_with_grad):]]
        self._handed_out = False  # gradients given to autograd since the last forward

    # ---- calls ------------------------------------------------------------------------------
    def __call__(self, inputs: Sequence, unflatten):
        """One forward; with grad enabled its outputs lead back to :meth:`run_backward`."""
        import torch

        if not torch.is_grad_enabled():
            outputs, _ = self.run_forward(inputs)
            return unflatten(outputs)
        for i, x in enumerate(inputs):
            if getattr(x, "requires_grad", False) and i not in self._with_grad:
                raise InputError(
                    f"input {i} requires grad, but the model was prepared with an example input "
                    "that did not: pass example inputs with requires_grad=True to "
                    "prepare(training=True) to get their gradients")
        outputs = _step_function().apply(self, *inputs, *self.params)
        return unflatten(list(outputs))

    def run_forward(self, inputs: Sequence) -> tuple[list, int]:
        """Launch the forward graph; ``(fresh output tensors, this forward's number)``."""
        self._release_adopted()
        outputs = self.forward.run_flat(inputs)
        with self._guard:
            self._generation += 1
            self._backward_done = False
            generation = self._generation
        if self.forward.return_copies:
            return outputs, generation
        # New tensor objects each call: autograd gives each its own grad_fn.
        return [o.detach() for o in outputs], generation

    def run_backward(self, generation: int, grad_outputs: Sequence) -> list:
        """Launch the backward graph for forward number ``generation``; one gradient (or None)
        per forward input, then per parameter."""
        import torch

        with self._guard:
            if generation != self._generation:
                raise NimbleError(
                    "backward through a Nimble output whose forward was followed by another "
                    "forward: the later call overwrote the activations this backward needs "
                    "(a prepared training step holds one step's activations). Run backward "
                    "after each forward; to accumulate gradients, run forward and backward once "
                    "per micro-batch.")
            if self._backward_done:
                raise NimbleError(
                    "a second backward through the same Nimble forward: its backward graph ran "
                    "already and may have overwritten the saved activations (retain_graph=True "
                    "is not supported); call the model again for another backward")
            self._backward_done = True
        layout = self.layout
        incoming = []
        for i in layout.differentiable:
            g = grad_outputs[i]
            if g is None:
                g = torch.zeros_like(self.forward.outputs[i])
            incoming.append(g)
        computed = self.backward.run_flat(incoming)
        first = layout.forward_outputs
        # Fresh tensor objects over the arena: autograd may adopt them as .grad without a copy.
        grads = [None if k < 0 else computed[k - first].detach() for k in layout.grad_output_of]
        self._handed_out = True
        n_in = len(layout.inputs_with_grad)
        for_inputs: list[Any] = [None] * layout.forward_inputs
        for j, i in enumerate(layout.inputs_with_grad):
            # An input's gradient flows on to code that may keep it: give it its own memory.
            for_inputs[i] = None if grads[j] is None else grads[j].clone()
        return for_inputs + grads[n_in:]

    def _release_adopted(self) -> None:
        """Give every parameter ``.grad`` that still lies in the arena memory of its own."""
        import torch

        if not self._handed_out:  # no backward since the last forward: nothing in the arena
            return
        self._handed_out = False
        with torch.no_grad():
            for p, address in zip(self.params, self._grad_addresses):
                g = p.grad
                if g is not None and g.data_ptr() == address:
                    p.grad = g.clone()

    def follow_parameters(self, model) -> None:
        """Take the model's current parameter objects (after an assignment replaced some)."""
        named = dict(model.named_parameters())
        missing = [n for n in self.param_names if n not in named]
        if missing:
            from ..errors import WeightsChangedError
            raise WeightsChangedError(f"parameter '{missing[0]}' is gone: prepare() again")
        self.params = [named[n] for n in self.param_names]
