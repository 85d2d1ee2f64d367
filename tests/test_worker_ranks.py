"""tests/workers/ranks.py, the torchrun workers' shared part, on the CPU: a line in one write,
a failure noted with its trace."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "workers"))

import ranks  # noqa: E402


class _Writes:
    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> None:
        self.writes.append(text)

    def flush(self) -> None:
        pass


def test_a_line_goes_out_in_one_write_and_a_failure_with_its_trace(monkeypatch):
    out = _Writes()
    monkeypatch.setattr(ranks.sys, "stdout", out)
    seen: dict = {"rank": 1}
    try:
        raise ValueError("bad shape")
    except ValueError as e:
        ranks.note_failure(seen, e)
    assert seen["error"] == "ValueError: bad shape" and "raise ValueError" in seen["trace"]
    ranks.report(seen)
    assert len(out.writes) == 1 and out.writes[0].endswith("\n")
    assert json.loads(out.writes[0]) == seen
