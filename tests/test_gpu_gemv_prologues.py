"""gemv_prologues on the GPU: the kernel's values in the three dtypes, and a Llama whose GEMVs
take their norms and gated activations in, compiled and prepared by Nimble."""
from __future__ import annotations

import contextlib

import pytest

pytestmark = pytest.mark.gpu

NEW_TOKENS = 24


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_each_prologue_gemv_matches_its_reference_in_float64(dtype):
    import torch

    import nimble.gemv_prologues as gp
    from nimble.fast_gemv import CONFIGS

    dt = getattr(torch, dtype)
    torch.manual_seed(2)
    for n, k in ((1001, 1500), (3, 4100), (3072, 2048)):
        w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
        a, b = (torch.randn(k, device="cuda", dtype=dt) for _ in range(2))
        nw = (1 + 0.1 * torch.randn(k, device="cuda")).to(dt)
        bias, nb = ((0.3 * torch.randn(k, device="cuda")).to(dt) for _ in range(2))
        for prologue in range(7):  # every kind, the biased ones with their biases
            second = b if gp.second_input(prologue) else None
            norm_weight = nw if prologue in gp.NORMS else None
            extra = {"bias": bias if prologue in gp.BIASED and prologue != gp.ADD_RMSNORM
                     else None,
                     "norm_bias": nb if prologue in (gp.LAYERNORM, gp.ADD_LAYERNORM) else None}
            cpu = {name: None if v is None else v.cpu() for name, v in extra.items()}
            want, want_total = gp.reference(prologue, a.cpu(), None if second is None
                                            else second.cpu(), None if norm_weight is None
                                            else norm_weight.cpu(), 1e-5, w.cpu(), **cpu)
            # the first kinds on every configuration; the layer norms' and GELUs' (the same
            # walk of the weight) on two
            for config in CONFIGS if prologue <= gp.SILU_GATED else CONFIGS[:2]:
                got, total = gp.launch(prologue, a, second, norm_weight, 1e-5, w, config,
                                       **extra)
                error = float((got.cpu().double() - want.double()).norm()
                              / want.double().norm())
                limit = {torch.bfloat16: 2e-2, torch.float16: 3e-3}.get(dt, 1e-5)
                assert error < limit, (n, k, prologue, config, error)
                if prologue in gp.ADDS:
                    assert torch.equal(total.cpu(), want_total), (n, k, config)
                # two tiles asked ahead: the same loads and sums, so the same bits
                two_ahead, _ = gp.launch(prologue, a, second, norm_weight, 1e-5, w, config,
                                         ahead=2, **extra)
                assert torch.equal(two_ahead, got), (n, k, prologue, config)


def test_every_launch_the_tuning_times_computes_the_gemv_and_it_keeps_the_fastest():
    """Each candidate of nimble.gemv_prologue_tuning (tile, warps, programs a multiprocessor,
    tiles ahead) against the float64 reference, then a choice made with the real timer."""
    import torch

    import nimble.gemv_prologue_tuning as tuning
    import nimble.gemv_prologues as gp
    from nimble.fast_gemv import GemvConfig

    dt = torch.bfloat16
    carried = GemvConfig(4, 1024, 8, 1)
    torch.manual_seed(3)
    for (n, k), prologue in (((3072, 2048), gp.ADD_RMSNORM), ((2048, 8192), gp.SILU_GATED)):
        w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
        a, b = (torch.randn(k, device="cuda", dtype=dt) for _ in range(2))
        nw = None if prologue == gp.SILU_GATED else (1 + 0.1 * torch.randn(k, device="cuda")
                                                     ).to(dt)
        want, _ = gp.reference(prologue, a.cpu(), b.cpu(), None if nw is None else nw.cpu(),
                               1e-5, w.cpu())
        for candidate in tuning.CANDIDATES:
            launch = candidate.launch(carried)
            got, _ = gp.launch(prologue, a, b, nw, 1e-5, w, launch.config, ahead=launch.ahead,
                               per_sm=launch.per_sm)
            error = float((got.cpu().double() - want.double()).norm() / want.double().norm())
            assert error < 2e-2, (n, k, prologue, launch, error)
        tuning.forget()
        shape = tuning.PrologueShape(prologue, n, k, dt, w.device)
        choice = tuning.choose(shape, carried)
        distinct = {choice.carried} | {c.launch(carried) for c in tuning.CANDIDATES}
        assert choice.timed == len(distinct) and 0 < choice.us <= choice.carried_us
        tuning.forget()


def test_a_llamas_folded_gemvs_prepare_proven_and_decode_as_the_unfolded_ones():
    import torch

    pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    from nimble.cli.decoders import causal_lm
    from nimble.fast_gemv import fast_gemv
    from nimble.fused_projections import fuse_projections
    from nimble.gemv_prologue_pass import fusing
    from nimble.generate import Generator, prepare_with_nimble

    model = causal_lm("llama_small", "bfloat16")
    fuse_projections(model)
    # every single-row GEMM on the GEMV, whatever was measured: the folds below must hold
    fast_gemv(model, time=lambda config, weights, x: 1.0 if config is None else 0.5)
    torch.manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (1, 128), device="cuda")
    tokens, names = {}, {}
    for folded in (False, True):
        torch._dynamo.reset()
        with (fusing() if folded else contextlib.nullcontext()) as the_pass:
            generator = Generator(model, max_cache_len=128 + NEW_TOKENS, prompt_buckets=[128],
                                  batch_sizes=[1], prepare_step=prepare_with_nimble(None, True))
        try:
            decode, _ = generator.steps(1)
            assert not decode.graph.meta["verified"]["not_bitwise"]
            names[folded] = [t.short_name or t.name for t in decode.graph.tasks]
            tokens[folded] = generator.generate(ids, NEW_TOKENS)
            assert torch.equal(generator.generate(ids, NEW_TOKENS), tokens[folded])
        finally:
            generator.close()
        if folded:
            done = [r for r in the_pass.runs if r.gemvs]
            layers = model.config.num_hidden_layers
            # every layer's two norms and its gated activation, and the final norm
            assert max(r.total for r in done) == 3 * layers + 1, done
    assert sum("gemv_prologue" in n for n in names[True]) == 3 * 4 + 1, names[True]
    assert len(names[True]) < len(names[False])
    # the folds round as the model's code does, so only the GEMV's order of sums and
    # Inductor's unrounded intermediates differ: the first tokens are the same (later ones
    # may part at a near-tie, and all after it with it)
    assert torch.equal(tokens[True][:, :136], tokens[False][:, :136]), (tokens[True],
                                                                        tokens[False])


def test_a_llamas_gemms_of_four_rows_fold_their_norms_prepare_proven_and_decode_as_unfolded(
        monkeypatch):
    """FOLD_ROWS: at batch 4 every projection on the GEMM of rows, each norm (of a residual
    sum) and gated activation computed by the GEMM after it, row by row; the decode step
    proven bit for bit and its tokens those of the unfolded step."""
    import torch

    pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    import nimble.gemv_prologue_pass as prologue_pass
    from nimble.cli.decoders import causal_lm
    from nimble.fast_gemv import fast_gemv
    from nimble.fused_projections import fuse_projections

    batch = 4
    model = causal_lm("llama_small", "bfloat16")
    fuse_projections(model)
    fast_gemv(model, time=lambda config, weights, x: 1.0 if config is None else 0.5,
              rows=(batch,), row_margin=-10.0)
    torch.manual_seed(4)
    ids = torch.randint(0, model.config.vocab_size, (batch, 128), device="cuda")

    def compiling(folded):
        monkeypatch.setattr(prologue_pass, "FOLD_ROWS", folded)
        return prologue_pass.fusing()

    runs = _decoded_both_ways(model, ids, batch, compiling)
    # every layer's two norms and its gated activation, and the final norm
    done = [r for r in runs[True] if r.gemms_of_rows]
    assert max(r.total for r in done) == 3 * model.config.num_hidden_layers + 1, done
    assert sum(r.total for r in runs[False]) == 0, runs[False]


def _decoded_both_ways(model, ids, batch: int, compiling) -> dict:
    """A Generator's decode step at ``batch`` compiled inside ``compiling(folded)`` unfolded and
    folded: each proven bit for bit and decoding ``ids`` the same twice, the folded step of
    fewer tasks, its first tokens the unfolded step's (later ones may part at a near-tie); the
    fold pass's runs by ``folded`` (none where ``compiling`` yields no pass)."""
    import torch

    from nimble.generate import Generator, prepare_with_nimble

    tokens, tasks, runs = {}, {}, {}
    for folded in (False, True):
        torch._dynamo.reset()
        with compiling(folded) as the_pass:
            generator = Generator(model, max_cache_len=128 + NEW_TOKENS, prompt_buckets=[128],
                                  batch_sizes=[batch],
                                  prepare_step=prepare_with_nimble(None, True))
        try:
            decode, _ = generator.steps(batch)
            assert not decode.graph.meta["verified"]["not_bitwise"]
            tasks[folded] = len(decode.graph.tasks)
            tokens[folded] = generator.generate(ids, NEW_TOKENS)
            assert torch.equal(generator.generate(ids, NEW_TOKENS), tokens[folded])
        finally:
            generator.close()
        runs[folded] = [] if the_pass is None else the_pass.runs
    assert tasks[True] < tasks[False], tasks
    assert torch.equal(tokens[True][:, :136], tokens[False][:, :136]), (tokens[True],
                                                                        tokens[False])
    return runs


@pytest.mark.parametrize("batch", [1, 4])
def test_a_gpt2s_layer_norms_and_gelus_fold_prepare_proven_and_decode_as_unfolded(
        monkeypatch, batch):
    """GPT-2 (its Conv1D projections on the GEMV, at batch 4 on the GEMM of rows with
    FOLD_ROWS): each layer norm of a residual sum and each GELU folded with the projection's
    bias before it; the step proven bit for bit, fewer tasks, the unfolded step's tokens."""
    import torch

    pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    import nimble.gemv_prologue_pass as prologue_pass
    from nimble.cli.decoders import causal_lm
    from nimble.fast_gemv import fast_gemv
    from nimble.fused_projections import fuse_projections

    model = causal_lm("gpt2_tiny", "float16")
    fuse_projections(model)
    fast_gemv(model, time=lambda config, weights, x: 1.0 if config is None else 0.5,
              rows=(batch,), row_margin=-10.0)
    monkeypatch.setattr(prologue_pass, "FOLD_ROWS", True)
    monkeypatch.setattr(prologue_pass, "FOLD_LAYER_NORMS", True)
    torch.manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (batch, 128), device="cuda")
    runs = _decoded_both_ways(model, ids, batch, lambda folded: prologue_pass.fusing()
                              if folded else contextlib.nullcontext())
    done = max(runs[True], key=lambda r: r.total)
    layers = model.config.n_layer
    # every norm (the first of the embeddings' sum: a plain one where the batch broadcasts the
    # positions' row), every GELU
    assert done.layernorm + done.add_layernorm == 2 * layers + 1, done
    assert done.gelu == layers, done


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_gemv_joining_the_attentions_split_matches_the_join_kernels_output(dtype):
    import torch

    import nimble.decode_attention as da
    import nimble.gemv_prologues as gp
    from nimble.fast_gemv import CONFIGS

    dt = getattr(torch, dtype)
    torch.manual_seed(5)
    for heads, kv_heads, slots, head_dim, splits in ((32, 8, 192, 64, 3), (32, 8, 4096, 64, 16),
                                                    (6, 2, 300, 80, 2)):
        q = torch.randn(1, heads, 1, head_dim, device="cuda", dtype=dt)
        k, v = (torch.randn(1, kv_heads, slots, head_dim, device="cuda", dtype=dt)
                for _ in range(2))
        keep = (torch.arange(slots, device="cuda") < slots - 5).view(1, 1, 1, slots)
        w = torch.randn(2048, heads * head_dim, device="cuda", dtype=dt) / 40
        attention = da.launch(q, k, v, keep, head_dim ** -0.5, splits=splits)
        part, stat = da.launch_parts(q, k, v, keep, head_dim ** -0.5, splits)
        layout = da.parts_layout(q.shape, k.shape, splits)
        want = (w.double() @ attention.reshape(-1).double())
        scale = w.double().abs() @ attention.reshape(-1).double().abs()
        for config in CONFIGS:
            got = gp.launch_joined(part, stat, w, layout, config).double()
            tol = scale * (2.0 ** -7 if dt is torch.bfloat16 else 2.0 ** -10 if
                           dt is torch.float16 else 2.0 ** -16) + 1e-6
            assert ((got - want).abs() <= tol).all(), (heads, slots, config)


def test_a_swapped_llamas_attention_joined_by_its_output_projection_prepares_proven(
        monkeypatch):
    import torch

    import nimble.decode_attention as da
    from helpers import swapped_llama_small

    monkeypatch.setattr(da, "WHOLE_SLOTS", 0)  # the cache split over programs, not one tile
    from nimble.gemv_prologue_pass import fusing
    from nimble.generate import Generator, prepare_with_nimble

    model, swap = swapped_llama_small()
    torch.manual_seed(6)
    ids = torch.randint(0, model.config.vocab_size, (1, 128), device="cuda")
    tokens = {}
    try:
        for joined in (False, True):
            torch._dynamo.reset()
            with fusing(join_attention=joined) as the_pass:
                # 128 + 24 slots: three blocks, split over programs
                generator = Generator(model, max_cache_len=128 + NEW_TOKENS,
                                      prompt_buckets=[128], batch_sizes=[1],
                                      prepare_step=prepare_with_nimble(None, True))
            try:
                decode, _ = generator.steps(1)
                assert not decode.graph.meta["verified"]["not_bitwise"]
                names = [t.short_name or t.name for t in decode.graph.tasks]
                joins = sum(n.startswith("join") for n in names)
                assert joins == (0 if joined else model.config.num_hidden_layers), names
                tokens[joined] = generator.generate(ids, NEW_TOKENS)
            finally:
                generator.close()
            if joined:
                assert max(r.joined for r in the_pass.runs) == model.config.num_hidden_layers
    finally:
        swap.undo()
    # the joined GEMV joins in the join kernel's order: the attention's bits are the same
    assert torch.equal(tokens[True][:, :136], tokens[False][:, :136])
