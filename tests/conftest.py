"""pytest's hooks for the suite: tests marked ``gpu`` skip, with the reason, where there is none.

Helpers the test modules share live in ``helpers.py``.
"""
from __future__ import annotations

import pytest


def _gpu_skip_reason() -> str | None:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a dependency
        return f"torch is not importable ({e})"
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU and driver: torch.cuda.is_available() is False on this machine"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
