"""Greedy decoding over a static cache (:mod:`nimble.generate`) without a GPU: the limits and
their errors, the bucket choice and the padding, and the token loop with the step modules run
eagerly on the CPU, against transformers' own ``generate(do_sample=False,
cache_implementation="static")`` token for token (tiny GPT-2 and Llama models, random weights).
The same loop over Nimble's graphs is ``tests/test_gpu_generate.py``.
"""
from __future__ import annotations

import math
import pytest
import torch

from helpers import FIXTURE_DIR
import nimble.generate as generate_module
from nimble.cli.decode_loop import compiled_loop
from nimble.errors import CaptureError, InputError
from nimble.generate import (DecodeStep, Generator, Limits, library_greedy, pad_right, run_eagerly,
                             unit_in_last_place)

VOCAB = 1000


def test_limits_pick_the_smallest_bucket_that_holds_the_prompt():
    limits = Limits.checked(256, [128, 32, 64, 32], [8, 1])
    assert limits.prompt_buckets == (32, 64, 128) and limits.batch_sizes == (1, 8)
    assert [limits.bucket_for(n) for n in (1, 32, 33, 64, 100, 128)] == [32, 32, 64, 64, 128, 128]
    assert limits.check(8, 100, 129) == 128


@pytest.mark.parametrize("args, match", [
    ((256, [], [1]), "at least one prompt-length bucket"),
    ((256, [64], []), "at least one prompt-length bucket"),
    ((256, [0, 64], [1]), "positive integers"),
    ((256, [64], [1.5]), "positive integers"),
    ((64, [64], [1]), r"largest prompt bucket \(64 tokens\) leaves no room .* cache of 64"),
])
def test_wrong_limits_are_input_errors_saying_which(args, match):
    with pytest.raises(InputError, match=match):
        Limits.checked(*args)


def test_a_prompt_longer_than_the_largest_bucket_names_the_buckets_and_the_cache():
    limits = Limits.checked(256, [32, 128], [1])
    with pytest.raises(InputError, match=r"prompt of 129 tokens is longer than the largest "
                                         r"prepared bucket \(128 tokens; buckets \[32, 128\], "
                                         r"cache 256 tokens\)"):
        limits.check(1, 129, 4)
    with pytest.raises(InputError, match="prompt is empty"):
        limits.check(1, 0, 4)


def test_a_generation_past_the_cache_names_how_many_tokens_fit():
    limits = Limits.checked(256, [128], [1, 8])
    assert limits.check(1, 128, 129) == 128  # the last token is never written to the cache
    with pytest.raises(InputError, match=r"need a cache of 257 tokens; the cache holds 256: "
                                         r"generate at most 129 new tokens"):
        limits.check(1, 128, 130)
    with pytest.raises(InputError, match=r"batch size 4 was not prepared; the Generator has "
                                         r"\[1, 8\]"):
        limits.check(4, 16, 8)
    with pytest.raises(InputError, match="max_new_tokens must be a positive integer"):
        limits.check(1, 16, 0)


def test_padding_goes_on_the_right_and_keeps_a_full_prompt_as_it_is():
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    assert torch.equal(pad_right(ids, 5, pad_id=0), torch.tensor([[5, 6, 7, 0, 0],
                                                                  [8, 9, 10, 0, 0]]))
    assert pad_right(ids, 3) is ids


def _tiny(name: str):
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                                         n_positions=256, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=VOCAB)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_token_loop_equals_the_librarys_greedy_generate_token_for_token(name):
    """Prefill into a bucket (exactly full, and padded on the right), then one decode step per
    token with the cache's position set from the step's input: the tokens the library picks."""
    pytest.importorskip("transformers")
    model = _tiny(name)
    generator = Generator(model, max_cache_len=96, prompt_buckets=[16, 32], batch_sizes=[1, 3],
                          prepare_step=run_eagerly)
    for batch, prompt_len in [(1, 16), (3, 32), (3, 20), (1, 1)]:
        ids = torch.randint(0, VOCAB, (batch, prompt_len))
        got = generator.generate(ids, 24)
        assert got.shape == (batch, prompt_len + 24)
        assert torch.equal(got, library_greedy(model, ids, 24)), (batch, prompt_len)
    # a generation that fills the cache to its last slot, against a cache of the same length
    ids = torch.randint(0, VOCAB, (1, 32))
    assert torch.equal(generator.generate(ids, 65), library_greedy(model, ids, 65))
    import transformers

    cache = transformers.StaticCache(config=model.config, max_cache_len=96)
    for new_tokens in (30, 12):  # one cache, reset for each generation
        assert torch.equal(generator.generate(ids, new_tokens),
                           library_greedy(model, ids, new_tokens, cache=cache))


def test_a_generator_asked_to_fuse_projections_fuses_them_before_preparing_and_decodes_alike():
    """``Generator(fuse_projections=True)``: the model's sibling projections are one GEMM each
    in the modules the steps are prepared from, and the tokens are the unfused model's."""
    pytest.importorskip("transformers")
    import copy

    from nimble.fused_projections import FusedSibling

    model = _tiny("llama")
    plain = copy.deepcopy(model)
    seen = []

    def prepare_step(module, examples):
        seen.append(isinstance(module.model.model.layers[0].self_attn.k_proj, FusedSibling))
        return run_eagerly(module, examples)

    generator = Generator(model, 64, [16], prepare_step=prepare_step, fuse_projections=True)
    assert generator.fused_projections == 4 and seen == [True, True]
    ids = torch.randint(0, VOCAB, (1, 12))
    assert torch.equal(generator.generate(ids, 10), library_greedy(plain, ids, 10))
    unfused = Generator(plain, 64, [16], prepare_step=run_eagerly)
    assert unfused.fused_projections is None
    assert type(plain.model.layers[0].self_attn.k_proj) is torch.nn.Linear


def test_generate_refuses_what_was_not_prepared_with_the_limits():
    pytest.importorskip("transformers")
    generator = Generator(_tiny("llama"), max_cache_len=64, prompt_buckets=[16],
                          batch_sizes=[1], prepare_step=run_eagerly)
    with pytest.raises(InputError, match=r"prompt of 17 tokens .* buckets \[16\], cache 64"):
        generator.generate(torch.zeros((1, 17), dtype=torch.long), 4)
    with pytest.raises(InputError, match="batch size 2 was not prepared"):
        generator.generate(torch.zeros((2, 16), dtype=torch.long), 4)
    with pytest.raises(InputError, match="generate at most 49 new tokens"):
        generator.generate(torch.zeros((1, 16), dtype=torch.long), 50)
    with pytest.raises(InputError, match="int64 token ids"):
        generator.generate(torch.zeros((1, 16), dtype=torch.int32), 4)
    with pytest.raises(InputError, match="int64 token ids"):
        generator.generate(torch.zeros(16, dtype=torch.long), 4)


def test_a_model_in_training_mode_is_refused_before_anything_is_prepared():
    pytest.importorskip("transformers")
    prepared = []
    with pytest.raises(InputError, match=r"training mode: call model.eval\(\)"):
        Generator(_tiny("gpt2").train(), 64, [16],
                  prepare_step=lambda module, example: prepared.append(module))
    assert not prepared


def test_a_failed_prepare_closes_the_steps_already_prepared():
    pytest.importorskip("transformers")

    class Step:
        closed = 0

        def __init__(self, module, examples):
            self.call = run_eagerly(module, examples)

        def __call__(self, *inputs):
            return self.call(*inputs)

        def close(self):
            Step.closed += 1

    calls = []

    def prepare_step(module, examples):
        calls.append([tuple(ids.shape) for ids, _ in examples])
        if len(calls) == 3:
            raise InputError("stand-in failure")
        return Step(module, examples)
    with pytest.raises(InputError, match="stand-in failure"):
        Generator(_tiny("gpt2"), 64, [8, 16], batch_sizes=[1, 2], prepare_step=prepare_step)
    assert calls == [[(1, 8), (1, 16)], [(1, 1)], [(2, 8), (2, 16)]]
    assert Step.closed == 2


def test_the_prefill_of_a_batch_size_is_prepared_once_over_every_prompt_bucket():
    """One ``prepare_step`` call per batch size gets every prompt bucket's example, ``(ids (B,
    P), last (1,))`` with ``last = P - 1``: each bucket's inputs a shape of their own, for one
    Nimble to dispatch a call by; the decode step gets its one example."""
    pytest.importorskip("transformers")
    from nimble.generate import DecodeStep, PrefillStep

    seen = []

    def prepare_step(module, examples):
        seen.append((type(module), [(tuple(ids.shape), ids.dtype, tuple(last.shape),
                                     last.tolist()) for ids, last in examples]))
        return run_eagerly(module, examples)
    generator = Generator(_tiny("llama"), 64, [24, 8, 16], batch_sizes=[3, 1],
                          prepare_step=prepare_step)
    assert seen == [
        (PrefillStep, [((1, p), torch.long, (1,), [p - 1]) for p in (8, 16, 24)]),
        (DecodeStep, [((1, 1), torch.long, (1,), [8])]),
        (PrefillStep, [((3, p), torch.long, (1,), [p - 1]) for p in (8, 16, 24)]),
        (DecodeStep, [((3, 1), torch.long, (1,), [8])])]
    decode, prefill = generator.steps(3)
    assert callable(decode) and callable(prefill)


def test_a_compiled_step_over_several_buckets_compiles_each_shape_statically(monkeypatch):
    """``prepare_with_nimble(compile_steps=True)`` hands Nimble one ``torch.compile``d module for
    every bucket; Nimble records each bucket by running it at that bucket's shapes.  Each shape
    must be a graph of its own with static shapes, more buckets than Dynamo's recompile limit
    included (past it the module would run eagerly).  Nimble is stood in for by what its
    recording does with the module: run it at every bucket's example."""
    import nimble.api
    from nimble.generate import prepare_with_nimble

    compiled_shapes = []

    def backend(gm, example_inputs):
        compiled_shapes.append([tuple(x.shape) for x in example_inputs
                                if isinstance(x, torch.Tensor)])
        assert not any(isinstance(d, torch.SymInt) for x in example_inputs
                       if isinstance(x, torch.Tensor) for d in x.shape)
        return gm.forward
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda module, dynamic: real_compile(
        module, dynamic=dynamic, backend=backend))

    class StandIn:
        def __init__(self, model):
            self.model = model

        def prepare(self, *, buckets, options):
            with torch.no_grad():
                self.outputs = [self.model(*example) for example in buckets]
            return self
    monkeypatch.setattr(nimble.api, "Nimble", StandIn)

    class Last(torch.nn.Module):
        def forward(self, ids, last):
            return ids.float().index_select(1, last) * 2

    torch._dynamo.reset()
    lengths = list(range(2, 2 + torch._dynamo.config.recompile_limit + 3))
    examples = [(torch.arange(3 * p).view(3, p), torch.tensor([p - 1])) for p in lengths]
    prepared = prepare_with_nimble(compile_steps=True)(Last().eval(), examples)
    assert [shapes[0] for shapes in compiled_shapes] == [(3, p) for p in lengths]
    for (ids, last), out in zip(examples, prepared.outputs):
        assert torch.equal(out, ids.float()[:, -1:] * 2)
    torch._dynamo.reset()


def test_a_step_that_cannot_be_one_graph_names_the_step_and_the_position_prepared():
    """A forward that picks its work from the cache position on the host synchronises under
    capture (a CaptureError from prepare); the Generator says which step, at which position."""
    pytest.importorskip("transformers")
    from nimble.errors import CaptureError
    from nimble.generate import DecodeStep

    def prepare_step(module, example):
        if isinstance(module, DecodeStep):
            raise CaptureError("the forward synchronises with the host at model.py:3")
        return run_eagerly(module, example)
    with pytest.raises(CaptureError, match=r"the decode step of batch 1, prepared at cache "
                                           r"position 8: the forward synchronises .* one graph "
                                           r"for every cache position"):
        Generator(_tiny("gpt2"), 64, [8, 16], prepare_step=prepare_step)


def test_the_step_modules_set_the_caches_counters_from_their_inputs():
    """Every launch starts from its inputs, not from how many launches ran before it: the
    counters are set inside the step (the proof and the per-task timing launch it often)."""
    pytest.importorskip("transformers")
    from nimble.generate import DecodeStep, PrefillStep

    generator = Generator(_tiny("llama"), max_cache_len=64, prompt_buckets=[16],
                          prepare_step=run_eagerly)
    cache = generator.caches[1]
    decode = DecodeStep(generator.model, cache)
    prefill = PrefillStep(generator.model, cache)
    counters = [layer.cumulative_length for layer in cache.layers]
    with torch.no_grad():
        prefill(torch.zeros((1, 16), dtype=torch.long), torch.tensor([9]))
        assert [int(c) for c in counters] == [10] * len(counters)
        first = decode(torch.ones((1, 1), dtype=torch.long), torch.tensor([10]))
        again = decode(torch.ones((1, 1), dtype=torch.long), torch.tensor([10]))
    assert [int(c) for c in counters] == [11] * len(counters)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_the_proof_restores_memory_the_graph_writes_outside_the_arena():
    """A block of torch's allocator that ATen or Triton kernels write is the model's own state:
    listed for the proof to restore; the library's scratch (given a private copy) is not, a
    workspace of torch's allocator that only a library's kernels write neither."""
    from nimble.engine.arena_layout import library_scratch, shared_state, written_externals
    from nimble.ir.taskgraph import Access, Buffer, Task, TaskGraph

    bf16 = TaskGraph.load(FIXTURE_DIR / "inception_v3_bfloat16.json.gz")
    blocks = {b.id for b in bf16.buffers if b.kind == "external" and b.name.startswith("block@")}
    # cuDNN's implicit-GEMM convolution writes a 32 MiB block torch cached before the recording
    (workspace,) = library_scratch(bf16)
    assert workspace in blocks and bf16.buffers[workspace].size == 32 << 20
    assert workspace in written_externals(bf16) and not shared_state(bf16)
    # the same block written by an ATen kernel as well (a cache the model updates) is state
    cache = TaskGraph(tasks=[Task(0, "kernel", name="_ZN2at6native18index_copy_kernelEv",
                                  accesses=[Access(1, 0, 64, True)]),
                             Task(1, "kernel", name="sm90_xmma_gemm_f16f16_f16f32",
                                  accesses=[Access(1, 0, 64, True)])],
                      buffers=[Buffer(0, "external", 64, 0x1000, "block@0x1000"),
                               Buffer(1, "external", 64, 0x2000, "block@0x2000")])
    assert shared_state(cache) == [(0x2000, 64)] and not written_externals(cache)
    cache.tasks[0].accesses = []  # only the library writes it now: a workspace
    assert library_scratch(cache) == [1] and not shared_state(cache)
    train = TaskGraph.load(FIXTURE_DIR / "resnet50_train.json.gz")
    private = {(train.buffers[b].address, train.buffers[b].size) for b in written_externals(train)}
    assert private and not private & set(shared_state(train))
    assert not shared_state(TaskGraph.load(FIXTURE_DIR / "resnet50.json.gz"))


def test_the_generate_bench_times_every_mode_and_checks_every_sequence(monkeypatch, capsys):
    """``nimble bench --generate`` on the CPU with its GPU parts stood in for (the model, the
    synchronisation, Nimble's prepare, the trace): every mode timed, every sequence checked,
    the table printed, and status 1 only when Nimble on eager kernels gives other tokens."""
    pytest.importorskip("transformers")
    import argparse

    from nimble.cli import generate_bench

    monkeypatch.setattr(generate_bench, "causal_lm", lambda name, dtype: _tiny("llama"))
    monkeypatch.setattr(generate_bench, "require_gpu", lambda command: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(generate_bench, "_decode_step_shape", lambda generator, batch, *_: {
        "dag_width": 5, "streams": 4, "tasks": 60, "concurrency": 1.5,
        "breakdown_text": "stand-in breakdown\n"})
    # the baseline's loop with its step run as it is (no CUDA graphs on the CPU)
    monkeypatch.setattr(generate_bench, "compiled_loop", lambda model, length: compiled_loop(
        model, length, compile=lambda fn, **options: fn))
    monkeypatch.setattr(generate_bench.decode_bandwidth, "copy_bandwidth", lambda: 4e12)

    def eager_generators(model, args, batch):
        return {mode: Generator(model, max(args.prompt_lengths) + args.new_tokens,
                                args.prompt_lengths, [batch], prepare_step=run_eagerly)
                for mode in ("nimble", "nimble+inductor")}
    monkeypatch.setattr(generate_bench, "nimble_generators", eager_generators)
    args = argparse.Namespace(models=["llama_small"], dtypes=["float32"], batches=[2],
                              prompt_lengths=[8, 16], new_tokens=6, rounds=2, quiet=True,
                              json=None, training=False, profiler=False, breakdown=True)
    assert generate_bench.run(args) == 0
    report = capsys.readouterr().out
    assert "llama_small (float32, batch 2): 6 new tokens, (T6 - T3) / 3 per token" in report
    assert "device copy bandwidth 4.00 TB/s" in report
    assert "where nimble's decode step spends its time:\nstand-in breakdown" in report
    for mode in generate_bench.MODES:
        assert f"\n{mode} " in report, report
    info = generate_bench.bench_generate("llama_small", args, "float32", 2)
    assert set(info["modes"]) == set(generate_bench.MODES)
    for row in info["modes"].values():
        # a per-token time is a difference of two timings: on a busy CPU, with a tiny model
        # and 6 tokens, it may come out at or below zero; on the GPU it is the bench's number
        assert math.isfinite(row["token_ms_median"]) and set(row["prefill_ms"]) == {"8", "16"}
        assert row["mismatch"] == {"sequences": 0, "first_token": None, "near_ties": 0,
                                   "margins_ulp": []}
    assert info["modes"]["static+compile"]["x_compiled"] == 1.0
    assert info["modes"]["compiled loop"]["x_loop"] == 1.0
    # every row's bandwidth is the same bytes over its own time
    needed = info["bytes"]
    assert needed["weights"] == sum(p.numel() * 4 for p in _tiny("llama").parameters())
    assert needed["slots_read"] == 8 + (3 + 6 - 1) / 2
    for row in info["modes"].values():
        if row["token_ms_median"] > 0:
            assert row["bandwidth"]["bytes_per_s"] == pytest.approx(
                needed["per_step"] / (row["token_ms_median"] / 1e3))
            assert row["bandwidth"]["of_copy"] == pytest.approx(
                row["bandwidth"]["bytes_per_s"] / 4e12)
    info["modes"]["nimble"]["mismatch"] = {"sequences": 1, "first_token": 20, "near_ties": 1}
    assert generate_bench._status(generate_bench.Outcome(results=[info])) == 0
    info["modes"]["nimble"]["mismatch"] = {"sequences": 2, "first_token": 20, "near_ties": 1}
    assert generate_bench._status(generate_bench.Outcome(results=[info])) == 1
    # a mode that fails is reported on its own line; the others keep their numbers
    monkeypatch.setattr(generate_bench, "nimble_generators", lambda model, args, batch: {
        **eager_generators(model, args, batch), "nimble+inductor": "RecordError: stand-in"})
    info = generate_bench.bench_generate("llama_small", args, "float32", 2)
    assert info["modes"]["nimble+inductor"] == {"error": "RecordError: stand-in"}
    # a ratio of two differences of timings: finite, of either sign on a busy CPU
    assert math.isfinite(info["modes"]["nimble"]["x_compiled"]) and "nimble+inductor" not in \
        info["decode_step"]
    assert "nimble+inductor: FAILED: RecordError: stand-in" in generate_bench.format_result(info)
    assert generate_bench._status(generate_bench.Outcome(results=[info])) == 1


def test_a_departure_is_a_near_tie_only_where_the_reference_chose_by_a_few_ulps():
    from nimble.cli import generate_bench

    want = torch.tensor([[5, 1, 2, 3], [5, 1, 2, 3], [5, 1, 2, 3]])
    got = torch.tensor([[5, 1, 2, 3], [5, 1, 0, 0], [5, 0, 2, 3]])
    logits = torch.zeros(3, 3, 4, dtype=torch.float16)  # 3 new tokens after a 1-token prompt
    logits[1, 1] = torch.tensor([4.0 - 2 * 2**-8, 0, 4.0, 0])  # row 1 departs by 2 ulps at 4.0
    logits[0, 2] = torch.tensor([0, 4.0, 3.0, 0])  # row 2 departs to a logit 4.0 lower
    result = generate_bench._mismatches(got, want, logits)
    assert result == {"sequences": 2, "first_token": 1, "near_ties": 1,
                      "margins_ulp": [2.0, 1024.0]}
    assert generate_bench.wrong_sequences(result) == 1
    assert generate_bench._mismatches(got, want)["margins_ulp"] == [None, None]
    # transformers hands out float32 logits of a float16 model: float16's rounding counts
    as_float32 = generate_bench._mismatches(got, want, logits.float(), torch.float16)
    assert as_float32["margins_ulp"] == [2.0, 1024.0]
    assert generate_bench._mismatches(got, want, logits.float())["margins_ulp"][0] == 2.0 * 2**13
    assert unit_in_last_place(4.0, torch.float16) == 2**-8
    assert unit_in_last_place(0.0, torch.bfloat16) > 0
    assert generate_bench._differ(result) == "2 (1 tie)"


def test_the_generate_bench_refuses_unknown_models_and_other_benches():
    from nimble.cli.main import main

    assert main(["bench", "--generate", "resnet50"]) == 2
    assert main(["bench", "--generate", "--training", "gpt2"]) == 2


def test_the_generate_bench_decodes_in_float16_unless_a_dtype_is_given(monkeypatch):
    from nimble.cli import bench, main as cli

    seen = []
    monkeypatch.setattr(bench, "run_generate", lambda args: seen.append(args.dtypes) or 0)
    for argv, dtypes in ((["bench", "--generate"], ["float16"]),
                         (["bench", "--generate", "--dtype", "float32"], ["float32"]),
                         (["bench", "--generate", "--dtype", "bfloat16,float16"],
                          ["bfloat16", "float16"])):
        assert bench.run(cli.build_parser("bench").parse_args(argv)) == 0
        assert seen.pop() == dtypes


def _decode_frozen_at_its_position(module, examples):
    """A stand-in ``prepare_step`` whose decode step ignores the position it is given and runs at
    the one it was prepared at, as a graph would that froze a Python-side counter."""
    if not isinstance(module, DecodeStep):
        return run_eagerly(module, examples)
    [(_, prepared_at)] = examples

    def call(ids, position):
        with torch.no_grad():
            return module(ids, prepared_at)
    return call


def test_a_decode_step_frozen_at_the_position_it_was_prepared_at_is_a_capture_error():
    pytest.importorskip("transformers")
    model = _tiny("llama")
    with pytest.raises(CaptureError, match=r"prepared at cache position 16; at position 47 .*"
                                           r"prepared positions: 16 only"):
        Generator(model, max_cache_len=48, prompt_buckets=[16], batch_sizes=[2],
                  prepare_step=_decode_frozen_at_its_position)


def test_the_position_check_leaves_the_cache_as_it_found_it():
    pytest.importorskip("transformers")
    model = _tiny("gpt2")
    generator = Generator(model, max_cache_len=40, prompt_buckets=[8], batch_sizes=[1],
                          prepare_step=run_eagerly)
    ids = torch.randint(0, VOCAB, (1, 8))
    assert torch.equal(generator.generate(ids, 24), library_greedy(model, ids, 24))
    cache = generator.caches[1]
    before = [t.clone() for t in generate_module._cache_tensors(cache)]
    generator._check_at_another_position(1, generator._steps[1])
    assert all(torch.equal(a, b) for a, b in zip(before, generate_module._cache_tensors(cache)))


def _library_with_eos(model, ids, new_tokens: int, eos: int, max_cache_len: int):
    import transformers

    cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          disable_compile=True, max_new_tokens=new_tokens, eos_token_id=eos,
                          pad_token_id=0, past_key_values=cache)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_an_end_of_sequence_token_pads_and_stops_as_the_library_does(name):
    """A sequence that produced the end-of-sequence token gets the pad token from then on, and
    the result ends where the last sequence finished: the library's own tokens and length."""
    pytest.importorskip("transformers")
    model = _tiny(name)
    generator = Generator(model, max_cache_len=64, prompt_buckets=[16], batch_sizes=[1, 3],
                          prepare_step=run_eagerly)
    torch.manual_seed(5)
    for batch in (1, 3):
        ids = torch.randint(1, VOCAB, (batch, 16))
        free = generator.generate(ids, 40)
        for eos in (int(free[0, 16 + 3]), int(free[-1, 16 + 30])):
            want = _library_with_eos(model, ids, 40, eos, 64)
            got = generator.generate(ids, 40, eos_token_id=eos)
            assert torch.equal(got, want), (batch, eos, got.shape, want.shape)
    # a batch of one stops early: 4 new tokens, the last of them the end-of-sequence token
    ids = torch.randint(1, VOCAB, (1, 16))
    eos = int(generator.generate(ids, 40)[0, 16 + 3])
    got = generator.generate(ids, 40, eos_token_id=eos)
    assert got.shape[1] <= 16 + 4 and int(got[0, -1]) == eos


def test_library_greedy_hands_its_compile_config_to_a_compiled_generate_only():
    """The bench's static+backend row: generate() gets the CompileConfig (its backend
    "nimble") when compiled, and never an eager one."""
    from nimble.generate import library_greedy

    seen = []

    class StandIn:
        def generate(self, ids, **kwargs):
            seen.append(kwargs)
            return ids

    config = object()
    ids = torch.zeros((1, 3), dtype=torch.long)
    library_greedy(StandIn(), ids, 4, compiled=True, compile_config=config)
    library_greedy(StandIn(), ids, 4, compiled=False, compile_config=config)
    assert seen[0]["compile_config"] is config and not seen[0]["disable_compile"]
    assert "compile_config" not in seen[1] and seen[1]["disable_compile"]
