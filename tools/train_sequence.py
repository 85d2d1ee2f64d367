"""Prepare and run training steps of several models one after another in one process.

    python3 tools/train_sequence.py resnet50,mobilenet_v2,efficientnet_b0,googlenet [--batch 32]
                                    [--single] [--graphed] [--steps 3]

For the failure seen on 2026-11-23: googlenet's (or mobilenet_v2's) training step failed with
``CUDA_ERROR_INVALID_ADDRESS_SPACE`` or a garbage gradient only when other models had been
prepared in the same process before it; alone it verified (compute-sanitizer: 0 errors).  Each
model in turn: optionally ``make_graphed_callables`` on a copy (``--graphed``, as the bench does),
``prepare(training=True)``, ``--steps`` SGD steps, a synchronize; one line per model with what
failed and where, then the CUDA state (a sticky error shows in every later model).  Run it under
``compute-sanitizer --tool memcheck`` to name the kernel.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str]) -> int:
    import torch

    import nimble
    from nimble.cli.train_bench import _setup

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--single", action="store_true", help="one stream per phase")
    p.add_argument("--graphed", action="store_true", help="make_graphed_callables first")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    failed = 0
    keep = []  # every prepared model stays alive, as in the bench process
    for name in args.models.split(","):
        stage = "setup"
        t0 = time.perf_counter()
        try:
            model, x, y = _setup(name, args.batch)
            if args.graphed:
                stage = "make_graphed_callables"
                keep.append(torch.cuda.make_graphed_callables(copy.deepcopy(model), (x,)))
            stage = "prepare"
            nm = nimble.Nimble(model).prepare(x, training=True,
                                              use_multi_stream=not args.single)
            stage = "steps"
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for _ in range(args.steps):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(nm(x), y).backward()
                opt.step()
            torch.cuda.synchronize()
            keep.append(nm)
            verified = nm.graph.meta.get("verified", {})
            print(f"{name}: ok in {time.perf_counter() - t0:.1f} s; "
                  f"{len(verified.get('not_bitwise', {}))} gradients not bitwise; arena "
                  f"{nm.memplan.arena_bytes / 2**20:.0f} MiB", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on: later models show stickiness
            failed += 1
            print(f"{name}: FAILED in {stage}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
