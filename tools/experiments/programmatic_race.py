"""Why programmatic launch is withdrawn: prepares on Inductor's kernels, proven, many times, with
a second process keeping the GPU busy (docs/findings.md, "Programmatic edges raced on a busy
GPU").

    python3 tools/experiments/programmatic_race.py [--variant programmatic|plain]
        [--tries 12] [--seconds 270] [--no-load] [--rule allowed|library-sources|none]

Each try builds the Generator of ``llama3_1b`` (bf16, random weights, sibling projections fused,
the math attention kernels, prompt buckets 128 and 512) on ``torch.compile``'s kernels, in one
process, and prints whether every prepare's proof passed or the first line of the
``VerificationError``.  ``--variant programmatic`` asks for ``programmatic_launch=True`` with the
engine's withdrawal undone for this process only (the edges the analysis allows are built, as
before the withdrawal); ``plain`` does not ask.  ``--rule library-sources`` also keeps no edge
out of a library's kernel (a candidate rule that did not help); ``--rule none`` builds no edge
at all while Inductor still compiles its kernels to launch programmatically (whether their code
alone, in a graph of full dependencies, races).  Unless ``--no-load``, a child
process runs bf16 matmuls of 256 to 4096 in bursts on the same GPU for ``--seconds``.  Set
``NIMBLE_FAULT_DIR`` to keep the recordings of the failed proofs.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

#: The child that keeps the GPU busy: matmuls of random sizes in bursts, random pauses between.
LOAD = """
import random, sys, time
import torch
end = time.time() + float(sys.argv[1])
rng = random.Random(0)
xs = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for n in (256, 1024, 4096)]
while time.time() < end:
    x = rng.choice(xs)
    for _ in range(rng.randint(1, 20)):
        x @ x
    torch.cuda.synchronize()
    time.sleep(rng.random() * 0.002)
"""


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=("programmatic", "plain"), default="programmatic")
    p.add_argument("--tries", type=int, default=12)
    p.add_argument("--seconds", type=float, default=270.0, help="how long the load runs")
    p.add_argument("--no-load", action="store_true", help="no second process on the GPU")
    p.add_argument("--rule", choices=("allowed", "library-sources", "none"), default="allowed")
    return p.parse_args(argv)


def undo_withdrawal(rule: str) -> None:
    """Programmatic edges built as before the withdrawal, in this process only."""
    from nimble.analysis import programmatic
    from nimble.engine import preparation
    from nimble.ir.kernel_names import library_kernel

    preparation._without_programmatic = lambda options: options
    if rule == "none":
        programmatic.candidate_edges = lambda graph, edges: []
    elif rule == "library-sources":
        allowed = programmatic.candidate_edges
        programmatic.candidate_edges = lambda graph, edges: [
            (u, v) for u, v in allowed(graph, edges) if not library_kernel(graph.tasks[u].name)]


def main(argv=None) -> int:
    args = parse(argv)
    import torch
    import torch._dynamo.config as dynamo

    from nimble import Nimble, PrepareOptions
    from nimble.cli.decoders import causal_lm
    from nimble.cli.generate_levers import attention_backends
    from nimble.fused_projections import fuse_projections
    from nimble.generate import Generator

    asked = args.variant == "programmatic"
    if asked:
        undo_withdrawal(args.rule)
    options = PrepareOptions(programmatic_launch=True) if asked else None
    model = causal_lm("llama3_1b", "bfloat16")
    fuse_projections(model)

    def step(module, examples):
        with dynamo.patch(recompile_limit=len(examples) + 1):
            return Nimble(torch.compile(module, dynamic=False)).prepare(
                buckets=list(examples), options=options)

    load = None if args.no_load else subprocess.Popen(
        [sys.executable, "-c", LOAD, str(args.seconds)])
    failed = 0
    try:
        for k in range(args.tries):
            began = time.perf_counter()
            try:
                with attention_backends(["math"]):
                    Generator(model, 512 + 64, [128, 512], [1], prepare_step=step).close()
                print(f"try {k}: proven in {time.perf_counter() - began:.0f} s", flush=True)
            except Exception as e:  # noqa: BLE001 - a failed proof is the finding
                failed += 1
                print(f"try {k}: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
            torch._dynamo.reset()
    finally:
        if load is not None:
            load.kill()
    print(f"{args.variant} ({args.rule}): {failed} of {args.tries} tries failed their proof")
    return 0


if __name__ == "__main__":
    sys.exit(main())
