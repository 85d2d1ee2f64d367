"""Where a multi-stream call's time goes against the limits no schedule beats (GPU).

    python3 tools/experiments/gap_analysis.py MODEL[,MODEL] [--dtype float32,float16] [--batch 1]
        [--rounds 5] [--iters 30] [--trace-runs 5] [--caps 8,16] [--json FILE]
    python3 tools/experiments/gap_analysis.py --report FILE  (no GPU: print a --json file's report)

Per model and dtype, from one recording: Nimble multi-stream as served (the default options),
with the arena uncapped, without kernel priorities, under stream caps (``--caps``), and Nimble
single-stream, each proven with
8 launches and no race fuzzer, timed in interleaved rounds.  Then every task is timed alone and
the phase's limits are worked out (:mod:`nimble.analysis.limits`): the critical path of isolated
times, the same with each task's single-stream launch cost added, and the GPU-capacity bound.
Then ``nm.trace()`` of the served graph and of the uncapped one: the executed critical path
split into isolated time, stretch (tasks running longer beside others than alone) and waits
(those of steps that change stream apart), and the whole run's stretch split by what bounds
each kernel (memory or compute).

Last, the isolated times are checked against the tasks' times inside a single-stream replay,
read from the profiler's CUDA activity records (CUPTI: no node added to the graph): where
timing each task alone between events overstates it, the limits are worked out again from the
in-chain times.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# The profiler run that reads the in-chain times must not leave CUPTI attached: with it, later
# graphs in the process run slower (docs/results.md, "After a profiler run").
os.environ.setdefault("TEARDOWN_CUPTI", "1")

import torch  # noqa: E402

import nimble  # noqa: E402
from nimble.analysis import limits
from nimble.analysis.deps import build_dag, transitive_reduction
from nimble.cli import models
from nimble.cli.bench import parse_dtypes
from nimble.cli.harness import time_rounds, to_dtype
from nimble.driver.gpu import use_cudnn_benchmark
from nimble.engine.gpu_limits import task_gpu_shares
from nimble.engine.task_timing import time_recording

PROOF = {"relaunches": 8, "fuzz": False}


def _variants(model, x, caps) -> dict[str, nimble.Nimble]:
    served = nimble.Nimble(model).prepare(
        x, options=nimble.PrepareOptions(keep_recording=True, **PROOF))
    rec = served.recording
    capped = {f"multi, at most {cap} streams": nimble.Nimble(model).prepare(
        x, max_streams=cap, options=nimble.PrepareOptions(recording=rec, **PROOF))
        for cap in caps if cap < len(served.schedule.streams)}
    return {**capped, 
        "multi (served)": served,
        "multi, arena uncapped": nimble.Nimble(model).prepare(
            x, options=nimble.PrepareOptions(recording=rec, arena_limit=None, **PROOF)),
        "multi, no priorities": nimble.Nimble(model).prepare(
            x, options=nimble.PrepareOptions(recording=rec, priorities=False, **PROOF)),
        "single": nimble.Nimble(model).prepare(
            x, use_multi_stream=False, options=nimble.PrepareOptions(recording=rec, **PROOF)),
    }


def _stretch_by_bound(times, isolated, bounds) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for (b, e), alone, bound in zip(times, isolated, bounds):
        row = out.setdefault(bound, {"tasks": 0, "isolated_us": 0.0, "ran_us": 0.0})
        row["tasks"] += 1
        row["isolated_us"] += alone
        row["ran_us"] += e - b
    return out


def _in_chain_us(single, x, replays: int = 5) -> list[float] | None:
    """Per task, its median GPU time inside ``replays`` single-stream calls, from the
    profiler's CUDA activity records in stream order (Nimble's own input gathers left out);
    None, with the reason printed, where the records do not match the tasks one to one."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    (order,) = single.schedule.streams
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            single(x)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA
                     and not e.name.startswith("nimble_")), key=lambda e: e.time_range.start)
    if len(events) != replays * len(order):
        names = sorted({e.name[:40] for e in events})[:8]
        print(f"  in-chain times: {len(events)} profiler records for {replays} x {len(order)} "
              f"tasks (e.g. {names}); not used", flush=True)
        return None
    samples: list[list[float]] = [[] for _ in order]
    for k, e in enumerate(events):
        samples[k % len(order)].append(e.time_range.end - e.time_range.start)
    out = [0.0] * len(order)
    for position, t in enumerate(order):
        out[t] = sorted(samples[position])[replays // 2]
    return out


def _trace(nm, x, isolated, bounds, runs: int, in_chain=None) -> dict:
    from nimble.debug.timeline import executed_critical_path

    tl = nm.trace(x, runs=runs)
    if len(tl.times) != len(isolated):
        raise SystemExit(f"the trace has {len(tl.times)} tasks, the recording {len(isolated)}")
    phase = tl.summary()["phases"][0]
    path = executed_critical_path(tl.schedule, tl.times, late_edges=tl.late_edges)
    begin = min(b for b, _ in tl.times)
    return {"plain_us": tl.plain_us, "instrumented_us": tl.instrumented_us,
            "makespan_us": phase["makespan_us"], "concurrency": phase["concurrency"],
            "streams": phase["streams"],
            "path": limits.path_breakdown(tl.times, isolated, path, begin,
                                          tl.schedule.stream_of).as_dict(),
            "path_in_chain": limits.path_breakdown(tl.times, in_chain, path, begin,
                                                   tl.schedule.stream_of).as_dict()
            if in_chain is not None else None,
            "by_bound": _stretch_by_bound(tl.times, isolated, bounds)}


def measure(name: str, dtype: str, args) -> dict:
    model, x = to_dtype(models.create(name).cuda().eval(), models.example_input(name, args.batch),
                        dtype)
    with torch.no_grad():
        variants = _variants(model, x, args.caps)
        samples = time_rounds({k: (lambda nm=nm: nm(x)) for k, nm in variants.items()},
                              args.rounds, args.iters)
        served = variants["multi (served)"]
        rec = served.recording
        isolated = time_recording(rec)
        shares, bounds = task_gpu_shares(rec, isolated)
        medians = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
        bound = limits.phase_limits(transitive_reduction(build_dag(rec.graph)), isolated,
                                    medians["single"] * 1e3, shares)
        in_chain = _in_chain_us(variants["single"], x)
        traces = {k: _trace(variants[k], x, isolated, bounds, args.trace_runs, in_chain)
                  for k in ("multi (served)", "multi, arena uncapped")}
        chain_bound = limits.phase_limits(transitive_reduction(build_dag(rec.graph)), in_chain,
                                          medians["single"] * 1e3, shares) \
            if in_chain is not None else None
    result = {"model": name, "dtype": dtype, "batch": args.batch,
              "streams": {k: len(nm.schedule.streams) for k, nm in variants.items()},
              "arena_mb": {k: nm.device_bytes.total_bytes / 2**20 for k, nm in variants.items()},
              "ms": {k: {"median": medians[k], "min": min(v), "max": max(v)}
                     for k, v in samples.items()},
              "limits": bound.as_dict(), "traces": traces,
              "in_chain_limits": chain_bound.as_dict() if chain_bound else None}
    for nm in variants.values():
        nm.close()
    return result


def _limits_line(what: str, lim: dict) -> str:
    return (f"  {what}: {lim['isolated_sum_us'] / 1e3:.3f} ms of kernels; critical path "
            f"{lim['critical_path_us'] / 1e3:.3f} ms; with {lim['launch_us']:.2f} µs launch cost "
            f"per task {lim['launch_aware_path_us'] / 1e3:.3f} ms; GPU capacity "
            f"{lim['capacity_us'] / 1e3:.3f} ms")


def report(r: dict) -> str:
    lim = r["limits"]
    out = [f"{r['model']} {r['dtype']} batch {r['batch']}: {lim['tasks']} tasks",
           _limits_line("isolated times (prepare's)", lim)]
    for k, m in r["ms"].items():
        out.append(f"  {k:<24}{m['median']:8.3f} ms ({m['min']:.3f}-{m['max']:.3f})  "
                   f"{m['median'] * 1e3 / lim['critical_path_us']:5.2f}x the critical path, "
                   f"{m['median'] * 1e3 / lim['tightest_us']:5.2f}x the tightest limit; "
                   f"{r['streams'][k]} streams, arena {r['arena_mb'][k]:.0f} MB")
    chain = r.get("in_chain_limits")
    if chain:
        served_us = r["ms"]["multi (served)"]["median"] * 1e3
        out.append(_limits_line("in-chain times (profiler, single-stream replays)", chain)
                   + f"; served multi {served_us / chain['tightest_us']:.2f}x the tightest")
    for k, t in r["traces"].items():
        p = t["path"]
        out.append(f"  trace of {k}: plain {t['plain_us']:.0f} µs, instrumented "
                   f"{t['instrumented_us']:.0f} µs, makespan {t['makespan_us']:.0f} µs, "
                   f"concurrency {t['concurrency']:.2f}")
        out.append(f"    executed path: {p['tasks']} tasks, {p['makespan_us']:.0f} µs = "
                   f"{p['isolated_us']:.0f} alone + {p['stretch_us']:.0f} stretch + "
                   f"{p['wait_us']:.0f} waits ({p['wait_us'] / max(p['tasks'], 1):.2f} µs a task;"
                   f" {p.get('cross_stream_steps', 0)} steps change stream, waiting "
                   f"{p.get('cross_stream_wait_us', 0.0):.0f} µs)")
        q = t.get("path_in_chain")
        if q:
            out.append(f"    with in-chain times: {q['isolated_us']:.0f} alone + "
                       f"{q['stretch_us']:.0f} stretch + {q['wait_us']:.0f} waits")
        for bound, row in t["by_bound"].items():
            out.append(f"    {bound:<8} {row['tasks']:5d} tasks: ran {row['ran_us']:.0f} µs "
                       f"against {row['isolated_us']:.0f} alone "
                       f"(×{row['ran_us'] / max(row['isolated_us'], 1e-9):.2f})")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="?", default="",
                   help="comma-separated model names (nimble.cli.models)")
    p.add_argument("--dtype", default="float32", help="comma-separated dtypes")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--trace-runs", type=int, default=5)
    p.add_argument("--caps", default="8,16",
                   help="stream caps to time beside the served graph ('' for none)")
    p.add_argument("--json", default="", help="write every result to this file")
    p.add_argument("--report", default="", help="print the report of a --json file (no GPU)")
    args = p.parse_args()
    args.caps = [int(c) for c in args.caps.split(",") if c]
    if args.report:
        with open(args.report) as f:
            for r in json.load(f):
                print(report(r))
        return 0
    if not torch.cuda.is_available():
        print("gap_analysis.py needs a CUDA GPU", file=sys.stderr)
        return 2
    use_cudnn_benchmark()
    results = []
    for name in [m for m in args.models.split(",") if m]:
        for dtype in parse_dtypes(args.dtype):
            results.append(measure(name, dtype, args))
            print(report(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
