"""Weight prefetch into the L2 on the GPU (``PrepareOptions(prefetch_l2=True)``, issue 53):
measured at prepare and served only where faster; a graph served with its prefetch nodes is
proven bit for bit like any graph, computes what the graph without them computes, and its
timeline runs.  Times are printed, never asserted."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


class Logits(torch.nn.Module):
    """A causal LM's logits at the last position, without a cache: a step that streams every
    weight once."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits[:, -1]


def _gpt2():
    pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    from nimble.cli.decoders import causal_lm

    return Logits(causal_lm("gpt2", "float16")).eval()


def _ids(seed: int):
    return torch.randint(0, 50257, (1, 16), device="cuda",
                         generator=torch.Generator("cuda").manual_seed(seed))


def test_weight_prefetch_is_measured_at_prepare_and_served_only_where_faster():
    import nimble

    model = _gpt2()
    plain = nimble.Nimble(model).prepare(_ids(0))
    fetched = nimble.Nimble(model).prepare(
        _ids(0), options=nimble.PrepareOptions(prefetch_l2=True))
    measured = fetched.graph.meta["prefetch_l2"]
    print(measured)
    # one entry per plan: GPT-2's norms and attention read no weight, so both plans fetch
    assert [m["plan"] for m in measured] == ["windows", "gaps"]
    assert all(m["phase"] == 0 and m["windows"] >= 1 for m in measured)
    assert all(m["plain_ms"] > 0 and m["prefetch_ms"] > 0 for m in measured)
    assert sum(m["kept"] for m in measured) <= 1
    assert bool(fetched.engine.builts[0].prefetch_nodes) is any(m["kept"] for m in measured)
    assert "prefetch_l2" not in plain.graph.meta and not plain.engine.builts[0].prefetch_nodes
    for seed in range(1, 4):
        assert torch.equal(fetched(_ids(seed)), plain(_ids(seed)))
    plain.close()
    fetched.close()


def test_a_graph_served_with_its_prefetch_is_proven_computes_the_same_and_traces(
        monkeypatch):
    """The measured choice forced to the prefetch: the served graph carries its nodes through
    the proof (poisoned, 100 launches, the fuzzer), the calls and a measured timeline."""
    import nimble
    from nimble.analysis.backfill import Fastest
    from nimble.debug.breakdown import format_breakdown, step_breakdown
    from nimble.engine import prefetch

    def prefetch_wins(plain, builds, launch, *args):  # the last plan (the gaps') wins
        plain.close()
        return Fastest(builds[-1](), len(builds), 1.0, (0.5,) * len(builds))
    model = _gpt2()
    plain = nimble.Nimble(model).prepare(_ids(0))
    monkeypatch.setattr(prefetch.backfill, "fastest", prefetch_wins)
    fetched = nimble.Nimble(model).prepare(
        _ids(0), options=nimble.PrepareOptions(prefetch_l2=True))
    monkeypatch.undo()
    nodes = fetched.engine.builts[0].prefetch_nodes
    assert nodes and fetched.engine.prefetch[0]
    assert [m["kept"] for m in fetched.graph.meta["prefetch_l2"]] == [False, True]
    assert sum(p.nbytes for p in nodes) == sum(p.nbytes for p in fetched.engine.prefetch[0])
    for seed in range(1, 4):
        assert torch.equal(fetched(_ids(seed)), plain(_ids(seed)))
    timeline = fetched.trace(_ids(5))
    print(format_breakdown(step_breakdown(timeline, fetched.graph)))
    assert timeline.summary()["phases"][0]["tasks"] == len(fetched.graph.tasks)
    plain.close()
    fetched.close()
