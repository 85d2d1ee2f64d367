"""Why the capture's own programmatic edges are withdrawn: prepares on Inductor's kernels, proven,
many times, with a second process keeping the GPU busy (docs/findings.md, "Programmatic edges
raced on a busy GPU").

    python3 tools/experiments/programmatic_race.py [--variant programmatic|plain|capture-replay]
        [--tries 12] [--seconds 270] [--no-load] [--rule allowed|library-sources|none]

Each try builds the Generator of ``llama3_1b`` (bf16, random weights, sibling projections fused,
the math attention kernels, prompt buckets 128 and 512) on ``torch.compile``'s kernels, in one
process, and prints whether every prepare's proof passed or the first line of the
``VerificationError``. ``--variant programmatic`` asks for ``programmatic_launch=True`` with the
engine's withdrawn rule back for this process only (``nimble.engine.programmatic_pick.RULE``: the
edges the capture launched programmatically between Inductor's kernels are built, as before the
withdrawal, not the edges into Nimble's own waiting kernels); ``plain`` does not ask. ``--rule
library-sources`` also keeps no edge out of a library's kernel (a candidate rule that did not
help); ``--rule none`` builds no edge at all while Inductor still compiles its kernels to launch
programmatically (whether their code alone, in a graph of full dependencies, races). ``--variant
capture-replay`` takes Nimble out: the prefill captured by ``torch.cuda.graph`` with Inductor's
programmatic launches, replayed ``--tries`` times against its first replay (whether torch's own
capture of the same kernels races under the same load). Unless ``--no-load``, a child process runs
bf16 matmuls of 256 to 4096 in bursts on the same GPU for ``--seconds``. Set ``NIMBLE_FAULT_DIR``
to keep the recordings of the failed proofs.
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
    p.add_argument("--variant", choices=("programmatic", "plain", "capture-replay"),
                   default="programmatic")
    p.add_argument("--tries", type=int, default=12)
    p.add_argument("--seconds", type=float, default=270.0, help="how long the load runs")
    p.add_argument("--no-load", action="store_true", help="no second process on the GPU")
    p.add_argument("--rule", choices=("allowed", "library-sources", "none"), default="allowed")
    return p.parse_args(argv)


def undo_withdrawal(rule: str) -> None:
    """Programmatic edges built as before the withdrawal, in this process only."""
    from nimble.analysis import programmatic
    from nimble.engine import programmatic_pick
    from nimble.ir.kernel_names import library_kernel

    programmatic_pick.RULE = "recorded"
    if rule == "none":
        programmatic.candidate_edges = lambda graph, edges: []
    elif rule == "library-sources":
        allowed = programmatic.candidate_edges
        programmatic.candidate_edges = lambda graph, edges: [
            (u, v) for u, v in allowed(graph, edges) if not library_kernel(graph.tasks[u].name)]


def llama_fused():
    """The experiment's decoder: ``llama3_1b`` in bf16, random weights, projections fused."""
    from nimble.cli.decoders import causal_lm
    from nimble.fused_projections import fuse_projections

    model = causal_lm("llama3_1b", "bfloat16")
    fuse_projections(model)
    return model


def prepares(args) -> int:
    """``--variant programmatic|plain``: Generators prepared by Nimble; how many failed."""
    import torch
    import torch._dynamo.config as dynamo

    from nimble import Nimble, PrepareOptions
    from nimble.cli.generate_levers import attention_backends
    from nimble.generate import Generator

    asked = args.variant == "programmatic"
    if asked:
        undo_withdrawal(args.rule)
    options = PrepareOptions(programmatic_launch=True) if asked else None
    model = llama_fused()

    def step(module, examples):
        with dynamo.patch(recompile_limit=len(examples) + 1):
            return Nimble(torch.compile(module, dynamic=False)).prepare(
                buckets=list(examples), options=options)
    failed = 0
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
    return failed


def capture_replays(args) -> int:
    """``--variant capture-replay``: no Nimble graph at all.  The prefill step (prompt of 128)
    compiled with Inductor's programmatic launches and captured by ``torch.cuda.graph``, then
    replayed ``--tries`` times, the static cache put back before each; how many replays gave
    other logits or another token than the first (what torch's own capture does with the same
    kernels, under the same load)."""
    import torch
    import torch._inductor.config as inductor
    import transformers

    from nimble.cli.generate_levers import attention_backends
    from nimble.decode_steps import PrefillStep, _cache_tensors

    model = llama_fused()
    cache = transformers.StaticCache(config=model.config, max_cache_len=512 + 64)
    ids = torch.randint(0, model.config.vocab_size, (1, 128), device="cuda")
    last = torch.tensor([127], device="cuda")
    with torch.no_grad():
        model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
        step = torch.compile(PrefillStep(model, cache).eval(), dynamic=False)
        state = _cache_tensors(cache)
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        # the capture in the same settings as the compile, so that Dynamo's guards hold there
        with inductor.patch({"triton.enable_pdl": True}), attention_backends(["math"]):
            with torch.cuda.stream(side):
                for _ in range(3):  # compiles, then warms up outside the capture
                    step(ids, last)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                token, logits = step(ids, last)

        def replay():
            for t, s in zip(state, saved):
                t.copy_(s)
            graph.replay()
            torch.cuda.synchronize()
            return token.clone(), logits.clone()
        want_token, want_logits = replay()
        failed = 0
        for k in range(args.tries):
            got_token, got_logits = replay()
            if not (torch.equal(got_token, want_token) and torch.equal(got_logits, want_logits)):
                failed += 1
                worst = (got_logits.float() - want_logits.float()).abs().max().item()
                print(f"replay {k}: differs (logits max abs diff {worst:.3g}, token "
                      f"{got_token.tolist()} for {want_token.tolist()})", flush=True)
    return failed


def main(argv=None) -> int:
    args = parse(argv)
    load = None if args.no_load else subprocess.Popen(
        [sys.executable, "-c", LOAD, str(args.seconds)])
    try:
        failed = capture_replays(args) if args.variant == "capture-replay" else prepares(args)
    finally:
        if load is not None:
            load.kill()
    what = "replays differed" if args.variant == "capture-replay" else \
        "tries failed their proof"
    print(f"{args.variant} ({args.rule}): {failed} of {args.tries} {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
