"""``nimble bench --profiler`` without a GPU: its sequence (timing, profiler, timing, fresh
prepares, timing), its table and JSON, and that nothing stays open when a step fails."""
from __future__ import annotations

import json
import types

import pytest
import torch

import nimble.cli.main as cli
from nimble.cli import models
from nimble.cli import profiler_bench as pb


def _rows(ms: dict[str, float]) -> dict[str, dict]:
    return {k: {"median_ms": v, "min_ms": v, "max_ms": v} for k, v in ms.items()}


def _timings():
    before = _rows({"torch.cuda.graph": 1.0, "nimble multi": 0.5,
                    "nimble multi, host launch": 0.5, "nimble single": 0.8})
    after = _rows({"torch.cuda.graph": 1.0, "nimble multi": 0.6,
                   "nimble multi, host launch": 0.5, "nimble single": 0.9})
    again = _rows({**{k: v["median_ms"] for k, v in after.items()},
                   **{k + pb.FRESH: ms for k, ms in (("torch.cuda.graph", 1.01),
                                                     ("nimble multi", 0.625),
                                                     ("nimble multi, host launch", 0.5),
                                                     ("nimble single", 0.8))}})
    return before, after, again


def _result(model: str = "googlenet", dtype: str = "float32") -> dict:
    before, after, again = _timings()
    return {"model": model, "dtype": dtype, "batch": 1, "rounds": 3, "iters": 10,
            "profiler_seconds": 1.5, "launch_modes": {},
            "timings": {"before": before, "after": after, "after_again": again},
            "modes": pb.compare(before, after, again)}


def test_compare_gives_every_mode_its_ratios_to_before():
    rows = pb.compare(*_timings())
    assert list(rows) == list(pb.MODES)
    multi = rows["nimble multi"]
    assert multi["after_over_before"] == pytest.approx(1.2)
    assert multi["prepared_after_ms"] == 0.625
    assert multi["prepared_after_over_before"] == pytest.approx(1.25)
    assert multi["after_again_ms"] == 0.6
    assert rows["nimble multi, host launch"]["after_over_before"] == pytest.approx(1.0)


def test_table_has_a_row_per_mode_with_the_ratios():
    lines = pb.format_result(_result()).splitlines()
    assert lines[0] == ("googlenet (float32, batch 1): torch.profiler over one eager forward "
                        "took 1.50 s")
    assert lines[1].split()[:5] == ["mode", "before", "ms", "after", "ms"]
    multi = next(line for line in lines if line.startswith("nimble multi "))
    assert multi.split()[2:] == ["0.500", "0.600", "1.200", "0.625", "1.250"]
    host = next(line for line in lines if line.startswith("nimble multi, host launch"))
    assert host.split()[-5:] == ["0.500", "0.500", "1.000", "0.500", "1.000"]
    assert "3 rounds of 10 calls" in lines[-1]
    assert len({len(line) for line in lines[1:-1] if not line.startswith("-")}) == 1


class _FakeNimble:
    """A prepared Nimble that counts calls and remembers whether it was closed."""

    opened: list["_FakeNimble"] = []

    def __init__(self, label: str, after: bool) -> None:
        self.label, self.after, self.closed = label, after, False
        _FakeNimble.opened.append(self)

    launch_mode = "device-launchable"

    def __call__(self, x) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _fake_gpu(monkeypatch, fail_at: str | None = None) -> list:
    """The GPU work replaced: returns the list of steps ``bench_profiler`` takes, in order."""
    steps: list = []
    _FakeNimble.opened = []
    profiled = [False]

    def prepare_kinds(model, x):
        if fail_at == "fresh prepare" and profiled[0]:
            raise RuntimeError("prepare failed")
        steps.append("prepare")
        return {k.label: _FakeNimble(k.label, profiled[0]) for k in pb.KINDS}

    def time_rounds(calls, rounds, iters):
        steps.append(("time", sorted(calls)))
        if fail_at == "timing" and profiled[0]:
            raise RuntimeError("timing failed")
        return {k: [1.0] * rounds for k in calls}

    def profile(model, x):
        profiled[0] = True
        steps.append("profile")
        return 0.25

    cpu_model = types.SimpleNamespace(cuda=lambda: torch.nn.Identity())
    monkeypatch.setattr(pb, "models", types.SimpleNamespace(
        create=lambda name: cpu_model, BUILTIN=models.BUILTIN,
        example_input=lambda name, batch: torch.zeros(batch, 3, 8, 8)))
    monkeypatch.setattr(pb, "use_cudnn_benchmark", lambda: None)
    monkeypatch.setattr(pb, "prepare_kinds", prepare_kinds)
    monkeypatch.setattr(pb, "time_rounds", time_rounds)
    monkeypatch.setattr(pb, "profile_one_forward", profile)
    monkeypatch.setattr(pb, "torch_graph_call", lambda model, x: (lambda: None))
    return steps


def _args(**kw):
    return types.SimpleNamespace(**{"batch": 2, "rounds": 3, "iters": 4, "quiet": True, **kw})


def test_the_sequence_times_before_and_after_the_profiler_then_fresh_ones(monkeypatch):
    steps = _fake_gpu(monkeypatch)
    info = pb.bench_profiler("branchy", _args(), "float16")
    old = sorted(pb.MODES)
    fresh = sorted([*pb.MODES, *(m + pb.FRESH for m in pb.MODES)])
    assert steps == ["prepare", ("time", old), "profile", ("time", old), "prepare",
                     ("time", fresh)]
    assert info["profiler_seconds"] == 0.25 and info["batch"] == 2
    assert list(info["modes"]) == list(pb.MODES)
    assert all(nm.closed for nm in _FakeNimble.opened) and len(_FakeNimble.opened) == 6
    assert [nm.after for nm in _FakeNimble.opened] == [False] * 3 + [True] * 3


@pytest.mark.parametrize("fail_at", ["timing", "fresh prepare"])
def test_a_failing_step_closes_every_prepared_graph(monkeypatch, fail_at):
    _fake_gpu(monkeypatch, fail_at)
    with pytest.raises(RuntimeError):
        pb.bench_profiler("branchy", _args(), "float32")
    assert _FakeNimble.opened and all(nm.closed for nm in _FakeNimble.opened)


def test_prepare_kinds_closes_what_it_prepared_when_one_kind_fails(monkeypatch):
    import nimble

    made: list = []

    class Recorded:
        def __init__(self, model) -> None:
            self.closed = False
            self.recording = object()

        def prepare(self, x, use_multi_stream=True, options=None):
            if not options.device_launch:
                raise nimble.errors.CaptureError("no")
            assert (options.recording is None) == (not made)  # the others reuse the first's
            made.append(self)
            return self

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(nimble, "Nimble", Recorded)
    with pytest.raises(nimble.errors.CaptureError):
        pb.prepare_kinds(None, None)
    assert len(made) == 1 and made[0].closed


def test_bench_profiler_command_prints_a_table_per_model_and_the_json(monkeypatch, tmp_path,
                                                                      capsys):
    seen = []

    def fake(name, args, dtype):
        seen.append((name, dtype, args.batch, args.rounds))
        if name == models.CHAINS:
            raise RuntimeError("no graph")
        return _result(name, dtype)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(pb, "bench_profiler", fake)
    out_json = tmp_path / "profiler.json"
    argv = ["bench", "--profiler", models.BUILTIN, models.CHAINS, "--dtype", "float16",
            "--rounds", "3", "--json", str(out_json)]
    assert cli.main(argv) == 1  # one model failed, the other is reported
    assert seen == [(models.BUILTIN, "float16", 1, 3), (models.CHAINS, "float16", 1, 3)]
    out = capsys.readouterr().out
    assert f"{models.BUILTIN} (float16, batch 1): torch.profiler" in out
    assert f"{models.CHAINS} (float16): FAILED: RuntimeError: no graph" in out
    data = json.loads(out_json.read_text())
    assert data["profiler"] is True and data["device"] == "fake GPU"
    [result] = data["results"]
    assert result["modes"]["nimble multi"]["after_over_before"] == pytest.approx(1.2)
    assert data["failed"] == [{"model": models.CHAINS, "dtype": "float16",
                               "error": "RuntimeError: no graph"}]


def test_profiler_with_training_is_a_usage_error(capsys):
    assert cli.main(["bench", "--profiler", "--training"]) == 2
    err = capsys.readouterr().err
    assert "--profiler times inference calls; leave out --training" in err
