"""The README and docs as a reader takes them, top to bottom (no GPU)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _line_of(text: str, needle: str) -> int:
    lines = [i for i, line in enumerate(text.splitlines()) if needle in line]
    assert lines, f"the README no longer says {needle!r}"
    return lines[0]


def test_the_cpu_torch_hint_comes_before_the_test_command():
    """Read top to bottom, the test command run first would pull torch's CUDA build."""
    text = README.read_text(encoding="utf-8")
    assert _line_of(text, "download.pytorch.org/whl/cpu") < \
        _line_of(text, "pip install -e '.[test]'")
