"""The fair decoding bench on the GPU (issue 53): the compiled tight loop's tokens, and
``nimble bench --generate`` with its baseline row, bandwidth columns and the decode step's
breakdown.  Times are printed, never asserted beyond what holds by construction."""
from __future__ import annotations

import json

import pytest
import torch

import nimble.cli.main as cli

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["gpt2_tiny", "llama_small"])
def test_the_compiled_loop_decodes_the_librarys_tokens_up_to_near_ties(name):
    """The loop on CUDA graphs of Inductor's kernels, twice on one cache: transformers' greedy
    tokens (static cache, eager kernels), departing only where the reference chose by a few
    units in the last place."""
    pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    from nimble.cli.decode_loop import compiled_loop
    from nimble.cli.decoders import causal_lm
    from nimble.cli.generate_bench import _mismatches, wrong_sequences
    from nimble.generate import library_greedy

    torch._dynamo.reset()
    model = causal_lm(name, "float16")
    loop = compiled_loop(model, 96)
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), device="cuda")
    want, logits = library_greedy(model, ids, 48, with_logits=True)
    first = loop(ids, 48)
    assert torch.equal(loop(ids, 48), first)  # the cache reset between calls
    mismatch = _mismatches(first, want, logits, model.dtype)
    assert wrong_sequences(mismatch) == 0, mismatch


def test_the_generate_bench_has_its_baseline_bandwidth_and_breakdown(capsys, tmp_path):
    pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    from nimble.cli.decode_bandwidth import weight_bytes
    from nimble.cli.decoders import causal_lm

    path = tmp_path / "generate.json"
    status = cli.main(["bench", "--generate", "gpt2_tiny", "--batch", "1", "--rounds", "2",
                       "--prompt-lengths", "32", "--new-tokens", "40", "--breakdown",
                       "--json", str(path), "-q"])
    out = capsys.readouterr().out
    print(out)
    assert status == 0, out
    [result] = json.loads(path.read_text())["results"]
    modes = result["modes"]
    assert list(modes)[0] == "compiled loop" and modes["compiled loop"]["x_loop"] == 1.0
    copy = result["copy_bytes_per_s"]
    assert copy > 0 and "device copy bandwidth" in out
    needed = result["bytes"]
    assert needed["weights"] == weight_bytes(causal_lm("gpt2_tiny", "float16"))
    assert needed["slots_read"] == 32 + (16 + 40 - 1) / 2
    for mode, row in modes.items():
        assert "error" not in row, (mode, row)
        assert row["timed_tokens"] == [16, 40]
        if row["token_ms_median"] > 0:
            assert row["bandwidth"]["of_copy"] == pytest.approx(
                needed["per_step"] / (row["token_ms_median"] / 1e3) / copy)
    for mode in ("nimble", "nimble+inductor"):
        shape = result["decode_step"][mode]
        assert "trace_error" not in shape, shape
        b = shape["breakdown"]
        assert b["tasks"] == shape["tasks"] and b["gaps"]["count"] > 0
        assert b["busy_us"] <= b["makespan_us"] and b["path_busy_us"] <= b["makespan_us"]
        # the path from a root to the last end: its busy time and its gaps make the makespan,
        # less the root's start after the step's first start
        assert b["path_busy_us"] + b["path_gaps"]["total_us"] <= b["makespan_us"] + 1e-3
        assert f"where {mode}'s decode step spends its time:" in out
