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


# ---- prove() and prove_copy(): what they poison before the served launches --------------------

def _stand_in_prepared(launches: list, poisoned: list):
    """A prepared graph of one input and one output, its arena at 0x10000 (4 KiB) and a
    low-word buffer outside it; its one launcher logs, per launch, the ranges poisoned so far."""
    from types import SimpleNamespace

    from nimble.ir.taskgraph import Buffer, TensorRef

    g = TaskGraph(meta={"low_word_buffers": [1]})
    g.buffers = [Buffer(0, "input", 16, 0x9000), Buffer(1, "intermediate", 64, 0x7000)]
    g.inputs = [TensorRef(0, 0, [4], [1], "float32")]
    g.outputs = [TensorRef(0, 0, [4], [1], "float32")]

    def run_flat(inputs):
        launches.append(list(poisoned))
        return [inputs[0] * 2]
    launcher = SimpleNamespace(rng=None, stream=lambda: "stream", slots=[None],
                               run_flat=run_flat)
    return SimpleNamespace(graph=g, launcher=launcher, launchers=[launcher], step=None,
                           arena_base=0x10000, memplan=SimpleNamespace(arena_bytes=4096),
                           bases=[0x20000, 0x30000], seconds={}, low_bits=(1,))


@pytest.mark.parametrize("which", ["prove", "prove_copy"])
def test_every_served_launch_starts_from_a_poisoned_arena(which, monkeypatch):
    """A relocation the build missed that reads the arena where an earlier launch or the
    recording left the right bytes would pass unpoisoned: the arena (each instance's own, for
    prove_copy) is poisoned before the first launch, with the buffers kept outside it."""
    from types import SimpleNamespace

    from nimble.engine import proving

    poisoned: list = []
    monkeypatch.setattr(proof, "poison", lambda ranges, stream: poisoned.extend(ranges))
    launches: list = []
    prepared = _stand_in_prepared(launches, poisoned)
    rec = SimpleNamespace(replay_reference=lambda inputs: [inputs[0] * 2],
                          static_inputs=[torch.zeros(4)])
    if which == "prove":
        proving.prove(prepared, rec, relaunches=3, fuzz=False)
    else:
        proving.prove_copy(prepared, rec, relaunches=3)
    assert len(launches) == 3
    for seen in launches:
        assert (0x10000, 4096) in seen  # the whole arena
        assert (0x30000, 64) in seen  # the low-word buffer, at its address now
        assert (0x9000, 16) in seen  # the recorded input, where the recording had it
