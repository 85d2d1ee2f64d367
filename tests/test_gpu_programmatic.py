"""Programmatic edges on the GPU (``PrepareOptions(programmatic_launch=True)``, issue 53):
Inductor's Triton kernels compiled to wait for their data in their own code, captured behind
programmatic edges, rebuilt with those the analysis allows, proven, and equal bit for bit to
the same model prepared without them."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.LayerNorm(512),
                          nn.Linear(512, 2048), nn.SiLU(), nn.Linear(2048, 512))
    return model.cuda().half().eval(), torch.randn(8, 512, device="cuda", dtype=torch.float16)


def test_a_compiled_models_kernels_get_programmatic_edges_and_the_same_bits():
    import torch

    import nimble

    model, x = _mlp()
    plain = nimble.Nimble(torch.compile(model, dynamic=False)).prepare(x)
    torch._dynamo.reset()  # compiled again, now with programmatic launches
    # served unmeasured, so that the edges are built whatever they gain on this machine
    fast = nimble.Nimble(torch.compile(model, dynamic=False)).prepare(
        x, options=nimble.PrepareOptions(programmatic_launch="always"))
    recorded = fast.graph.meta.get("programmatic_edges", [])
    assert recorded, "the capture holds no programmatic edge: did Inductor launch with PDL?"
    assert "programmatic_edges" not in plain.graph.meta and not plain.programmatic_edges
    assert fast.programmatic_edges, (len(recorded), fast.launch_mode)
    assert set(fast.programmatic_edges) <= {tuple(e) for e in recorded}
    for _ in range(3):
        fresh = torch.randn_like(x)
        assert torch.equal(fast(fresh), plain(fresh))
    # measured: kept or not, as the timing says, and the same bits either way
    torch._dynamo.reset()
    measured = nimble.Nimble(torch.compile(model, dynamic=False)).prepare(
        x, options=nimble.PrepareOptions(programmatic_launch=True))
    [row] = measured.graph.meta["programmatic"]
    assert row["measured"] and bool(measured.programmatic_edges) == row["kept"], row
    fresh = torch.randn_like(x)
    assert torch.equal(measured(fresh), plain(fresh))


def test_a_generator_on_programmatic_inductor_kernels_decodes_the_same_tokens():
    pytest.importorskip("transformers")
    import torch

    from nimble.cli.decoders import causal_lm
    from nimble.engine.options import PrepareOptions
    from nimble.generate import Generator, prepare_with_nimble

    model = causal_lm("llama_small", "float16")
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), device="cuda")
    tokens = {}
    for asked in (False, True):
        torch._dynamo.reset()
        step = prepare_with_nimble(PrepareOptions(programmatic_launch="always" if asked
                                                  else False), True)
        generator = Generator(model, max_cache_len=64, prompt_buckets=[16], prepare_step=step)
        decode, _ = generator.steps(1)
        if asked:
            assert decode.programmatic_edges, decode.graph.meta.get("programmatic_edges")
        tokens[asked] = generator.generate(prompt, 32)
        generator.close()
    assert torch.equal(tokens[True], tokens[False])


def saved_programmatic_mlp(folder) -> dict:
    """:func:`_mlp` prepared with programmatic edges and saved into ``folder`` by
    tests/workers/programmatic_save_worker.py (a process that keeps its kernel binaries from
    its start), with its inputs and outputs; the worker's JSON line."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).parent / "workers" / "programmatic_save_worker.py"
    done = subprocess.run([sys.executable, str(worker), str(folder)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_saved_graph_keeps_its_programmatic_edges_when_loaded(tmp_path):
    """The edges a prepare served are in the saved file, and the loaded graph is built with
    them: the same edges, the same bits."""
    seen = saved_programmatic_mlp(tmp_path)
    assert seen["edges"] and seen["loaded_edges"] == seen["edges"], seen
    assert seen["same"], seen
