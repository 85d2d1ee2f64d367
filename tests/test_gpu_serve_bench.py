"""``nimble bench --serve`` and ``tools/serve_prepare_cost.py`` on the GPU, on the built-in model
with short runs: every mode serves requests of two batch sizes from two client threads, every
checked response agrees with eager, and the memory and ratios are filled in."""
from __future__ import annotations

import json

import pytest
from helpers import load_tool

import nimble.cli.main as cli

pytestmark = pytest.mark.gpu

_SHORT = ["--threads", "2", "--seconds", "1", "--warmup", "0.2", "--batches", "1:0.5,4:0.5",
          "--check-every", "5", "-q"]


def _serve(capsys, tmp_path, *argv: str) -> dict:
    path = tmp_path / "serve.json"
    status = cli.main(["bench", "--serve", "branchy", *_SHORT, "--json", str(path), *argv])
    out = capsys.readouterr().out
    assert status == 0, out
    data = json.loads(path.read_text())
    assert data["failed"] == [] and data["wrong"] == 0, out
    [result] = data["results"]
    for label, row in result["modes"].items():
        assert row["requests"] > 0 and row["checked"] > 0 and row["wrong"] == 0, label
        assert 0 < row["p50_ms"] <= row["p99_ms"], label
        assert row["samples"] > row["requests"], label  # batches of 4 served too
    return result


def test_eager_and_torch_graphs_serve_two_clients(capsys, tmp_path):
    result = _serve(capsys, tmp_path, "--modes", "eager,graphs")
    graphs = result["modes"]["graphs"]
    # two clients' pools of two graphs each hold memory; eager's cache holds some too
    assert graphs["device_mb"] > 0 and graphs["clients"] == 2
    assert set(result["ratios"]) == set()


def test_nimble_buckets_instances_and_equal_memory_serve(capsys, tmp_path):
    result = _serve(capsys, tmp_path, "--instances", "2", "--equal-memory")
    modes = result["modes"]
    assert list(modes) == ["eager", "graphs", "nimble", "instances", "equal-memory"]
    assert modes["nimble"]["instances"] == 1 and modes["instances"]["instances"] == 2
    assert set(modes["instances"]["arena_mb"]) == {"1", "4"}  # JSON keys: the batch sizes
    assert modes["nimble"]["device_mb"] > 0 and modes["instances"]["prepare_total_s"] > 0
    assert len(modes["instances"]["device_bytes"]["instance_bytes"]) == 2
    eq = modes["equal-memory"]
    assert eq["instances"] == eq["clients"] >= 1
    assert {"nimble/graphs throughput", "instances/nimble throughput",
            "equal-memory/graphs throughput", "p50 graphs/nimble"} <= set(result["ratios"])


def test_prepare_cost_tool_measures_the_three_ways(capsys, tmp_path):
    tool = load_tool("serve_prepare_cost")
    out_json = tmp_path / "cost.json"
    assert tool.main(["branchy", "--dtype", "float32", "--batches", "1,4",
                      "--json", str(out_json)]) == 0
    assert "target <= 1.2" in capsys.readouterr().out
    [result] = json.loads(out_json.read_text())
    ways = result["ways"]
    assert set(ways) == {"largest alone", "buckets", "separate"}
    assert set(ways["buckets"]["plans_mb"]) == set(ways["separate"]["plans_mb"]) == {"1", "4"}
    assert all(w["prepare_s"] > 0 for w in ways.values())
    assert result["targets"]["prepare"] > 0 and result["targets"]["memory"] > 0
