"""fast_gemv: which GEMMs it reaches, what it keeps per shape, and what a swapped layer runs
(the timing and the GEMV stood in: the CPU has neither)."""
from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nimble.fast_gemv as fg
from nimble.errors import InputError
from nimble.fused_projections import fuse_projections

FAST, SLOW = fg.GemvConfig(4, 1024, 8, 1), fg.GemvConfig(8, 512, 4, 3)


class Block(nn.Module):
    def __init__(self, width=16, hidden=48):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width, bias=False)
                                                 for _ in range(3))
        self.down = nn.Linear(hidden, width)
        self.up = nn.Linear(width, hidden)

    def forward(self, x):
        h = self.q_proj(x) + self.k_proj(x) + self.v_proj(x)
        return self.down(F.relu(self.up(h)))


def timer(table):
    """A stand-in for the GPU's timing: µs per config by (out, in) shape (None: torch's)."""
    seen = []

    def time(config, weights, x):
        seen.append((tuple(weights[0].shape), config, len(weights)))
        return table[tuple(weights[0].shape)][config]
    time.seen = seen
    return time


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it is on the GPU: the swapped layers' test inputs."""

    @property
    def is_cuda(self):
        return True


def gpu_like(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(_OnGpu)


@pytest.fixture
def stand_in_gemv(monkeypatch):
    """The GEMV operator replaced by F.linear's values on the CPU, each call noted."""
    calls = []

    def op(x, weight, block_n, block_k, warps, stages):
        calls.append((tuple(weight.shape), fg.GemvConfig(block_n, block_k, warps, stages)))
        return F.linear(x.as_subclass(torch.Tensor), weight)
    monkeypatch.setattr(fg, "gemv_op", op)
    return calls


def test_choose_keeps_the_fastest_gemv_where_it_beats_torch_by_the_margin():
    w = [torch.zeros(8, 16)]
    fast = fg.choose(w, timer({(8, 16): {None: 10.0, FAST: 6.0, SLOW: 8.0}}), (FAST, SLOW))
    assert fast.config == FAST and (fast.torch_us, fast.gemv_us) == (10.0, 6.0)
    near = fg.choose(w, timer({(8, 16): {None: 10.0, FAST: 9.8, SLOW: 9.9}}), (FAST, SLOW))
    assert near.config is None and near.gemv_us == 9.8  # within 3%: torch's stays
    assert "-> torch" in near.describe() and "-> GEMV" in fast.describe()


def test_fast_gemv_measures_each_shape_once_over_all_its_layers_and_swaps_the_winners(
        stand_in_gemv):
    model = Block()
    table = {(16, 16): {None: 5.0, FAST: 3.0, SLOW: 4.0},  # q, k, v: the GEMV wins
             (16, 48): {None: 5.0, FAST: 6.0, SLOW: 7.0},  # down: torch's stays
             (48, 16): {None: 5.0, FAST: 4.0, SLOW: 2.0}}
    time = timer(table)
    names = [n for n, _ in model.named_parameters()]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    choices = fg.fast_gemv(model, time=time, configs=(FAST, SLOW))
    assert {(c.out_features, c.in_features): c.config for c in choices} == {
        (16, 16): FAST, (16, 48): None, (48, 16): SLOW}
    assert sorted(len_ for shape, c, len_ in time.seen if c is None) == [1, 1, 3]
    assert type(model.q_proj) is fg.GemvLinear and model.q_proj.gemv_config == FAST
    assert type(model.down) is nn.Linear  # no win: the layer is left as it was
    assert [n for n, _ in model.named_parameters()] == names
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # chosen again with a margin that lets a GEMV up to 25% slower win (where a fold pays
    # for it): down takes it, and a margin that asks for 50% gives every layer back to torch
    again = fg.fast_gemv(model, time=time, configs=(FAST, SLOW), margin=-0.25)
    assert {(c.out_features, c.in_features): c.config for c in again}[(16, 48)] == FAST
    assert type(model.down) is fg.GemvLinear and model.down.gemv_config == FAST
    fg.fast_gemv(model, time=time, configs=(FAST, SLOW), margin=0.5)
    assert model.down.gemv_config is None and model.q_proj.gemv_config is None


def test_a_single_row_runs_the_gemv_and_more_rows_or_grad_run_f_linear(stand_in_gemv):
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    want = layer(torch.ones(1, 1, 16))
    layer.__class__ = fg.GemvLinear
    layer.gemv_config = FAST
    with torch.no_grad():
        one = layer(gpu_like(torch.ones(1, 1, 16)))
        layer(gpu_like(torch.ones(3, 16)))  # a prefill or a batch: torch's GEMM
        layer(torch.ones(1, 16))  # a model moved to the CPU afterwards: torch's GEMM
    assert one.shape == (1, 1, 8) and torch.allclose(one.as_subclass(torch.Tensor), want)
    assert stand_in_gemv == [((8, 16), FAST)]
    layer(gpu_like(torch.ones(1, 16)))  # grad enabled and the weight trainable: torch's GEMM
    assert len(stand_in_gemv) == 1


def test_a_fused_group_gets_its_shapes_choice(stand_in_gemv):
    model = Block()
    assert fuse_projections(model, [("q_proj", "k_proj", "v_proj")]) == 1
    table = {(48, 16): {None: 5.0, FAST: 3.0}, (16, 48): {None: 5.0, FAST: 9.0}}
    fg.fast_gemv(model, time=timer(table), configs=(FAST,))
    group = model.q_proj._group
    assert group.gemv_config == FAST and model.up.gemv_config == FAST
    with torch.no_grad():
        model(gpu_like(torch.ones(1, 16)))
    assert ((48, 16), FAST) in stand_in_gemv  # the fused q/k/v GEMM and the up projection


def test_fast_gemv_wants_a_module_on_the_gpu():
    with pytest.raises(InputError, match="nn.Module"):
        fg.fast_gemv("model")
    with pytest.raises(InputError, match="CUDA device"):
        fg.fast_gemv(Block())


def test_the_bench_lever_is_off_unless_asked():
    from nimble.cli.generate_levers import add_lever_arguments, gemv_if_asked

    p = argparse.ArgumentParser()
    add_lever_arguments(p)
    assert p.parse_args(["--fast-gemv"]).fast_gemv and not p.parse_args([]).fast_gemv
    info: dict = {}
    gemv_if_asked(Block(), p.parse_args([]), info)
    assert "fast_gemv" not in info


def test_the_bench_keeps_a_gemv_within_the_prologue_margin_only_where_it_folds(monkeypatch):
    from nimble.cli.generate_levers import add_lever_arguments, gemv_if_asked

    margins = []
    monkeypatch.setattr(fg, "fast_gemv",
                        lambda model, margin, rows: margins.append(margin) or [])
    p = argparse.ArgumentParser()
    add_lever_arguments(p)
    gemv_if_asked(Block(), p.parse_args(["--fast-gemv"]), {})
    gemv_if_asked(Block(), p.parse_args(["--fast-gemv", "--gemv-prologues"]), {})
    assert margins == [fg.MARGIN, fg.PROLOGUE_MARGIN] and fg.PROLOGUE_MARGIN < 0 < fg.MARGIN


def test_the_bench_folds_the_rotary_embedding_only_beside_the_attention_kernel(monkeypatch):
    from nimble.cli.generate_levers import (add_lever_arguments, check_lever_arguments,
                                            gemv_if_asked, inductor_settings)

    p = argparse.ArgumentParser()
    add_lever_arguments(p)
    with pytest.raises(InputError, match="add --decode-attention"):
        check_lever_arguments(p.parse_args(["--rope-attention"]))
    with pytest.raises(InputError, match="add --fast-gemv"):
        check_lever_arguments(p.parse_args(["--gemv-prologues"]))
    args = p.parse_args(["--fast-gemv", "--decode-attention", "--rope-attention"])
    check_lever_arguments(args)
    assert inductor_settings(args)["post_grad_custom_post_pass"].rope_attention
    assert not inductor_settings(p.parse_args(["--gemv-prologues"]))[
        "post_grad_custom_post_pass"].rope_attention
    assert "post_grad_custom_post_pass" not in inductor_settings(p.parse_args([]))
    margins = []
    monkeypatch.setattr(fg, "fast_gemv",
                        lambda model, margin, rows: margins.append(margin) or [])
    gemv_if_asked(Block(), args, {})  # the rotary fold runs the prologue folds too
    assert margins == [fg.PROLOGUE_MARGIN]


def test_all_levers_are_the_fast_generators():
    from nimble import fast_decoding
    from nimble.cli.generate_levers import (ALL_LEVERS, add_lever_arguments,
                                            check_lever_arguments, inductor_settings)

    p = argparse.ArgumentParser()
    add_lever_arguments(p)
    args = p.parse_args(["--all-levers"])
    check_lever_arguments(args)
    assert all(getattr(args, flag) is True for flag in ALL_LEVERS)
    settings = inductor_settings(args)
    assert {k: settings[k] for k in fast_decoding.INDUCTOR_SETTINGS} == \
        fast_decoding.INDUCTOR_SETTINGS
    assert settings["post_grad_custom_post_pass"].rope_attention
    assert settings["post_grad_custom_post_pass"].tune_launches  # as fast_generator tunes them
    tuned_alone = p.parse_args(["--fast-gemv", "--tune-prologues"])
    with pytest.raises(InputError, match="add --gemv-prologues"):
        check_lever_arguments(tuned_alone)


def test_a_gemv_slower_than_torch_within_a_negative_margin_is_kept(stand_in_gemv):
    model = nn.Sequential(nn.Linear(16, 8))
    table = {(8, 16): {None: 5.0, FAST: 5.4}}  # the GEMV 8% slower than torch's GEMM
    fg.fast_gemv(model, time=timer(table), configs=(FAST,))
    assert type(model[0]) is nn.Linear
    [choice] = fg.fast_gemv(model, time=timer(table), configs=(FAST,),
                            margin=fg.PROLOGUE_MARGIN)
    assert choice.config == FAST and type(model[0]) is fg.GemvLinear


def test_a_weight_whose_rows_are_not_contiguous_is_left_to_torch(stand_in_gemv):
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 16))
    with torch.no_grad():
        model[0].weight = nn.Parameter(torch.randn(16, 8).t())  # a transposed view
    table = {(16, 8): {None: 5.0, FAST: 1.0}}
    choices = fg.fast_gemv(model, time=timer(table), configs=(FAST,))
    assert [(c.out_features, c.in_features) for c in choices] == [(16, 8)]
    assert type(model[0]) is nn.Linear and type(model[1]) is fg.GemvLinear


def test_the_gemv_kernel_gives_the_same_bits_with_one_weight_tile_or_two_asked_early():
    """Under Triton's interpreter: the GEMV's sum against float64, and ``EARLY_TILES`` 2 (a
    second weight tile asked for before the wait) the same bits as 1, within one step of the
    input, over two, ragged and over many."""
    from pathlib import Path

    from helpers import interpreted_cases

    cases = interpreted_cases(Path(__file__).parent / "workers" / "gemv_interpreted.py")
    assert len(cases) == 8, sorted(cases)
    for name, case in cases.items():
        assert case["same_bits"], name
        assert case["error"] < (1e-6 if "float32" in name else 2e-3), (name, case["error"])


class Gpt2Mlp(nn.Module):
    """GPT-2's MLP shape: two of transformers' Conv1D (weights stored ``in x out``)."""

    def __init__(self, width=16, hidden=48):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.c_fc, self.c_proj = Conv1D(hidden, width), Conv1D(width, hidden)
        with torch.no_grad():
            for m in (self.c_fc, self.c_proj):
                m.bias.normal_()

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


def test_a_conv1d_is_timed_as_out_by_in_and_a_chosen_one_keeps_its_weight_re_laid(
        stand_in_gemv):
    torch.manual_seed(0)
    model = Gpt2Mlp()
    x, batch = torch.randn(1, 1, 16), torch.randn(5, 3, 16)
    with torch.no_grad():
        want_one, want_rows = model(x), model(batch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weight = model.c_fc.weight
    time = timer({(48, 16): {None: 5.0, FAST: 3.0}, (16, 48): {None: 5.0, FAST: 6.0}})
    choices = fg.fast_gemv(model, time=time, configs=(FAST,))
    assert {(c.out_features, c.in_features): c.config for c in choices} == {
        (48, 16): FAST, (16, 48): None}
    # the GEMV's shape, out x in: the transpose of the weight torch's GEMM was timed on
    assert sorted(shape for shape, _, _ in time.seen) == [(16, 48), (16, 48), (48, 16),
                                                         (48, 16)]
    fc = model.c_fc
    assert type(fc).__name__ == "GemvConv1D" and fc.gemv_config == FAST
    assert type(model.c_proj).__name__ == "Conv1D"  # torch's kept: its layout too
    assert model.c_proj.weight.is_contiguous()
    # the same Parameter, shape, values and state_dict; stored column by column
    assert fc.weight is weight and fc.weight.shape == (16, 48) and fc.weight.stride() == (1, 16)
    assert fc.weight.t().is_contiguous()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():
        one = model(gpu_like(x))
        rows = model(batch)
    assert stand_in_gemv == [((48, 16), FAST)]
    assert one.shape == (1, 1, 16) and torch.allclose(one.as_subclass(torch.Tensor), want_one,
                                                      atol=1e-5)
    assert torch.equal(rows, want_rows)  # more rows: Conv1D's own addmm


def test_a_re_laid_conv1d_loads_a_state_dict_in_its_layout_and_pickles(stand_in_gemv, tmp_path):
    model = Gpt2Mlp()
    fg.fast_gemv(model, time=timer({(48, 16): {None: 5.0, FAST: 3.0},
                                    (16, 48): {None: 5.0, FAST: 3.0}}), configs=(FAST,))
    fresh = Gpt2Mlp()
    model.load_state_dict(fresh.state_dict())  # e.g. a checkpoint: copied into the layout
    assert torch.equal(model.c_fc.weight, fresh.c_fc.weight)
    assert model.c_fc.weight.t().is_contiguous()
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    assert type(loaded.c_fc) is type(model.c_fc) and loaded.c_fc.gemv_config == FAST
    with torch.no_grad():
        assert torch.equal(loaded(torch.ones(2, 16)), model(torch.ones(2, 16)))
    # chosen again, torch's GEMM wins: the class stays, the GEMV is off
    fg.fast_gemv(model, time=timer({(48, 16): {None: 1.0, FAST: 3.0},
                                    (16, 48): {None: 1.0, FAST: 3.0}}), configs=(FAST,))
    assert model.c_fc.gemv_config is None
    with torch.no_grad():
        model(gpu_like(torch.ones(1, 16)))
    assert stand_in_gemv == []


def test_a_gpt2_decoder_reaches_its_projections(stand_in_gemv):
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()
    time = timer({(96, 32): {None: 5.0, FAST: 3.0}, (32, 32): {None: 5.0, FAST: 3.0},
                  (128, 32): {None: 5.0, FAST: 3.0}, (32, 128): {None: 5.0, FAST: 3.0},
                  (64, 32): {None: 5.0, FAST: 3.0}})
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        want = model(ids).logits
    choices = fg.fast_gemv(model, time=time, configs=(FAST,))
    # c_attn, the attention's c_proj, c_fc, the MLP's c_proj (2 layers each), the tied LM head
    assert sorted((c.out_features, c.in_features, c.layers) for c in choices) == [
        (32, 32, 2), (32, 128, 2), (64, 32, 1), (96, 32, 2), (128, 32, 2)]
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, want, atol=1e-5)  # a prefill: torch's GEMMs
    assert torch.equal(model.lm_head.weight, model.transformer.wte.weight)
