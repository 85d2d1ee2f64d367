"""nimble.fast_decoding: the decode levers in their order, refusals before any change (no GPU:
stand-ins for the GPU's measurement and the Generator)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from nimble import fast_decoding
from nimble import fast_gemv as gemv_module
from nimble import generate
from nimble.errors import InputError
from nimble.fused_projections import FusedSibling
from nimble.gemv_prologue_pass import Fused

transformers = pytest.importorskip("transformers")


def tiny_llama(attn: str = "sdpa"):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100,
                                      attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_what_the_generator_would_refuse_is_refused_before_the_model_changes():
    model = tiny_llama()
    layer = model.model.layers[0]
    with pytest.raises(InputError, match="CUDA device"):
        fast_decoding.fast_generator(model, 64, [8])
    with pytest.raises(InputError, match="prompt bucket"):
        fast_decoding.fast_generator(model, 8, [8])
    with pytest.raises(InputError, match="nn.Module"):
        fast_decoding.fast_generator("gpt2", 64, [8])
    with pytest.raises(InputError, match="training mode"):
        fast_decoding.fast_generator(model.train(), 64, [8])
    assert type(layer.self_attn.q_proj) is nn.Linear
    assert model.config._attn_implementation == "sdpa"


class StandIns:
    """fast_gemv and the Generator replaced: what each saw when it was called."""

    def __init__(self, monkeypatch, fail: bool = False):
        self.calls: list = []
        self.seen: dict = {}
        monkeypatch.setattr(fast_decoding, "_check", lambda *a: self.calls.append("check"))
        monkeypatch.setattr(gemv_module, "fast_gemv", self.fast_gemv)
        monkeypatch.setattr(generate, "Generator", self.generator(fail))

    def fast_gemv(self, model, margin, rows):
        fused = isinstance(model.model.layers[0].self_attn.q_proj, FusedSibling)
        self.calls.append(("fast_gemv", margin, fused, rows))
        return [gemv_module.ShapeChoice(192, 64, "float32", 2, 5.0, 5.3,
                                        gemv_module.CONFIGS[0])]

    def generator(self, fail: bool):
        test = self

        class Generator:
            def __init__(self, model, max_cache_len, prompt_buckets, batch_sizes, *,
                         pad_id, prepare_step):
                import torch._inductor.config as inductor_config

                the_pass = inductor_config.post_grad_custom_post_pass
                test.calls.append("generator")
                test.seen = {"attention": model.config._attn_implementation,
                             "coordinate": inductor_config.coordinate_descent_tuning,
                             "combo": inductor_config.combo_kernels,
                             "rope": the_pass.rope_attention, "joins": the_pass.join_attention,
                             "tuned": the_pass.tune_launches,
                             "limits": (max_cache_len, prompt_buckets, batch_sizes, pad_id)}
                if fail:
                    raise InputError("the model cannot be captured")
                the_pass.runs.append(Fused(add_rmsnorm=4, gated=2, gemvs=9, roped=2))
                the_pass.runs.append(Fused(gemvs=0))  # a graph with nothing to fold
        return Generator


def test_the_levers_come_in_their_order_under_the_measured_settings(monkeypatch):
    import torch._inductor.config as inductor_config

    stand_ins = StandIns(monkeypatch)
    model = tiny_llama()
    before = inductor_config.post_grad_custom_post_pass
    generator = fast_decoding.fast_generator(model, 64, [8, 16], [1, 8], pad_id=3)
    # the GEMV measured for batch 1, the GEMM of rows for batch 8
    assert stand_ins.calls == ["check", ("fast_gemv", gemv_module.PROLOGUE_MARGIN, True, (1, 8)),
                               "generator"]
    assert stand_ins.seen == {"attention": "nimble_decode", "coordinate": True, "combo": True,
                              "rope": True, "joins": False, "tuned": True,
                              "limits": (64, [8, 16], [1, 8], 3)}
    levers = generator.levers
    assert levers.fused_projections == 4 and len(levers.gemvs) == 1
    assert levers.attention is not None and len(levers.folds) == 1
    assert "4 projection group(s) fused; GEMV for 1 of 1" in levers.describe()
    assert "6 kernel(s) folded into GEMVs and 2 rotary" in levers.describe()
    assert "over 2 compiled graph(s)" in levers.describe()  # the one that folded nothing too
    cached = dataclasses.replace(levers, folds=(), compilations=0)
    assert "from Inductor's cache" in cached.describe()
    # the settings were the prepare's only
    assert inductor_config.post_grad_custom_post_pass is before
    assert model.config._attn_implementation == "nimble_decode"
    levers.attention.undo()
    assert model.config._attn_implementation == "sdpa"


def test_a_failed_prepare_points_the_attention_back(monkeypatch):
    stand_ins = StandIns(monkeypatch, fail=True)
    model = tiny_llama()
    with pytest.raises(InputError, match="cannot be captured"):
        fast_decoding.fast_generator(model, 64, [8])
    assert stand_ins.seen["attention"] == "nimble_decode"
    assert model.config._attn_implementation == "sdpa"


def test_an_attention_not_on_sdpa_is_kept_and_its_rotary_embedding_not_folded(monkeypatch):
    stand_ins = StandIns(monkeypatch)
    model = tiny_llama("eager")
    generator = fast_decoding.fast_generator(model, 64, [8])
    assert stand_ins.seen["attention"] == "eager" and stand_ins.seen["rope"] is False
    assert generator.levers.attention is None
    assert "attention not swapped" in generator.levers.describe()
