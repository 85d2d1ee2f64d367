"""tools/ddp_capture_probe.py on the CPU: its probes by name, a wrong name refused, and the
torchrun it starts per probe."""
from __future__ import annotations

import subprocess

from helpers import load_tool

probe = load_tool("ddp_capture_probe")


def test_a_probe_not_named_in_the_docstring_is_refused_with_the_list(capsys):
    assert probe.main(["nope"]) == 2
    out = capsys.readouterr().out
    assert all(f"``{name}``" in out for name in probe.PROBES)
    assert all(f"``{name}``" in probe.__doc__ for name in probe.PROBES)
    assert probe.main(["--help"]) == 0


def test_started_by_hand_it_runs_one_torchrun_of_two_ranks_per_probe(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    started = []

    def run(cmd, env, timeout):
        started.append((cmd[cmd.index("torch.distributed.run") + 1:], env))
        return subprocess.CompletedProcess(cmd, 1 if cmd[-1] == "ddp" else 0)

    monkeypatch.setattr(probe.subprocess, "run", run)
    assert probe.main(["plain", "ddp"]) == 1  # a failed probe fails the tool
    assert [cmd[0] for cmd, _ in started] == ["--nproc_per_node=2"] * 2
    assert [cmd[-1] for cmd, _ in started] == ["plain", "ddp"]
    assert all(env["NCCL_NVLS_ENABLE"] == "0" for _, env in started)
    started.clear()
    probe.main([])
    assert [cmd[-1] for cmd, _ in started] == list(probe.PROBES)
