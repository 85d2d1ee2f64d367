"""``nimble bench --serve`` without a GPU: its options and their errors, the batch draw, the
latency statistics, the check of a response, client threads run against stand-in models, the
report, the JSON and the exit status."""
from __future__ import annotations

import argparse
import json
import random
import threading
import time

import numpy as np
import pytest
import torch
from helpers import load_tool

import nimble.cli.main as cli
from nimble.cli import common, serve_bench
from nimble.cli.serve_bench import (EQUAL_MEMORY, MAX_EQUAL_MEMORY_INSTANCES, command_line,
                                    equal_memory_instances, format_model, parse_modes, rotated,
                                    serve_modes)
from nimble.cli.serve_load import (INPUTS_PER_BATCH, Load, ModeRun, NoStreams, Served,
                                   latency_stats, parse_batch_mix, percentile, response_error,
                                   run_clients)


# ---- options -----------------------------------------------------------------------------------

def test_batch_mix_reads_sizes_with_weights_and_sizes_alone():
    mix = parse_batch_mix("1:0.5, 8:0.3,32:0.2")
    assert mix.sizes == (1, 8, 32) and mix.weights == (0.5, 0.3, 0.2)
    assert mix.buckets == [1, 8, 32] and mix.text == "1:0.5,8:0.3,32:0.2"
    alone = parse_batch_mix("16,4")
    assert alone.sizes == (16, 4) and alone.weights == (1.0, 1.0) and alone.buckets == [4, 16]
    assert alone.text == "16:0.5,4:0.5"


@pytest.mark.parametrize("text, says", [
    ("1:0.5,8:x", "give batch sizes with weights"),
    ("", "give batch sizes with weights"),
    ("1;8", "give batch sizes with weights"),
    ("0:1", "batch size 0 is not positive"),
    ("1:0", "the weight of batch 1 must be a positive number, not 0"),
    ("1:-2", "the weight of batch 1 must be a positive number, not -2"),
    ("1:nan", "must be a positive number, not nan"),
    ("1:inf", "must be a positive number, not inf"),
    ("8:1,8:2", "batch size 8 given twice"),
])
def test_batch_mix_refuses_what_it_cannot_draw_from(text, says):
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        parse_batch_mix(text)


def test_modes_are_known_names_in_the_order_given():
    assert parse_modes("nimble, eager,nimble") == ("nimble", "eager")
    with pytest.raises(argparse.ArgumentTypeError, match="fast: choose from eager, graphs"):
        parse_modes("eager,fast")
    with pytest.raises(argparse.ArgumentTypeError, match="choose from"):
        parse_modes(",")


def _cli_error(capsys, *argv: str) -> str:
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("argv, says", [
    (["--serve", "branchy", "--batches", "1:0.5,8:x"], "argument --batches: '1:0.5,8:x': give"),
    (["--serve", "branchy", "--batches", "4:0"], "the weight of batch 4 must be a positive"),
    (["--serve", "branchy", "--modes", "eager,turbo"], "argument --modes: turbo: choose from"),
    (["--serve", "branchy", "--threads", "0"], "argument --threads: must be at least 1"),
    (["--serve", "branchy", "--seconds", "0"], "argument --seconds: must be more than 0 seconds"),
    (["--serve", "branchy", "--warmup", "-1"], "argument --warmup: must be 0 seconds or more"),
    (["--serve", "branchy", "--check-every", "x"], "argument --check-every: not an integer"),
    (["--serve", ","], "argument --serve: ',': give model names"),
    (["--threads", "2"], "nimble: --threads: only with --serve MODEL"),
    (["branchy", "--batches", "1", "--equal-memory"],
     "nimble: --batches, --equal-memory: only with --serve MODEL"),
    (["--serve", "branchy", "resnet50"], "nimble: --serve takes its models itself: --serve "
                                         "resnet50"),
    (["--serve", "branchy", "--training"], "nimble: --serve and --training: choose one"),
    (["--serve", "branchy", "--batch", "8"], "nimble: --batch: with --serve, give the batch sizes"),
    (["--serve", "branchy", "--modes", "eager,graphs", "--equal-memory"],
     "--equal-memory sizes its Nimble from the memory of the graphs, nimble and instances"),
    (["--serve", "branchy,vgg_nonexistent"], "nimble: unknown model 'vgg_nonexistent'"),
])
def test_option_errors_are_one_line_before_any_work(capsys, argv, says):
    assert says in _cli_error(capsys, *argv)


def _args(*argv: str) -> argparse.Namespace:
    args = cli.build_parser("bench").parse_args(["bench", *argv])
    serve_bench.finish_serve_args(args)
    return args


def test_defaults_and_the_echoed_command():
    args = _args("--serve", "resnet50,googlenet", "--dtype", "float16")
    assert (args.threads, args.instances, args.seconds, args.warmup, args.check_every) == \
        (4, 4, 5.0, 1.0, 20)
    assert args.modes == ("eager", "graphs", "nimble", "instances")
    assert args.serve_batches.sizes == (1,) and not args.equal_memory
    assert command_line(args) == (
        "nimble bench --serve resnet50,googlenet --dtype float16 --threads 4 --batches 1:1 "
        "--seconds 5 --warmup 1 --instances 4 --modes eager,graphs,nimble,instances "
        "--check-every 20")
    # The echoed command parses back to the same run.
    again = _args(*command_line(args).split()[2:])
    assert command_line(again) == command_line(args)
    assert _args("--serve", "branchy", "--threads", "3").instances == 3
    assert _args("--serve", "branchy", "--threads", "3", "--instances", "2").instances == 2


def test_bench_without_serve_still_takes_its_own_options():
    args = cli.build_parser("bench").parse_args(["bench", "branchy", "--batch", "8"])
    serve_bench.refuse_without_serve(args)
    assert args.serve is None and args.batches == [8]


# ---- the draw and the statistics ---------------------------------------------------------------

def test_batch_draws_follow_the_weights_and_repeat_with_the_seed():
    mix = parse_batch_mix("1:0.5,8:0.3,32:0.2")
    draws = [mix.draw(random.Random(7)) for _ in range(3)]
    assert len(set(draws)) == 1  # the same seed, the same first draw
    rng = random.Random(0)
    counts = {size: 0 for size in mix.sizes}
    for _ in range(20000):
        counts[mix.draw(rng)] += 1
    for size, weight in zip(mix.sizes, mix.weights):
        assert abs(counts[size] / 20000 - weight) < 0.015
    rng_a, rng_b = random.Random(3), random.Random(3)
    assert [mix.draw(rng_a) for _ in range(50)] == [mix.draw(rng_b) for _ in range(50)]


def test_percentiles_on_known_samples():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 100) == 100.0 and percentile(values, 0) == 1.0
    assert percentile([4.0], 99) == 4.0
    rng = np.random.default_rng(1)
    samples = sorted(rng.exponential(size=333).tolist())
    for q in (50, 90, 99):
        assert percentile(samples, q) == pytest.approx(float(np.percentile(samples, q)))
    with pytest.raises(ValueError):
        percentile([], 50)


def test_latency_stats_are_in_ms():
    stats = latency_stats([0.004, 0.001, 0.002, 0.003])
    assert stats.p50_ms == pytest.approx(2.5) and stats.max_ms == pytest.approx(4.0)
    assert stats.mean_ms == pytest.approx(2.5) and stats.p99_ms == pytest.approx(3.97)


# ---- checking a response -----------------------------------------------------------------------

def test_a_response_within_the_dtype_tolerance_agrees():
    want = torch.randn(4, 10, dtype=torch.float16) * 5
    assert response_error(want.clone(), want) is None
    nudged = want.float() + 1e-3 * want.abs().max().float()
    assert response_error(nudged.half(), want) is None
    assert response_error((want.clone(), want.clone()), (want, want)) is None


def test_a_wrong_response_says_why():
    want = torch.ones(2, 3)
    assert "largest difference 0.5" in response_error(want + 0.5, want)
    nan = want.clone()
    nan[0, 0] = float("nan")
    assert "NaN or Inf where the reference is finite" in response_error(nan, want)
    assert "shape (3, 3), the reference's is (2, 3)" in response_error(torch.ones(3, 3), want)
    assert "1 outputs, the reference has 2" in response_error(want, (want, want))


# ---- clients against stand-ins -----------------------------------------------------------------

def _doubling(delay_s: float, wrong_batch: int | None = None):
    """A stand-in model: sleeps (releasing the GIL, as a GPU wait does), returns twice its input,
    and for ``wrong_batch`` one more."""
    def call(x):
        time.sleep(delay_s)
        return x * 2 + (1 if x.shape[0] == wrong_batch else 0)
    return call


def _load(mix: str = "1:0.5,8:0.3,32:0.2", seconds: float = 0.3, check_every: int = 3,
          warmup: float = 0.05) -> Load:
    batch_mix = parse_batch_mix(mix)
    inputs = {b: [torch.randn(b, 3) for _ in range(INPUTS_PER_BATCH)] for b in batch_mix.sizes}
    return Load(batch_mix, inputs, {b: [x * 2 for x in xs] for b, xs in inputs.items()},
                warmup_s=warmup, seconds=seconds, check_every=check_every)


def test_clients_count_requests_check_every_mth_and_time_the_window():
    load = _load()
    result = run_clients([_doubling(0.002)] * 3, NoStreams(), load)
    assert result.clients == 3 and result.wrong == 0 and result.first_wrong is None
    # each client checks its 1st, 4th, 7th... counted response
    assert result.requests / 3 - 3 <= result.checked <= result.requests / 3 + 3
    assert load.seconds - 0.01 <= result.window_s < load.seconds + 0.1
    # three clients at 2 ms a request: about 1500 requests/s, never more than they can send
    assert 300 < result.requests_per_s <= 1500
    assert result.samples > result.requests  # batches of 8 and 32 drawn too
    assert 2.0 <= result.latency.p50_ms <= result.latency.p99_ms <= result.latency.max_ms


def test_what_a_thread_sets_up_on_its_first_call_of_a_shape_is_not_timed():
    """A library that tunes per thread and shape on first use (cuDNN's benchmark cache is
    thread-local): each client makes one uncounted call per batch size before the clock."""
    tuned: set = set()
    lock = threading.Lock()

    def call(x):
        key = (threading.get_ident(), x.shape[0])
        with lock:
            first = key not in tuned
            tuned.add(key)
        time.sleep(0.3 if first else 0.001)
        return x * 2

    result = run_clients([call] * 3, NoStreams(), _load(seconds=0.2, warmup=0.0))
    assert len(tuned) == 3 * 3  # every client, every batch size of the mix
    assert result.latency.max_ms < 100


def test_wrong_responses_are_counted_with_the_first_reason():
    result = run_clients([_doubling(0.001, wrong_batch=8)] * 2, NoStreams(),
                         _load(check_every=1))
    assert result.wrong > 0 and result.checked == result.requests
    assert "largest difference 1" in result.first_wrong


def test_a_client_that_raises_stops_the_run_with_its_error():
    def broken(x):
        raise RuntimeError("device lost")

    with pytest.raises(RuntimeError, match="device lost"):
        run_clients([_doubling(0.001), broken], NoStreams(), _load(seconds=0.2))


def test_a_window_without_a_request_started_in_it_is_an_error():
    # requests start at 0, 0.2 (both in the warm-up) and 0.4 s (after the window)
    with pytest.raises(serve_bench.Fail, match="no request started within the 0.01 s after"):
        run_clients([_doubling(0.2)], NoStreams(), _load(seconds=0.01, warmup=0.25))


# ---- the modes, the report, the exit status ----------------------------------------------------

class _FakeMemory:
    """Free device bytes as the stand-in modes take and give them back."""

    def __init__(self) -> None:
        self.used = 0

    def free_bytes(self, release_cache: bool) -> int:
        return 80 * 2**30 - self.used


def _holding(memory: _FakeMemory, mb: float, calls: list, info: dict | None = None) -> Served:
    memory.used += int(mb * 2**20)

    def close() -> None:
        memory.used -= int(mb * 2**20)
    return Served(calls, close, dict(info or {}))


def _fake_run(memory: _FakeMemory, threads: int, instances: int,
              wrong_mode: str | None = None) -> tuple[ModeRun, object]:
    def calls(mode: str, n: int, delay: float) -> list:
        return [_doubling(delay, wrong_batch=8 if mode == wrong_mode else None)] * n
    builders = {
        "eager": lambda: _holding(memory, 10, calls("eager", threads, 0.004)),
        "graphs": lambda: _holding(memory, 400, calls("graphs", threads, 0.002)),
        "nimble": lambda: _holding(memory, 60, calls("nimble", threads, 0.002),
                                   {"instances": 1}),
        "instances": lambda: _holding(memory, 60 + 30 * (instances - 1),
                                      calls("instances", threads, 0.001),
                                      {"instances": instances}),
    }

    def equal_memory(k: int):
        return lambda: _holding(memory, 60 + 30 * (k - 1), calls(EQUAL_MEMORY, k, 0.001),
                                {"instances": k})
    return ModeRun(builders, NoStreams(), memory), equal_memory


def test_equal_memory_instances_fit_the_graphs_memory():
    # one instance 30 MB beside 30 MB all share: (400 - 30) // 30
    assert equal_memory_instances(400, 60, 150, 4) == 12
    assert equal_memory_instances(400, 60, 60, 1) == 6  # one instance: 60 MB each
    assert equal_memory_instances(50, 60, 150, 4) == 1
    assert equal_memory_instances(1e6, 1, 1.5, 2) == MAX_EQUAL_MEMORY_INSTANCES
    with pytest.raises(serve_bench.Fail, match="the nimble mode held 0.0 MB, too little"):
        equal_memory_instances(400, 0.0, 0.0, 4)


def test_modes_run_in_the_given_order_and_equal_memory_after_them():
    memory = _FakeMemory()
    run, equal_memory = _fake_run(memory, threads=2, instances=4)
    steps: list[str] = []
    order = rotated(["eager", "graphs", "nimble", "instances"], 2)
    assert order == ["nimble", "instances", "eager", "graphs"]
    rows = serve_modes(run, _load(seconds=0.15), order, steps.append, equal_memory)
    assert list(rows) == [*order, EQUAL_MEMORY] and memory.used == 0
    assert [s.split(":")[0] for s in steps] == list(rows)
    assert rows["graphs"]["device_mb"] == pytest.approx(400)
    assert rows["instances"]["device_mb"] == pytest.approx(150)
    assert rows[EQUAL_MEMORY]["instances"] == rows[EQUAL_MEMORY]["clients"] == 12
    assert all(r["wrong"] == 0 and r["checked"] > 0 for r in rows.values())


def _serve_with_stand_ins(monkeypatch, wrong_mode: str | None = None) -> list[tuple]:
    """``run`` of ``nimble bench --serve`` with the GPU's part replaced; the (model, dtype,
    shift) of every set-up, in order."""
    set_up: list[tuple] = []

    def gpu_setup(name, dtype, args):
        set_up.append((name, dtype))
        run, equal_memory = _fake_run(_FakeMemory(), args.threads, args.instances, wrong_mode)
        return _load(args.serve_batches.text, args.seconds, args.check_every, args.warmup), \
            run, equal_memory

    monkeypatch.setattr(serve_bench, "gpu_setup", gpu_setup)
    monkeypatch.setattr(common, "require_gpu", lambda command: None)
    monkeypatch.setattr(serve_bench, "_environment", lambda: {"device": "stand-in"})
    return set_up


_RUN = ["bench", "--serve", "branchy,gemm_chains", "--threads", "2", "--seconds", "0.15",
        "--warmup", "0.02", "--batches", "1:0.7,8:0.3", "--check-every", "2"]


def test_serve_end_to_end_prints_tables_ratios_and_writes_the_json(monkeypatch, capsys, tmp_path):
    set_up = _serve_with_stand_ins(monkeypatch)
    path = tmp_path / "serve.json"
    assert cli.main([*_RUN, "--equal-memory", "--json", str(path), "-q"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("nimble bench --serve branchy,gemm_chains --dtype "
                                          "float32 --threads 2 --batches 1:0.7,8:0.3")
    assert set_up == [("branchy", "float32"), ("gemm_chains", "float32")]
    data = json.loads(path.read_text())
    assert data["command"] == out.splitlines()[0] and data["wrong"] == 0
    assert data["device"] == "stand-in" and data["failed"] == []
    first, second = data["results"]
    # the order of the modes rotates from one model to the next
    assert first["order"] == ["eager", "graphs", "nimble", "instances"]
    assert second["order"] == ["graphs", "nimble", "instances", "eager"]
    assert list(first["modes"]) == [*first["order"], EQUAL_MEMORY]
    row = first["modes"]["instances"]
    for key in ("clients", "requests", "requests_per_s", "samples_per_s", "p50_ms", "p99_ms",
                "device_mb", "device_mb_built", "build_s", "checked", "wrong", "instances"):
        assert key in row
    assert set(first["ratios"]) >= {"nimble/graphs throughput", "instances/nimble throughput",
                                    "equal-memory/graphs throughput", "p50 graphs/nimble"}
    # one table per model: the header line, the column titles, a row per mode, the ratios
    assert out.count("branchy (float32): batches 1:0.7,8:0.3, 2 threads, 2 instances") == 1
    for title in ("mode", "req/s", "samples/s", "p50 ms", "p99 ms", "MB", "build s", "checked",
                  "wrong"):
        assert title in out
    assert out.count("ratios: nimble/graphs throughput") == 2
    assert "WRONG" not in out


def test_a_wrong_response_prints_and_exits_1(monkeypatch, capsys, tmp_path):
    _serve_with_stand_ins(monkeypatch, wrong_mode="nimble")
    path = tmp_path / "serve.json"
    assert cli.main([*_RUN, "--modes", "graphs,nimble", "--json", str(path), "-q"]) == 1
    out = capsys.readouterr().out
    assert "WRONG: nimble:" in out and "(first: output 0: largest difference 1" in out
    assert "wrong responses" in out.splitlines()[-1]
    data = json.loads(path.read_text())
    assert data["wrong"] > 0
    assert all(r["modes"]["graphs"]["wrong"] == 0 for r in data["results"])


def test_format_model_has_a_row_per_mode():
    rows = {m: {"mode": m, "clients": 4, "requests_per_s": 100.0, "samples_per_s": 800.0,
                "p50_ms": 1.0, "p99_ms": 2.0, "device_mb": 50.0, "build_s": 1.5, "checked": 10,
                "wrong": 0, "first_wrong": None} for m in ("eager", "nimble")}
    text = format_model({"model": "m", "dtype": "float16", "batches": "1:1", "threads": 4,
                         "instances": 4, "seconds": 5.0, "modes": rows,
                         "ratios": {"nimble/eager throughput": 1.0}})
    lines = text.splitlines()
    assert lines[0] == "m (float16): batches 1:1, 4 threads, 4 instances, 5 s per mode"
    assert lines[3].split() == ["eager", "4", "100.0", "800.0", "1.000", "2.000", "50", "1.5",
                                "10", "0"]
    assert lines[-1] == "ratios: nimble/eager throughput 1.00"


# ---- tools/serve_prepare_cost.py ---------------------------------------------------------------

def test_prepare_cost_targets_and_report():
    tool = load_tool("serve_prepare_cost")
    ways = {"largest alone": tool.Way("largest alone", 10.0, {32: 40.0}, 44.0),
            "buckets": tool.Way("buckets", 15.0, {1: 2.0, 32: 40.0}, 50.0,
                                stages_s={"record": 3.0, "total": 15.0},
                                device_bytes={"shared_bytes": 40 << 20, "state_bytes": 1 << 20,
                                              "outside_bytes": 0, "total_bytes": 41 << 20}),
            "separate": tool.Way("separate", 30.0, {1: 2.0, 32: 40.0}, 90.0)}
    t = tool.targets(ways, weights_mb=50.0)
    assert t["memory"] == pytest.approx(100 / 90) and t["prepare"] == pytest.approx(1.5)
    text = tool.report(ways, 50.0)
    assert "buckets              15.00       50.0             40.0      42.0  1: 2.0, 32: 40.0" \
        in text
    assert "    stages: record 3.00 s, total 15.00 s" in text
    assert "    device_bytes: shared plans 40.0 MB + states 1.0 MB per instance, 0.0 MB beside, " \
        "total 41.0 MB" in text
    assert text.splitlines()[-2:] == [
        "memory: buckets with weights / (largest bucket's arena + weights) = 1.11 (target <= 1.2)",
        "prepare: buckets / largest alone = 1.50 (target <= 2.0)"]
