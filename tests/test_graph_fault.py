"""A kernel fault during prepare's proof (no GPU): the typed error, the recording saved for a
bug report, and the model's state left alone on the lost context."""
from __future__ import annotations

import os
import types

import pytest

import nimble
import nimble.api as api
import nimble.engine.preparation as preparation
from nimble.errors import GraphFaultError, VerificationError
from nimble.ir.taskgraph import TaskGraph

from helpers import FIXTURE_DIR


def _graph() -> TaskGraph:
    graph = TaskGraph.load(FIXTURE_DIR / "branchy.json.gz")
    graph.meta["model"] = "branchy"
    return graph


def _proof_setup(graph):
    candidate = types.SimpleNamespace(builts=[], seconds={})
    planned = types.SimpleNamespace(rec=types.SimpleNamespace(graph=graph))
    options = types.SimpleNamespace(verify=True, fuzz=False, proof_launches=lambda training: 2)
    return candidate, planned, options


def test_a_fault_in_the_proof_is_a_graph_fault_with_the_recording_saved(monkeypatch, tmp_path):
    graph = _graph()

    def faulting_prove(*args, progress, **kwargs):
        progress.stage = "the rebuilt graph's launches"
        raise RuntimeError("CUDA error: an illegal instruction was encountered")

    monkeypatch.setattr(preparation, "prove", faulting_prove)
    monkeypatch.setattr(preparation.driver, "context_fault",
                        lambda: "CUDA_ERROR_ILLEGAL_INSTRUCTION")
    monkeypatch.setenv(preparation.FAULT_DIR_VARIABLE, str(tmp_path))
    with pytest.raises(GraphFaultError) as e:
        preparation._prove(*_proof_setup(graph), training=True, quiet=True)
    err = e.value
    assert isinstance(err, VerificationError) and isinstance(err, nimble.NimbleError)
    assert err.fault == "CUDA_ERROR_ILLEGAL_INSTRUCTION"
    # the stage the fault showed in tells the recording's own replays from the rebuilt graph
    assert err.stage == "the rebuilt graph's launches"
    assert "shown during the rebuilt graph's launches: RuntimeError" in str(err)
    assert err.recording and err.recording.startswith(str(tmp_path))
    assert err.recording in str(err) and "Restart the process" in str(err)
    assert isinstance(err.__cause__, RuntimeError)
    saved = TaskGraph.load(err.recording)
    assert len(saved.tasks) == len(graph.tasks) and saved.meta["model"] == "branchy"


@pytest.mark.parametrize("streams", [1, 2])
def test_wrong_bits_on_a_healthy_context_are_a_mismatch_with_the_recording_saved(
        monkeypatch, tmp_path, streams):
    """A single-stream training step of googlenet computed a wrong gradient (a padded integer
    relocated as a pointer): its recording is what tells why, and on one stream the hint to
    look for a missing dependency would mislead."""
    def wrong_bits(*args, **kwargs):
        raise VerificationError("output 0 differs")

    graph = _graph()
    candidate, planned, options = _proof_setup(graph)
    n = len(graph.tasks)
    planned.schedule = types.SimpleNamespace(stream_of=[t % streams for t in range(n)],
                                             phases=[n // 2, n - n // 2])
    monkeypatch.setattr(preparation, "prove", wrong_bits)
    monkeypatch.setattr(preparation.driver, "context_fault", lambda: None)
    monkeypatch.setenv(preparation.FAULT_DIR_VARIABLE, str(tmp_path))
    with pytest.raises(VerificationError, match="output 0 differs") as e:
        preparation._prove(candidate, planned, options, training=False, quiet=True)
    err = e.value
    assert not isinstance(err, GraphFaultError)
    assert err.recording and err.recording.startswith(str(tmp_path / "nimble-mismatch-branchy"))
    assert err.recording in str(err) and len(TaskGraph.load(err.recording).tasks) == n
    assert ("no two of its tasks ran unordered" in str(err)) is (streams == 1)


def test_one_order_means_one_stream_in_every_phase():
    schedule = types.SimpleNamespace(stream_of=[0, 0, 1, 1], phases=[2, 2])
    assert preparation.one_order(schedule)
    schedule.stream_of = [0, 1, 2, 2]
    assert not preparation.one_order(schedule)
    assert not preparation.one_order(types.SimpleNamespace(stream_of=[0, 1], phases=[]))
    assert preparation.one_order(types.SimpleNamespace(stream_of=[3, 3], phases=[]))


def test_an_unwritable_fault_folder_still_gives_the_error(monkeypatch, tmp_path):
    monkeypatch.setenv(preparation.FAULT_DIR_VARIABLE, str(tmp_path / "missing" / "folder"))
    err = preparation.fault_error(_graph(), "CUDA_ERROR_LAUNCH_FAILED", "the race fuzzer's launches",
                                  RuntimeError("x"))
    assert err.recording is None and "CUDA_ERROR_LAUNCH_FAILED" in str(err)
    assert "saved" not in str(err)


def test_prepare_leaves_the_models_state_alone_after_a_fault(monkeypatch):
    """Putting back batch-norm statistics copies on the GPU: on a lost context that copy would
    raise in its turn and hide the fault."""
    restored = []
    fault = GraphFaultError("faulted", "CUDA_ERROR_ILLEGAL_ADDRESS", None)

    def raising(error):
        def prepare_serving(*args, **kwargs):
            raise error
        return prepare_serving

    monkeypatch.setattr(api, "bucket_examples", lambda *a, **k: [()])
    monkeypatch.setattr(api, "check_mode", lambda *a: None)
    monkeypatch.setattr(api, "watch_modules", lambda: None)
    monkeypatch.setattr(preparation, "saved_state", lambda *a: lambda: restored.append(True))
    nm = nimble.Nimble(object())
    monkeypatch.setattr(api, "prepare_serving", raising(fault))
    with pytest.raises(GraphFaultError):
        nm.prepare()
    assert restored == []
    monkeypatch.setattr(api, "prepare_serving", raising(VerificationError("differs")))
    with pytest.raises(VerificationError):
        nm.prepare()
    assert restored == [True]


def test_asking_for_a_fault_without_a_driver_never_raises(monkeypatch):
    """The question is asked on failure paths: it must not replace the failure with its own."""
    from nimble.driver import calls

    def no_driver():
        raise ImportError("no libcuda here")

    monkeypatch.setattr(calls, "bindings", no_driver)
    assert calls.context_fault() is None


def test_prove_hands_the_progress_to_the_proof(monkeypatch):
    """prepare's progress reaches the proof's stages (the proof itself is stood in for)."""
    import torch

    from nimble.engine import proof, proving

    seen = {}

    def verify(*args, progress=None, **kwargs):
        seen["progress"] = progress
        progress.stage = "done"
        return {}

    monkeypatch.setattr(proof, "verify_against_reference", verify)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    graph = TaskGraph()
    prepared = types.SimpleNamespace(
        launcher=types.SimpleNamespace(rng=None, stream=lambda: None), graph=graph, step=None,
        launchers=[], arena_base=0, memplan=types.SimpleNamespace(arena_bytes=0), seconds={},
        low_bits=())
    rec = types.SimpleNamespace(replay_reference=None, static_inputs=[])
    progress = proof.ProofProgress()
    proving.prove(prepared, rec, 2, fuzz=False, progress=progress)
    assert seen["progress"] is progress and progress.stage == "done"
    assert graph.meta["verified"]["launches"] == 2


def test_the_models_state_is_put_back_after_a_prepare_that_ends_well(monkeypatch):
    restored = []
    monkeypatch.setattr(preparation, "saved_state", lambda *a: lambda: restored.append(True))
    with preparation.model_state_kept(object(), training=True):
        pass
    assert restored == [True]


@pytest.mark.parametrize("model, word", [("PrefillStep (compiled)", "PrefillStep_compiled"),
                                         ("a/b\\c", "a_b_c"), ("(  )", "model")])
def test_a_saved_recordings_name_is_one_plain_word(monkeypatch, tmp_path, model, word):
    """A compiled step's model name has a space and parentheses: its recording's file name
    must still be one word a shell and a file copy take as it is."""
    graph = _graph()
    graph.meta["model"] = model
    monkeypatch.setenv(preparation.FAULT_DIR_VARIABLE, str(tmp_path))
    path = preparation.saved_recording(graph, "mismatch")
    assert os.path.basename(path) == f"nimble-mismatch-{word}-{os.getpid()}.json.gz"
    assert len(TaskGraph.load(path).tasks) == len(graph.tasks)
