"""``nimble bench --training``: one training step, Nimble against eager and torch's graph tools.

A step is ``zero_grad()``, forward, cross-entropy loss, ``backward()`` and ``optimizer.step()``
(SGD with momentum).  Every mode gets its own copy of the model and its own optimizer, and all
run in one process, interleaved round by round as ``nimble bench`` does (make_graphed_callables
first, so Nimble's first prepare finds cuDNN's autotuning partly warm: the table shows the
longer of Nimble's two prepares):

* ``eager``: the model as it is;
* ``graphed``: ``torch.cuda.make_graphed_callables(model, (x,))``;
* ``compile``: ``torch.compile(model)`` (default mode; skipped with ``--no-compile``);
* ``nimble single`` / ``nimble multi``: ``prepare(x, training=True)`` on one stream / many.

The classifiers of the paper's training table run at CIFAR-10 shapes (3×32×32, 10 classes), the
others at their ImageNet shapes.  The table prints ×eager beside the paper's figure (batch 32,
V100) where the paper has one, Nimble's arena beside the memory pool ``make_graphed_callables``
took for the same model (the allocator's segments of the pool it created), and how long
``prepare(training=True)`` took.
"""
from __future__ import annotations

import copy
import time
from typing import Callable

from . import models
from ..progress import say

#: The paper's training speed-ups over PyTorch (batch 32, CIFAR-10, V100).
PAPER_X_EAGER = {"mobilenet_v2": 3.61, "efficientnet_b0": 3.32, "resnet50": 1.90}
CIFAR_MODELS = ("resnet50", "mobilenet_v2", "efficientnet_b0")
DEFAULT_MODELS = ["resnet50", "mobilenet_v2", "efficientnet_b0", "googlenet", "inception_v3"]


def parse_batches(text: str) -> list[int]:
    """``--batch`` for training: comma-separated positive ints."""
    import argparse

    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give batch sizes like 32 or 32,64,128")
    return list(dict.fromkeys(values))


def _setup(name: str, batch: int):
    """``(model in train mode on the GPU, input, labels)`` at the shape the table uses."""
    import torch

    cifar = name in CIFAR_MODELS
    model = models.create(name, num_classes=10 if cifar else None).cuda().train()
    x = models.example_input(name, batch, side=32 if cifar else None)
    y = torch.randint(0, 10 if cifar else 1000, (batch,), device="cuda")
    return model, x, y


def _stepper(forward: Callable, model, x, y) -> Callable[[], None]:
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

    from .bench import time_rounds

    torch.backends.cudnn.benchmark = True
    base, x, y = _setup(name, batch)
    steps: dict[str, Callable[[], None]] = {}
    eager = copy.deepcopy(base)
    steps["eager"] = _stepper(eager, eager, x, y)
    graphed_model = copy.deepcopy(base)
    before = _pool_ids()
    graphed = torch.cuda.make_graphed_callables(graphed_model, (x,))
    graphed_pool = _pool_bytes(_pool_ids() - before - {(0, 0), ()})
    steps["graphed"] = _stepper(graphed, graphed_model, x, y)
    if not args.no_compile:
        compiled_model = copy.deepcopy(base)
        steps["compile"] = _stepper(torch.compile(compiled_model), compiled_model, x, y)
    info: dict = {"model": name, "batch": batch, "input": list(x.shape),
                  "graphed_pool_mb": graphed_pool / 2**20, "prepare_seconds": {}}
    for label, multi in (("nimble single", False), ("nimble multi", True)):
        model = copy.deepcopy(base)
        t0 = time.perf_counter()
        nm = nimble.Nimble(model).prepare(x, training=True, use_multi_stream=multi,
                                          quiet=args.quiet)
        info["prepare_seconds"][label] = time.perf_counter() - t0
        steps[label] = _stepper(nm, model, x, y)
        if multi:
            info.update(streams=len(nm.schedule.streams),
                        syncs=len(nm.schedule.sync_edges), tasks=len(nm.graph.tasks),
                        phases=list(nm.graph.meta["phases"]),
                        arena_mb=nm.memplan.arena_bytes / 2**20,
                        pool_mb=nm.graph.meta["pool_bytes"] / 2**20,
                        not_bitwise=len(nm.graph.meta.get("verified", {}).get("not_bitwise", {})))
    say(f"timing {name} batch {batch}: {', '.join(steps)}", args.quiet, "bench")
    samples = time_rounds(steps, args.rounds, args.iters)
    medians = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    info["modes"] = {k: {"median_ms": medians[k], "min_ms": min(v), "max_ms": max(v),
                         "x_eager": medians["eager"] / medians[k],
                         "x_graphed": medians["graphed"] / medians[k]}
                     for k, v in samples.items()}
    info["paper_x_eager"] = PAPER_X_EAGER.get(name) if name in CIFAR_MODELS and batch == 32 \
        else None
    return info


def table(results: list[dict]) -> str:
    """The final table: a row per model and batch."""
    head = (f"{'model':<16}{'batch':>6}{'eager':>8}{'graphed':>9}{'compile':>9}{'single':>8}"
            f"{'multi':>8}{'x eager':>8}{'x graphed':>10}{'paper':>7}{'arena':>7}{'graphed':>8}"
            f"{'prep s':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        m = r["modes"]
        get = lambda k: f"{m[k]['median_ms']:.2f}" if k in m else "–"  # noqa: E731
        multi = m["nimble multi"]
        paper = f"{r['paper_x_eager']:.2f}" if r["paper_x_eager"] else "–"
        lines.append(
            f"{r['model']:<16}{r['batch']:>6}{get('eager'):>8}{get('graphed'):>9}"
            f"{get('compile'):>9}{get('nimble single'):>8}{get('nimble multi'):>8}"
            f"{multi['x_eager']:>8.2f}{multi['x_graphed']:>10.2f}{paper:>7}"
            f"{r['arena_mb']:>7.0f}{r['graphed_pool_mb']:>8.0f}"
            f"{max(r['prepare_seconds'].values()):>7.1f}")
    lines.append("times: median ms per training step (zero_grad, forward, loss, backward, SGD "
                 "step); x eager / x graphed: Nimble multi-stream against eager and "
                 "make_graphed_callables; paper: the paper's x PyTorch (V100, batch 32); arena: "
                 "Nimble's MB for forward and backward; graphed: MB of the memory pool "
                 "make_graphed_callables took; prep s: the longer of the two "
                 "prepare(training=True), cuDNN's autotuning partly warm from "
                 "make_graphed_callables")
    return "\n".join(lines)


def run(args) -> int:
    """``nimble bench --training``."""
    import json

    from .main import check_models, require_gpu

    names = args.models if args.models_given else DEFAULT_MODELS
    check_models(names)
    require_gpu("bench --training")
    results, failed = [], []
    for name in names:
        for batch in args.batches:
            try:
                info = bench_training(name, batch, args)
            except Exception as e:  # noqa: BLE001 - one run's failure must not hide the others
                failed.append({"model": name, "batch": batch, "error": f"{type(e).__name__}: {e}"})
                print(f"{name} (batch {batch}): FAILED: {type(e).__name__}: {e}", flush=True)
                continue
            results.append(info)
            print(f"{name} batch {batch}: " + ", ".join(
                f"{k} {v['median_ms']:.2f} ms" for k, v in info["modes"].items()), flush=True)
    if results:
        print(table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"results": results, "failed": failed}, f, indent=2, default=str)
    return 1 if failed else 0
