"""A torch profiler run in the serving process: Nimble's graphs go to host launch, once, with one
warning, and keep giving the same outputs (nimble.engine.profiler_guard).

The profiler leaves CUPTI attached for the rest of a process, so the check runs in a process of
its own and reports back as JSON.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

_SCRIPT = textwrap.dedent("""
    import json, warnings
    import torch
    import nimble
    from nimble.cli import models
    from nimble.driver.gpu import use_cudnn_benchmark

    use_cudnn_benchmark()
    model = models.create("branchy").cuda().eval()
    x = models.example_input("branchy").cuda()
    nm = nimble.Nimble(model).prepare(x)
    report = {"mode_before": nm.launch_mode}
    before = nm(x).clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]):
            with torch.no_grad():
                model(x)
            torch.cuda.synchronize()
        after = nm(x).clone()
        nm(x)
        report["mode_after"] = nm.launch_mode
        later = nimble.Nimble(model).prepare(x)
        report["mode_prepared_after"] = later.launch_mode
        later_out = later(x).clone()
    torch.cuda.synchronize()
    with torch.no_grad():
        eager = model(x)
    report["same_after"] = bool(torch.equal(before, after))
    report["same_prepared_after"] = bool(torch.equal(before, later_out))
    report["eager_max_diff"] = float((after - eager).abs().max())
    report["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                          and "CUPTI" in str(w.message)]
    print("REPORT " + json.dumps(report))
""")


def test_a_profiler_run_moves_the_graphs_to_host_launch(tmp_path):
    pytest.importorskip("torch")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    script = tmp_path / "profile_then_call.py"
    script.write_text(_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")), None)
    assert done.returncode == 0 and line, done.stderr[-3000:]
    report = json.loads(line[len("REPORT "):])
    assert report["mode_before"] == "device-launchable"
    assert report["mode_after"] == "host"
    assert report["mode_prepared_after"] == "host"
    assert report["same_after"] and report["same_prepared_after"]
    assert report["eager_max_diff"] < 1e-3
    assert len(report["warnings"]) == 1, report["warnings"]
