"""The bench's round order (no GPU): every mode in every position and after every other mode
equally often, the same number of samples for each, and ``time_rounds`` timing in that order."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from nimble.cli import harness
from nimble.cli.harness import round_orders

MODES = ["eager", "torch.cuda.graph", "torch.compile", "nimble single", "nimble multi",
         "nimble multi, host launch", "nimble k=2"]


def _positions(orders: list[list[str]]) -> Counter:
    return Counter((mode, i) for order in orders for i, mode in enumerate(order))


def _followers(orders: list[list[str]]) -> Counter:
    return Counter(pair for order in orders for pair in zip(order, order[1:]))


@pytest.mark.parametrize("n", range(1, 9))
def test_every_mode_in_every_position_equally_often_over_a_full_square(n):
    modes = MODES[:n] if n <= len(MODES) else MODES + ["nimble k=4"]
    period = n if n % 2 == 0 else 2 * n
    orders = round_orders(modes, 3 * period)
    assert all(sorted(order) == sorted(modes) for order in orders)
    counts = _positions(orders)
    assert set(counts) == {(m, i) for m in modes for i in range(n)}
    assert set(counts.values()) == {3 * period // n}


@pytest.mark.parametrize("n", range(2, 9))
def test_every_mode_follows_every_other_equally_often(n):
    modes = [f"m{i}" for i in range(n)]
    period = n if n % 2 == 0 else 2 * n
    pairs = _followers(round_orders(modes, period))
    assert set(pairs) == {(a, b) for a in modes for b in modes if a != b}
    assert len(set(pairs.values())) == 1


@pytest.mark.parametrize("n, rounds", [(5, 3), (7, 5), (4, 6), (3, 7), (8, 5)])
def test_any_number_of_rounds_keeps_positions_within_one(n, rounds):
    """The bench's defaults (5 rounds, more modes than that) still spread the positions."""
    modes = [f"m{i}" for i in range(n)]
    counts = _positions(round_orders(modes, rounds))
    full = [counts[(m, i)] for m in modes for i in range(n)]
    assert max(full) - min(full) <= 1
    firsts = Counter(order[0] for order in round_orders(modes, rounds))
    assert len(firsts) == min(n, rounds)  # no mode goes first twice before all have


def test_the_last_mode_does_not_always_run_last():
    orders = round_orders(["eager", "torch.cuda.graph", "nimble single", "nimble multi"], 5)
    assert Counter(order[-1] for order in orders)["nimble multi"] <= 2


class _FakeEvent:
    """A CUDA event on the host clock of a fake GPU: each call adds 1 ms per mode index."""

    now = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = _FakeEvent.now

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return end.at - self.at


def test_time_rounds_runs_the_modes_in_the_rotated_order(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls: list[str] = []

    def mode(name: str, ms: float):
        def call() -> None:
            calls.append(name)
            _FakeEvent.now += ms
        return call

    modes = {"a": mode("a", 1.0), "b": mode("b", 2.0), "c": mode("c", 3.0)}
    samples = harness.time_rounds(modes, rounds=4, iters=3)
    assert samples == {"a": [1.0] * 4, "b": [2.0] * 4, "c": [3.0] * 4}
    timed = calls[30:]  # after 10 warm-up calls of each; then per round one untimed and 3
    runs = [timed[i] for i in range(0, len(timed), 4)]
    assert all(len(set(timed[i:i + 4])) == 1 for i in range(0, len(timed), 4))
    assert [runs[i:i + 3] for i in range(0, 12, 3)] == round_orders(list(modes), 4)


class _Device:
    """A host clock and a GPU queue: a call takes its host time, then its work runs once the
    GPU is free and the call has been queued; an event stamps the queue's time."""

    def __init__(self) -> None:
        self.host = 0.0
        self.gpu_free = 0.0

    def call(self, host_ms: float, gpu_ms: float):
        def run() -> None:
            self.host += host_ms
            self.gpu_free = max(self.gpu_free, self.host) + gpu_ms
        return run

    def event(self, enable_timing: bool = False):
        device = self

        class Event:
            at = 0.0

            def record(self) -> None:
                self.at = max(device.gpu_free, device.host)

            def synchronize(self) -> None:
                device.host = max(device.host, self.at)

            def elapsed_time(self, end) -> float:
                return end.at - self.at
        return Event()


def test_a_round_does_not_count_its_first_calls_host_time(monkeypatch):
    """A call whose host time (0.4 ms) is below its GPU time (0.5) is timed at its GPU time:
    the round's first call is queued while the untimed one runs. A host-bound call (host 0.9,
    GPU 0.5) is timed at its host time, as a loop of such calls runs."""
    device = _Device()
    monkeypatch.setattr(torch.cuda, "Event", device.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    samples = harness.time_rounds({"gpu-bound": device.call(0.4, 0.5),
                                   "host-bound": device.call(0.9, 0.5)}, rounds=3, iters=5)
    assert samples["gpu-bound"] == pytest.approx([0.5] * 3)
    assert samples["host-bound"] == pytest.approx([0.9] * 3)
