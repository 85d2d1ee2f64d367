"""``nimble.fused_projections.fuse_projections``: sibling projections that read one input as
one GEMM, on the CPU (the decode step's lever, issue 53)."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nimble.errors import InputError
from nimble.fused_projections import FusedSibling, fuse_projections
from helpers import tiny_decoder


class _GEMMs(TorchDispatchMode):
    """Counts the matrix products a forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Block(nn.Module):
    """An attention's projections and a gated MLP, as transformers names them."""

    def __init__(self, width: int = 32, bias: bool = False) -> None:
        super().__init__()
        self.q_proj = nn.Linear(width, width, bias=bias)
        self.k_proj = nn.Linear(width, width // 4, bias=bias)
        self.v_proj = nn.Linear(width, width // 4, bias=bias)
        self.gate_proj = nn.Linear(width, 2 * width, bias=bias)
        self.up_proj = nn.Linear(width, 2 * width, bias=bias)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        h = x + q * k.repeat(1, 1, 4) + v.repeat(1, 1, 4)
        return self.gate_proj(h) * self.up_proj(h)


def _pair(bias: bool = False):
    torch.manual_seed(0)
    plain = _Block(bias=bias).eval()
    fused = copy.deepcopy(plain)
    assert fuse_projections(fused) == 2
    return plain, fused


def _gemms(model, x) -> int:
    with torch.no_grad(), _GEMMs() as mode:
        model(x)
    return mode.count


@pytest.mark.parametrize("bias", [False, True])
def test_siblings_run_as_one_gemm_each_and_give_the_same_outputs(bias):
    plain, fused = _pair(bias)
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), plain(x))
    assert (_gemms(plain, x), _gemms(fused, x)) == (5, 2)
    assert sorted(fused.state_dict()) == sorted(plain.state_dict())
    assert all(isinstance(getattr(fused, n), FusedSibling) for n in ("q_proj", "gate_proj"))


def test_a_weight_updated_in_place_reaches_the_fused_gemm():
    plain, fused = _pair()
    new = {k: 0.1 * torch.randn_like(v) for k, v in plain.state_dict().items()}
    plain.load_state_dict(new)
    fused.load_state_dict(new)
    x = torch.randn(1, 4, 32)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), plain(x))


def test_siblings_called_with_other_inputs_compute_their_own():
    plain, fused = _pair()
    a, b = torch.randn(1, 2, 32), torch.randn(1, 2, 32)
    with torch.no_grad():
        got = (fused.q_proj(a), fused.k_proj(b), fused.k_proj(a), fused.v_proj(a),
               fused.q_proj(a))
        want = (plain.q_proj(a), plain.k_proj(b), plain.k_proj(a), plain.v_proj(a),
                plain.q_proj(a))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_where_a_gradient_is_wanted_each_sibling_computes_its_own():
    plain, fused = _pair()
    plain.train(), fused.train()
    x = torch.randn(2, 3, 32)
    plain(x).sum().backward()
    fused(x).sum().backward()
    for (name, p), (_, q) in zip(plain.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_a_model_cast_after_the_fusion_runs_unfused_and_says_so(caplog):
    plain, fused = _pair()
    with caplog.at_level(logging.WARNING, logger="nimble"):
        plain.double(), fused.double()
    assert "fuse_projections after" in caplog.text
    x = torch.randn(1, 2, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), plain(x))
    assert _gemms(fused, x) == 5


def test_a_copy_of_a_fused_model_runs_unfused_and_follows_its_own_weights():
    plain, fused = _pair()
    copied = copy.deepcopy(fused)
    new = {k: 0.1 * torch.randn_like(v) for k, v in plain.state_dict().items()}
    plain.load_state_dict(new)
    copied.load_state_dict(new)
    x = torch.randn(1, 2, 32)
    with torch.no_grad():
        torch.testing.assert_close(copied(x), plain(x))
    assert _gemms(copied, x) == 5 and fuse_projections(copied) == 2 and _gemms(copied, x) == 2
    with torch.no_grad():
        torch.testing.assert_close(copied(x), plain(x))


def test_torch_compile_traces_the_fused_model_whole_with_one_gemm_per_group():
    """The decode steps on Inductor's kernels compile the model: a graph break at each
    projection would cut the step into pieces."""
    plain, fused = _pair()
    linears = []

    def counting(gm, inputs):
        linears.append(sum(n.op == "call_function" and "linear" in str(n.target)
                           for n in gm.graph.nodes))
        return gm
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        got = torch.compile(fused, backend=counting, fullgraph=True)(x)
        torch.compile(plain, backend=counting, fullgraph=True)(x)
        torch.testing.assert_close(got, plain(x))
    assert linears == [2, 5]


def test_siblings_that_differ_are_left_alone_and_a_non_module_is_refused():
    block = _Block()
    block.k_proj = nn.Linear(16, 8)  # another input width: not siblings of one input
    assert fuse_projections(block) == 1  # the MLP's pair only
    assert type(block.q_proj) is nn.Linear
    with pytest.raises(InputError, match="nn.Module"):
        fuse_projections(lambda x: x)


def test_a_layer_or_weight_tied_to_another_place_is_left_alone():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = _Block(), _Block()
            self.b.q_proj = self.a.q_proj  # one layer in two places
            self.b.gate_proj.weight = self.a.up_proj.weight  # one weight in two places

    two = Two()
    assert fuse_projections(two) == 0
    assert two.b.q_proj is two.a.q_proj and two.b.gate_proj.weight is two.a.up_proj.weight


def test_a_llama_decodes_the_same_tokens_with_its_projections_fused():
    transformers = pytest.importorskip("transformers")
    from nimble.generate import library_greedy

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100)
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config).eval()
    fused = copy.deepcopy(plain)
    assert fuse_projections(fused) == 4  # each layer's attention and MLP
    ids = torch.randint(0, 100, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, plain(ids).logits)
    assert torch.equal(library_greedy(fused, ids, 6), library_greedy(plain, ids, 6))


def test_the_bench_fuses_the_model_every_row_runs_only_where_asked():
    from types import SimpleNamespace

    from nimble.cli.generate_levers import fuse_if_asked

    plain, _ = _pair()
    info: dict = {}
    fuse_if_asked(plain, SimpleNamespace(fuse_projections=False), info)
    assert type(plain.q_proj) is nn.Linear and "fused_projections" not in info
    fuse_if_asked(plain, SimpleNamespace(fuse_projections=True), info)
    assert info["fused_projections"] == 2 and isinstance(plain.q_proj, FusedSibling)


@pytest.mark.parametrize("family, groups", [("Qwen2", 4), ("Mistral", 4), ("Qwen3", 4),
                                            ("Gemma", 4), ("Phi3", 0), ("Granite", 4),
                                            ("Cohere", 4), ("Olmo2", 4)])
def test_other_decoders_fuse_their_siblings_and_give_the_same_outputs(family, groups):
    """Other families' attention and MLP projections (biases on Qwen2's, Phi-3's already one
    GEMM each, so nothing to fuse): the same logits and greedy tokens fused."""
    from nimble.generate import library_greedy

    plain = tiny_decoder(family, hidden=64, intermediate=128, vocab=100, head_dim=16)
    fused = copy.deepcopy(plain)
    assert fuse_projections(fused) == groups
    ids = torch.randint(1, 100, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, plain(ids).logits)
    assert torch.equal(library_greedy(fused, ids, 6), library_greedy(plain, ids, 6))
