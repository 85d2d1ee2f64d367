"""pytest's hooks for the suite: tests marked ``gpu`` skip, with the reason, where there is none;
``NIMBLE_TEST_SHARD`` runs a share of a file's tests (tools/gpu_suite.py spreads a long GPU test
file over several processes so).

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


def parse_shards(text: str) -> dict[str, tuple[int, frozenset[int]]]:
    """``NIMBLE_TEST_SHARD``: ``FILE:I,J/K;FILE:I/K``: of FILE's tests in collection order, those
    whose index modulo K is I or J run; the files it does not name run whole."""
    shards = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, share = part.partition(":")
        picked, _, count = share.partition("/")
        try:
            k = int(count)
            indices = frozenset(int(i) for i in picked.split(","))
        except ValueError:
            k, indices = 0, frozenset()
        if k < 1 or not indices or not all(0 <= i < k for i in indices):
            raise pytest.UsageError(f"NIMBLE_TEST_SHARD: {part!r} is not FILE:I[,J...]/K with "
                                    "0 <= I < K")
        shards[name] = (k, indices)
    return shards


def _sharded(config, items) -> None:
    import os

    shards = parse_shards(os.environ.get("NIMBLE_TEST_SHARD", ""))
    if not shards:
        return
    kept, dropped, seen = [], [], {}
    for item in items:
        name = item.path.name
        index = seen[name] = seen.get(name, -1) + 1
        share = shards.get(name)
        (kept if share is None or index % share[0] in share[1] else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


#: Per test id, its seconds so far (setup, call, teardown) and its outcome.
_TIMES: dict[str, list] = {}


def pytest_runtest_logreport(report):
    """Where ``NIMBLE_TEST_TIMES`` names a file (tools/gpu_suite.py sets it per process), a
    line per test as it ends: outcome, seconds (setup, call and teardown), test id; written at
    once, so a process stopped at the suite's deadline still tells what it did."""
    import os

    path = os.environ.get("NIMBLE_TEST_TIMES")
    if not path:
        return
    entry = _TIMES.setdefault(report.nodeid, [0.0, "passed"])
    entry[0] += report.duration
    if report.failed:
        entry[1] = "failed" if report.when == "call" else "error"
    elif report.skipped and entry[1] == "passed":
        entry[1] = "skipped"
    if report.when == "teardown":
        seconds, outcome = _TIMES.pop(report.nodeid)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{outcome}\t{seconds:.2f}\t{report.nodeid}\n")


def pytest_collection_modifyitems(config, items):
    _sharded(config, items)
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


@pytest.fixture
def no_gpu_work(monkeypatch):
    """Fail the test where a load asks for the GPU (or the driver) at all: a saved file whose
    structure does not hold must be refused before (its checksum, hashed meanwhile, holds later,
    before any graph is built: tests/test_load_checksum.py)."""
    import torch

    from nimble.engine import loading

    def asked(*args, **kwargs):
        raise AssertionError("the load reached the GPU with a damaged file")
    monkeypatch.setattr(torch.cuda, "is_available", asked)
    monkeypatch.setattr(loading.driver, "ensure_context", asked)
