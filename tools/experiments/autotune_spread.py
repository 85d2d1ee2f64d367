"""What cuDNN's autotuning picks, process by process, and what that does to the multi-stream time.

    python3 tools/experiments/autotune_spread.py MODEL [--processes 7] [--heuristics 0]
        [--dtype float32] [--rounds 5] [--iters 50] [--json F]

cuDNN's autotuning (``torch.backends.cudnn.benchmark``, on in every recording, bench and GPU
test) times each convolution's algorithms in the process and keeps the fastest alone; between
algorithms within timing noise of each other the pick changes from one process to the next.
Each of ``--processes`` child processes turns the autotuning on, prepares ``MODEL`` with Nimble
and times ``torch.cuda.graph`` of the model (input copied in) against Nimble multi in
interleaved rounds; ``--heuristics K`` adds K children with the autotuning off (cuDNN's
heuristics). A line per process gives its tasks, streams, medians and ×graph; then, against the
recording most processes made, the kernels whose counts differ in each other recording.
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys


def _child(args) -> None:
    import torch

    import nimble
    from nimble.cli import models
    from nimble.cli.harness import time_rounds, to_dtype, torch_graph_call

    torch.backends.cudnn.benchmark = args.child == "autotuned"
    model, x = to_dtype(models.create(args.model).cuda().eval(),
                        models.example_input(args.model, 1), args.dtype)
    with torch.no_grad():
        nm = nimble.Nimble(model).prepare(x)
        samples = time_rounds({"graph": torch_graph_call(model, x), "multi": lambda: nm(x)},
                              args.rounds, args.iters)
    medians = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    kernels = collections.Counter(t.short_name or t.name for t in nm.graph.tasks)
    print(json.dumps({"cudnn": args.child, "tasks": len(nm.graph.tasks),
                      "streams": len(nm.schedule.streams), "ms": medians,
                      "x_graph": medians["graph"] / medians["multi"], "kernels": kernels}))


def _run_child(args, how: str) -> dict:
    run = subprocess.run([sys.executable, __file__, args.model, "--child", how, "--dtype",
                          args.dtype, "--rounds", str(args.rounds), "--iters", str(args.iters)],
                         capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        return {"cudnn": how, "error": run.stderr.strip().splitlines()[-1:]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def _differences(runs: list[dict]) -> tuple[int, list[dict]]:
    """The index of the recording most processes made (by task count, then kernel counts) and,
    per run, the kernels whose count differs from it."""
    keys = [json.dumps(sorted(r["kernels"].items())) if "kernels" in r else "" for r in runs]
    common = collections.Counter(k for k in keys if k).most_common(1)[0][0]
    base_i = keys.index(common)
    base = runs[base_i]["kernels"]
    out = []
    for r in runs:
        if "kernels" not in r:
            out.append({})
            continue
        got = r["kernels"]
        out.append({k: got.get(k, 0) - base.get(k, 0) for k in set(got) | set(base)
                    if got.get(k, 0) != base.get(k, 0)})
    return base_i, out


def _report(args, runs: list[dict]) -> str:
    lines = [f"{args.model} {args.dtype} batch 1, {args.rounds} rounds of {args.iters} calls"]
    for i, r in enumerate(runs):
        if "error" in r:
            lines.append(f"  {i}: cudnn {r['cudnn']}: failed: {r['error']}")
            continue
        lines.append(f"  {i}: cudnn {r['cudnn']:<10} {r['tasks']:5d} tasks {r['streams']:4d} "
                     f"streams  graph {r['ms']['graph']:.3f} ms  multi {r['ms']['multi']:.3f} ms"
                     f"  x{r['x_graph']:.2f}")
    if any("kernels" in r for r in runs):
        base_i, diffs = _differences(runs)
        lines.append(f"kernel counts against process {base_i}'s recording:")
        for i, diff in enumerate(diffs):
            for name, d in sorted(diff.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:12]:
                lines.append(f"  {i}: {d:+4d} {name[:90]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--processes", type=int, default=7)
    p.add_argument("--heuristics", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json")
    p.add_argument("--child", choices=("autotuned", "heuristics"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    runs = []
    for how in ["autotuned"] * args.processes + ["heuristics"] * args.heuristics:
        runs.append(_run_child(args, how))
        print(f"process {len(runs)}: {json.dumps({k: v for k, v in runs[-1].items() if k != 'kernels'})}",
              file=sys.stderr, flush=True)
    print(_report(args, runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "runs": runs}, f)
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
