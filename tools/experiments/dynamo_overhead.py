"""The host cost of one call through ``torch.compile(model, backend="nimble")`` with the GPU
work taken away: Dynamo's frame and guards and the backend's dispatch, per call, on a stand-in
model of ``--blocks`` residual blocks (8 parameters and 6 buffers each) whose prepared graph is
replaced by a run that returns a saved output.  Runs on the CPU.  Each way of filtering
Dynamo's guards (``options={"guard_filter_fn": ...}``, which torch.compile takes itself) is
timed in turn, beside the same run called directly (issue 52: where the backend's extra host
µs go).  With ``--training`` a call is a training step's forward and backward: the run is an
autograd function that gives every parameter a zero gradient, and each step starts with the
gradients set to None, as ``zero_grad()`` leaves them.

    python3 tools/experiments/dynamo_overhead.py --blocks 16 --calls 3000
    python3 tools/experiments/dynamo_overhead.py --blocks 16 --training
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=16, help="residual blocks of the stand-in")
    p.add_argument("--calls", type=int, default=3000, help="calls timed per way")
    p.add_argument("--training", action="store_true",
                   help="time a training step (forward through the backend, backward)")
    return p.parse_args(argv)


def guard_filters() -> dict:
    """The ways timed: Dynamo's default, and torch.compiler's guard filters."""
    import torch.compiler as tc

    return {"default": None,
            "skip_guard_on_inbuilt_nn_modules_unsafe": tc.skip_guard_on_inbuilt_nn_modules_unsafe,
            "skip_guard_on_all_nn_modules_unsafe": tc.skip_guard_on_all_nn_modules_unsafe,
            "keep_tensor_guards_unsafe": tc.keep_tensor_guards_unsafe}


def stand_in(blocks: int):
    """A model of ``blocks`` residual blocks (two 1×1 convolutions and two batch norms each)
    in eval mode, and an input for it."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Conv2d(c, c, 1), torch.nn.Conv2d(c, c, 1)
            self.na, self.nb = torch.nn.BatchNorm2d(c), torch.nn.BatchNorm2d(c)

        def forward(self, x):
            return torch.relu(x + self.nb(self.b(torch.relu(self.na(self.a(x))))))
    model = torch.nn.Sequential(*[Block(8) for _ in range(blocks)]).eval()
    return model, torch.randn(1, 8, 4, 4)


class _Saved:
    """A prepared signature that returns the output it was made with: no work but the call.
    In training, the output leads back to a backward that gives each parameter a zero
    gradient (:func:`_zero_grads`)."""

    def __init__(self, out, params=()) -> None:
        self.out, self.params = out, list(params)

    def __call__(self, args):
        if not self.params:
            return self.out
        return (_zero_grads().apply(self.out, *self.params),)


_FUNCTION: list = []


def _zero_grads():
    """An autograd function: its output is a copy of its first input, its backward a zero
    gradient for every other input (a training step's hand-off to autograd, without work)."""
    if _FUNCTION:
        return _FUNCTION[0]
    import torch

    class ZeroGrads(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out, *params):
            ctx.params = params
            return out.clone()

        @staticmethod
        def backward(ctx, grad):
            return (None, *[torch.zeros_like(p) for p in ctx.params])
    _FUNCTION.append(ZeroGrads)
    return ZeroGrads


def _prepare(request) -> _Saved:
    import torch

    from nimble.compile_backend.holder import RegionModule

    with torch.no_grad():
        out = request.compiled(*request.args)
    if not request.training:
        return _Saved(out)
    out = out[0] if isinstance(out, (tuple, list)) else out
    module = RegionModule(request.compiled, request.inputs, request.args, True)
    return _Saved(out.detach(), module.parameters())


def _timed(call, calls: int, before=None) -> float:
    """Median µs of ``call()`` over ``calls`` calls after 10 untimed (``before()`` first, not
    timed, each time)."""
    samples = []
    for i in range(10 + calls):
        if before is not None:
            before()
        t0 = time.perf_counter()
        call()
        if i >= 10:
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def per_call_us(model, x, guard_filter, calls: int, training: bool = False) -> float:
    """Median µs of a call (or a training step: ``training``) through the backend, stand-ins
    for Inductor and Nimble."""
    import torch

    from nimble.compile_backend import NimbleBackend

    torch._dynamo.reset()
    backend = NimbleBackend(compile=lambda gm, example, patches: gm.forward, prepare=_prepare)
    options = {"guard_filter_fn": guard_filter} if guard_filter is not None else None
    compiled = torch.compile(model, backend=backend, options=options)
    try:
        if training:
            # Dynamo unpacks the graph's one output: the model's output is the tensor itself
            return _timed(lambda: compiled(x).sum().backward(), calls,
                          before=lambda: model.zero_grad(set_to_none=True))
        with torch.no_grad():
            return _timed(lambda: compiled(x), calls)
    finally:
        torch._dynamo.reset()


def direct_us(model, x, calls: int, training: bool = False) -> float:
    """The same saved run called without torch.compile: what the backend's call adds to."""
    import torch

    with torch.no_grad():
        out = model(x)
    if not training:
        run = _Saved(out)
        return _timed(lambda: run(()), calls)
    run = _Saved(out, model.parameters())
    return _timed(lambda: run(())[0].sum().backward(), calls,
                  before=lambda: model.zero_grad(set_to_none=True))


def main(argv=None) -> int:
    args = parse(argv)
    model, x = stand_in(args.blocks)
    if args.training:
        model.train()
    weights = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    what = "training step" if args.training else "call"
    print(f"{args.blocks} blocks, {weights} weights and buffers lifted by Dynamo; µs a {what}")
    print(f"{'the run called directly':42s} {direct_us(model, x, args.calls, args.training):7.1f}")
    for name, guard_filter in guard_filters().items():
        us = per_call_us(model, x, guard_filter, args.calls, args.training)
        print(f"{name:42s} {us:7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
