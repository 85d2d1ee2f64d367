"""Resource-aware kernel priorities against the slack ones, side by side in one process (GPU).

    python3 tools/experiments/resource_ab.py MODEL[,MODEL] [--dtype float32,float16] [--batch 1]
        [--rounds 7] [--iters 50]
    python3 tools/experiments/resource_ab.py --fixtures FIXTURE[,FIXTURE]    (no GPU)

Per model and dtype, Nimble multi-stream is prepared (inference) with the slack priorities (the
default), with each rule of :data:`nimble.analysis.resources.RULES` served unmeasured
(``PrepareOptions(resource_order=RULE)``) and with the measured choice at prepare
(``resource_order=True``), all from one recording, each proven with 8 launches and no race
fuzzer.  Calls are timed in interleaved rounds
(:func:`nimble.cli.harness.time_rounds`); each line gives the median ms per call with the
rounds' spread, the ratio to the critical-path limit of isolated task times (as ``nimble
bench`` computes it), the speed-up over the slack priorities and how many tasks run at a
different priority than with them.  Last, what the measured prepare timed and kept.

``--fixtures`` names recorded fixtures (``tests/fixtures/NAME.json.gz``) instead: per fixture,
its schedule as prepare makes it and, with the sm_90 defaults of
:class:`nimble.analysis.resources.SmLimits` and six priority levels (the H100's), how many
kernels each rule marks and how many tasks change priority, and how many neighbours on a stream
the DAG leaves unordered.  No GPU needed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import nimble
from nimble.analysis import resources
from nimble.cli import models
from nimble.cli.bench import parse_dtypes
from nimble.cli.harness import time_rounds, to_dtype
from nimble.driver.gpu import use_cudnn_benchmark
from nimble.engine.gpu_limits import recording_limits

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
H100_LEVELS = 6  # the H100's and H200's stream priorities, 0 to -5


#: Each variant's proof: a few poisoned launches, no race fuzzer (the tool prepares four graphs
#: of one recording; the full proof of each is the GPU tests' job).
PROOF = {"relaunches": 8, "fuzz": False}


def _variants(model, x) -> tuple[dict[str, nimble.Nimble], float]:
    """The prepared variants by label, and the critical-path limit in µs."""
    plain = nimble.Nimble(model).prepare(
        x, options=nimble.PrepareOptions(keep_recording=True, **PROOF))
    rec = plain.recording
    out = {"slack priorities": plain}
    for rule in resources.RULES:
        out[rule] = nimble.Nimble(model).prepare(
            x, options=nimble.PrepareOptions(recording=rec, resource_order=rule, **PROOF))
    out["measured"] = nimble.Nimble(model).prepare(
        x, options=nimble.PrepareOptions(recording=rec, resource_order=True, **PROOF))
    # Last: it times the tasks again into the recording, which the prepares above rank by.
    limit_us = recording_limits(plain.recording, 0.0).critical_path_us
    return out, limit_us


def _changed(nm: nimble.Nimble, plain: nimble.Nimble) -> int:
    a, b = nm.kernel_priorities, plain.kernel_priorities
    if a is None or b is None:
        return 0
    return sum(p != q for p, q in zip(a, b))


def measure(name: str, dtype: str, args) -> None:
    model, x = to_dtype(models.create(name).cuda().eval(), models.example_input(name, args.batch),
                        dtype)
    with torch.no_grad():
        variants, limit_us = _variants(model, x)
        samples = time_rounds({k: (lambda nm=nm: nm(x)) for k, nm in variants.items()},
                              args.rounds, args.iters)
    medians = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    plain = variants["slack priorities"]
    print(f"{name} {dtype} batch {args.batch}: critical-path limit {limit_us / 1e3:.3f} ms, "
          f"{len(plain.schedule.streams)} streams", flush=True)
    for label, v in samples.items():
        ms = medians[label]
        print(f"  {label:<18}{ms:9.3f} ms ({min(v):.3f}-{max(v):.3f})"
              f"  {ms * 1e3 / limit_us:5.2f}x the limit"
              f"  x{medians['slack priorities'] / ms:.3f} over slack"
              f"  {_changed(variants[label], plain):5d} tasks reprioritised", flush=True)
    for r in variants["measured"].graph.meta.get("resource_order", []):
        trials = ", ".join(f"{t['rule']} {t['ms']:.3f} ms ({t['changed']} tasks)"
                           for t in r["trials"])
        print(f"  measured at prepare, phase {r['phase']}: slack {r['plain_ms']:.3f} ms, "
              f"{trials}; kept {r['kept'] or 'the slack priorities'}", flush=True)
    for nm in variants.values():
        nm.close()


def plan_fixture(name: str) -> None:
    """What each rule changes on a recorded fixture (the analysis alone)."""
    from nimble.analysis.deps import build_dag, reachability, task_durations
    from nimble.analysis.schedule import phase_spans
    from nimble.engine.prepared import plan_graph
    from nimble.ir.taskgraph import TaskGraph

    graph = TaskGraph.load(FIXTURES / f"{name}.json.gz")
    durations = task_durations(graph)
    if durations is None:
        print(f"{name}: the fixture carries no task times", flush=True)
        return
    n = len(graph.tasks)
    schedule, _ = plan_graph(graph, True, None, "pool", durations)
    profiles = resources.profile_tasks(graph, resources.SmLimits(), durations)
    trials = resources.plan_trials(n, schedule.edges(), durations, H100_LEVELS, profiles,
                                   phase_spans(schedule.phases, n))
    counts = resources.summary(profiles)
    reach = reachability(build_dag(graph))
    free = sum(1 for tasks in schedule.streams for a, b in zip(tasks, tasks[1:])
               if not (reach[a] >> b) & 1)
    print(f"{name}: {n} tasks, {len(schedule.streams)} streams; {counts['memory']} memory-bound, "
          f"{counts['compute']} compute-bound ({counts['large compute']} with a large "
          f"footprint), {counts['other']} unknown; "
          + (", ".join(f"{t.rule} marks {t.marked}, reprioritises {t.changed}" for t in trials)
             or "no candidate")
          + f"; {free} neighbours on a stream that the DAG leaves unordered", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="?", default="",
                   help="comma-separated model names (nimble.cli.models)")
    p.add_argument("--fixtures", default="", help="comma-separated fixture names (no GPU)")
    p.add_argument("--dtype", default="float32", help="comma-separated dtypes")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    if args.fixtures:
        for name in args.fixtures.split(","):
            plan_fixture(name)
        return 0
    if not args.models:
        p.error("name models (or --fixtures)")
    use_cudnn_benchmark()
    for name in args.models.split(","):
        for dtype in parse_dtypes(args.dtype):
            measure(name, dtype, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
