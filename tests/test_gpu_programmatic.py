"""``PrepareOptions(programmatic_launch=...)`` on the GPU (issue 53): edges into Nimble's own
kernels (its GEMVs and decode attention, which wait for their predecessor in their code) built
programmatic, proven at prepare, and the same bits as full dependencies while another stream
keeps the GPU busy (the withdrawn rule's edges between Inductor's kernels raced there:
docs/findings.md); on Inductor's kernels alone no edge qualifies."""
from __future__ import annotations

import pytest

from helpers import busy_gpu

pytestmark = pytest.mark.gpu

NEW_TOKENS = 24


def _mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.LayerNorm(512),
                          nn.Linear(512, 2048), nn.SiLU(), nn.Linear(2048, 512))
    return model.cuda().half().eval(), torch.randn(8, 512, device="cuda", dtype=torch.float16)


def test_on_inductors_kernels_alone_no_edge_is_programmatic_and_the_bits_are_the_same():
    import warnings

    import torch

    import nimble

    model, x = _mlp()
    plain = nimble.Nimble(torch.compile(model, dynamic=False)).prepare(x)
    for asked in (True, "always"):
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            nm = nimble.Nimble(torch.compile(model, dynamic=False)).prepare(
                x, options=nimble.PrepareOptions(programmatic_launch=asked))
        assert not nm.programmatic_edges
        for _ in range(2):
            fresh = torch.randn_like(x)
            assert torch.equal(nm(fresh), plain(fresh))


def test_a_generator_on_nimbles_kernels_builds_edges_into_them_and_decodes_the_same_tokens():
    """llama_small with every single-row GEMM on the GEMV (norms and gated activations folded
    into it) and the decode attention: asked for ``"always"`` (served unmeasured), the decode
    step's edges into those kernels are programmatic and the step is proven at prepare; its
    tokens equal the step's with full dependencies, again and again while another stream
    keeps the GPU busy."""
    import torch

    from helpers import swapped_llama_small
    from nimble.engine.options import PrepareOptions
    from nimble.gemv_prologue_pass import fusing
    from nimble.generate import Generator, prepare_with_nimble
    from nimble.ir.waiting_kernels import WAITING_KERNELS

    model, swap = swapped_llama_small()
    torch.manual_seed(4)
    ids = torch.randint(0, model.config.vocab_size, (1, 64), device="cuda")
    generators = {}
    try:
        for asked in (False, "always"):
            torch._dynamo.reset()
            with fusing():
                generators[asked] = Generator(
                    model, max_cache_len=64 + NEW_TOKENS, prompt_buckets=[64], batch_sizes=[1],
                    prepare_step=prepare_with_nimble(PrepareOptions(programmatic_launch=asked),
                                                     True))
        decode, _ = generators["always"].steps(1)
        edges = decode.programmatic_edges
        assert not generators[False].steps(1)[0].programmatic_edges
        graph = decode.graph
        into = {(graph.ops[graph.tasks[v].op].name, graph.tasks[v].name) for _, v in edges}
        assert len(edges) >= 3 * model.config.num_hidden_layers, edges
        assert into <= set(WAITING_KERNELS) and any("gemv" in op for op, _ in into), into
        assert not graph.meta["verified"]["not_bitwise"]
        want = generators[False].generate(ids, NEW_TOKENS)
        with busy_gpu():
            for _ in range(3):
                assert torch.equal(generators["always"].generate(ids, NEW_TOKENS), want)
    finally:
        for generator in generators.values():
            generator.close()
        swap.undo()


def test_a_saved_generator_loads_its_edges_into_nimbles_kernels_where_asked(tmp_path):
    """The decode step served with programmatic edges, saved and loaded in a fresh process that
    kept its kernel binaries (tests/workers/programmatic_load_worker.py): with
    ``LOAD_WAITING_EDGES`` off every edge a full dependency; on (the default) the file's edges
    into Nimble's waiting kernels built programmatic as the saving process served them, the load's proof passing and
    the tokens those of the saved Generator, while another stream keeps the GPU busy."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).parent / "workers" / "programmatic_load_worker.py"
    done = subprocess.run([sys.executable, str(worker), str(tmp_path / "g.nimble"),
                           str(NEW_TOKENS)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["saved_edges"] > 0 and said["plain_edges"] == 0, said
    assert said["loaded_edges"] == said["saved_edges"] and said["same_edges"], said
