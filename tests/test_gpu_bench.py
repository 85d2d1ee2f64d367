"""``nimble bench`` on the GPU, every mode of the built-in model in short rounds: the report's
limits (critical path, launch-aware path, GPU capacity of isolated task times) and Nimble multi
against them.  Times are printed, never asserted beyond what holds by construction."""
from __future__ import annotations

import json

import pytest

import nimble.cli.main as cli

pytestmark = pytest.mark.gpu


def test_full_bench_reports_the_limits_and_multi_against_the_tightest(capsys, tmp_path):
    path = tmp_path / "bench.json"
    status = cli.main(["bench", "branchy", "--rounds", "2", "--iters", "10", "--no-compile",
                       "--max-streams", "2", "--json", str(path), "-q"])
    out = capsys.readouterr().out
    assert status == 0, out
    [result] = json.loads(path.read_text())["results"]
    lim = result["limits"]
    assert lim["tasks"] == result["tasks"]
    # the chain of isolated times, then the same with a launch cost a task, then the GPU's
    # capacity: no longer than the tasks run one after another, and the tightest is their largest
    assert 0 < lim["critical_path_us"] <= lim["launch_aware_path_us"]
    assert 0 < lim["capacity_us"] <= lim["isolated_sum_us"]
    assert lim["tightest_us"] == max(lim["critical_path_us"], lim["launch_aware_path_us"],
                                     lim["capacity_us"])
    single_us = result["modes"]["nimble single"]["median_ms"] * 1e3
    assert lim["launch_aware_path_us"] <= max(single_us, lim["critical_path_us"]) + 1e-6
    multi_us = result["modes"]["nimble multi"]["median_ms"] * 1e3
    assert result["over_tightest_limit"] == pytest.approx(multi_us / lim["tightest_us"])
    assert result["over_critical_path"] >= result["over_tightest_limit"]
    assert f"the tightest ({lim['tightest']})" in out
    print(out)
