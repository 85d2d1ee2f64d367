"""``nimble bench --profiler`` on the GPU, end to end on the built-in model.

It runs as a child process: the profiler run it makes changes how the driver runs graphs for
the rest of its process (issue 36), which must not reach the other tests.  Times are printed,
never asserted (performance is shown by the bench, not by tests)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def test_profiler_mode_times_every_graph_before_and_after_and_fresh_ones(tmp_path):
    from nimble.cli import models, profiler_bench

    out = tmp_path / "profiler.json"
    run = subprocess.run(
        [sys.executable, "-m", "nimble", "bench", "--profiler", models.BUILTIN, "--rounds", "2",
         "--iters", "5", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["failed"] == [] and data["profiler"] is True
    [result] = data["results"]
    assert list(result["modes"]) == list(profiler_bench.MODES)
    for row in result["modes"].values():
        assert all(row[k] > 0 for k in ("before_ms", "after_ms", "after_again_ms",
                                        "prepared_after_ms"))
    assert result["launch_modes"] == {"nimble multi": "device-launchable",
                                      "nimble multi, host launch": "host",
                                      "nimble single": "device-launchable"}
    assert set(result["launch_modes_after"].values()) == {"host"}
    assert result["profiler_seconds"] > 0
    fresh = [k for k in result["timings"]["after_again"] if k.endswith(profiler_bench.FRESH)]
    assert len(fresh) == len(profiler_bench.MODES)
    assert "after/before" in run.stdout and "prepared-after ms" in run.stdout
    print(run.stdout)
