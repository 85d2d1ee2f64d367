"""``nimble bench --serve``: a server's load on eager, ``torch.cuda.graph`` and Nimble.

Client threads (:mod:`nimble.cli.serve_load`) send requests of batch sizes drawn from ``--batches``
for ``--seconds`` per mode, each thread on its own CUDA stream; the table gives requests and
samples per second, p50 and p99 latency and the device memory each mode held.  The modes:

* ``eager``: the model under ``torch.inference_mode()``;
* ``graphs``: per client, one ``torch.cuda.graph`` per batch size, a client's graphs sharing one
  memory pool (captured largest first); a call copies its input into the static input, replays
  and clones the output;
* ``nimble``: one Nimble with a bucket per batch size, one instance, ``return_copies=True``;
* ``instances``: the same buckets times ``--instances`` copies;
* ``equal-memory`` (``--equal-memory``): as many instances as fit in the memory the graphs mode
  held, sized from the graphs, nimble and instances modes (so it runs after them), with as many
  clients as instances: the extra copies serve only with callers to use them.

Every mode is built, measured and freed before the next; the order of the modes rotates from one
model (or dtype) to the next.  Every ``--check-every``-th response of a client is compared with
the eager output of the same input computed up front; a wrong one makes the command exit 1.
"""
from __future__ import annotations

import argparse
import shlex
import time
from typing import Callable

from . import models
from .common import Fail, check_models, positive_int
from .harness import Case, Column, format_table, run_cases
from .output import outputs
from .serve_load import (DeviceMemory, Load, LoadResult, ModeRun, Served, StreamOps,
                         parse_batch_mix, run_clients)
from .serve_modes import gpu_mode_run, make_load
from ..progress import say

MODES = ("eager", "graphs", "nimble", "instances")
EQUAL_MEMORY = "equal-memory"
#: The most instances ``--equal-memory`` gives one Nimble (and clients it runs).
MAX_EQUAL_MEMORY_INSTANCES = 64

DEFAULTS = {"threads": 4, "serve_batches": "1", "seconds": 5.0, "warmup": 1.0, "modes": MODES,
            "check_every": 20}


# ---- arguments --------------------------------------------------------------------------------

def parse_models(text: str) -> list[str]:
    """``--serve``: model names, comma-separated, no repeats (checked against the zoo later)."""
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give model names like resnet50,googlenet")
    return names


def parse_modes(text: str) -> tuple[str, ...]:
    """``--modes``: names from :data:`MODES`, comma-separated, run in this order (rotated)."""
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [n for n in names if n not in MODES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad) or repr(text)}: choose from {', '.join(MODES)}, comma-separated "
            f"(--equal-memory adds {EQUAL_MEMORY})")
    return tuple(names)


def _seconds(text: str, zero_allowed: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not ((value >= 0 if zero_allowed else value > 0) and value < float("inf")):
        raise argparse.ArgumentTypeError(
            f"must be {'0 seconds or more' if zero_allowed else 'more than 0 seconds'}, not {text}")
    return value


def positive_seconds(text: str) -> float:
    """``--seconds``: a number of seconds above 0."""
    return _seconds(text, zero_allowed=False)


def seconds_or_zero(text: str) -> float:
    """``--warmup``: a number of seconds, 0 allowed."""
    return _seconds(text, zero_allowed=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--serve`` options of ``nimble bench``; None where not given, so that a run without
    ``--serve`` can refuse them (:func:`refuse_without_serve`)."""
    g = p.add_argument_group("serving (--serve)")
    g.add_argument("--serve", type=parse_models, default=None, metavar="MODEL[,MODEL...]",
                   help="time a server's load instead: client threads sending requests of mixed "
                        "batch sizes, against eager, torch.cuda.graph per bucket and Nimble with "
                        "buckets and instances")
    g.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help=f"client threads, each on its own stream (default {DEFAULTS['threads']})")
    g.add_argument("--batches", dest="serve_batches", type=parse_batch_mix, default=None,
                   metavar="B:W,...",
                   help="batch sizes and their weights, like 1:0.5,8:0.3,32:0.2 (default 1)")
    g.add_argument("--seconds", type=positive_seconds, default=None, metavar="S",
                   help=f"measured seconds per mode (default {DEFAULTS['seconds']:g})")
    g.add_argument("--warmup", type=seconds_or_zero, default=None, metavar="S",
                   help=f"uncounted seconds before them (default {DEFAULTS['warmup']:g})")
    g.add_argument("--instances", type=positive_int, default=None, metavar="K",
                   help="Nimble copies of the instances mode (default: as many as threads)")
    g.add_argument("--modes", type=parse_modes, default=None, metavar="M,M,...",
                   help=f"modes to run (default {','.join(MODES)})")
    g.add_argument("--check-every", type=positive_int, default=None, metavar="M",
                   help="compare every M-th response of a client with eager (default "
                        f"{DEFAULTS['check_every']})")
    g.add_argument("--equal-memory", action="store_true",
                   help=f"add {EQUAL_MEMORY}: a Nimble with as many instances (and clients) as "
                        "fit in the memory the graphs mode held")


_SERVE_ONLY = ("threads", "serve_batches", "seconds", "warmup", "instances", "modes",
               "check_every")


def refuse_without_serve(args: argparse.Namespace) -> None:
    """Fail on a ``--serve`` option given to a run without ``--serve``."""
    given = [name for name in _SERVE_ONLY if getattr(args, name) is not None]
    given += ["equal_memory"] if args.equal_memory else []
    if given:
        flags = ", ".join("--" + {"serve_batches": "batches"}.get(n, n).replace("_", "-")
                          for n in given)
        raise Fail(f"{flags}: only with --serve MODEL")


def finish_serve_args(args: argparse.Namespace) -> None:
    """Refuse what does not go with ``--serve`` and fill in the defaults of what was not given."""
    if args.models:
        raise Fail(f"--serve takes its models itself: --serve {','.join(args.models)}")
    if args.training:
        raise Fail("--serve and --training: choose one")
    if args.batches is not None:
        raise Fail("--batch: with --serve, give the batch sizes and weights with --batches")
    for name in _SERVE_ONLY:
        if getattr(args, name) is None:
            default = DEFAULTS.get(name)
            setattr(args, name, parse_batch_mix(default) if name == "serve_batches" else default)
    args.instances = args.instances or args.threads
    if args.equal_memory and not {"graphs", "nimble", "instances"} <= set(args.modes):
        raise Fail("--equal-memory sizes its Nimble from the memory of the graphs, nimble and "
                   "instances modes: keep them in --modes")


def command_line(args: argparse.Namespace) -> str:
    """The command that repeats this run, every serving option spelled out."""
    words = ["nimble", "bench", "--serve", ",".join(args.serve), "--dtype", ",".join(args.dtypes),
             "--threads", str(args.threads), "--batches", args.serve_batches.text,
             "--seconds", f"{args.seconds:g}", "--warmup", f"{args.warmup:g}",
             "--instances", str(args.instances), "--modes", ",".join(args.modes),
             "--check-every", str(args.check_every)]
    words += ["--equal-memory"] if args.equal_memory else []
    return shlex.join(words)


# ---- modes -------------------------------------------------------------------------------------

def rotated(labels: list[str], shift: int) -> list[str]:
    """``labels`` started at position ``shift`` (modulo their number)."""
    k = shift % len(labels) if labels else 0
    return labels[k:] + labels[:k]


def equal_memory_instances(graphs_mb: float, nimble_mb: float, instances_mb: float,
                           instances: int) -> int:
    """How many Nimble instances fit in the graphs mode's ``graphs_mb``: one instance's memory
    and the memory all share come from the nimble mode's (one instance) and the instances
    mode's (``instances``); with one instance only, all of nimble's counts per instance.  At
    least 1, at most :data:`MAX_EQUAL_MEMORY_INSTANCES`."""
    per, shared = nimble_mb, 0.0
    if instances > 1 and instances_mb > nimble_mb:
        per = (instances_mb - nimble_mb) / (instances - 1)
        shared = max(0.0, nimble_mb - per)
    if per <= 0:
        raise Fail(f"{EQUAL_MEMORY}: the nimble mode held {nimble_mb:.1f} MB, too little to "
                   "measure one instance by; leave out --equal-memory")
    return max(1, min(MAX_EQUAL_MEMORY_INSTANCES, int((graphs_mb - shared) // per)))


def measure_mode(label: str, build: Callable[[], Served], ops: StreamOps, memory: DeviceMemory,
                 load: Load) -> dict:
    """Build ``label``'s mode, run the load on it, free it; its row of the table."""
    before = memory.free_bytes(True)
    t0 = time.perf_counter()
    served = build()
    build_s = time.perf_counter() - t0
    try:
        built = memory.free_bytes(True)
        result = run_clients(served.calls, ops, load)
        serving = memory.free_bytes(False)
    finally:
        served.close()
        served.calls.clear()  # a call holds its mode's graphs or model copies alive
    return {"mode": label, **row_numbers(result), "build_s": build_s,
            "device_mb": (before - serving) / 2**20, "device_mb_built": (before - built) / 2**20,
            **served.info}


def row_numbers(result: LoadResult) -> dict:
    """A mode's load numbers as the JSON and the table hold them."""
    lat = result.latency
    return {"clients": result.clients, "requests": result.requests, "samples": result.samples,
            "window_s": result.window_s, "requests_per_s": result.requests_per_s,
            "samples_per_s": result.samples_per_s, "p50_ms": lat.p50_ms, "p99_ms": lat.p99_ms,
            "mean_ms": lat.mean_ms, "max_ms": lat.max_ms, "checked": result.checked,
            "wrong": result.wrong, "first_wrong": result.first_wrong}


def serve_modes(run: ModeRun, load: Load, order: list[str], step: Callable[[str], None],
                equal_memory: Callable[[int], Callable[[], Served]] | None = None) -> dict:
    """Every mode of ``order`` measured in turn, then (given ``equal_memory``, a builder for K
    instances) the equal-memory mode sized from the others; rows by label."""
    rows: dict[str, dict] = {}
    for label in order:
        step(f"{label}: building, then {load.seconds:g} s of load")
        rows[label] = measure_mode(label, run.builders[label], run.ops, run.memory, load)
    if equal_memory is not None:
        k = equal_memory_instances(*(rows[m]["device_mb"] for m in ("graphs", "nimble",
                                                                     "instances")),
                                   rows["instances"]["instances"])
        step(f"{EQUAL_MEMORY}: {k} instances and clients in the graphs mode's "
             f"{rows['graphs']['device_mb']:.0f} MB")
        rows[EQUAL_MEMORY] = measure_mode(EQUAL_MEMORY, equal_memory(k), run.ops, run.memory,
                                          load)
    return rows


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    """Throughput of one mode over another's, and p50 latency of one over another's (above 1:
    the second mode answers faster), where both ran."""
    out = {}
    for a, b in (("nimble", "graphs"), ("instances", "nimble"), ("instances", "graphs"),
                 (EQUAL_MEMORY, "graphs"), ("nimble", "eager")):
        if a in rows and b in rows:
            out[f"{a}/{b} throughput"] = rows[a]["requests_per_s"] / rows[b]["requests_per_s"]
    for slow, fast in (("graphs", "nimble"), ("graphs", "instances")):
        if slow in rows and fast in rows:
            out[f"p50 {slow}/{fast}"] = rows[slow]["p50_ms"] / rows[fast]["p50_ms"]
    return out


def gpu_setup(name: str, dtype: str, args) -> tuple[Load, ModeRun, Callable]:
    """``name`` in ``dtype`` on the GPU: the load's inputs and eager outputs, every mode's
    builder and the equal-memory mode's builder for K instances."""
    import torch

    from ..driver.gpu import use_cudnn_benchmark

    use_cudnn_benchmark()
    dt = getattr(torch, dtype)
    model, example = models.create(name).cuda().to(dt), models.example_input(name).to(dt)
    load = make_load(model, example, args)
    return (load, *gpu_mode_run(model, load, args))


def serve_model(name: str, dtype: str, args, shift: int) -> dict:
    """Every mode of ``name`` in ``dtype`` under the load ``args`` give, in the order rotated
    by ``shift``; the numbers as a dict."""
    load, run, equal_memory = gpu_setup(name, dtype, args)
    order = rotated(list(args.modes), shift)

    def step(what: str) -> None:
        say(f"{name} ({dtype}): {what}", args.quiet, "serve")
    rows = serve_modes(run, load, order, step, equal_memory if args.equal_memory else None)
    return model_result(name, dtype, args, order, rows)


def model_result(name: str, dtype: str, args, order: list[str], rows: dict[str, dict]) -> dict:
    """One model's numbers as the JSON holds them."""
    return {"model": name, "dtype": dtype, "batches": args.serve_batches.text,
            "threads": args.threads, "instances": args.instances, "seconds": args.seconds,
            "warmup_s": args.warmup, "check_every": args.check_every, "order": order,
            "modes": rows, "ratios": ratios(rows)}


# ---- report ------------------------------------------------------------------------------------

_COLUMNS = [Column("mode", 14, left=True), Column("clients", 8), Column("req/s", 10),
            Column("samples/s", 11), Column("p50 ms", 9), Column("p99 ms", 9), Column("MB", 8),
            Column("build s", 9), Column("checked", 9), Column("wrong", 7)]

LEGEND = ("req/s, samples/s: requests and images answered per second over the measured window; "
          "p50, p99: request latency from the call to its output ready on the client's stream; "
          "MB: device memory the mode held while serving (free memory before building it minus "
          "after its run, the allocator's cache kept); build s: building it (capture or "
          "prepare); checked, wrong: responses compared with eager and found wrong")


def _row(r: dict) -> list[str]:
    return [r["mode"], str(r["clients"]), f"{r['requests_per_s']:.1f}",
            f"{r['samples_per_s']:.1f}", f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}",
            f"{r['device_mb']:.0f}", f"{r['build_s']:.1f}", str(r["checked"]), str(r["wrong"])]


def format_model(info: dict) -> str:
    """One model's table, the ratios under it and every wrong response's first reason."""
    head = (f"{info['model']} ({info['dtype']}): batches {info['batches']}, {info['threads']} "
            f"threads, {info['instances']} instances, {info['seconds']:g} s per mode")
    lines = [head, format_table(_COLUMNS, [_row(r) for r in info["modes"].values()], LEGEND)]
    if info["ratios"]:
        lines.append("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in info["ratios"].items()))
    lines += [f"WRONG: {r['mode']}: {r['wrong']} of {r['checked']} checked responses "
              f"(first: {r['first_wrong']})" for r in info["modes"].values() if r["wrong"]]
    return "\n".join(lines)


def wrong_responses(results: list[dict]) -> int:
    return sum(r["wrong"] for info in results for r in info["modes"].values())


def _environment() -> dict:
    import torch

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__}


def run(args) -> int:
    """``nimble bench --serve``: exit 1 when a mode failed or a checked response was wrong."""
    finish_serve_args(args)
    out = outputs(args, "json")
    check_models(args.serve, "bench --serve")
    command = command_line(args)
    print(command, file=out.report, flush=True)
    cases = [(name, dtype) for name in args.serve for dtype in args.dtypes]
    outcome = run_cases([Case(f"{name} ({dtype})", {"model": name, "dtype": dtype},
                              lambda name=name, dtype=dtype, i=i: serve_model(name, dtype,
                                                                              args, i))
                         for i, (name, dtype) in enumerate(cases)], format_model, out.report)
    wrong = wrong_responses(outcome.results)
    if wrong:
        print(f"{command}: {wrong} wrong responses", file=out.report, flush=True)
    if args.json:
        out.write_json("--json", {"command": command, "results": outcome.results,
                                  "failed": outcome.failed, "wrong": wrong, **_environment()},
                       "serving results")
    return 1 if wrong or outcome.status else 0

