"""tools/profiler_processes.py on the CPU: each process a stand-in that writes the profiler
bench's JSON; the ratios summarized over the processes, a failed process said."""
from __future__ import annotations

import json

import pytest

from helpers import load_tool

tool = load_tool("profiler_processes")


def _modes(after: float, fresh: float) -> dict:
    return {"Nimble multi": {"after_over_before": after, "prepared_after_over_before": fresh},
            "torch.cuda.graph": {"after_over_before": 1.004,
                                 "prepared_after_over_before": 1.003}}


def test_the_ratios_are_summarized_over_the_processes_and_a_failure_is_said(monkeypatch,
                                                                            capsys):
    ratios = iter([(1.036, 1.02), (1.091, 1.05), None, (1.079, 1.04)])

    def run(cmd, cwd, capture_output, text, env, timeout):
        assert cmd[3:6] == ["bench", "--profiler", "wide"] and env["NCCL_NVLS_ENABLE"] == "0"
        got = next(ratios)
        if got is None:
            return tool.subprocess.CompletedProcess(cmd, 1, "", "nimble: NoGpuError: none\n")
        out = cmd[cmd.index("--json") + 1]
        with open(out, "w") as f:
            json.dump({"results": [{"modes": _modes(*got)}]}, f)
        return tool.subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(tool.subprocess, "run", run)
    assert tool.main(["wide", "--processes", "4"]) == 0
    out = capsys.readouterr().out
    assert "wide: 3 process(es), 1 failed: exit status 1: nimble: NoGpuError: none" in out
    assert "Nimble multi: after/before 1.079 (1.036-1.091), prepared after/before 1.040 " \
           "(1.020-1.050)  (past 1.03)" in out
    assert "torch.cuda.graph: after/before 1.004 (1.004-1.004)" in out
    assert "torch.cuda.graph: after/before 1.004 (1.004-1.004), prepared after/before 1.003 " \
           "(1.003-1.003)\n" in out + "\n"


def test_no_process_that_ran_is_status_1(monkeypatch):
    monkeypatch.setattr(tool.subprocess, "run", lambda cmd, **kw:
                        tool.subprocess.CompletedProcess(cmd, 2, "", "boom\n"))
    assert tool.main(["m", "--processes", "2"]) == 1
    summary = tool.summarize([{"failed": "x"}], 1.03)
    assert summary == {"processes": 0, "failed": ["x"], "modes": {}}
    with pytest.raises(SystemExit):
        tool.main([])
