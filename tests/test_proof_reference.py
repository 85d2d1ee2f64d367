"""The proof's reference checks (nimble.engine.proof.Reference) on CPU tensors (no GPU)."""
from __future__ import annotations

import pytest
import torch

from nimble.engine.proof import Reference
from nimble.errors import VerificationError
from nimble.ir.taskgraph import TaskGraph


def _reference() -> Reference:
    sets = [[torch.tensor([1.0])], [torch.tensor([2.0])]]
    return Reference(TaskGraph(), sets, [[torch.tensor([10.0])], [torch.tensor([20.0])]], {})


def test_launches_alternate_the_input_sets_and_a_later_start_keeps_the_alternation():
    seen = []

    def run(inputs):
        seen.append(float(inputs[0]))
        return [inputs[0] * 10]
    ref = _reference()
    ref.launches(run, 1)
    ref.launches(run, 4, first=1)  # the rest of four, as the proof at load runs them
    assert seen == [1.0, 2.0, 1.0, 2.0]


def test_a_launch_that_gives_other_bits_names_itself(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # CPU tensors here

    def wrong_second(inputs):
        return [inputs[0] * 10 + (float(inputs[0]) == 2.0)]
    with pytest.raises(VerificationError, match="load check launch 3"):
        _reference().launches(wrong_second, 4, label="load check launch", first=3)
