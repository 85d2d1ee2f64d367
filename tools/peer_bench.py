"""Nimble against a published multi-stream peer on the same GPU, each in processes of its own.

    python3 tools/peer_bench.py --peer DIR MODEL[,MODEL...] [--dtype float32[,float16]]
                                [--processes 3] [--rounds 5] [--iters 50] [--json F]

The peer is Opara (resource-aware operator launch order over CUDA graphs and streams; its public
code, a checkout whose ``Opara/`` folder sits in ``DIR``; nothing of it is part of Nimble). For
every model and dtype, ``--processes`` child processes per system run one after the other,
alternating Nimble and the peer; each turns cuDNN's autotuning on (as every Nimble bench does:
the pick changes from process to process, so one process per system says little), builds the
system, checks its output against eager PyTorch, and times ``torch.cuda.graph`` of the model
(input copied in) against the system in interleaved rounds. Reported per process: the medians
and ×graph (graph time over the system's time); per model and dtype: the median ×graph of
each system's processes and Nimble's over the peer's.

Two adaptations let the peer's code, written for torch 2.0, run on a newer torch, applied by this
tool from outside it: ``torch._dynamo.explain`` called the old way returns the tuple the peer
unpacks, and dynamo keeps ``nn.Module`` calls in its graph instead of inlining them (the peer's
interpreter runs that graph with the model's inputs alone). The peer's profile, which it caches
by model class and input shape, is removed before each of its processes so that it profiles
the kernels that process picked.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SYSTEMS = ("nimble", "peer")


def _peer_system(peer_dir: str, model, x):
    """The peer's callable for ``model`` at ``x``."""
    import torch
    import torch._dynamo as dynamo

    results = os.path.join(peer_dir, "Opara", "profile_result")
    os.makedirs(results, exist_ok=True)
    for name in os.listdir(results):
        if name.endswith(".pt.trace.json"):
            os.remove(os.path.join(results, name))
    if hasattr(dynamo.config, "inline_inbuilt_nn_modules"):
        dynamo.config.inline_inbuilt_nn_modules = False
    sys.path.insert(0, peer_dir)
    from Opara import GraphCapturer

    explain = dynamo.explain

    def explain_as_a_tuple(fn, *args):
        out = explain(fn)(*args)
        if len(out.graphs) != 1:
            raise RuntimeError(f"dynamo split the model into {len(out.graphs)} graphs; the peer "
                               "runs only the first")
        return str(out), out.out_guards, out.graphs, out.ops_per_graph, out.break_reasons, ""

    GraphCapturer.dynamo.explain = explain_as_a_tuple
    with torch.no_grad():
        run = GraphCapturer.capturer((x,), model)
    return lambda: run(x)


def _child(args) -> None:
    import torch

    from nimble.cli import models
    from nimble.cli.harness import time_rounds, to_dtype, torch_graph_call

    torch.backends.cudnn.benchmark = True
    model, x = to_dtype(models.create(args.models).cuda().eval(),
                        models.example_input(args.models, 1), args.dtype)
    with torch.no_grad():
        expected = model(x)
        if args.child == "nimble":
            import nimble

            nm = nimble.Nimble(model).prepare(x)
            system = lambda: nm(x)  # noqa: E731
        else:
            system = _peer_system(args.peer, model, x)
        got = system()
        got = got[0] if isinstance(got, (list, tuple)) else got
        max_diff = (got.float() - expected.float()).abs().max().item()
        samples = time_rounds({"graph": torch_graph_call(model, x), "system": system},
                              args.rounds, args.iters)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    spread = max(abs(s / medians["system"] - 1) for s in samples["system"])
    print(json.dumps({"system": args.child, "ms": medians, "spread": spread,
                      "x_graph": medians["graph"] / medians["system"], "max_diff": max_diff}))


def _run_child(args, model: str, dtype: str, system: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), model, "--child", system, "--dtype", dtype,
           "--rounds", str(args.rounds), "--iters", str(args.iters), "--peer", args.peer]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"system": system, "error": f"no result in {args.timeout} s"}
    if run.returncode != 0:
        return {"system": system, "error": " | ".join(run.stderr.strip().splitlines()[-3:])}
    return json.loads(run.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict]) -> dict:
    """Per system, the median ×graph over its processes that ran; and Nimble's over the peer's."""
    out: dict = {}
    for system in SYSTEMS:
        ratios = [r["x_graph"] for r in runs if r["system"] == system and "x_graph" in r]
        out[system] = statistics.median(ratios) if ratios else None
    out["nimble_over_peer"] = (out["nimble"] / out["peer"]
                               if out["nimble"] and out["peer"] else None)
    return out


def format_case(model: str, dtype: str, runs: list[dict]) -> str:
    lines = [f"{model} {dtype}"]
    for r in runs:
        if "error" in r:
            lines.append(f"  {r['system']:<6} failed: {r['error']}")
            continue
        lines.append(f"  {r['system']:<6} graph {r['ms']['graph']:.3f} ms  system "
                     f"{r['ms']['system']:.3f} ms (rounds within {100 * r['spread']:.1f}%)  "
                     f"x{r['x_graph']:.2f}  max |diff| to eager {r['max_diff']:.2e}")
    s = summarize(runs)
    shown = {k: (f"{v:.2f}" if v else "-") for k, v in s.items()}
    lines.append(f"  median x graph: nimble {shown['nimble']}, peer {shown['peer']}; "
                 f"nimble / peer {shown['nimble_over_peer']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models")
    p.add_argument("--peer", required=True, help="the folder holding the peer's Opara/ package")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--processes", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--json")
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.peer = os.path.abspath(args.peer)
    if args.child:
        _child(args)
        return 0
    if not os.path.isdir(os.path.join(args.peer, "Opara")):
        p.error(f"no Opara/ folder in {args.peer}")
    cases = []
    for model in args.models.split(","):
        for dtype in args.dtype.split(","):
            runs = []
            for _ in range(args.processes):
                for system in SYSTEMS:
                    runs.append(_run_child(args, model, dtype, system))
                    print(f"{model} {dtype} {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
            print(format_case(model, dtype, runs), flush=True)
            cases.append({"model": model, "dtype": dtype, "runs": runs, **summarize(runs)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(cases, f, indent=1)
    return 0 if all("error" not in r for c in cases for r in c["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
