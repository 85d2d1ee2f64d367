"""The load of ``nimble bench --serve``: client threads, the batch mix they draw from, the check
of their responses and the statistics of their latencies; what a mode hands the clients
(:class:`Served`).

Nothing here knows which mode serves the requests or that there is a GPU: a client gets a call
(``x -> output``), a stream and a :class:`StreamOps` that enters and waits for it, so that the
whole loop runs against stand-ins in the CPU tests.

A run is closed-loop: every client sends its next request as soon as the last one's output is
ready.  All clients start together (a barrier), run a warm-up that is not counted, then the
measured window; a request counts when it starts inside the window, and the window ends with the
last counted response.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Protocol, Sequence

from .common import Fail

#: Pre-made inputs per batch size: a client takes one of them at random for every request.
INPUTS_PER_BATCH = 3


# ---- the batch mix ----------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchMix:
    """Batch sizes and the weight with which a request draws each (``--batches``)."""
    sizes: tuple[int, ...]
    weights: tuple[float, ...]

    def draw(self, rng: random.Random) -> int:
        """One request's batch size."""
        return rng.choices(self.sizes, self.weights)[0]

    @property
    def buckets(self) -> list[int]:
        """The sizes, smallest first: the shapes every mode prepares."""
        return sorted(self.sizes)

    @property
    def text(self) -> str:
        """The mix as ``--batches`` takes it, weights normalized to sum to 1."""
        total = sum(self.weights)
        return ",".join(f"{s}:{w / total:.3g}" for s, w in zip(self.sizes, self.weights))


_MIX_SYNTAX = "batch sizes with weights like 1:0.5,8:0.3,32:0.2 (a size alone weighs 1)"


def parse_batch_mix(text: str) -> BatchMix:
    """``--batches``: ``size[:weight]`` items, comma-separated; sizes and weights positive, no
    size twice."""
    sizes: list[int] = []
    weights: list[float] = []
    for item in (t.strip() for t in text.split(",")):
        size_text, _, weight_text = item.partition(":")
        try:
            size = int(size_text)
            weight = float(weight_text) if weight_text.strip() else 1.0
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give {_MIX_SYNTAX}") from None
        if size < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: batch size {size} is not positive")
        if not weight > 0 or weight == float("inf"):
            raise argparse.ArgumentTypeError(
                f"{text!r}: the weight of batch {size} must be a positive number, not "
                f"{weight_text.strip()}")
        if size in sizes:
            raise argparse.ArgumentTypeError(f"{text!r}: batch size {size} given twice")
        sizes.append(size)
        weights.append(weight)
    return BatchMix(tuple(sizes), tuple(weights))


# ---- latency statistics ----------------------------------------------------------------------

@dataclass(frozen=True)
class LatencyStats:
    """Percentiles of request latencies, in ms (linear interpolation between samples)."""
    p50_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) of ascending ``sorted_values``, interpolated linearly
    between the two nearest ranks (numpy's default method)."""
    if not sorted_values:
        raise ValueError("no samples")
    rank = (len(sorted_values) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def latency_stats(seconds: Sequence[float]) -> LatencyStats:
    """p50, p99, mean and max of latencies given in seconds."""
    ordered = sorted(seconds)
    return LatencyStats(p50_ms=percentile(ordered, 50) * 1e3, p99_ms=percentile(ordered, 99) * 1e3,
                        mean_ms=sum(ordered) / len(ordered) * 1e3, max_ms=ordered[-1] * 1e3)


# ---- checking a response ---------------------------------------------------------------------

def _tensors(out) -> list:
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    return [out]


def response_error(out, reference) -> str | None:
    """Why ``out`` is not ``reference`` (None when it agrees): every tensor of the same shape,
    finite, and its largest difference within the dtype's tolerance scaled to the reference's
    largest magnitude (the eager reference and a recorded graph may run other library
    algorithms, whose sums round differently by a fraction of their terms)."""
    from ..debug.divergence import tolerance

    got_all, want_all = _tensors(out), _tensors(reference)
    if len(got_all) != len(want_all):
        return f"{len(got_all)} outputs, the reference has {len(want_all)}"
    for i, (got, want) in enumerate(zip(got_all, want_all)):
        if tuple(got.shape) != tuple(want.shape):
            return f"output {i}: shape {tuple(got.shape)}, the reference's is {tuple(want.shape)}"
        rtol, atol = tolerance(want.dtype)
        got64, want64 = got.double(), want.double()
        if not bool(got64.isfinite().all()) and bool(want64.isfinite().all()):
            return f"output {i}: NaN or Inf where the reference is finite"
        diff = float((got64 - want64).abs().max()) if want64.numel() else 0.0
        scale = float(want64.abs().max()) if want64.numel() else 0.0
        if not diff <= atol + rtol * scale:
            return (f"output {i}: largest difference {diff:.3g} over the tolerance "
                    f"{atol + rtol * scale:.3g} ({rtol:g} of the largest magnitude {scale:.3g})")
    return None


# ---- the clients -----------------------------------------------------------------------------

class StreamOps(Protocol):
    """How a client makes its stream, runs on it and waits for it (torch's CUDA streams on the
    GPU; stand-ins in the CPU tests)."""

    def new(self) -> object: ...

    def on(self, stream) -> ContextManager: ...

    def wait(self, stream) -> None: ...


@dataclass(frozen=True)
class Load:
    """What every client does: the mix, the pre-made inputs and their eager outputs per batch
    size, the phases' lengths and how often a response is checked."""
    mix: BatchMix
    inputs: dict[int, list]
    references: dict[int, list]
    warmup_s: float
    seconds: float
    check_every: int
    seed: int = 0


@dataclass
class ClientLog:
    """One client's counted requests: their latencies (s) and batch sizes, the responses it
    checked and found wrong (the first one's reason kept), when its last counted one ended."""
    latencies: list[float] = field(default_factory=list)
    samples: int = 0
    checked: int = 0
    wrong: int = 0
    first_wrong: str | None = None
    last_end: float = 0.0
    error: BaseException | None = None


@dataclass(frozen=True)
class LoadResult:
    """The clients' requests, merged: counts, rates over the measured window, latencies."""
    clients: int
    requests: int
    samples: int
    window_s: float
    latency: LatencyStats
    checked: int
    wrong: int
    first_wrong: str | None

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.window_s

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.window_s


@dataclass
class Served:
    """A built mode: a call per client, what frees it, its numbers for the report."""
    calls: list[Callable]
    close: Callable[[], None]
    info: dict = dataclasses.field(default_factory=dict)


class DeviceMemory(Protocol):
    """Free device bytes, after the work queued so far (``release_cache``: and after the
    allocator handed its unused cache back)."""

    def free_bytes(self, release_cache: bool) -> int: ...


@dataclass(frozen=True)
class ModeRun:
    """How the modes of one model run: each one's builder by label, the clients' streams and
    the memory probe."""
    builders: dict[str, Callable[[], Served]]
    ops: StreamOps
    memory: DeviceMemory


class _Clock:
    """The run's shared start, set once by the barrier as the clients are released."""

    def __init__(self) -> None:
        self.start = 0.0

    def set(self) -> None:
        self.start = time.perf_counter()


def _client(index: int, call: Callable, ops: StreamOps, load: Load, barrier: threading.Barrier,
            clock: _Clock, log: ClientLog) -> None:
    try:
        rng = random.Random(load.seed * 1_000_003 + index)
        stream = ops.new()
        with ops.on(stream):
            _first_calls(call, ops, stream, load)
        barrier.wait()
        measure_from = clock.start + load.warmup_s
        deadline = measure_from + load.seconds
        counted = 0
        with ops.on(stream):
            while True:
                batch = load.mix.draw(rng)
                pick = rng.randrange(len(load.inputs[batch]))
                t0 = time.perf_counter()
                if t0 >= deadline:
                    break
                out = call(load.inputs[batch][pick])
                ops.wait(stream)
                t1 = time.perf_counter()
                if t0 < measure_from:
                    continue
                log.latencies.append(t1 - t0)
                log.samples += batch
                log.last_end = t1
                if counted % load.check_every == 0:
                    _check(out, load.references[batch][pick], log)
                counted += 1
    except threading.BrokenBarrierError:
        return  # another client failed before the start; its error is the one reported
    except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
        log.error = e
        barrier.abort()


def _first_calls(call: Callable, ops: StreamOps, stream, load: Load) -> None:
    """One uncounted call per batch size on this client's thread and stream, before the clock
    starts: what a library sets up per thread or per stream on its first call (cuDNN's tuned
    plans are cached per thread, and tuning every convolution of a model takes seconds) would
    otherwise land in the measured window of whichever mode runs it."""
    for batch in load.mix.buckets:
        call(load.inputs[batch][0])
    ops.wait(stream)


def _check(out, reference, log: ClientLog) -> None:
    log.checked += 1
    reason = response_error(out, reference)
    if reason is not None:
        log.wrong += 1
        log.first_wrong = log.first_wrong or reason


def run_clients(calls: Sequence[Callable], ops: StreamOps, load: Load) -> LoadResult:
    """One client thread per call, started together, for the warm-up and ``load.seconds``; a
    client's exception is raised here once all have stopped."""
    clock = _Clock()
    barrier = threading.Barrier(len(calls), action=clock.set)
    logs = [ClientLog() for _ in calls]
    threads = [threading.Thread(target=_client, args=(i, call, ops, load, barrier, clock, log),
                                name=f"nimble-serve-client-{i}", daemon=True)
               for i, (call, log) in enumerate(zip(calls, logs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for log in logs:
        if log.error is not None:
            raise log.error
    latencies = [s for log in logs for s in log.latencies]
    if not latencies:
        raise Fail(f"no request started within the {load.seconds:g} s after the warm-up: give "
                   "more --seconds")
    return LoadResult(
        clients=len(calls), requests=len(latencies), samples=sum(log.samples for log in logs),
        window_s=max(log.last_end for log in logs) - clock.start - load.warmup_s,
        latency=latency_stats(latencies), checked=sum(log.checked for log in logs),
        wrong=sum(log.wrong for log in logs),
        first_wrong=next((log.first_wrong for log in logs if log.first_wrong), None))


class NoStreams:
    """:class:`StreamOps` of a client without streams: nothing to enter or wait for (calls that
    return finished work, as the CPU tests' stand-ins)."""

    def new(self) -> object:
        return None

    def on(self, stream) -> ContextManager:
        return contextlib.nullcontext()

    def wait(self, stream) -> None:
        pass
