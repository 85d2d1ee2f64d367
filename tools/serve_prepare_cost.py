"""What shape buckets cost to prepare and to hold, against the largest bucket alone (GPU).

    python3 tools/serve_prepare_cost.py MODEL [--dtype float16] [--batches 1,2,4,8,16,32]
        [--json FILE]

Three ways of serving the batch sizes, each prepared after a cuDNN warm-up (three eager calls at
every batch size, so that no prepare pays for the autotuning of another's shapes) and freed
before the next:

* ``largest alone``: one Nimble prepared for the largest batch size only;
* ``buckets``: one Nimble with a bucket per batch size (``prepare(x, batch_sizes=...)``), the
  buckets sharing one arena;
* ``separate``: one Nimble per batch size, each with its own arena.

For each: prepare seconds (and ``prepare_report``'s split by stage for the buckets), the arena
plans (per bucket, and the largest), the device memory it took (``torch.cuda.mem_get_info()``
before and after, dead objects collected and the allocator's cache released around it) and
``nm.device_bytes``.  The last lines hold the issue's targets: device memory of the buckets over
the largest bucket's arena, both with the model's weights (target at most 1.2), and the
buckets' prepare over the largest's alone (target at most 2).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from nimble.cli.bench import parse_dtypes  # noqa: E402
from nimble.cli.common import parse_batches  # noqa: E402

#: The issue's targets: buckets' device memory over the largest arena's (weights in both), and
#: the buckets' prepare over the largest's alone.
MEMORY_TARGET = 1.2
PREPARE_TARGET = 2.0


@dataclass
class Way:
    """One way of serving the batch sizes: how long its prepare took, the arena plans it holds
    (MB by batch size), the device memory it took and its own reports."""
    label: str
    prepare_s: float
    plans_mb: dict[int, float]
    device_mb: float
    stages_s: dict = field(default_factory=dict)
    device_bytes: dict | None = None  # nm.device_bytes, with its total_bytes

    @property
    def largest_plan_mb(self) -> float:
        return max(self.plans_mb.values())


def targets(ways: dict[str, Way], weights_mb: float) -> dict[str, float]:
    """The issue's two ratios: the buckets' device memory (weights included) over the largest
    bucket's arena plus the weights, and the buckets' prepare seconds over the largest's alone."""
    buckets, largest = ways["buckets"], ways["largest alone"]
    return {"memory": (weights_mb + buckets.device_mb) / (weights_mb + buckets.largest_plan_mb),
            "prepare": buckets.prepare_s / largest.prepare_s}


def report(ways: dict[str, Way], weights_mb: float) -> str:
    """A line per way, its stages, then the targets."""
    lines = [f"{'way':<16}{'prepare s':>10}{'device MB':>11}{'largest plan MB':>17}"
             f"{'plans MB':>10}  per batch size"]
    for way in ways.values():
        lines.append(f"{way.label:<16}{way.prepare_s:>10.2f}{way.device_mb:>11.1f}"
                     f"{way.largest_plan_mb:>17.1f}{sum(way.plans_mb.values()):>10.1f}  "
                     + ", ".join(f"{b}: {mb:.1f}" for b, mb in way.plans_mb.items()))
        if way.stages_s:
            lines.append("    stages: " + ", ".join(f"{k} {v:.2f} s"
                                                   for k, v in way.stages_s.items()))
        if way.device_bytes is not None:
            d = way.device_bytes
            lines.append(f"    device_bytes: shared plans {d['shared_bytes'] / 2**20:.1f} MB + "
                         f"states {d['state_bytes'] / 2**20:.1f} MB per instance, "
                         f"{d['outside_bytes'] / 2**20:.1f} MB beside, total "
                         f"{d['total_bytes'] / 2**20:.1f} MB")
    t = targets(ways, weights_mb)
    lines.append(f"weights {weights_mb:.1f} MB")
    lines.append(f"memory: buckets with weights / (largest bucket's arena + weights) = "
                 f"{t['memory']:.2f} (target <= {MEMORY_TARGET})")
    lines.append(f"prepare: buckets / largest alone = {t['prepare']:.2f} "
                 f"(target <= {PREPARE_TARGET})")
    return "\n".join(lines)


def _prepared(label: str, prepare: Callable[[], list], memory) -> tuple[Way, list]:
    """Run ``prepare`` (a list of Nimbles) between two free-memory probes; the way's seconds,
    memory and arena plans, and the Nimbles."""
    from nimble.cli.serve_modes import nimble_reports

    before = memory.free_bytes(True)
    t0 = time.perf_counter()
    prepared = prepare()
    seconds = time.perf_counter() - t0
    taken = (before - memory.free_bytes(True)) / 2**20
    reports = [nimble_reports(nm) for nm in prepared]
    way = Way(label, seconds, {b: mb for r in reports for b, mb in r["arena_mb"].items()}, taken)
    if len(reports) == 1:
        [r] = reports
        way.stages_s = {**r["prepare_stages_s"], "total": r["prepare_total_s"]}
        way.device_bytes = r["device_bytes"]
    return way, prepared


def measure(name: str, dtype: str, batches: list[int], say: Callable[[str], None]
            ) -> tuple[dict[str, Way], float]:
    """The three ways of serving ``batches`` for ``name`` in ``dtype``; the weights' MB."""
    import torch

    import nimble
    from nimble.cli import models
    from nimble.cli.bench import to_dtype
    from nimble.cli.serve_modes import CudaMemory
    from nimble.driver.gpu import use_cudnn_benchmark

    use_cudnn_benchmark()
    model, example = to_dtype(models.create(name).cuda(), models.example_input(name), dtype)
    inputs = {b: torch.randn((b, *example.shape[1:]), device="cuda", dtype=example.dtype)
              for b in sorted(batches)}
    largest = max(inputs)
    weights_mb = sum(t.numel() * t.element_size()
                     for t in [*model.parameters(), *model.buffers()]) / 2**20
    memory = CudaMemory()

    def warm() -> None:
        with torch.inference_mode():
            for x in inputs.values():
                for _ in range(3):
                    model(x)
        torch.cuda.synchronize()

    ways = {
        "largest alone": lambda: [nimble.Nimble(model).prepare(inputs[largest])],
        "buckets": lambda: [nimble.Nimble(model).prepare(inputs[largest],
                                                         batch_sizes=sorted(inputs))],
        "separate": lambda: [nimble.Nimble(model).prepare(x) for x in inputs.values()],
    }
    measured: dict[str, Way] = {}
    for label, prepare in ways.items():
        say(f"{name} ({dtype}): {label}, batch sizes {sorted(inputs)}")
        warm()
        measured[label], prepared = _prepared(label, prepare, memory)
        for nm in prepared:
            nm.close()
    return measured, weights_mb


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", help="models, comma-separated")
    parser.add_argument("--dtype", type=parse_dtypes, default=["float16"])
    parser.add_argument("--batches", type=parse_batches, default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
    results = []
    for name in args.models.split(","):
        for dtype in args.dtype:
            ways, weights_mb = measure(name, dtype, args.batches, say)
            print(f"{name} ({dtype}), batch sizes {','.join(map(str, args.batches))}")
            print(report(ways, weights_mb), flush=True)
            results.append({"model": name, "dtype": dtype, "weights_mb": weights_mb,
                            "ways": {k: asdict(w) for k, w in ways.items()},
                            "targets": targets(ways, weights_mb)})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
