"""A training step through ``torch.compile(model, backend="nimble")`` against the same step
prepared by hand on Inductor's kernels (``Nimble(torch.compile(model)).prepare(training=True)``):
GPU ms per step (CUDA events over a run of steps) and host µs to queue one step (the GPU idle
before it), the two interleaved round by round, per model (issue 52).

A step is the training bench's (``nimble bench --training``: zero_grad, forward, cross-entropy,
backward, SGD with momentum) at its shapes (the paper's classifiers at CIFAR-10's).  Where a
step's host µs reach its GPU ms, the step is host-bound and the backend's extra host work per
call (Dynamo's frame and guards over the lifted weights) shows in its time; where the GPU time
dominates, it does not.

    python3 tools/experiments/train_gap.py resnet50 mobilenet_v2 googlenet --batch 32
    python3 tools/experiments/train_gap.py resnet50 --unguarded   # a third step: fewer guards
    python3 tools/experiments/train_gap.py resnet50 --parts 200   # and each part of a step
    python3 tools/experiments/train_gap.py resnet50 --ops 25      # a step's costliest host ops
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds per model")
    p.add_argument("--steps", type=int, default=20, help="steps timed per round on the GPU")
    p.add_argument("--host-steps", type=int, default=10,
                   help="steps whose host µs are sampled per round, each after the GPU idles")
    p.add_argument("--unguarded", action="store_true",
                   help="also the backend's step compiled with Dynamo's guards on the modules "
                        "filtered out (guard_filter_fn=skip_guard_on_inbuilt_nn_modules_unsafe)")
    p.add_argument("--parts", type=int, default=0, metavar="N",
                   help="also each part of a step (forward, forward+loss+backward, optimizer "
                        "step, zero_grad) timed alone N times per mode; 0: not")
    p.add_argument("--ops", type=int, default=0, metavar="N",
                   help="also the N host operations of a step that cost the most host time "
                        "(torch.profiler over 20 steps per mode: calls and self µs per step); "
                        "0: not")
    p.add_argument("--block-steps", type=int, default=100,
                   help="after the rounds, each mode's host µs sampled again over this many "
                        "steps in a row (the other mode not run between them); 0: not")
    return p.parse_args(argv)


def summary(name: str, gpu_ms: dict, host_us: dict, block_us: dict | None = None
            ) -> list[str]:
    """One line per mode (median GPU ms with its spread, median host µs sampled within the
    rounds, and in a block of steps where measured), then the ratio."""
    median = {k: statistics.median(v) for k, v in gpu_ms.items()}
    block_us = block_us or {}
    lines = [f"{name} {k:9s} ms/step {median[k]:.3f} ({min(v):.3f}-{max(v):.3f})  "
             f"host µs/step {statistics.median(host_us[k]):.0f}"
             + (f" (in a block of {len(block_us[k])}: {statistics.median(block_us[k]):.0f})"
                if block_us.get(k) else "") for k, v in gpu_ms.items()]
    lines += [f"{name} {k} / inductor {median[k] / median['inductor']:.3f}"
              for k in median if k != "inductor"]
    return lines


def measure(name: str, args) -> list[str]:
    import torch

    import nimble
    from nimble.cli import train_bench

    base, x, y = train_bench.setup(name, args.batch)
    # per mode: (the forward a step calls, the model whose parameters it trains)
    modes = {}
    by_backend = copy.deepcopy(base)
    modes["backend"] = (torch.compile(by_backend, backend="nimble"), by_backend)
    if args.unguarded:
        unguarded = copy.deepcopy(base)
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe}
        modes["unguarded"] = (torch.compile(unguarded, backend="nimble", options=options),
                              unguarded)
    steps = {}
    for k, (forward, model) in modes.items():
        steps[k] = train_bench.training_step(forward, model, x, y)
        steps[k]()  # compiles and prepares
    by_hand = copy.deepcopy(base)
    prepared = nimble.Nimble(torch.compile(by_hand)).prepare(x, training=True, quiet=True)
    modes["inductor"] = (prepared, by_hand)
    steps["inductor"] = train_bench.training_step(prepared, by_hand, x, y)
    for step in steps.values():
        for _ in range(10):
            step()
    gpu_ms: dict = {k: [] for k in steps}
    host_us: dict = {k: [] for k in steps}
    for _ in range(args.rounds):
        for k, step in steps.items():
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.steps):
                step()
            end.record()
            end.synchronize()
            gpu_ms[k].append(start.elapsed_time(end) / args.steps)
            host_us[k] += host_samples(step, args.host_steps)
    # the same quantity with the other mode not run in between: the rounds interleave the two
    # steps, whose Python objects and graphs then take turns in the CPU's caches
    block_us = {k: host_samples(step, args.block_steps) for k, step in steps.items()}
    lines = summary(name, gpu_ms, host_us, block_us)
    if args.parts:
        for k, (forward, model) in modes.items():
            lines.append(parts_line(name, k, part_us(forward, model, x, y, args.parts)))
    if args.ops:
        for k, step in steps.items():
            lines += [f"{name} {k:9s} {row}" for row in host_ops(step, args.ops)]
    return lines


def host_ops(step, top: int, steps: int = 20) -> list[str]:
    """The ``top`` operations of ``steps`` steps by their own host time under torch.profiler
    (CPU and CUDA activity, so the runtime's launch calls are named), per step: calls and self
    µs.  The profiler slows every call, the few heaviest most; its rows rank, not time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [f"op {e.key[:60]:60s} calls/step {e.count / steps:7.1f}  self host µs/step "
            f"{e.self_cpu_time_total / steps:8.1f}" for e in rows[:top]]


@contextlib.contextmanager
def backward_spans():
    """Host µs of each Nimble backward call made inside: ``{"run_backward": [...], "launch":
    [...]}``, the whole of :meth:`nimble.engine.autograd.TrainingStep.run_backward` (autograd's
    call into Nimble) and, within it, the backward graph's :meth:`Launcher.run_flat` (its
    inputs' checks and the launch); the rest of a backward is autograd's and the loss's."""
    from nimble.engine.autograd import TrainingStep
    from nimble.engine.launcher import Launcher

    spans: dict[str, list[float]] = {"run_backward": [], "launch": []}
    run_backward, run_flat = TrainingStep.run_backward, Launcher.run_flat
    inside = [False]

    def timed_backward(self, generation, grad_outputs):
        if self is not None:
            spans.setdefault("steps", set()).add(self)
        inside[0] = True
        t0 = time.perf_counter()
        try:
            return run_backward(self, generation, grad_outputs)
        finally:
            spans["run_backward"].append((time.perf_counter() - t0) * 1e6)
            inside[0] = False

    def timed_run_flat(self, inputs):
        if not inside[0]:
            return run_flat(self, inputs)
        t0 = time.perf_counter()
        try:
            return run_flat(self, inputs)
        finally:
            spans["launch"].append((time.perf_counter() - t0) * 1e6)
    TrainingStep.run_backward, Launcher.run_flat = timed_backward, timed_run_flat
    try:
        yield spans
    finally:
        TrainingStep.run_backward, Launcher.run_flat = run_backward, run_flat


def part_us(forward, model, x, y, count: int) -> dict[str, float]:
    """Median host µs of each part of a step, timed alone (the GPU idle before each): the
    forward, the forward with the loss and the backward (the gradients set to None before
    each, as a step's zero_grad leaves them), of which Nimble's backward call and its graph's
    launch (:func:`backward_spans`; absent where no Nimble backward ran), the optimizer's step
    (with gradients in place), zero_grad (after a backward each time).  A fresh SGD with
    momentum, as the step's."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def backward() -> None:
        loss_fn(forward(x), y).backward()

    def no_grads() -> None:
        opt.zero_grad(set_to_none=True)
    times = {"forward": host_samples(lambda: forward(x), count)}
    with backward_spans() as spans:
        times["forward+loss+backward"] = host_samples(backward, count, before=no_grads)
    steps = spans.pop("steps", set())
    for name, values in spans.items():
        if values:
            times[f"of which {name}"] = values
    adopted = adopted_share(steps)
    times["optimizer step"] = host_samples(opt.step, count)
    times["zero_grad"] = host_samples(no_grads, count, before=backward)
    medians = {k: statistics.median(v) for k, v in times.items()}
    if adopted is not None:
        medians["gradients adopted (no copy)"] = adopted
    return medians


def adopted_share(steps, named: int = 3) -> str | None:
    """``"k/n"``: of the ``n`` gradients the last backward of the Nimble steps ``steps`` wrote,
    how many autograd took as the parameters' ``.grad`` without a copy (a view into the arena);
    each one it copied instead costs the host a kernel launch per step.  The first ``named``
    copied ones follow by name, with the parameter's strides and those of its gradient in the
    arena (autograd copies a gradient whose layout differs from its parameter's).  None: no
    Nimble step."""
    if not steps:
        return None
    kept = total = 0
    copied = []
    for step in steps:
        names = getattr(step, "param_names", None) or [f"#{i}" for i in range(len(step.params))]
        for i, (p, address) in enumerate(zip(step.params, step._grad_addresses)):
            if address is None:
                continue
            total += 1
            if p.grad is not None and p.grad.data_ptr() == address:
                kept += 1
                continue
            grad = arena_grad(step, i)
            where = "" if grad is None else f", its gradient's {tuple(grad.stride())}"
            copied.append(f"{names[i]} {tuple(p.shape)} strides {tuple(p.stride())}{where}")
    share = f"{kept}/{total}"
    return share + (f" (copied: {'; '.join(copied[:named])})" if copied else "")


def arena_grad(step, i: int):
    """The arena tensor the backward graph of ``step`` writes parameter ``i``'s gradient into
    (None where the step has no layout to say: a stand-in)."""
    layout, backward = getattr(step, "layout", None), getattr(step, "backward", None)
    if layout is None or backward is None:
        return None
    k = layout.grad_output_of[len(layout.inputs_with_grad) + i]
    return None if k < 0 else backward.outputs[k - layout.forward_outputs]


def parts_line(name: str, mode: str, parts: dict[str, float]) -> str:
    return f"{name} {mode:9s} host µs, parts alone: " + ", ".join(
        f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in parts.items())


def host_samples(step, count: int, before=None) -> list[float]:
    """µs to queue each of ``count`` steps, the GPU idle before each (``before()`` run first
    each time, not timed)."""
    import torch

    samples = []
    for _ in range(count):
        if before is not None:
            before()
        torch.cuda.current_stream().synchronize()
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e6)
    return samples


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    torch.backends.cudnn.benchmark = True
    for name in args.models:
        print("\n".join(measure(name, args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
