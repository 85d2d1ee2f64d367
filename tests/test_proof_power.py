"""The proof fails when it should: stand-in graphs whose wrong answers show only to a proof that
poisons old memory, alternates its input sets and launches more than once.

Each stand-in is a rebuilt graph with one defect of the kinds the proof exists for, run against
a simulated device memory on the CPU:

* a missed pointer relocation whose stale target still holds the right bytes (only poisoning
  the recorded buffers turns it into a wrong answer);
* a race that reads the previous launch's values (only a second launch on *other* inputs shows
  it);
* a race that loses only now and then (only several launches show it).

Weakening the proof in any of those three ways makes one of these tests fail.
"""
from __future__ import annotations

import pytest
import torch

from nimble import driver
from nimble.engine import proof
from nimble.errors import VerificationError
from nimble.ir.taskgraph import Buffer, BufferKind, TaskGraph

RECORDED = 0x10000  # a recorded intermediate's address (the capture's pool)
ARENA = 0x80000  # where the rebuilt graph placed that intermediate
WEIGHT = torch.arange(8, dtype=torch.float32)


class Memory:
    """Device memory as a few float32 regions, filled by the proof's poison like the driver."""

    def __init__(self) -> None:
        self.regions = {RECORDED: torch.zeros(8), ARENA: torch.zeros(8)}
        self.fills: list[int] = []

    def fill_bytes_async(self, address: int, value: int, size: int, stream) -> None:
        self.fills.append(address)
        if address in self.regions:
            self.regions[address].view(torch.uint8)[:size].fill_(value)


@pytest.fixture
def memory(monkeypatch):
    mem = Memory()
    monkeypatch.setattr(driver, "fill_bytes_async", mem.fill_bytes_async)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return mem


def _graph() -> TaskGraph:
    g = TaskGraph()
    g.buffers = [Buffer(0, BufferKind.INTERMEDIATE, 32, RECORDED, "weight_t")]
    return g


def _verify(reference, run, relaunches: int = 6):
    return proof.verify_against_reference(_graph(), reference, run, [torch.zeros(8)],
                                          [(ARENA, 32)], None, relaunches=relaunches)


def _reference(memory: Memory):
    """The single-stream recording: an input-independent intermediate (a weight transform, as
    a captured ``w.t()``) at its recorded address, then ``x + intermediate``."""
    def reference(inputs):
        (x,) = inputs
        memory.regions[RECORDED].copy_(WEIGHT * 3)
        return [x + memory.regions[RECORDED]]
    return reference


def test_a_missed_relocation_with_right_stale_bytes_fails_only_because_of_the_poison(memory):
    def rebuilt(inputs):
        (x,) = inputs
        memory.regions[ARENA].copy_(WEIGHT * 3)  # the producer was relocated...
        return [x + memory.regions[RECORDED]]  # ...its reader was not

    with pytest.raises(VerificationError, match=r"output 0 differs.* [1-9]\d* NaN elements"):
        _verify(_reference(memory), rebuilt)
    assert RECORDED in memory.fills and ARENA in memory.fills


def test_the_same_graph_rebuilt_right_is_proven(memory):
    def rebuilt(inputs):
        (x,) = inputs
        memory.regions[ARENA].copy_(WEIGHT * 3)
        return [x + memory.regions[ARENA]]

    assert _verify(_reference(memory), rebuilt) == {}


def _reads_previous_launch(memory: Memory):
    """A race that reads the previous launch's intermediate: the first launch is right."""
    previous: list[torch.Tensor] = []

    def rebuilt(inputs):
        (x,) = inputs
        memory.regions[ARENA].copy_(WEIGHT * 3)
        out = (previous[-1] if previous else x) + memory.regions[ARENA]
        previous.append(x.clone())
        return [out]
    return rebuilt


def test_a_race_on_the_previous_launch_needs_a_second_launch_on_other_inputs(memory):
    with pytest.raises(VerificationError, match="launch 1: output 0 differs"):
        _verify(_reference(memory), _reads_previous_launch(memory))


def test_one_launch_cannot_see_a_race_on_the_previous_launch(memory):
    """What the test above relies on: its defect is invisible to a single launch."""
    assert _verify(_reference(memory), _reads_previous_launch(memory), relaunches=1) == {}


def test_a_race_that_loses_now_and_then_is_caught_by_relaunching(memory):
    calls = [0]

    def rebuilt(inputs):
        (x,) = inputs
        calls[0] += 1
        memory.regions[ARENA].copy_(WEIGHT * 3)
        # The reader overtakes its producer on the fifth launch only.
        intermediate = WEIGHT * 0 if calls[0] == 5 else memory.regions[ARENA]
        return [x + intermediate]

    with pytest.raises(VerificationError, match="launch 4: output 0 differs"):
        _verify(_reference(memory), rebuilt)


def test_the_outputs_that_differ_are_found_bit_for_bit_in_one_read():
    same = torch.arange(6, dtype=torch.float16)
    signed = torch.zeros(3)
    nan = torch.full((2,), float("nan"))
    outputs = [same.clone(), -signed, nan.clone(), torch.zeros(2, 2), torch.zeros(0),
               torch.ones(4, dtype=torch.bool)]
    expected = [same, signed, nan, torch.zeros(4), torch.zeros(0),
                torch.tensor([True, True, False, True])]
    # -0.0 differs from 0.0, equal NaN bits are equal, a shape differs, nothing to compare
    assert proof.differing(outputs, expected) == [1, 3, 5]
    assert proof.differing(expected, expected) == []
