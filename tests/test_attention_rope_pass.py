"""The rotary embedding and the cache read folded into the decode attention
(nimble.attention_rope_pass) on graphs Inductor compiles on the CPU: a tiny Llama's decode step
with a static cache (every layer folded, the logits and the written caches as without the fold,
the writes after the attention), its join folded too, and what the pass leaves."""
from __future__ import annotations

import pytest
import torch

import nimble.decode_attention as da
import nimble.fast_gemv as fast_gemv_module
import nimble.fused_projections as fused_module
from nimble import gemv_prologue_pass as prologue_pass
from helpers import tiny_decoder
from test_gemv_prologues import _gemv_on_every_device

transformers = pytest.importorskip("transformers", reason="the pass is for transformers' models")

SLOTS = 192  # three blocks of slots: the kernel splits the cache at batch 1
PROMPT = 5


def _on_every_device(query, key, value, mask, dropout, kwargs):
    """The swap's rule without its GPU check: the CPU's compiled graph holds the operator."""
    return None if query.dim() == 4 and query.shape[2] == 1 else "a prefill"


WRITES = (torch.ops.aten.index_put.default, torch.ops.aten.index_copy.default)


class Inspect(prologue_pass._make_pass()):
    """A pass after the fold that notes, as it is handed the graph (Inductor's later passes
    change it), the targets in order and, per folded attention, where it and the writes of
    its caches stand."""

    def __init__(self):
        super().__init__()
        self.targets: list = []
        self.folded: list = []  # (attention's place, its caches' ops, their writes' places)

    def __call__(self, graph):
        nodes = list(graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        self.targets.append([n.target for n in nodes])
        for n in nodes:
            if n.target == torch.ops.nimble.decode_attention_rope.default:
                caches = n.args[1:3]
                self.folded.append((order[n], [c.op for c in caches],
                                    [order[u] for c in caches for u in c.users
                                     if u.target in WRITES]))

    def uuid(self):
        return "inspect"


def _llama(monkeypatch, dtype, gemv: bool = False):
    monkeypatch.setattr(da, "unsupported", _on_every_device)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=500,
                                      max_position_embeddings=SLOTS)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    if gemv:
        from nimble.fast_gemv import fast_gemv
        from nimble.fused_projections import fuse_projections

        monkeypatch.setattr(fast_gemv_module, "gemv_linear", _gemv_on_every_device)
        monkeypatch.setattr(fused_module, "gemv_linear", _gemv_on_every_device)
        fuse_projections(model)
        fast_gemv(model, time=lambda c, weights, x: 1.0 if c is None else 0.5)
    da.decode_attention(model)
    return model, _prefilled(model)


def _prefilled(model):
    """A static cache of SLOTS slots holding ``model``'s prefill of a PROMPT-token prompt."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=SLOTS)
    with torch.no_grad():
        model(torch.arange(1, PROMPT + 1)[None], past_key_values=cache,
              cache_position=torch.arange(PROMPT), use_cache=True)
    return cache


def _caches(cache) -> list:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def _state(cache) -> list:
    """Every tensor the cache's layers hold (the slots, and the count of tokens seen where
    transformers keeps one), to put back after a step."""
    return [t for layer in cache.layers for t in vars(layer).values()
            if isinstance(t, torch.Tensor)]


def _step(model, cache, rope: bool, join: bool = False, then=None):
    """One decode step compiled by Inductor (fresh: the pass runs on a compilation only) from
    the cache as the prefill left it; the logits and the caches after it."""
    import torch._inductor.config as inductor_config

    state = _state(cache)
    before = [t.clone() for t in state]
    numbers = [(layer, dict((k, v) for k, v in vars(layer).items() if isinstance(v, int)))
               for layer in cache.layers]  # a sliding layer counts its tokens in an int too

    def step(token, position):
        return model(token, past_key_values=cache, cache_position=position,
                     use_cache=True).logits

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    the_pass = prologue_pass.make_pass(then, join_attention=join, rope_attention=rope)
    with inductor_config.patch(fx_graph_cache=False, post_grad_custom_post_pass=the_pass), \
            torch.no_grad():
        logits = compiled(torch.tensor([[7]]), torch.tensor([PROMPT]))
    after = [t.clone() for t in _caches(cache)]
    for t, b in zip(state, before):
        t.copy_(b)
    for layer, kept in numbers:
        vars(layer).update(kept)
    return logits, after, the_pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiny_llamas_attentions_take_their_rotary_embedding_and_cache_read(monkeypatch,
                                                                           dtype):
    model, cache = _llama(monkeypatch, dtype)
    plain, plain_caches, unfolded = _step(model, cache, rope=False)
    inspect = Inspect()
    folded, folded_caches, the_pass = _step(model, cache, rope=True, then=inspect)
    assert [r.roped for r in unfolded.runs] == [0]
    assert [r.roped for r in the_pass.runs] == [2]  # both layers
    # the caches are written as without the fold: the writes stay; the first layer's bit for
    # bit (Inductor's own kernel writes them from the same inputs), a later one's from a
    # hidden state that went through the folded attention (its rotation of the query in
    # another kernel: the last bits of a bfloat16 may differ)
    assert torch.equal(plain_caches[0], folded_caches[0])
    assert torch.equal(plain_caches[1], folded_caches[1])
    limit = 1e-5 if dtype == torch.float32 else 2 ** -5
    for a, b in zip(plain_caches[2:], folded_caches[2:]):
        assert (a.float() - b.float()).abs().max() <= limit * a.float().abs().max()
    assert not torch.equal(plain_caches[0], _caches(cache)[0])  # the step did write them
    assert (plain.float() - folded.float()).abs().max() <= limit * plain.float().abs().max()
    # in the graph the pass handed on: each folded attention before the writes of its caches
    # (graph inputs), and no plain attention left
    assert len(inspect.folded) == 2
    assert torch.ops.nimble.decode_attention.default not in inspect.targets[-1]
    for place, ops, writes in inspect.folded:
        assert ops == ["placeholder", "placeholder"]
        assert len(writes) == 2 and all(w > place for w in writes)
    # the writes together after the last attention, where Inductor may launch them as one
    last = max(place for place, _, _ in inspect.folded)
    assert all(w > last for _, _, writes in inspect.folded for w in writes)


def test_the_writes_can_stay_right_after_their_attention(monkeypatch):
    import nimble.attention_rope_pass as rope_pass

    monkeypatch.setattr(rope_pass, "WRITES_LAST", False)
    model, cache = _llama(monkeypatch, torch.float32)
    inspect = Inspect()
    _step(model, cache, rope=True, then=inspect)
    (first, _, first_writes), (second, _, _) = sorted(inspect.folded)
    assert sorted(first_writes) == [first + 1, first + 2]  # right after it, before the next
    assert all(w < second for w in first_writes)


def test_a_folded_attention_read_by_a_gemv_alone_gives_its_parts_to_the_joining_gemv(
        monkeypatch):
    monkeypatch.setattr(da, "WHOLE_SLOTS", 0)  # the cache split, its parts joined
    model, cache = _llama(monkeypatch, torch.float32, gemv=True)
    plain, _, _ = _step(model, cache, rope=False)
    inspect = Inspect()
    folded, _, the_pass = _step(model, cache, rope=True, join=True, then=inspect)
    [done] = [r for r in the_pass.runs if r.gemvs]
    assert (done.roped, done.joined) == (2, 2)
    targets = inspect.targets[-1]
    assert targets.count(torch.ops.nimble.decode_attention_rope_parts.default) == 2
    assert torch.ops.nimble.decode_attention_rope.default not in targets
    assert (plain - folded).abs().max() <= 1e-5 * plain.abs().max()


def _attention_step(rotation, cache_is_input: bool = True):
    """A single layer's decode attention over a cache of SLOTS slots, the query and key rotated
    by ``rotation(x, cos, sin)``."""
    heads, kv_heads, dim = 4, 2, 32
    torch.manual_seed(3)
    k_cache, v_cache = (torch.randn(1, kv_heads, SLOTS, dim) for _ in range(2))

    def step(q, k, v, cos, sin, position, k_cache, v_cache):
        if not cache_is_input:
            k_cache, v_cache = k_cache * 1.0, v_cache * 1.0
        k_cache = k_cache.index_copy(2, position, rotation(k, cos, sin))
        v_cache = v_cache.index_copy(2, position, v)
        keep = (torch.arange(SLOTS) <= position).view(1, 1, 1, SLOTS)
        return torch.ops.nimble.decode_attention(rotation(q, cos, sin), k_cache, v_cache, keep,
                                                 dim ** -0.5), k_cache

    angle = torch.randn(1, 1, 1, dim // 2).repeat(1, 1, 1, 2)
    args = (torch.randn(1, heads, 1, dim), torch.randn(1, kv_heads, 1, dim),
            torch.randn(1, kv_heads, 1, dim), angle.cos(), angle.sin(), torch.tensor([40]),
            k_cache, v_cache)
    return step, args


def _compile_folding(step, args):
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    with inductor_config.patch(fx_graph_cache=False), \
            prologue_pass.fusing(rope_attention=True) as the_pass:
        return compiled(*args), the_pass


def _rotate_half_form(x, cos, sin):
    from nimble.attention_rope import rotate_half

    return x * cos + rotate_half(x) * sin


def _interleaved_form(x, cos, sin):
    """GPT-J's rotary embedding: pairs of neighbours rotated, not the halves."""
    pairs = torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
    return x * cos + pairs * sin


def test_the_rotate_half_form_over_a_cache_input_folds_and_gives_the_same_attention():
    step, args = _attention_step(_rotate_half_form)
    with torch.no_grad():
        want = step(*args)
        got, the_pass = _compile_folding(step, args)
    assert the_pass.runs[-1].roped == 1
    assert (got[0] - want[0]).abs().max() <= 1e-5 * want[0].abs().max()
    assert torch.equal(got[1], want[1])  # the cache written as before


@pytest.mark.parametrize("case", ["interleaved", "cache made in the graph"])
def test_what_is_no_rotate_half_over_a_cache_input_stays_as_it_was(case):
    if case == "interleaved":
        step, args = _attention_step(_interleaved_form)
    else:
        step, args = _attention_step(_rotate_half_form, cache_is_input=False)
    with torch.no_grad():
        want = step(*args)
        got, the_pass = _compile_folding(step, args)
    assert the_pass.runs[-1].roped == 0
    assert (got[0] - want[0]).abs().max() <= 1e-5 * want[0].abs().max()


@pytest.mark.parametrize("family", ["Qwen2", "Mistral", "Qwen3", "Gemma", "Phi3", "Granite"])
def test_other_decoders_steps_fold_every_layer_and_compute_the_same(monkeypatch, family):
    """The pass on other families' decode steps (tiny, float32, a static cache): each layer's
    attention folded, the logits and the first layer's caches as without the fold."""
    monkeypatch.setattr(da, "unsupported", _on_every_device)
    model = tiny_decoder(family, max_position_embeddings=SLOTS, attn_implementation="sdpa")
    da.decode_attention(model)
    cache = _prefilled(model)
    plain, plain_caches, _ = _step(model, cache, rope=False)
    folded, folded_caches, the_pass = _step(model, cache, rope=True)
    assert [r.roped for r in the_pass.runs] == [2]
    assert (plain - folded).abs().max() <= 1e-5 * plain.abs().max()
    for a, b in zip(plain_caches[:2], folded_caches[:2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["Qwen2", "Qwen3", "Mistral"])
def test_every_fold_at_once_on_other_decoders_steps(monkeypatch, family):
    """The swap, the fused projections on the GEMV, and every fold of the passes at once
    (norms, gates, the rotary embedding, the join) on a biased (Qwen2), a query-key-normed
    (Qwen3) and a sliding-window (Mistral) decoder's step: the logits as without the passes."""
    from nimble.fast_gemv import fast_gemv
    from nimble.fused_projections import fuse_projections

    monkeypatch.setattr(da, "unsupported", _on_every_device)
    monkeypatch.setattr(da, "WHOLE_SLOTS", 0)  # the caches split, their parts joined
    monkeypatch.setattr(fast_gemv_module, "gemv_linear", _gemv_on_every_device)
    monkeypatch.setattr(fused_module, "gemv_linear", _gemv_on_every_device)
    model = tiny_decoder(family, max_position_embeddings=SLOTS, attn_implementation="sdpa")
    fuse_projections(model)
    fast_gemv(model, time=lambda c, weights, x: 1.0 if c is None else 0.5)
    da.decode_attention(model)
    cache = _prefilled(model)
    plain, plain_caches, _ = _step(model, cache, rope=False)
    folded, folded_caches, the_pass = _step(model, cache, rope=True, join=True)
    [done] = [r for r in the_pass.runs if r.gemvs]
    assert (done.roped, done.joined, done.gated) == (2, 2, 2)
    assert done.rmsnorm + done.add_rmsnorm == 5  # each layer's two norms and the final one
    assert (plain - folded).abs().max() <= 1e-5 * plain.abs().max()
    assert torch.equal(plain_caches[0], folded_caches[0])
