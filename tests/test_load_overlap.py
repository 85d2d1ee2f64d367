"""nimble.load's kernels loaded on a worker beside the weights' copies (no GPU: stand-ins for
the driver, the kernels' loading and the copies)."""
from __future__ import annotations

import threading

import pytest

from nimble.engine import loading
from nimble.errors import LoadError


class Kernels:
    def __init__(self) -> None:
        self.seconds = {"kernel_binaries": 0.5}
        self.closed = False
        self.thread = threading.current_thread()

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def stand_ins(monkeypatch):
    made = {}
    monkeypatch.setattr(loading.driver, "current_context", lambda: "ctx")
    monkeypatch.setattr(loading.driver, "use_context",
                        lambda ctx: made.setdefault("context", (ctx, threading.current_thread())))

    def load_kernels(kernels, binaries, saved):
        made["kernels"] = Kernels()
        return made["kernels"]
    monkeypatch.setattr(loading, "load_kernels", load_kernels)
    monkeypatch.setattr(loading, "place_weights", lambda *a: ([1], ["w"]))
    monkeypatch.setattr(loading, "place_memory", lambda *a: ([2], ["m"]))
    return made


MANIFEST = {"kernels": [], "binaries": []}


def test_the_kernels_load_on_a_worker_with_the_callers_context(stand_ins):
    seconds = {}
    got = loading._weights_beside_kernels(MANIFEST, None, None, "cuda:0", seconds)
    assert got[:4] == ([1], ["w"], [2], ["m"]) and got[4] is stand_ins["kernels"]
    ctx, thread = stand_ins["context"]
    assert ctx == "ctx" and thread is not threading.current_thread()
    assert stand_ins["kernels"].thread is thread
    assert {"kernels", "weights_and_memory", "kernel_binaries"} <= set(seconds)


def test_a_weight_that_does_not_fit_closes_the_kernels_loaded_beside_it(stand_ins, monkeypatch):
    def refused(*args):
        raise LoadError("the model has no 'fc.weight'")
    monkeypatch.setattr(loading, "place_weights", refused)
    with pytest.raises(LoadError, match="fc.weight"):
        loading._weights_beside_kernels(MANIFEST, None, None, "cuda:0", {})
    assert stand_ins["kernels"].closed


def test_a_kernel_that_does_not_load_is_the_error(stand_ins, monkeypatch):
    def refused(kernels, binaries, saved):
        raise LoadError("binary 0 is not the one saved")
    monkeypatch.setattr(loading, "load_kernels", refused)
    with pytest.raises(LoadError, match="binary 0"):
        loading._weights_beside_kernels(MANIFEST, None, None, "cuda:0", {})
