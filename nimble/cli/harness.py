"""The benchmark harness shared by ``nimble bench`` (inference), ``nimble bench --training`` and
``nimble bench --profiler``.

Baselines: a model and its input in a dtype, the model under ``torch.cuda.graph``.  Timing: every
mode in turn within each round (interleaved, so clock and thermal drift touch them alike), in an
order that changes from round to round (:func:`round_orders`), ``iters`` back-to-back calls
between two CUDA events after a warm-up, behind one untimed call; host time of one call on an
idle GPU.  Results: a row per mode with the median and the spread (min–max) of its rounds and
its speed-ups over other modes.  Reporting: fixed-width tables, one case after
another with a failure reported and the rest still run.
"""
from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence, TextIO

from . import models
from .common import check_models, context_fault
from .output import Outputs, outputs


# ---- the modes every bench compares against --------------------------------------------------

#: The row of ``torch.compile(model, backend="nimble")`` (:mod:`nimble.compile_backend`) in
#: ``nimble bench`` and ``nimble bench --training``.
BACKEND_ROW = "compile backend=nimble"
#: The same with ``options={"return_copies": False}``: its calls return the arena's outputs, as
#: a ``Nimble`` call and reduce-overhead's do (the default row copies them on every call).
BACKEND_VIEWS_ROW = "backend=nimble, no copies"


def to_dtype(model, x, dtype: str):
    """``(model, x)`` in ``dtype`` (a torch dtype's name, e.g. ``"float16"``); the model is
    converted in place."""
    import torch

    dt = getattr(torch, dtype)
    return model.to(dt), x.to(dt)


def torch_graph_call(model, x) -> Callable[[], None]:
    """``model`` under ``torch.cuda.graph`` (warmed up on a side stream first): a call copies
    ``x`` into the graph's static input, as each Nimble call brings its input in, and replays."""
    import torch

    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    torch_graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(torch_graph):
        model(static_x)

    def graph_call() -> None:
        static_x.copy_(x)
        torch_graph.replay()
    return graph_call


# ---- timing ---------------------------------------------------------------------------------

def round_orders(modes: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of ``modes`` in each of ``rounds`` rounds: a balanced Latin square (Williams
    design) repeated as often as needed.

    Over every ``n`` rounds (``2n`` for an odd number ``n`` of modes) each mode runs once in
    each position and follows each other mode equally often, so neither going first (after the
    warm-up or a synchronisation) nor running after a heavy mode favours one of them.  Over any
    number of rounds each mode's count in each position differs by at most one.
    """
    n = len(modes)
    # 0, 1, n-1, 2, n-2, ...: shifted by the round, every difference of neighbours occurs once.
    base = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]
    orders = []
    for r in range(rounds):
        row = [modes[(b + r) % n] for b in base]
        orders.append(row[::-1] if n % 2 and (r // n) % 2 else row)
    return orders


def time_rounds(fns: dict[str, Callable[[], object]], rounds: int, iters: int
                ) -> dict[str, list[float]]:
    """Per mode, the mean ms per call of each round; modes interleaved within every round, in
    the order :func:`round_orders` gives it.  Every mode gets ``rounds`` samples of ``iters``
    calls, each round after one untimed call: the GPU is busy with it when the timer starts, so
    the first timed call's host time is hidden as every later one's is (without it a round
    counts one call's host latency, a 390-µs Dynamo call over 50 calls 7.8 µs each)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for fn in fns.values():  # warm-up
        for _ in range(10):
            fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for order in round_orders(list(fns), rounds):
        for name in order:
            fn = fns[name]
            fn()
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / iters)
    return samples


def host_us(fn: Callable[[], object], calls: int = 300) -> float:
    """Median host time of one call (returning as soon as the work is queued), in µs.

    The GPU is idle before each call, so a full launch queue never makes the host wait.
    """
    return host_us_beside([fn], calls)[0]


def host_us_beside(fns: Sequence[Callable[[], object]], calls: int = 300,
                   device_sync: bool = False) -> list[float]:
    """Median host µs of one call of each of ``fns``, taken in turn (GPU idle before each).

    Before each call the host waits for the current stream, as a server waits for the call
    before (``device_sync``: for the whole device, ``torch.cuda.synchronize()``, which makes the
    next launch slower).  A bare ``cuGraphLaunch`` varies several-fold between rounds of one
    process (see README.md, "Results"): sampled in turn, calls are compared under the same
    machine state, so the difference between them is the cost of what they do differently.
    """
    import torch

    wait = torch.cuda.synchronize if device_sync else torch.cuda.current_stream().synchronize
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(calls):
        for fn, mine in zip(fns, times):
            wait()
            t0 = time.perf_counter()
            fn()
            mine.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return [statistics.median(t) * 1e6 for t in times]


# ---- results --------------------------------------------------------------------------------

def mode_rows(samples: dict[str, list[float]]) -> dict[str, dict]:
    """Per mode, the median and the spread of its rounds' ms per call."""
    return {label: {"median_ms": statistics.median(s), "min_ms": min(s), "max_ms": max(s)}
            for label, s in samples.items()}


def add_speedup(rows: dict[str, dict], key: str, over: str) -> None:
    """Give every row ``key``: how many times faster its median is than mode ``over``'s."""
    base = rows[over]["median_ms"]
    for row in rows.values():
        row[key] = base / row["median_ms"]


# ---- reporting ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Column:
    """A fixed-width table column: its title and cells are padded to ``width``."""
    title: str
    width: int
    left: bool = False

    def cell(self, text: str) -> str:
        return f"{text:<{self.width}}" if self.left else f"{text:>{self.width}}"


def format_table(columns: Sequence[Column], rows: Iterable[Sequence[str]], legend: str) -> str:
    """The header, a rule under it, a line per row (one text per column) and the legend."""
    head = "".join(c.cell(c.title) for c in columns)
    lines = [head, "-" * len(head)]
    lines += ["".join(c.cell(text) for c, text in zip(columns, row)) for row in rows]
    lines.append(legend)
    return "\n".join(lines)


@dataclass(frozen=True)
class Case:
    """One benchmark run: ``measure`` returns its numbers; ``label`` names it in the printed
    lines and ``fields`` in the record of its failure."""
    label: str
    fields: dict
    measure: Callable[[], dict]


@dataclass
class Outcome:
    """The numbers of the cases that ran and the record of each that failed."""
    results: list[dict] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)

    @property
    def status(self) -> int:
        """The command's exit status: 1 if any case failed."""
        return 1 if self.failed else 0


def model_cases(args, measure: Callable[[str, object, str], dict]) -> list[Case]:
    """A case per model, batch and dtype of ``args`` (``models``, ``batches``, ``dtypes``):
    ``measure(model name, args with that ``batch``, dtype)``."""
    def case(name: str, dtype: str, batch: int) -> Case:
        at_batch = copy.copy(args)
        at_batch.batch = batch
        return Case(f"{name} ({dtype})", {"model": name, "dtype": dtype},
                    lambda: measure(name, at_batch, dtype))
    return [case(name, dtype, batch) for name in args.models for batch in args.batches or [1]
            for dtype in args.dtypes]


def run_models(args, command: str, measure: Callable[[str, object, str], dict],
               report: Callable[[dict], str]) -> tuple[Outcome, Outputs]:
    """``nimble <command>`` over ``args.models`` (default the built-in model): before any work,
    the outputs writable, every name known, a GPU to run on and each model's package installed
    (:func:`~nimble.cli.common.check_models`); then
    every case of :func:`model_cases` measured and ``report``-ed as it ends."""
    args.models = args.models or [models.BUILTIN]
    out = outputs(args, "json")
    check_models(args.models, command)
    return run_cases(model_cases(args, measure), report, out.report), out


def write_results(args, out: Outputs, outcome: Outcome, what: str, **fields) -> None:
    """With ``--json``: the results, the failures, the dtypes, ``fields``, the device and the
    torch version."""
    import torch

    if args.json:
        out.write_json("--json", {"results": outcome.results, "failed": outcome.failed,
                                  "dtypes": args.dtypes, **fields,
                                  "device": torch.cuda.get_device_name(),
                                  "torch": torch.__version__}, what)


def run_cases(cases: Iterable[Case], report: Callable[[dict], str],
              out: TextIO | None = None) -> Outcome:
    """Measure every case, printing ``report`` of its numbers to ``out`` (default stdout) as it
    ends; a case that raises is printed and recorded as failed and the others still run, unless
    its fault took the CUDA context with it: then the rest are recorded as not run."""
    outcome = Outcome()
    fault = None
    for case in cases:
        if fault:
            outcome.failed.append({**case.fields, "error": f"not run: {fault}"})
            continue
        try:
            info = case.measure()
        except Exception as e:  # noqa: BLE001 - one run's failure must not hide the others
            error = f"{type(e).__name__}: {e}"
            outcome.failed.append({**case.fields, "error": error})
            print(f"{case.label}: FAILED: {error}", file=out or sys.stdout, flush=True)
            lost = context_fault()
            if lost:
                fault = f"the CUDA context was lost to {lost} in {case.label}"
                print(f"{fault}: the remaining cases cannot run in this process",
                      file=out or sys.stdout, flush=True)
            continue
        outcome.results.append(info)
        print(report(info), file=out or sys.stdout, flush=True)
    return outcome
