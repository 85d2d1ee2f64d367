"""The proof catches a missing synchronization: googlenet fp16, needed sync edges removed one at
a time from a verification copy (tools/proof_power.py), each caught by the proof with the race
fuzzer; the same copy with nothing removed passes.  The served graph itself carries no delay
node and its proof records what the fuzzer ran."""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from helpers import zoo_model

pytestmark = pytest.mark.gpu

EDGES = 5


def _power():
    path = Path(__file__).resolve().parent.parent / "tools" / "proof_power.py"
    spec = importlib.util.spec_from_file_location("proof_power", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_removed_sync_edges_are_caught_by_the_fuzzed_proof():
    import torch

    import nimble
    from nimble.driver import node_count
    from nimble.engine.proof import Reference

    power = _power()
    model, x = zoo_model("googlenet")
    model, x = model.half(), x.half()
    nm = nimble.Nimble(model).prepare(
        x, quiet=True, options=nimble.PrepareOptions(keep_recording=True))
    try:
        prepared, rec = nm.engine, nm.recording
        verified = nm.graph.meta["verified"]
        assert verified["fuzz"] and verified["fuzz_launches"] >= 4
        assert verified["delay_draws"] == verified["fuzz_launches"]
        assert verified["tasks_delayed_per_draw"] > 0 and verified["max_delay_us"] > 0
        assert node_count(prepared.built.graph.handle) == len(prepared.graph.tasks) + len(
            prepared.gathers(0))  # no delay node in the served graph
        fresh = torch.randn_like(x)
        with torch.no_grad():
            want = model(fresh)
        torch.testing.assert_close(nm(fresh).float(), want.float(), rtol=2e-2, atol=2e-2)

        reference = Reference.record(prepared.graph, rec.replay_reference, rec.static_inputs)
        edges = prepared.schedule.edges()
        sync = list(prepared.schedule.sync_edges)
        random.Random(0).shuffle(sync)
        changes = []
        for edge in sync:
            change = power.Change("sync", removed_edges=frozenset({edge}))
            if power.needed(prepared.graph, edges, prepared.memplan, change)[0]:
                changes.append(change)
            if len(changes) == EDGES:
                break
        assert len(changes) == EDGES, "googlenet has enough sync edges the plan check needs"
        missed = []
        for i, change in enumerate(changes):
            _, caught, *_ = power.run_trial(prepared, rec, reference, change, 100, 100, i)
            if not caught:
                missed.append(change.describe())
        assert not missed, "the fuzzed proof missed: " + "; ".join(missed)
        plain, fuzzed, *_, message = power.run_trial(prepared, rec, reference,
                                                     power.Change("none"), 100, 100, 0)
        assert not plain and not fuzzed, message
    finally:
        nm.close()
