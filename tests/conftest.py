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


@pytest.fixture
def failed_proofs_saved_aside(monkeypatch, tmp_path):
    """For a test that makes a proof fail on purpose: the recording ``prepare`` then saves for
    a bug report goes to the test's own folder, not to ``$NIMBLE_FAULT_DIR``, where the GPU
    suite collects the recordings of real failures."""
    monkeypatch.setenv("NIMBLE_FAULT_DIR", str(tmp_path))
    return tmp_path
