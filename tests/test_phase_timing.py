"""nimble.engine.phase_timing: the order in which a timed launch of a phase is queued (the GPU
replaced by stand-ins that write down what the host asks for)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from nimble.engine import phase_timing


class _Event:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def record(self) -> None:
        self.log.append(f"record {self.name}")

    def synchronize(self) -> None:
        self.log.append("sync")

    def elapsed_time(self, other) -> float:
        return 0.5


def _timed(monkeypatch, lead: bool, before_names: list[str]) -> list[str]:
    torch = pytest.importorskip("torch")
    log: list[str] = []
    names = iter(["start", "end"])
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing: _Event(log, next(names)))
    monkeypatch.setattr(phase_timing.driver, "launch",
                        lambda handle, stream: log.append(f"launch {handle}"))
    monkeypatch.setattr(phase_timing, "LEAD_LAUNCH", lead)
    before = [SimpleNamespace(exec=SimpleNamespace(handle=n)) for n in before_names]
    launch = phase_timing.after_phases(before, None, lambda: log.append("refresh"))
    assert launch(SimpleNamespace(exec=SimpleNamespace(handle="built")), 2) == 1.0
    return log


@pytest.mark.parametrize("lead", [False, True])
def test_a_phase_after_others_is_timed_behind_them_lead_or_not(monkeypatch, lead):
    log = _timed(monkeypatch, lead, ["forward"])
    assert log == ["refresh", "launch forward", "record start", "launch built", "record end",
                   "sync"] * 2


def test_a_first_phase_is_timed_from_an_idle_gpu_unless_led(monkeypatch):
    assert _timed(monkeypatch, False, []) == ["refresh", "record start", "launch built",
                                              "record end", "sync"] * 2
    # led: an untimed launch of itself keeps the GPU busy while the timed one is queued; the
    # inputs refreshed again between the two (a launch may reuse their bytes)
    assert _timed(monkeypatch, True, []) == ["refresh", "launch built", "refresh",
                                             "record start", "launch built", "record end",
                                             "sync"] * 2
