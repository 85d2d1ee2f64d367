"""The host cost of one call through ``torch.compile(model, backend="nimble")`` with the GPU
work taken away: Dynamo's frame and guards and the backend's dispatch, per call, on a stand-in
model of ``--blocks`` residual blocks (8 parameters and 6 buffers each) whose prepared graph is
replaced by a run that returns a saved output.  Runs on the CPU.  Each way of filtering
Dynamo's guards (``options={"guard_filter_fn": ...}``, which torch.compile takes itself) is
timed in turn (issue 52: where the backend's extra host µs go).

    python3 tools/experiments/dynamo_overhead.py --blocks 16 --calls 3000
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
    """A prepared signature that returns the output it was made with: no work but the call."""

    def __init__(self, out) -> None:
        self.out = out

    def __call__(self, args):
        return self.out


def _prepare(request) -> _Saved:
    import torch

    with torch.no_grad():
        return _Saved(request.compiled(*request.args))


def per_call_us(model, x, guard_filter, calls: int) -> float:
    """Median µs of a call through the backend (stand-ins for Inductor and Nimble)."""
    import torch

    from nimble.compile_backend import NimbleBackend

    torch._dynamo.reset()
    backend = NimbleBackend(compile=lambda gm, example, patches: gm.forward, prepare=_prepare)
    options = {"guard_filter_fn": guard_filter} if guard_filter is not None else None
    compiled = torch.compile(model, backend=backend, options=options)
    samples = []
    with torch.no_grad():
        for _ in range(10):
            compiled(x)
        for _ in range(calls):
            t0 = time.perf_counter()
            compiled(x)
            samples.append(time.perf_counter() - t0)
    torch._dynamo.reset()
    return statistics.median(samples) * 1e6


def main(argv=None) -> int:
    args = parse(argv)
    model, x = stand_in(args.blocks)
    weights = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    print(f"{args.blocks} blocks, {weights} weights and buffers lifted by Dynamo")
    for name, guard_filter in guard_filters().items():
        print(f"{name:42s} {per_call_us(model, x, guard_filter, args.calls):7.1f} µs a call",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
