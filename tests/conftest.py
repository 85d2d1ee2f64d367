"""Shared test configuration: the ``gpu`` marker and the recorded fixtures."""
from __future__ import annotations

from pathlib import Path

import pytest

FIXTURE_DIR = Path(__file__).parent / "fixtures"
FIXTURE_PATHS = sorted(FIXTURE_DIR.glob("*.json.gz"))


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


def random_dag(n: int, fanout: int, window: int, seed: int):
    """A DAG of ``n`` tasks, each after up to ``fanout`` random ones of the ``window`` before it."""
    import random

    from nimble.analysis.deps import dag_from_edges

    rng = random.Random(seed)
    edges = [(u, v) for v in range(1, n)
             for u in rng.sample(range(max(0, v - window), v), min(fanout, v, window))]
    return dag_from_edges(n, edges)


def fixture_ids() -> list[str]:
    return [p.name.split(".")[0] for p in FIXTURE_PATHS]


def zoo_model(name: str):
    """``(model on the GPU, example input)`` for a built-in or zoo model; skips without its package."""
    from nimble.cli import models
    from nimble.driver.gpu import use_cudnn_benchmark

    use_cudnn_benchmark()
    try:
        return models.create(name).cuda(), models.example_input(name)
    except ImportError as e:
        pytest.skip(str(e))
