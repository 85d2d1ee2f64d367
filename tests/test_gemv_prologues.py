"""gemv_prologues and its graph pass: the kernel's values (Triton's interpreter on the CPU, in
float32 and float16), and the pass on graphs Inductor compiles on the CPU: what it folds on a
tiny Llama, what it leaves, and the outputs it keeps."""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch import nn

import nimble.fast_gemv as fast_gemv_module
import nimble.fused_projections as fused_module
from nimble import gemv_prologue_pass as prologue_pass
from nimble.fast_gemv import GemvConfig
from helpers import interpreted_cases, tiny_decoder

WORKER = Path(__file__).parent / "workers" / "gemv_prologues_interpreted.py"
CONFIG = (4, 1024, 8, 1)


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """Every kernel case of the worker, by case (Triton's interpreter)."""
    return interpreted_cases(WORKER)


def test_the_kernel_computes_each_prologue_then_the_gemv(interpreted):
    assert len(interpreted) == 86
    for name, r in interpreted.items():
        if name.startswith("joined"):
            continue
        limit = 2e-3 if "float16" in name else 1e-5
        assert r["shape_ok"] and r["error"] < limit, (name, r)
        # the residual sum the layer reads on is the model's sum, bit for bit
        assert r["total_same"] in ((True,) if name.startswith("add_") else (None,)), (name, r)
        assert r["two_ahead_same"], (name, r)


def test_the_gemv_joins_the_attentions_split_as_the_join_kernel_does(interpreted):
    """Against the attention of the attend and join kernels and a GEMV of it; the references
    in torch's operations against the kernels' parts and join."""
    joined = {n: r for n, r in interpreted.items() if n.startswith("joined")}
    assert len(joined) == 6
    for name, r in joined.items():
        limit = 2e-3 if "float16" in name else 1e-5
        assert r["shape_ok"] and r["error"] < limit, (name, r)
        assert r["join_error"] < (1e-3 if "float16" in name else 1e-6), (name, r)
        assert r["parts_error"] < 1e-3 and r["stats_error"] < 1e-4, (name, r)


def test_the_reference_rounds_where_the_models_code_rounds():
    torch.manual_seed(0)
    k = 64
    a, b = torch.randn(k, dtype=torch.bfloat16), torch.randn(k, dtype=torch.bfloat16)
    nw, w = torch.randn(k, dtype=torch.bfloat16), torch.randn(8, k, dtype=torch.bfloat16)
    x = (a.float() + b.float()).to(torch.bfloat16)
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean() + 1e-5)).to(torch.bfloat16)
    want = (w.float() @ (nw * normed).float()).to(torch.bfloat16)
    got, total = prologue_pass.gemv_prologues.reference(
        prologue_pass.gemv_prologues.ADD_RMSNORM, a, b, nw, 1e-5, w)
    assert torch.equal(total, x) and torch.equal(got, want)
    gated = (torch.nn.functional.silu(a) * b)
    got = prologue_pass.gemv_prologues.reference(prologue_pass.gemv_prologues.SILU_GATED, a, b,
                                                 None, 0.0, w)[0]
    assert torch.equal(got, (w.float() @ gated.float()).to(torch.bfloat16))


def _gemv_on_every_device(x, weight, bias, config, row_configs=None):
    """``gemv_linear`` without its GPU check: the CPU's compiled graph holds the GEMV (and the
    GEMM of a row count ``row_configs`` has) too."""
    k = weight.shape[1]
    rows = x.numel() // k
    if row_configs and rows in row_configs:
        y = torch.ops.nimble.gemm_rows(x.reshape(rows, k).contiguous(), weight,
                                       *row_configs[rows].row_args)
    elif config is None or x.numel() != k:
        return torch.nn.functional.linear(x, weight, bias)
    else:
        y = torch.ops.nimble.gemv(x.reshape(k).contiguous(), weight, config.block_n,
                                  config.block_k, config.warps, config.stages)
    y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _compiled(fn, *args, fusing: bool):
    """``fn`` compiled by Inductor (no cached graph: the pass runs on a compilation only) and
    called, with the pass where ``fusing``."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    with inductor_config.patch(fx_graph_cache=False):
        if not fusing:
            return compiled(*args), None
        with prologue_pass.fusing() as the_pass:
            out = compiled(*args)
    return out, the_pass


def _one_token_logits_folded(model, batch: int = 1):
    """A decoder's logits for one token a row of ``batch`` compiled without the pass and with
    it, its sibling projections fused and every GEMM on the GEMV (one row) or the GEMM of
    rows: ``(plain, folded, the pass)``."""
    from nimble.fast_gemv import fast_gemv
    from nimble.fused_projections import fuse_projections

    fuse_projections(model)
    fast_gemv(model, time=lambda c, weights, x: 1.0 if c is None else 0.5,  # every GEMM
              rows=(batch,))

    def logits(ids):
        return model(ids, use_cache=False).logits

    ids = torch.tensor([[7 + 11 * row] for row in range(batch)])
    with torch.no_grad():
        plain, _ = _compiled(logits, ids, fusing=False)
        folded, the_pass = _compiled(logits, ids, fusing=True)
    return plain, folded, the_pass


def _tiny_llama_on_the_gemvs(monkeypatch, dtype):
    """A seeded two-layer Llama in ``dtype`` whose swapped layers run the GEMV's (and the
    GEMM of rows') operators on the CPU too."""
    transformers = pytest.importorskip("transformers")

    monkeypatch.setattr(fast_gemv_module, "gemv_linear", _gemv_on_every_device)
    monkeypatch.setattr(fused_module, "gemv_linear", _gemv_on_every_device)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=500)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_tiny_llamas_norms_and_gated_activation_fold_into_its_gemvs(monkeypatch, dtype):
    model = _tiny_llama_on_the_gemvs(monkeypatch, dtype)
    plain, folded, the_pass = _one_token_logits_folded(model)
    runs = [r for r in the_pass.runs if r.gemvs]
    assert len(runs) == 1
    # 2 layers of (qkv, o, gate_up, down) and the head: every GEMV but the attention's
    # output projections reads a norm or the gated activation; the first norm reads the
    # embedding, every later one a residual sum
    done = runs[0]
    assert (done.gemvs, done.rmsnorm, done.add_rmsnorm, done.gated) == (9, 1, 4, 2)
    limit = 0 if dtype == torch.float32 else 2 ** -6
    assert (plain.float() - folded.float()).abs().max() <= limit * plain.float().abs().max() + 1e-6


@torch.library.custom_op("nimble_test::rank_sum", mutates_args=())
def _rank_sum(x: torch.Tensor) -> torch.Tensor:
    """A stand-in for a sum over the ranks, opaque as ``nimble::peer_sum`` is (one rank's)."""
    return x.clone()


@_rank_sum.register_fake
def _rank_sum_shape(x):
    return x.new_empty(x.shape)


def test_a_split_llamas_norms_fold_across_its_sums_over_the_ranks(monkeypatch):
    """One rank's shard of a Llama split over two (nimble.cli.tp_decoders), its projections'
    partial sums through an opaque operator as the peer sum's: each residual sum's norm after
    a sum over the ranks still folds into the GEMV after it, as in the whole model."""
    from nimble.cli.tp_decoders import split

    model = split(_tiny_llama_on_the_gemvs(monkeypatch, torch.bfloat16), 0, 2, head="whole")
    for layer in model.model.layers:
        layer.self_attn.o_proj.reduce = layer.mlp.down_proj.reduce = _rank_sum
    _, _, the_pass = _one_token_logits_folded(model)
    [done] = [r for r in the_pass.runs if r.gemvs]
    assert (done.gemvs, done.rmsnorm, done.add_rmsnorm, done.gated) == (9, 1, 4, 2)


def test_a_tiny_llamas_norms_and_gated_activation_fold_into_its_gemms_of_four_rows(
        monkeypatch):
    model = _tiny_llama_on_the_gemvs(monkeypatch, torch.bfloat16)
    _, _, left = _one_token_logits_folded(model, batch=4)
    assert left.runs and sum(r.total for r in left.runs) == 0  # off by default
    monkeypatch.setattr(prologue_pass, "FOLD_ROWS", True)
    plain, folded, the_pass = _one_token_logits_folded(model, batch=4)
    runs = [r for r in the_pass.runs if r.gemms_of_rows]
    assert len(runs) == 1
    done = runs[0]  # as at one row: each norm (of a residual sum) and gated activation
    assert (done.gemms_of_rows, done.gemvs, done.rmsnorm, done.add_rmsnorm, done.gated) == \
        (9, 0, 1, 4, 2)
    assert plain.shape == folded.shape == (4, 1, 500)
    # each row normalised on its own: the rows' logits differ, and match the plain graph's
    assert not torch.equal(folded[0], folded[1])
    assert (plain.float() - folded.float()).abs().max() <= 2 ** -6 * plain.float().abs().max()


class GemmaNorm(nn.Module):
    """An RMS norm that scales by ``1 + weight`` in float32 before it rounds: of a bfloat16
    input, not the rounding the folded kernel does, so no pattern the pass takes."""

    def __init__(self, k):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
                * (1 + self.weight)).to(x.dtype)


class Block(nn.Module):
    def __init__(self, k, norm):
        super().__init__()
        self.norm = norm
        self.w = nn.Parameter(torch.randn(k, k, dtype=torch.bfloat16) / k ** 0.5,
                              requires_grad=False)

    def forward(self, x, other):
        y = torch.ops.nimble.gemv(self.norm(x).reshape(-1), self.w, *CONFIG)
        # a GEMV of a product that is no gated activation, and of an op's plain output
        z = torch.ops.nimble.gemv((torch.tanh(y) * other).reshape(-1), self.w, *CONFIG)
        return torch.ops.nimble.gemv(torch.relu(z), self.w, *CONFIG)


def test_what_matches_no_pattern_stays_as_it_was():
    k = 32
    block = Block(k, GemmaNorm(k)).requires_grad_(False)
    x, other = torch.randn(1, k, dtype=torch.bfloat16), torch.randn(k, dtype=torch.bfloat16)
    with torch.no_grad():
        plain, _ = _compiled(block, x, other, fusing=False)
        folded, the_pass = _compiled(block, x, other, fusing=True)
    done = the_pass.runs[-1]
    assert (done.gemvs, done.total) == (3, 0)
    assert torch.equal(plain, folded)


def test_a_norm_whose_input_is_read_on_keeps_its_value_for_the_readers():
    """The residual sum before a norm, read again after the GEMV: the folded GEMV writes it."""
    k = 64
    torch.manual_seed(1)
    w = torch.randn(k, k, dtype=torch.bfloat16) / 8
    nw = torch.randn(k, dtype=torch.bfloat16)

    def layer(h, d):
        x = h + d
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
        y = torch.ops.nimble.gemv((nw * normed).reshape(-1), w, *CONFIG)
        return x + y.reshape(x.shape), x * 2

    h, d = torch.randn(1, 1, k, dtype=torch.bfloat16), torch.randn(1, 1, k, dtype=torch.bfloat16)
    plain, _ = _compiled(layer, h, d, fusing=False)
    folded, the_pass = _compiled(layer, h, d, fusing=True)
    assert the_pass.runs[-1].add_rmsnorm == 1
    assert torch.equal(plain[1], folded[1])  # the sum itself, as the model computes it
    assert (plain[0].float() - folded[0].float()).abs().max() <= 2 ** -6 * plain[0].abs().max()


def test_the_pass_chains_to_a_pass_set_before_it_and_keys_the_cache_on_both():
    import torch._inductor.config as inductor_config

    seen = []

    class Before(prologue_pass._make_pass()):
        def __call__(self, graph):
            seen.append(len(graph.nodes))

        def uuid(self):
            return "before"

    with inductor_config.patch(post_grad_custom_post_pass=Before(), fx_graph_cache=False):
        with prologue_pass.fusing() as the_pass:
            assert inductor_config.post_grad_custom_post_pass is the_pass
            assert the_pass.uuid().endswith("-before")
            compiled = torch.compile(lambda v: torch.ops.nimble.gemv(v.sin(), torch.ones(3, 4),
                                                                     *CONFIG))
            torch._dynamo.reset()
            compiled(torch.randn(4))
    assert seen and the_pass.runs and the_pass.runs[-1].gemvs == 1
    assert prologue_pass.make_pass().uuid() == prologue_pass.make_pass().uuid()
    GemvConfig(*CONFIG)


def test_the_cache_key_follows_the_modules_switches(monkeypatch):
    """A compilation cached with the layer norms (or the GEMMs of rows) folded is not the one
    without: the pass's key names its switches."""
    keys = {prologue_pass.make_pass().uuid()}
    for switch in ("FOLD_LAYER_NORMS", "FOLD_ROWS"):
        monkeypatch.setattr(prologue_pass, switch, True)
        keys.add(prologue_pass.make_pass().uuid())
    assert len(keys) == 3


def test_a_norm_over_part_of_the_gemvs_input_is_not_folded():
    """A norm over rows of half the GEMV's width, the rows then read as one vector: a fold
    would normalise over the whole, so the pass leaves it."""
    k = 64
    w, nw = torch.randn(8, k), torch.randn(2, k // 2)

    def halves(x):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return torch.ops.nimble.gemv((nw * normed).reshape(-1), w, *CONFIG)

    x = torch.randn(2, k // 2)
    plain, _ = _compiled(halves, x, fusing=False)
    folded, the_pass = _compiled(halves, x, fusing=True)
    assert (the_pass.runs[-1].gemvs, the_pass.runs[-1].total) == (1, 0)
    assert torch.equal(plain, folded)


def _attention_then_gemv(read_again: bool, slots: int = 192):
    k_dim, heads, kv_heads, head_dim = 256, 4, 2, 64
    torch.manual_seed(4)
    w = torch.randn(40, heads * head_dim)

    def step(q, k, v, keep):
        out = torch.ops.nimble.decode_attention(q, k, v, keep, head_dim ** -0.5)
        y = torch.ops.nimble.gemv(out.reshape(1, 1, -1).reshape(-1), w, *CONFIG)
        return (y, out * 2) if read_again else y

    q = torch.randn(1, heads, 1, head_dim)
    k, v = (torch.randn(1, kv_heads, slots, head_dim) for _ in range(2))
    keep = (torch.arange(slots) < slots - 40).view(1, 1, 1, slots)
    assert k_dim == heads * head_dim
    return step, (q, k, v, keep)


def _compiled_joining(fn, *args):
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    with inductor_config.patch(fx_graph_cache=False), \
            prologue_pass.fusing(join_attention=True) as the_pass:
        return compiled(*args), the_pass


def test_a_split_attention_read_by_a_gemv_alone_is_joined_by_the_gemv_when_asked(monkeypatch):
    import nimble.decode_attention as da

    monkeypatch.setattr(da, "WHOLE_SLOTS", 0)  # 192 slots split, not one tile
    step, args = _attention_then_gemv(read_again=False)
    plain, the_pass = _compiled(step, *args, fusing=True)
    assert the_pass.runs[-1].joined == 0  # not asked
    joined, the_pass = _compiled_joining(step, *args)
    assert (the_pass.runs[-1].gemvs, the_pass.runs[-1].joined) == (1, 1)
    # the CPU's kernels: the same parts, the same join in the same order
    assert torch.equal(plain, joined)


def test_an_attention_read_by_more_than_the_gemv_or_unsplit_keeps_its_join():
    step, args = _attention_then_gemv(read_again=True)
    joined, the_pass = _compiled_joining(step, *args)
    assert (the_pass.runs[-1].gemvs, the_pass.runs[-1].joined) == (1, 0)
    # a cache read as one tile (WHOLE_SLOTS), or two blocks read unsplit: no join to fold
    step, args = _attention_then_gemv(read_again=False)
    joined, the_pass = _compiled_joining(step, *args)
    assert (the_pass.runs[-1].gemvs, the_pass.runs[-1].joined) == (1, 0)
    step, args = _attention_then_gemv(read_again=False, slots=128)
    joined, the_pass = _compiled_joining(step, *args)
    assert (the_pass.runs[-1].gemvs, the_pass.runs[-1].joined) == (1, 0)


def test_the_kernels_compile_for_a_hopper_gpu_on_a_machine_without_one():
    """Triton's compiler to PTX for sm_90, no GPU needed: what the interpreter cannot show
    (the compiled language's rules for the kernels' nested calls and constexpr branches)."""
    triton = pytest.importorskip("triton", reason="compiles with Triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import nimble.gemv_prologue_kernels as kernels

    def compiled(fn, signature, constexprs):
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32))
        return kernel.asm["ptx"]

    pointers = {name: "*bf16" for name in ("a_ptr", "b_ptr", "nw_ptr", "w_ptr", "y_ptr",
                                           "sum_ptr", "c_ptr", "nb_ptr")}
    flags = ("PROLOGUE", "BLOCK_N", "BLOCK_K", "NORM_BLOCK", "WAITS", "LATE", "AHEAD", "HAS_C",
             "HAS_NB", "ONE_BLOCK")
    for prologue, ahead, biased in ((0, 1, False), (1, 1, False), (2, 1, False), (1, 2, False),
                                    (2, 2, False), (1, 1, True), (3, 1, True), (4, 1, True),
                                    (4, 2, False), (5, 1, True), (6, 1, False)):
        ptx = compiled(kernels.gemv_prologue_kernel,
                       {**pointers, "N": "i32", "K": "i32", "stride_w": "i32", "eps": "fp32",
                        **{f: "constexpr" for f in flags}},
                       {"PROLOGUE": prologue, "BLOCK_N": 4, "BLOCK_K": 1024, "NORM_BLOCK": 2048,
                        "WAITS": True, "LATE": False, "AHEAD": ahead, "HAS_C": biased,
                        "HAS_NB": biased, "ONE_BLOCK": prologue in (3, 4) and ahead == 1})
        assert "gemv_prologue_kernel" in ptx
    ptx = compiled(kernels.gemv_joined_kernel,
                   {"part_ptr": "*fp32", "stat_ptr": "*fp32", "w_ptr": "*bf16", "y_ptr": "*bf16",
                    "N": "i32", "K": "i32", "stride_w": "i32", "groups": "i32", "splits": "i32",
                    "HEAD_DIM": "constexpr", "BLOCK_R": "constexpr", "BLOCK_D": "constexpr",
                    "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "WAITS": "constexpr"},
                   {"HEAD_DIM": 64, "BLOCK_R": 16, "BLOCK_D": 64, "BLOCK_N": 4, "BLOCK_K": 1024,
                    "WAITS": True})
    assert "gemv_joined_kernel" in ptx


def test_the_attend_kernel_compiles_in_both_forms_its_launches_give_it():
    """The attend kernel for sm_90 with the parts alone (its output pointer the float32 parts,
    as ``launch_parts`` passes it) and writing the attention itself, the whole cache as one
    tile too."""
    triton = pytest.importorskip("triton", reason="compiles with Triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import nimble.decode_attention_kernels as kernels

    ints = ("slots", "groups", "kv_heads", "splits", "slots_per_split", "sqb", "sqh", "skb",
            "skh", "skl", "svb", "svh", "svl", "smb", "smh", "sml", "sob", "soh")
    rope_ints = ("scb", "ssb", "sknb", "sknh", "svnb", "svnh")
    for split, out, early, rope, whole in ((True, "*fp32", False, False, False),
                                           (False, "*bf16", False, False, False),
                                           (True, "*fp32", True, False, False),
                                           (True, "*fp32", False, True, False),
                                           (False, "*bf16", True, True, False),
                                           (False, "*bf16", True, True, True)):
        cache_early = rope and whole  # what the launcher asks for there
        signature = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "mask_ptr": "*i1",
                     "out_ptr": out, "part_ptr": "*fp32", "stat_ptr": "*fp32",
                     "count_ptr": "*i32", "scale": "fp32", **{i: "i32" for i in ints},
                     "cos_ptr": "*bf16", "sin_ptr": "*bf16", "kn_ptr": "*bf16",
                     "vn_ptr": "*bf16", "pos_ptr": "*i64", **{i: "i32" for i in rope_ints}}
        constexprs = {"HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_R": 16,
                      "BLOCK_L": 256 if whole else 64, "MASK": 1, "SPLIT": split,
                      "IEEE": False, "BRANCHLESS": False, "LAST_JOINS": False,
                      "VALUES_EARLY": early, "ROPE": rope, "WAITS": True, "WHOLE": whole,
                      "CACHE_EARLY": cache_early}
        signature.update({name: "constexpr" for name in constexprs})
        kernel = triton.compile(ASTSource(fn=kernels.attend, signature=signature,
                                          constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 8 if whole else 4})
        assert "attend" in kernel.asm["ptx"]


@pytest.mark.parametrize("family, folds", [("Qwen2", (1, 4, 2)), ("Mistral", (1, 4, 2)),
                                           ("Qwen3", (1, 4, 2)), ("Phi3", (1, 4, 2)),
                                           ("Granite", (1, 4, 2)), ("Gemma", (0, 0, 0))])
def test_other_decoders_norms_and_activations_fold_where_they_are_the_patterns(monkeypatch,
                                                                              family, folds):
    """Tiny bfloat16 decoders of other families, every GEMM on the GEMV: the norms and SiLU
    gates fold as in a Llama; Gemma's (a norm scaling by ``1 + weight`` in float32, a GELU
    gate) are no pattern the pass takes, and stay."""

    monkeypatch.setattr(fast_gemv_module, "gemv_linear", _gemv_on_every_device)
    monkeypatch.setattr(fused_module, "gemv_linear", _gemv_on_every_device)
    plain, folded, the_pass = _one_token_logits_folded(tiny_decoder(family).to(torch.bfloat16))
    done = [r for r in the_pass.runs if r.gemvs][-1]
    assert (done.rmsnorm, done.add_rmsnorm, done.gated) == folds
    limit = 2 ** -6
    assert (plain.float() - folded.float()).abs().max() <= limit * plain.float().abs().max()


def _product_on_every_device(x, weight, bias, config, row_configs=None):
    """``fast_gemv._product`` without its GPU check: the swapped layers (``nn.Linear`` and
    transformers' ``Conv1D``, GPT-2's) run the GEMV's and the GEMM of rows' operators in the
    CPU's compiled graphs too."""
    k = weight.shape[1]
    rows = x.numel() // k
    if rows == 1 and config is not None:
        y = torch.ops.nimble.gemv(x.reshape(k).contiguous(), weight, *config.args)
    elif row_configs and rows in row_configs and x.dtype != torch.float32:
        y = torch.ops.nimble.gemm_rows(x.reshape(rows, k).contiguous(), weight,
                                       *row_configs[rows].row_args)
    else:
        return None
    y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _tiny_gpt2(monkeypatch, dtype):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(fast_gemv_module, "_product", _product_on_every_device)
    monkeypatch.setattr(prologue_pass, "FOLD_LAYER_NORMS", True)
    config = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=500,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(dtype).eval()


@contextlib.contextmanager
def _prologue_calls():
    """The generic prologue operators each compilation's pass leaves inside the block, as
    (kind, has a bias, has a norm's bias): seen by a pass set before the fold pass, which the
    fold chains to."""
    import torch._inductor.config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []
    generic = (torch.ops.nimble.gemv_prologue.default, torch.ops.nimble.gemm_rows_prologue.default)

    class Look(CustomGraphPass):
        def __call__(self, graph):
            seen.append([(n.args[7], n.args[2] is not None, n.args[4] is not None)
                         for n in graph.nodes if n.op == "call_function" and n.target in generic])

        def uuid(self):
            return "look"

    with inductor_config.patch(post_grad_custom_post_pass=Look()):
        yield seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiny_gpt2s_layer_norms_and_gelus_fold_with_the_projections_biases(monkeypatch, dtype):
    """GPT-2 on the GEMV (its Conv1D projections): each layer norm reads a residual sum (the
    first, the embeddings' sum) whose operand is a projection's output plus its bias, and each
    MLP's GELU (tanh) reads the up projection's output plus its bias; every one folds, the
    biases with them, and the logits are the unfolded graph's."""
    with _prologue_calls() as seen:
        plain, folded, the_pass = _one_token_logits_folded(_tiny_gpt2(monkeypatch, dtype))
    [done] = [r for r in the_pass.runs if r.gemvs]
    assert (done.gemvs, done.layernorm, done.add_layernorm, done.gelu, done.rmsnorm) == \
        (9, 0, 5, 2, 0)
    calls = next(c for c in seen if c)
    gp = prologue_pass.gemv_prologues
    # the embeddings' sum has no bias; each later norm's sum, and each GELU, takes one
    assert sorted(calls) == sorted([(gp.ADD_LAYERNORM, False, True)]
                                   + [(gp.ADD_LAYERNORM, True, True)] * 4
                                   + [(gp.GELU_TANH, True, False)] * 2), calls
    limit = 1e-5 if dtype == torch.float32 else 2 ** -6
    assert (plain.float() - folded.float()).abs().max() <= limit * plain.float().abs().max()


def test_a_tiny_gpt2s_folds_reach_its_gemms_of_four_rows(monkeypatch):
    monkeypatch.setattr(prologue_pass, "FOLD_ROWS", True)
    plain, folded, the_pass = _one_token_logits_folded(_tiny_gpt2(monkeypatch, torch.bfloat16),
                                                       batch=4)
    [done] = [r for r in the_pass.runs if r.gemms_of_rows]
    # the embeddings' sum broadcasts the positions' row over the batch: no residual sum of
    # rows, a plain layer norm of it
    assert (done.gemms_of_rows, done.layernorm, done.add_layernorm, done.gelu) == (9, 1, 4, 2)
    assert not torch.equal(folded[0], folded[1])
    assert (plain.float() - folded.float()).abs().max() <= 2 ** -6 * plain.float().abs().max()


class NormedMLP(nn.Module):
    """A layer norm without a bias of its own, a projection with a bias, an exact GELU, and
    a projection without: every GEMM a GEMV."""

    def __init__(self, k, bias_in_norm: bool):
        super().__init__()
        self.norm = nn.LayerNorm(k, bias=bias_in_norm)
        self.up = nn.Linear(k, 2 * k)
        self.down = nn.Linear(2 * k, k, bias=False)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(self.norm(x))))


@pytest.mark.parametrize("bias_in_norm", [False, True])
def test_a_layer_norm_and_an_exact_gelu_fold_into_the_gemvs_after_them(monkeypatch,
                                                                       bias_in_norm):
    from nimble.fast_gemv import fast_gemv

    monkeypatch.setattr(fast_gemv_module, "_product", _product_on_every_device)
    monkeypatch.setattr(prologue_pass, "FOLD_LAYER_NORMS", True)
    torch.manual_seed(5)
    model = NormedMLP(64, bias_in_norm).to(torch.bfloat16).eval()
    with torch.no_grad():
        model.norm.weight.add_(0.1 * torch.randn(64, dtype=torch.bfloat16))
    fast_gemv(model, time=lambda c, weights, x: 1.0 if c is None else 0.5)
    x = (torch.randn(1, 64) + 2.0).to(torch.bfloat16)  # an offset the centring takes out
    with torch.no_grad(), _prologue_calls() as seen:
        plain, _ = _compiled(model, x, fusing=False)
        folded, the_pass = _compiled(model, x, fusing=True)
    done = the_pass.runs[-1]
    assert (done.gemvs, done.layernorm, done.gelu, done.add_layernorm) == (2, 1, 1, 0)
    gp = prologue_pass.gemv_prologues
    assert sorted(next(c for c in seen if c)) == [(gp.LAYERNORM, False, bias_in_norm),
                                                  (gp.GELU_ERF, True, False)]
    assert (plain.float() - folded.float()).abs().max() <= 2 ** -6 * plain.float().abs().max()


@pytest.mark.parametrize("family, folds", [("Phi", (3, 2, 2, 0)), ("StableLm", (1, 4, 0, 2)),
                                           ("GPTNeoX", (3, 2, 2, 0)), ("OPT", (0, 5, 0, 0))])
def test_layer_normed_decoders_fold_their_norms_and_activations(monkeypatch, family, folds):
    """Tiny bfloat16 decoders with layer norms, every GEMM on the GEMV: Phi's and GPT-NeoX's
    (one norm read by the attention's and the MLP's projections alike, a residual sum of
    three, the MLP's GELU with its bias), StableLM's (a SiLU gate) and OPT's (its rows
    flattened between the residual sum and the norm; a ReLU, which stays); as (layer norms, of
    a residual sum, GELUs, gated activations)."""
    monkeypatch.setattr(fast_gemv_module, "_product", _product_on_every_device)
    monkeypatch.setattr(prologue_pass, "FOLD_LAYER_NORMS", True)
    plain, folded, the_pass = _one_token_logits_folded(tiny_decoder(family).to(torch.bfloat16))
    done = [r for r in the_pass.runs if r.gemvs][-1]
    assert (done.layernorm, done.add_layernorm, done.gelu, done.gated) == folds, done
    assert (plain.float() - folded.float()).abs().max() <= 2 ** -6 * plain.float().abs().max()


def test_layer_norms_and_gelus_stay_unless_asked(monkeypatch):
    """FOLD_LAYER_NORMS off (the default, until measured faster): a GPT-2's norms and GELUs
    keep their kernels."""
    model = _tiny_gpt2(monkeypatch, torch.float32)
    monkeypatch.setattr(prologue_pass, "FOLD_LAYER_NORMS", False)
    plain, folded, the_pass = _one_token_logits_folded(model)
    [done] = [r for r in the_pass.runs if r.gemvs]
    assert (done.gemvs, done.total) == (9, 0)
    assert torch.equal(plain, folded)
