"""``nimble bench --training``: one training step, Nimble against eager and torch's graph tools.

A step is ``zero_grad()``, forward, cross-entropy loss, ``backward()`` and ``optimizer.step()``
(SGD with momentum).  Every mode gets its own copy of the model and its own optimizer, and all
run in one process, interleaved round by round as ``nimble bench`` does (make_graphed_callables
first, so Nimble's first prepare finds cuDNN's autotuning partly warm: the table shows the
longer of Nimble's two prepares):

* ``eager``: the model as it is;
* ``graphed``: ``torch.cuda.make_graphed_callables(model, (x,))``;
* ``compile``: ``torch.compile(model)`` (default mode; skipped with ``--no-compile``);
* ``compile backend=nimble``: ``torch.compile(model, backend="nimble")``, each step's forward
  and backward as Nimble's prepared training step (skipped with ``--no-compile``; in the
  per-model lines and the JSON, not the table);
* ``nimble single`` / ``nimble multi``: ``prepare(x, training=True)`` on one stream / many;
* ``nimble+inductor``: ``Nimble(torch.compile(model)).prepare(x, training=True)``, the step on
  Inductor's kernels that the backend's row is held to (skipped with ``--no-compile``; a model
  whose compiled step cannot be prepared gets its error in the per-model line and the JSON,
  ``nimble_inductor_error``, and the other rows still run).

The classifiers of the paper's training table run at CIFAR-10 shapes (3×32×32, 10 classes), the
others at their ImageNet shapes.  The table prints ×eager beside the paper's figure (batch 32,
V100) where the paper has one, Nimble's arena beside the memory pool ``make_graphed_callables``
took for the same model (the allocator's segments of the pool it created), and how long
``prepare(training=True)`` took.  Each model's line (and the JSON's ``host_us_per_step``) adds
the host µs to queue one step of each graph mode, sampled in turn with the GPU idle before
each: a step whose host time reaches its GPU time is host-bound.
"""
from __future__ import annotations

import copy
import time
from typing import Callable

from . import models
from .common import check_models
from .harness import (BACKEND_ROW, Case, Column, add_speedup, format_table, host_us_beside,
                      mode_rows, run_cases, time_rounds)
from .output import outputs
from ..driver.gpu import use_cudnn_benchmark
from ..progress import say

#: The paper's training speed-ups over PyTorch (batch 32, CIFAR-10, V100).
PAPER_X_EAGER = {"mobilenet_v2": 3.61, "efficientnet_b0": 3.32, "resnet50": 1.90}
CIFAR_MODELS = ("resnet50", "mobilenet_v2", "efficientnet_b0")
#: The row of Nimble's training step on Inductor's kernels, prepared by hand.
INDUCTOR_ROW = "nimble+inductor"
#: The graph modes whose host time per step is sampled in turn, each with the GPU idle before
#: it: what a step costs the host to queue, against its GPU time, says whether a row is
#: host-bound (the backend's step over Nimble's on the same kernels).
HOST_SAMPLED = ("graphed", BACKEND_ROW, INDUCTOR_ROW, "nimble single", "nimble multi")
HOST_STEPS = 30
DEFAULT_MODELS = ["resnet50", "mobilenet_v2", "efficientnet_b0", "googlenet", "inception_v3"]


def setup(name: str, batch: int):
    """``(model in train mode on the GPU, input, labels)`` at the shape the table uses."""
    import torch

    cifar = name in CIFAR_MODELS
    model = models.create(name, num_classes=10 if cifar else None).cuda().train()
    x = models.example_input(name, batch, side=32 if cifar else None)
    y = torch.randint(0, 10 if cifar else 1000, (batch,), device="cuda")
    return model, x, y


def training_step(forward: Callable, model, x, y) -> Callable[[], None]:
    """One SGD step (momentum 0.9) of ``model``'s parameters on the loss of ``forward(x)``
    against ``y``, as every mode of the table takes it."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(forward(x), y).backward()
        opt.step()
    return step


def _pool_ids() -> set:
    import torch

    return {tuple(seg.get("segment_pool_id", ())) for seg in torch.cuda.memory_snapshot()}


def _pool_bytes(ids: set) -> int:
    """Bytes of the allocator's segments that belong to the private pools ``ids``."""
    import torch

    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", ())) in ids)


def bench_training(name: str, batch: int, args) -> dict:
    """Time every mode's training step for ``name`` at ``batch``; the numbers as a dict."""
    import torch

    import nimble

    use_cudnn_benchmark()
    base, x, y = setup(name, batch)
    steps: dict[str, Callable[[], None]] = {}
    eager = copy.deepcopy(base)
    steps["eager"] = training_step(eager, eager, x, y)
    graphed_model = copy.deepcopy(base)
    before = _pool_ids()
    graphed = torch.cuda.make_graphed_callables(graphed_model, (x,))
    graphed_pool = _pool_bytes(_pool_ids() - before - {(0, 0), ()})
    steps["graphed"] = training_step(graphed, graphed_model, x, y)
    info: dict = {"model": name, "batch": batch, "input": list(x.shape),
                  "graphed_pool_mb": graphed_pool / 2**20, "prepare_seconds": {}}
    if not args.no_compile:
        compiled_model = copy.deepcopy(base)
        steps["compile"] = training_step(torch.compile(compiled_model), compiled_model, x, y)
        backend_model = copy.deepcopy(base)
        steps[BACKEND_ROW] = training_step(torch.compile(backend_model, backend="nimble"),
                                           backend_model, x, y)
        t0 = time.perf_counter()
        steps[BACKEND_ROW]()  # its first step compiles and prepares
        info["backend_first_step_seconds"] = time.perf_counter() - t0
    if not args.no_compile:
        _add_inductor_step(steps, info, base, x, y, args)
    for label, multi in (("nimble single", False), ("nimble multi", True)):
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        nm = nimble.Nimble(model).prepare(x, training=True, use_multi_stream=multi,
                                          quiet=args.quiet)
        info["prepare_seconds"][label] = time.perf_counter() - t0
        steps[label] = training_step(nm, model, x, y)
        if multi:
            info.update(streams=len(nm.schedule.streams),
                        syncs=len(nm.schedule.sync_edges), tasks=len(nm.graph.tasks),
                        phases=list(nm.graph.meta["phases"]),
                        arena_mb=nm.memplan.arena_bytes / 2**20,
                        pool_mb=nm.graph.meta["pool_bytes"] / 2**20,
                        not_bitwise=len(nm.graph.meta.get("verified", {}).get("not_bitwise", {})))
    say(f"timing {name} batch {batch}: {', '.join(steps)}", args.quiet, "bench")
    rows = mode_rows(time_rounds(steps, args.rounds, args.iters))
    add_speedup(rows, "x_eager", "eager")
    add_speedup(rows, "x_graphed", "graphed")
    info["modes"] = rows
    sampled = [m for m in HOST_SAMPLED if m in steps]
    info["host_us_per_step"] = dict(zip(sampled, host_us_beside([steps[m] for m in sampled],
                                                                calls=HOST_STEPS)))
    info["paper_x_eager"] = PAPER_X_EAGER.get(name) if name in CIFAR_MODELS and batch == 32 \
        else None
    return info


def _add_inductor_step(steps: dict, info: dict, base, x, y, args) -> None:
    """``steps[INDUCTOR_ROW]``: Nimble's training step of ``torch.compile(copy of base)``; its
    prepare's seconds (Inductor's compile included) apart from Nimble's own prepares."""
    import torch

    import nimble

    model = copy.deepcopy(base)
    t0 = time.perf_counter()
    try:
        nm = nimble.Nimble(torch.compile(model)).prepare(x, training=True, quiet=args.quiet)
    except nimble.NimbleError as e:
        info["nimble_inductor_error"] = f"{type(e).__name__}: {e}"
        say(f"{INDUCTOR_ROW} not timed: {info['nimble_inductor_error']}", args.quiet, "bench")
        return
    info["nimble_inductor_prepare_seconds"] = time.perf_counter() - t0
    steps[INDUCTOR_ROW] = training_step(nm, model, x, y)


_COLUMNS = [Column("model", 16, left=True), Column("batch", 6), Column("eager", 8),
            Column("graphed", 9), Column("compile", 9), Column("single", 8), Column("multi", 8),
            Column("x eager", 8), Column("x graphed", 10), Column("paper", 7),
            Column("arena", 7), Column("graphed", 8), Column("prep s", 7)]


def _row(r: dict) -> list[str]:
    m = r["modes"]
    get = lambda k: f"{m[k]['median_ms']:.2f}" if k in m else "–"  # noqa: E731
    multi = m["nimble multi"]
    return [r["model"], str(r["batch"]), get("eager"), get("graphed"), get("compile"),
            get("nimble single"), get("nimble multi"), f"{multi['x_eager']:.2f}",
            f"{multi['x_graphed']:.2f}",
            f"{r['paper_x_eager']:.2f}" if r["paper_x_eager"] else "–",
            f"{r['arena_mb']:.0f}", f"{r['graphed_pool_mb']:.0f}",
            f"{max(r['prepare_seconds'].values()):.1f}"]


def table(results: list[dict]) -> str:
    """The final table: a row per model and batch."""
    return format_table(_COLUMNS, map(_row, results),
                        "times: median ms per training step (zero_grad, forward, loss, backward, "
                        "SGD step); x eager / x graphed: Nimble multi-stream against eager and "
                        "make_graphed_callables; paper: the paper's x PyTorch (V100, batch 32); "
                        "arena: Nimble's MB for forward and backward; graphed: MB of the memory "
                        "pool make_graphed_callables took; prep s: the longer of the two "
                        "prepare(training=True), cuDNN's autotuning partly warm from "
                        "make_graphed_callables")


def _report(info: dict) -> str:
    line = f"{info['model']} batch {info['batch']}: " + ", ".join(
        f"{k} {v['median_ms']:.2f} ms" for k, v in info["modes"].items())
    modes = info["modes"]
    if BACKEND_ROW in modes and INDUCTOR_ROW in modes:
        ratio = modes[BACKEND_ROW]["median_ms"] / modes[INDUCTOR_ROW]["median_ms"]
        line += f"; {BACKEND_ROW} against {INDUCTOR_ROW}: {ratio:.3f}"
    if info.get("nimble_inductor_error"):
        line += f"; {INDUCTOR_ROW} not timed ({info['nimble_inductor_error']})"
    host = info.get("host_us_per_step")
    if host:
        line += "; host µs/step sampled in turn: " + ", ".join(
            f"{mode} {us:.0f}" for mode, us in host.items())
    return line


def _case(name: str, batch: int, args) -> Case:
    return Case(f"{name} (batch {batch})", {"model": name, "batch": batch},
                lambda: bench_training(name, batch, args))


def run(args) -> int:
    """``nimble bench --training``."""
    names = args.models if args.models_given else DEFAULT_MODELS
    out = outputs(args, "json")
    check_models(names, "bench --training")
    outcome = run_cases([_case(name, batch, args) for name in names for batch in args.batches],
                        _report, out.report)
    if outcome.results:
        print(table(outcome.results), file=out.report)
    if args.json:
        out.write_json("--json", {"results": outcome.results, "failed": outcome.failed},
                       "bench results")
    return outcome.status
