"""gemv_prologue_tuning on the CPU: what it times and keeps (a stand-in timer), and the pass
putting the chosen launch into a tiny Llama's folded GEMVs."""
from __future__ import annotations

import pytest
import torch

import nimble.fast_gemv as fast_gemv_module
import nimble.fused_projections as fused_module
import nimble.gemv_prologue_tuning as tuning
import nimble.gemv_prologues as gp
from nimble.fast_gemv import GemvConfig
from test_gemv_prologues import _gemv_on_every_device, _one_token_logits_folded

SHAPE = tuning.PrologueShape(gp.ADD_RMSNORM, 4096, 2048, torch.bfloat16, torch.device("cuda"))
CARRIED = GemvConfig(8, 512, 4, 1)


@pytest.fixture(autouse=True)
def no_choices():
    tuning.forget()
    yield
    tuning.forget()


def test_the_fastest_launch_is_kept_and_each_shape_is_timed_once_a_process(monkeypatch):
    timed = []

    def time(shape, launch):
        timed.append(launch)
        # wide tiles fastest, then more programs
        return 10.0 - launch.config.block_k / 1024 - launch.per_sm / 100

    choice = tuning.choose(SHAPE, CARRIED, time)
    assert timed[0] == tuning.PrologueLaunch(CARRIED, gp.PROGRAMS_PER_SM, gp.TILES_AHEAD)
    assert len(timed) == len(set(timed)) == choice.timed  # no launch timed twice
    assert choice.launch.config.block_k == 2048 and choice.us == min(map(
        lambda l: 10.0 - l.config.block_k / 1024 - l.per_sm / 100, timed))
    assert choice.carried == timed[0] and choice.carried_us == pytest.approx(
        10.0 - 512 / 1024 - gp.PROGRAMS_PER_SM / 100)
    again = tuning.choose(SHAPE, CARRIED, time)
    assert again is choice and len(timed) == choice.timed
    assert tuning.chosen() == [choice]
    assert "4096x2048 bfloat16 add_rmsnorm" in choice.describe()
    # another carried configuration, or another default of the module, is another choice
    tuning.choose(SHAPE, GemvConfig(4, 1024, 8, 1), time)
    assert len(tuning.chosen()) == 2
    monkeypatch.setattr(gp, "TILES_AHEAD", 2)
    assert tuning.choose(SHAPE, CARRIED, time).carried.ahead == 2
    assert len(tuning.chosen()) == 3


def test_the_carried_launch_stays_where_nothing_is_faster():
    choice = tuning.choose(SHAPE, CARRIED, lambda shape, launch: 5.0)
    assert choice.launch == choice.carried and choice.us == choice.carried_us == 5.0


def test_a_weight_off_the_gpu_is_not_timed():
    assert "not a CUDA device" in tuning.tunable(torch.device("cpu"))


def _tiny_llama(transformers):
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=500)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _recording_launches(monkeypatch) -> list:
    """Every folded operator's call as ``(prologue, per_sm, ahead)``."""
    calls, run = [], gp._run

    def recording(prologue, a, b, norm_weight, eps, weight, config, per_sm=0, ahead=0):
        calls.append((prologue, tuple(config), per_sm, ahead))
        return run(prologue, a, b, norm_weight, eps, weight, config, per_sm, ahead)
    monkeypatch.setattr(gp, "_run", recording)
    return calls


def test_the_pass_launches_each_folded_gemv_as_chosen(monkeypatch):
    transformers = pytest.importorskip("transformers")
    import nimble.gemv_prologue_pass as prologue_pass

    monkeypatch.setattr(fast_gemv_module, "gemv_linear", _gemv_on_every_device)
    monkeypatch.setattr(fused_module, "gemv_linear", _gemv_on_every_device)
    monkeypatch.setattr(tuning, "tunable", lambda device: None)  # the CPU's graph is timed
    wide = GemvConfig(8, 2048, 16, 1)
    monkeypatch.setattr(tuning, "graph_timer", lambda shape, launch: (
        1.0 if (launch.config, launch.per_sm) == (wide, 2) else 2.0))
    calls = _recording_launches(monkeypatch)
    fusing = prologue_pass.fusing
    monkeypatch.setattr(prologue_pass, "fusing", lambda: fusing(tune_launches=True))
    plain, folded, the_pass = _one_token_logits_folded(_tiny_llama(transformers))
    assert "-tuned-" in the_pass.uuid()
    # the head's norm, the first layer's norm, the residual sums' norms, the gated products
    kinds = {c.shape.prologue for c in tuning.chosen()}
    assert kinds == {gp.RMSNORM, gp.ADD_RMSNORM, gp.SILU_GATED}
    assert all(c.launch == tuning.PrologueLaunch(wide, 2, 1) for c in tuning.chosen())
    assert calls and all((config, per_sm, ahead) == ((8, 2048, 16, 1), 2, 1)
                         for _, config, per_sm, ahead in calls)
    # the CPU's kernel is the reference, whatever the launch: the same logits as the untuned
    assert (plain.float() - folded.float()).abs().max() <= 2 ** -6 * plain.float().abs().max()


def test_without_tuning_the_folded_gemvs_carry_the_plain_configuration(monkeypatch):
    transformers = pytest.importorskip("transformers")

    monkeypatch.setattr(fast_gemv_module, "gemv_linear", _gemv_on_every_device)
    monkeypatch.setattr(fused_module, "gemv_linear", _gemv_on_every_device)
    calls = _recording_launches(monkeypatch)
    _, _, the_pass = _one_token_logits_folded(_tiny_llama(transformers))
    assert "-tuned" not in the_pass.uuid() and not tuning.chosen()
    assert calls and all((per_sm, ahead) == (0, 0) for *_, per_sm, ahead in calls)
