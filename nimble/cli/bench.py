"""``nimble bench``: Nimble against eager PyTorch, ``torch.cuda.graph`` and ``torch.compile``.

All modes run in one process on the same model and input.  Each round times every mode in turn
(interleaved, so clock and thermal drift touch them alike, in an order that changes from round
to round: :func:`~nimble.cli.harness.round_orders`) over ``--iters`` back-to-back calls between
two CUDA events, after a warm-up and behind one untimed call; the table gives the median
per-call time over ``--rounds`` rounds and the spread (min–max) of the rounds.  Every call of
the ``torch.cuda.graph`` row copies the input into the graph's static input before the replay,
as a Nimble call copies its input in.  Beside ``torch.compile(mode="reduce-overhead")`` and
Nimble on ``torch.compile(model)``'s kernels (``nimble+inductor``),
``torch.compile(model, backend="nimble")`` has a row of its own (its calls return copies of the
outputs, the backend's default) and another with ``options={"return_copies": False}`` (the
arena's outputs, as ``nimble+inductor`` returns them), with the host time per call of the first
three sampled in turn.

``--training`` times training steps instead (:mod:`nimble.cli.train_bench`), ``--generate``
greedy decoding of causal LMs (:mod:`nimble.cli.generate_bench`), ``--profiler``
Nimble before and after a torch profiler run (:mod:`nimble.cli.profiler_bench`).  ``--dtype``
runs each model once per dtype (model and input converted before anything else); ``--quick``
times only eager, ``torch.cuda.graph``, ``torch.compile`` (unless ``--no-compile``) and Nimble
single and multi, without the stream-cap / uncapped / host-launch variants and the per-task
critical-path timing.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Callable

from . import models, serve_bench
from .common import (add_batch_argument, add_quiet_argument, model_help, names_from,
                     parse_stream_caps, positive_int)
from .harness import (BACKEND_ROW, BACKEND_VIEWS_ROW, Column, add_speedup, format_table,
                      host_us, host_us_beside, mode_rows, run_models, time_rounds, to_dtype,
                      torch_graph_call, write_results)
from .generate_bench import add_arguments as add_generate_arguments, run as run_generate
from .profiler_bench import run as run_profiler
from .train_bench import run as run_training
from ..driver.gpu import use_cudnn_benchmark
from ..progress import say

DTYPES = ("float32", "float16", "bfloat16")


def parse_dtypes(text: str) -> list[str]:
    """``--dtype``: comma-separated names from :data:`DTYPES`, in the order given, no repeats."""
    return names_from(DTYPES, text)


class DefaultDtypes(list):
    """``--dtype``'s default, float32, told apart from ``--dtype float32`` given: with
    ``--generate`` the default is float16 (decoders are served in half precision)."""

    def __init__(self) -> None:
        super().__init__(["float32"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="*", default=[], metavar="MODEL",
                   help=model_help(f"models to run (default {models.BUILTIN}; with --training, "
                                   "the paper's training models)"))
    add_batch_argument(p, several=True, default="1; 32 with --training")
    p.add_argument("--training", action="store_true",
                   help="time training steps (forward, loss, backward, SGD step) against eager, "
                        "make_graphed_callables and torch.compile instead of inference calls")
    p.add_argument("--rounds", type=positive_int, default=5,
                   help="timed rounds per mode (default 5)")
    p.add_argument("--iters", type=positive_int, default=100,
                   help="calls per round (default 100)")
    p.add_argument("--max-streams", type=parse_stream_caps, default=[2, 4, 8], metavar="K,K,...",
                   help="stream caps to try besides unlimited (default 2,4,8; '' for none)")
    p.add_argument("--no-compile", action="store_true",
                   help="skip torch.compile(mode='reduce-overhead'), the nimble+inductor rows "
                        "and torch.compile(backend='nimble') (they compile for minutes)")
    p.add_argument("--no-inductor", action="store_true",
                   help="skip the nimble+inductor rows (Nimble on torch.compile(model)'s kernels, "
                        "by hand and as torch.compile(backend='nimble'))")
    p.add_argument("--dtype", dest="dtypes", type=parse_dtypes, default=DefaultDtypes(),
                   metavar="D,D,...",
                   help=f"run every model in each of these dtypes ({', '.join(DTYPES)}; "
                        "default float32, float16 with --generate)")
    p.add_argument("--quick", action="store_true",
                   help="time only eager, torch.cuda.graph, torch.compile and Nimble single and "
                        "multi: no stream-cap, uncapped or host-launch variants, no "
                        "critical-path limit")
    p.add_argument("--profiler", action="store_true",
                   help="time torch.cuda.graph and Nimble multi, multi host-launch and single "
                        "before and after a torch.profiler run of one eager forward, and fresh "
                        "ones prepared after it (issue 36)")
    p.add_argument("--generate", action="store_true",
                   help="time greedy decoding of causal LMs (gpt2, gpt2_tiny, llama_small, "
                        "llama_1b, llama3_1b; default gpt2 llama_1b) at batch 1 and 8: a tight "
                        "loop over a compiled step (the baseline), transformers' eager and "
                        "compiled static-cache generate against Nimble on eager and Inductor's "
                        "kernels, with the bandwidth each gets (issues 37, 53)")
    add_generate_arguments(p)
    p.add_argument("--json", metavar="FILE",
                   help="write every number to FILE as JSON ('-': stdout; the text report then "
                        "goes to stderr)")
    add_quiet_argument(p)
    serve_bench.add_arguments(p)


def _say(args, msg: str) -> None:
    say(msg, args.quiet, "bench")


def bare_launch(nm) -> Callable[[], None]:
    """A ``cuGraphLaunch`` of ``nm``'s exec on its launcher's stream, and nothing else: the
    driver's share of a call."""
    from .. import driver

    api, engine = driver.CallPath(), nm.engine
    exec_handle, stream = engine.built.exec.handle, engine.launcher.stream()
    return lambda: api.launch(exec_handle, stream)


def _phase_limits(nm, single_ms: float) -> dict:
    """The limits of ``nm``'s recorded phase (:func:`nimble.engine.gpu_limits.recording_limits`:
    every task timed alone, ``single_ms`` per single-stream call for the launch cost)."""
    from ..engine.gpu_limits import recording_limits

    return recording_limits(nm.recording, single_ms * 1e3).as_dict()


def _no_grad_call(fn: Callable, x) -> Callable[[], object]:
    """``fn(x)`` without autograd, as an inference call."""
    import torch

    def call():
        with torch.no_grad():
            return fn(x)
    return call


def _warm_compile(model, x, **options):
    """``torch.compile(model, **options)`` run three times, so that compiling is over."""
    import torch

    compiled = torch.compile(model, **options)
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
    return compiled


def _nimble_calls(prepared: dict, x) -> dict[str, Callable[[], object]]:
    return {label: (lambda nm=nm: nm(x)) for label, nm in prepared.items()}


def _prepare_on_inductor(model, x, info: dict, step: Callable[[str], None]) -> dict:
    """Nimble single and multi on the kernels of ``torch.compile(model)`` (default mode)."""
    import nimble

    step("torch.compile(model) for nimble+inductor")
    t0 = time.perf_counter()
    compiled = _warm_compile(model, x)
    info["inductor_compile_seconds"] = time.perf_counter() - t0
    step("nimble+inductor prepare")
    t0 = time.perf_counter()
    multi = nimble.Nimble(compiled).prepare(
        x, options=nimble.PrepareOptions(keep_recording=True))
    info["inductor_prepare_seconds"] = time.perf_counter() - t0
    single = nimble.Nimble(compiled).prepare(
        x, use_multi_stream=False, options=nimble.PrepareOptions(recording=multi.recording))
    info["inductor"] = {**_graph_record(multi), "width": multi.schedule.width,
                        "triton_launches": multi.graph.meta.get("triton_launches", 0),
                        "arena_mb": multi.memplan.arena_bytes / 2**20}
    return {"nimble+inductor multi": multi, "nimble+inductor single": single}


#: The rows whose host time per call the report gives side by side (Dynamo's guards included
#: in the first two).
HOST_ROWS = ("torch.compile", BACKEND_ROW, "nimble+inductor multi")


def _on_backend(model, x, info: dict, step: Callable[[str], None]) -> dict:
    """Calls of ``torch.compile(model, backend="nimble")``, compiled and prepared first: as the
    backend's calls are by default (each returns copies of the outputs) and with
    ``return_copies`` off (the arena's outputs, as the other compiled rows return them)."""
    from nimble.compile_backend import backend

    step("torch.compile(model, backend='nimble'): Inductor, then Nimble at the first call")
    before = {id(r) for r in backend.regions}
    t0 = time.perf_counter()
    compiled = _warm_compile(model, x, backend="nimble")
    info["backend_seconds"] = time.perf_counter() - t0
    info["backend_graphs"] = _graph_shapes(r for r in backend.regions if id(r) not in before)
    views = _warm_compile(model, x, backend="nimble", options={"return_copies": False})
    return {BACKEND_ROW: _no_grad_call(compiled, x), BACKEND_VIEWS_ROW: _no_grad_call(views, x)}


def _graph_shapes(regions) -> list[dict]:
    """:func:`_graph_record` of each Nimble graph the regions prepared, to set beside
    ``nimble+inductor``'s: the same kernels should give the same schedule."""
    return [_graph_record(run.launch) for region in regions for run in region.runs.values()
            if getattr(run, "launch", None) is not None]


def _graph_record(nm) -> dict:
    """A prepared graph's tasks, streams and synchronizations, and what its prepare measured
    and kept (two prepares of the same kernels may keep different ones): node priorities,
    late edges backfilled, programmatic edges."""
    engine = nm.engine
    return {"tasks": len(nm.graph.tasks), "streams": len(nm.schedule.streams),
            "sync_edges": len(nm.schedule.sync_edges),
            "priorities": engine.priorities is not None,
            "backfilled": sum(p.kept is not None for p in engine.backfill),
            "programmatic": len(engine.programmatic)}


def _choices_text(g: dict, lead: str) -> str:
    """:func:`_graph_record`'s kept choices said after ``lead``; nothing for a record without
    them."""
    if "priorities" not in g:
        return ""
    return (f"{lead}priorities {'on' if g['priorities'] else 'off'}, {g['backfilled']} phases "
            f"backfilled, {g['programmatic']} programmatic edges")


def _prepare_variants(model, x, args, info: dict) -> dict:
    """Nimble multi-stream (its recording kept and reused by the others) and single-stream;
    unless ``--quick``, also host launch, uncapped (where it has other streams) and each stream
    cap below the schedule's."""
    import nimble

    t0 = time.perf_counter()
    multi = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(keep_recording=True))
    info["prepare_seconds"] = time.perf_counter() - t0
    rec = multi.recording
    prepared = {"nimble multi": multi}
    reuse = nimble.PrepareOptions(recording=rec)
    prepared["nimble single"] = nimble.Nimble(model).prepare(
        x, use_multi_stream=False, options=reuse)
    if args.quick:
        return prepared
    prepared["nimble multi, host launch"] = nimble.Nimble(model).prepare(
        x, options=dataclasses.replace(reuse, device_launch=False))
    uncapped = nimble.Nimble(model).prepare(
        x, options=dataclasses.replace(reuse, arena_limit=None))
    if len(uncapped.schedule.streams) != len(multi.schedule.streams):
        prepared["nimble uncapped"] = uncapped  # full concurrency, arena above torch's pool
    else:
        uncapped.close()
    for k in args.max_streams:
        if k < len(multi.schedule.streams) - 1:
            prepared[f"nimble k={k}"] = nimble.Nimble(model).prepare(
                x, max_streams=k, options=reuse)
    return prepared


def _measure(fns: dict, prepared: dict, x, args, info: dict,
             step: Callable[[str], None]) -> dict[str, list[float]]:
    """Every mode's rounds, and into ``info`` the host times of a call, the critical-path limit
    (unless ``--quick``) and the measured trace of the multi-stream run."""
    multi = prepared["nimble multi"]
    step(f"timing {len(fns)} modes, {args.rounds} rounds of {args.iters} calls")
    samples = time_rounds(fns, args.rounds, args.iters)
    info["host_us_per_call"], info["host_us_bare_launch"] = host_us_beside(
        [lambda: multi(x), bare_launch(multi)])
    info["launch_mode"] = multi.launch_mode
    if not args.quick:
        host_launch = prepared["nimble multi, host launch"]
        info["host_us_per_call_host_launch"] = host_us(lambda: host_launch(x))
        step("timing every task alone for the limits (critical path, GPU capacity)")
        info["limits"] = _phase_limits(multi, statistics.median(samples["nimble single"]))
    step("tracing the multi-stream run (achieved concurrency)")
    info["trace"] = _trace_info(multi, x)
    return samples


def _add_results(info: dict, samples: dict[str, list[float]], prepared: dict) -> None:
    """The rows of every mode with their speed-ups and the multi-stream schedule's numbers.

    No "best" variant is picked: the fastest of several variants' medians against the one
    median of ``torch.cuda.graph`` would favour Nimble by the choice alone, and the choice
    could fall on a variant whose arena exceeds torch's pool.  The summary compares the default
    ``nimble multi``; the per-model lines show every variant with its arena.
    """
    rows = mode_rows(samples)
    add_speedup(rows, "x_graph", "torch.cuda.graph")
    add_speedup(rows, "x_eager", "eager")
    multi = prepared["nimble multi"]
    s = multi.schedule
    info.update(
        modes=rows, tasks=len(multi.graph.tasks), streams=len(s.streams),
        sync_edges=len(s.sync_edges), width=s.width,
        arena_mb={k: nm.memplan.arena_bytes / 2**20 for k, nm in prepared.items()},
        pool_mb=multi.graph.meta.get("pool_bytes", 0) / 2**20,
        prepare_breakdown=multi.prepare_seconds)
    if "limits" in info:
        multi_us, lim = rows["nimble multi"]["median_ms"] * 1e3, info["limits"]
        info["over_critical_path"] = multi_us / lim["critical_path_us"] \
            if lim["critical_path_us"] else None
        info["over_tightest_limit"] = multi_us / lim["tightest_us"] if lim["tightest_us"] else None
    if "torch.compile" in rows:
        add_speedup(rows, "x_compile", "torch.compile")


def bench_model(name: str, args, dtype: str = "float32") -> dict:
    """Time every mode of ``name`` in ``dtype`` at ``args.batch``; the numbers as a dict."""
    use_cudnn_benchmark()
    model, x = to_dtype(models.create(name).cuda(), models.example_input(name, args.batch), dtype)
    info: dict = {"model": name, "dtype": dtype, "batch": args.batch, "quick": args.quick}

    def step(what: str) -> None:
        _say(args, f"{name} ({dtype}): {what}")

    fns: dict[str, Callable[[], object]] = {"eager": _no_grad_call(model, x)}
    step("capturing torch.cuda.graph")
    fns["torch.cuda.graph"] = torch_graph_call(model, x)
    if not args.no_compile:
        step("torch.compile(mode='reduce-overhead')")
        t0 = time.perf_counter()
        fns["torch.compile"] = _no_grad_call(_warm_compile(model, x, mode="reduce-overhead"), x)
        info["compile_seconds"] = time.perf_counter() - t0
    inductor = {}
    if not args.no_compile and not args.no_inductor:
        inductor = _prepare_on_inductor(model, x, info, step)
        fns.update(_nimble_calls(inductor, x))
        fns.update(_on_backend(model, x, info, step))
    step("nimble prepare (multi-stream, recording kept for the others)")
    prepared = _prepare_variants(model, x, args, info)
    fns.update(_nimble_calls(prepared, x))
    samples = _measure(fns, prepared, x, args, info, step)
    if all(label in fns for label in HOST_ROWS):
        info["host_us_compiled"] = dict(zip(HOST_ROWS, host_us_beside(
            [fns[label] for label in HOST_ROWS])))
    _add_results(info, samples, prepared)
    for nm in [*prepared.values(), *inductor.values()]:
        nm.close()
    return info


#: Stamp groups of the bench's third trace (see :func:`nimble.debug.timeline.stamp_groups`).
TRACE_GROUPS = 8


def _trace_info(nm, x) -> dict:
    """Achieved concurrency and idle streams of one measured run (:meth:`nimble.Nimble.trace`),
    and the overhead of three instrumentations (start and end stamps; end stamps only; end
    stamps spread over :data:`TRACE_GROUPS` runs)."""
    full = nm.trace(x).summary()
    ends = nm.trace(x, start_stamps=False).summary()
    grouped = nm.trace(x, start_stamps=False, groups=TRACE_GROUPS).summary()
    [phase] = full["phases"]
    return {"concurrency": phase["concurrency"], "makespan_us": phase["makespan_us"],
            "idle_us": phase["idle_us"], "overhead": full["overhead"],
            "overhead_ends_only": ends["overhead"], "overhead_grouped": grouped["overhead"],
            "concurrency_ends_only": ends["phases"][0]["concurrency"]}


def format_model(info: dict) -> str:
    """One model's report; ``--quick`` results (no variants, no limit) print fewer lines."""
    out = [f"{info['model']} ({info.get('dtype', 'float32')}, batch {info['batch']}): "
           f"{info['tasks']} tasks, width {info['width']}, {info['streams']} streams, "
           f"{info['sync_edges']} syncs"]
    with_compile = any("x_compile" in r for r in info["modes"].values())
    out.append(f"  {'mode':<26}{'median ms':>10}{'spread ms':>18}{'x graph':>9}{'x eager':>9}"
               + (f"{'x compile':>11}" if with_compile else ""))
    for label, r in info["modes"].items():
        out.append(f"  {label:<26}{r['median_ms']:>10.3f}{r['min_ms']:>9.3f}–{r['max_ms']:<8.3f}"
                   f"{r['x_graph']:>9.2f}{r['x_eager']:>9.2f}"
                   + (f"{r['x_compile']:>11.2f}" if with_compile else ""))
    arena = info["arena_mb"]
    out.append("  arena MB: " + ", ".join(f"{k.removeprefix('nimble ')} {v:.1f}"
                                           for k, v in arena.items())
               + f"; torch graph pool {info['pool_mb']:.1f} MB")
    host = f"  prepare {info['prepare_seconds']:.2f} s; host {info['host_us_per_call']:.1f} " \
           f"µs/call ({info['launch_mode']}"
    if "host_us_bare_launch" in info:
        host += f"; a bare cuGraphLaunch of it beside: {info['host_us_bare_launch']:.1f} µs"
    if "host_us_per_call_host_launch" in info:
        host += f"; {info['host_us_per_call_host_launch']:.1f} µs with a plain host-launch graph"
    out.append(host + ")")
    if "inductor" in info:
        ind = info["inductor"]
        out.append(f"  nimble+inductor: {ind['tasks']} tasks ({ind['triton_launches']} Triton "
                   f"launches), width {ind['width']}, {ind['streams']} streams, "
                   f"{ind['sync_edges']} syncs, arena {ind['arena_mb']:.1f} MB; compile "
                   f"{info['inductor_compile_seconds']:.1f} s, then prepare "
                   f"{info['inductor_prepare_seconds']:.2f} s{_choices_text(ind, '; ')}")
    if "host_us_compiled" in info:
        out.append(_compiled_host_line(info))
    if "trace" in info:
        t = info["trace"]
        idle = sorted(t["idle_us"].items(), key=lambda kv: -kv[1])[:3]
        out.append(f"  trace: achieved concurrency {t['concurrency']:.2f} (DAG width "
                   f"{info['width']}, {info['streams']} streams) over {t['makespan_us']:.0f} µs; "
                   f"instrumentation {t['overhead']:+.0%} ({t['overhead_ends_only']:+.0%} with "
                   f"end stamps only, {t['overhead_grouped']:+.0%} with them in {TRACE_GROUPS} "
                   "groups); most idle streams "
                   + ", ".join(f"{k} {us:.0f} µs" for k, us in idle))
    if "limits" in info:
        out.append(_limits_line(info["limits"], info["over_critical_path"],
                                info["over_tightest_limit"]))
    return "\n".join(out)


def _compiled_host_line(info: dict) -> str:
    """Host µs per call of torch.compile's two ways and Nimble on its kernels, sampled in
    turn."""
    host = info["host_us_compiled"]
    return (f"  host µs/call sampled in turn: torch.compile(mode='reduce-overhead') "
            f"{host['torch.compile']:.1f}, torch.compile(backend='nimble') "
            f"{host[BACKEND_ROW]:.1f}, nimble+inductor multi {host['nimble+inductor multi']:.1f}"
            f"; backend=nimble compiled and prepared in {info['backend_seconds']:.1f} s"
            + "".join(f"; its graph: {g['tasks']} tasks, {g['streams']} streams, "
                      f"{g['sync_edges']} syncs{_choices_text(g, ', ')}"
                      for g in info.get("backend_graphs", ())))


def _limits_line(lim: dict, over_path: float | None, over_tightest: float | None) -> str:
    """The limits no schedule beats, from isolated task times, and Nimble multi against them."""
    ratio = lambda r: f"{r:.2f}×" if r is not None else "–"  # noqa: E731
    return (f"  limits of isolated task times: critical path {lim['critical_path_us']:.0f} µs; "
            f"with {lim['launch_us']:.2f} µs launch cost a task {lim['launch_aware_path_us']:.0f}"
            f" µs; GPU capacity {lim['capacity_us']:.0f} µs (serial "
            f"{lim['isolated_sum_us']:.0f} µs); nimble multi at {ratio(over_path)} the critical "
            f"path, {ratio(over_tightest)} the tightest ({lim['tightest']})")


def _x_compile(modes: dict) -> str:
    """``torch.compile`` time over the fastest multi-stream Nimble row (eager or Inductor
    kernels); "–" without a ``torch.compile`` row."""
    if "torch.compile" not in modes:
        return "–"
    ours = [modes[k]["median_ms"] for k in ("nimble multi", "nimble+inductor multi") if k in modes]
    return f"{modes['torch.compile']['median_ms'] / min(ours):.2f}" if ours else "–"


def _summary_columns(dtype_column: bool) -> list[Column]:
    dtype = [Column("dtype", 10, left=True)] if dtype_column else []
    return [Column("model", 16, left=True), *dtype,
            *(Column(t, 8) for t in ("eager", "graph", "compile", "single", "multi")),
            Column("x graph", 8), Column("x eager", 8),
            Column("arena", 7), Column("pool", 7), Column("limit", 7), Column("host µs", 8),
            Column("conc", 6), Column("ind.1", 8), Column("ind.N", 8), Column("x comp", 7)]


def _summary_row(r: dict, dtype_column: bool) -> list[str]:
    m = r["modes"]
    get = lambda k: f"{m[k]['median_ms']:.3f}" if k in m else "–"  # noqa: E731
    multi = m["nimble multi"]
    return [r["model"], *([r.get("dtype", "float32")] if dtype_column else []),
            get("eager"), get("torch.cuda.graph"), get("torch.compile"), get("nimble single"),
            get("nimble multi"), f"{multi['x_graph']:.2f}", f"{multi['x_eager']:.1f}",
            f"{r['arena_mb']['nimble multi']:.1f}",
            f"{r['pool_mb']:.1f}",
            f"{r['limits']['tightest_us'] / 1e3:.3f}" if "limits" in r else "–",
            f"{r['host_us_per_call']:.1f}",
            f"{r['trace']['concurrency']:.2f}" if "trace" in r else "–",
            get("nimble+inductor single"), get("nimble+inductor multi"), _x_compile(m)]


def summary_table(results: list[dict], dtype_column: bool | None = None) -> str:
    """The final table, a row per result.  ``dtype_column``: show each row's dtype (default:
    where the results hold more than one); without the column the legend names the dtype."""
    dtypes = list(dict.fromkeys(r.get("dtype", "float32") for r in results)) or ["float32"]
    if dtype_column is None:
        dtype_column = len(dtypes) > 1
    in_dtype = "" if dtype_column else f" in {', '.join(dtypes)}"
    legend = (f"times: median ms per call{in_dtype}; graph = torch.cuda.graph with the input "
              "copied in on every call; x graph, x eager and arena: of Nimble multi (every "
              "variant is in the model's lines above); arena and pool in MB; limit = "
              "the tightest of the critical path, the launch-aware path and the GPU's "
              "capacity, from isolated task times, ms (– with --quick); "
              "host µs = one multi call on an idle GPU (each model's lines above give a bare "
              "cuGraphLaunch sampled beside it); conc = achieved concurrency of the "
              "multi-stream run (tasks in flight on average, measured by nm.trace()); "
              "ind.1 / ind.N = Nimble on torch.compile(model)'s kernels, single / multi "
              "stream; x comp = torch.compile(mode='reduce-overhead') time over the faster "
              "of Nimble multi and nimble+inductor multi")
    return format_table(_summary_columns(dtype_column),
                        [_summary_row(r, dtype_column) for r in results], legend)


def run(args) -> int:
    """``nimble bench``."""
    if args.serve is not None:
        return serve_bench.run(args)
    serve_bench.refuse_without_serve(args)
    args.models_given = bool(args.models)
    if args.generate:
        if isinstance(args.dtypes, DefaultDtypes):
            args.dtypes = ["float16"]
        return run_generate(args)
    if args.profiler:
        return run_profiler(args)
    if args.training:
        args.batches = args.batches or [32]
        return run_training(args)
    outcome, out = run_models(args, "bench", bench_model, format_model)
    if outcome.results:
        print(summary_table(outcome.results, dtype_column=len(args.dtypes) > 1), file=out.report)
    write_results(args, out, outcome, "bench results", quick=args.quick)
    return outcome.status
