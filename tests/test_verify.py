"""The proof's rules (nimble.engine.proof), on the CPU with stand-in reference and rebuilt graphs.

Bitwise by default; an output the recording itself does not reproduce is held to its own spread;
a training step's gradients may differ within a stated tolerance, and forward outputs may not.
"""
from __future__ import annotations

import pytest
import torch

from nimble.engine import proof
from nimble.errors import VerificationError
from nimble.ir.taskgraph import TaskGraph


@pytest.fixture(autouse=True)
def _no_device(monkeypatch):
    monkeypatch.setattr(proof, "poison", lambda ranges, stream: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)


def _graphs(noise_of_reference, noise_of_run):
    """``(reference, run)`` computing two outputs of one input, each output plus noise."""
    def compute(inputs, noise):
        (x,) = inputs
        return [x * 2 + noise[0](), x.sum().reshape(1) + noise[1]()]
    return (lambda inputs: compute(inputs, noise_of_reference),
            lambda inputs: compute(inputs, noise_of_run))


def _zero():
    return 0.0


def _jitter(scale):
    return lambda: float(torch.randn(()) * scale)


def _check(reference, run, **kw):
    return proof.verify_against_reference(TaskGraph(), reference, run, [torch.zeros(8)], [],
                                           None, relaunches=6, **kw)


def test_equal_bits_prove_every_output():
    assert _check(*_graphs([_zero, _zero], [_zero, _zero])) == {}


def test_a_forward_output_that_differs_at_all_fails():
    with pytest.raises(VerificationError, match="output 0 differs"):
        _check(*_graphs([_zero, _zero], [lambda: 1e-6, _zero]))


def test_an_output_the_recording_does_not_reproduce_is_held_to_its_own_spread():
    torch.manual_seed(0)
    spread = _check(*_graphs([_zero, _jitter(1e-3)], [_zero, _jitter(1e-3)]), repeats=4)
    assert set(spread) == {1} and 0 < spread[1] < 1e-2
    with pytest.raises(VerificationError, match="varies by up to"):
        _check(*_graphs([_zero, _jitter(1e-3)], [_zero, lambda: 1.0]), repeats=4)


def test_gradients_may_differ_within_the_tolerance_and_no_further():
    big = proof.GRADIENT_RTOL * 100  # |x.sum()| of a standard normal 8-vector is ~3
    assert 1 in _check(*_graphs([_zero, _zero], [_zero, lambda: 1e-5]), gradients=[1])
    with pytest.raises(VerificationError, match="output 1"):
        _check(*_graphs([_zero, _zero], [_zero, lambda: big]), gradients=[1])
    with pytest.raises(VerificationError, match="output 0"):  # not a gradient: bitwise
        _check(*_graphs([_zero, _zero], [lambda: 1e-5, _zero]), gradients=[1])


def test_only_memory_the_recording_owns_is_poisoned():
    from nimble.ir.taskgraph import Buffer

    g = TaskGraph()
    g.buffers = [Buffer(0, "intermediate", 256, 0x1000), Buffer(1, "intermediate", 256, 0x9000),
                 Buffer(2, "input", 64, 0x20000), Buffer(3, "param", 64, 0x30000),
                 Buffer(4, "rng", 8, 0x40000), Buffer(5, "scratch", 0, 0x1100)]
    everything = [(0x1000, 256), (0x9000, 256), (0x20000, 64), (0x40000, 8)]
    assert proof.poison_ranges(g) == everything  # an old recording: no pool segments
    g.meta["pool_segments"] = [[0x1000, 0x1000]]
    assert proof.poison_ranges(g) == [(0x1000, 256), (0x20000, 64), (0x40000, 8)]


def test_the_progress_names_the_stage_a_failure_came_from():
    """A kernel fault shows at the next synchronization; the stage then says whether the
    recording's own replays or the rebuilt graph's launches were running."""
    reference, run = _graphs([_zero, _zero], [_zero, _zero])

    def broken(inputs):
        raise RuntimeError("faulted")

    progress = proof.ProofProgress()
    with pytest.raises(RuntimeError, match="faulted"):
        _check(broken, run, progress=progress)
    assert progress.stage == "the recording's own replays"
    with pytest.raises(RuntimeError, match="faulted"):
        _check(reference, broken, progress=progress)
    assert progress.stage == "the rebuilt graph's launches"
    _check(reference, run, progress=progress)
    assert progress.stage == "done"
