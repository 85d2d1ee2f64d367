"""The fair decoding bench's parts without a GPU (issue 53): the bytes a decode step must read,
the bandwidth arithmetic, the timed span, the Llama-3.2-1B shape, and the compiled loop's
tokens with its step run as it is (no CUDA graphs on the CPU)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from nimble.cli import decode_bandwidth as bw
from nimble.cli.decode_bandwidth import StepBytes, kv_bytes_per_slot, mean_slots_read, used
from nimble.cli.generate_bench import timed_span


def test_the_timed_span_is_the_issues_64_less_16_and_halves_below_that():
    assert timed_span(64) == (16, 64) and timed_span(17) == (16, 17)
    assert timed_span(16) == (8, 16) and timed_span(6) == (3, 6) and timed_span(2) == (1, 2)


def test_the_slots_read_are_averaged_over_the_timed_tokens():
    # tokens 17..64 after 128 prompt tokens come from the steps at positions 143..190, which
    # read 144..191 slots
    assert mean_slots_read(128, 16, 64) == pytest.approx(sum(range(144, 192)) / 48)
    assert mean_slots_read(10, 1, 2) == 11  # token 2: the step at position 10
    with pytest.raises(ValueError, match="short < long"):
        mean_slots_read(10, 4, 4)


def test_a_steps_bytes_and_the_bandwidth_it_gets():
    step = StepBytes(weights=2_000_000_000, kv_per_slot=1_000_000, slots_read=100.5)
    assert step.kv == 100_500_000 and step.total == 2_100_500_000
    got = used(step, 1.0, 4e12)
    assert got["bytes_per_s"] == pytest.approx(2.1005e12)
    assert got["of_copy"] == pytest.approx(2.1005e12 / 4e12)
    assert used(step, 1.0, None) == {"bytes_per_s": pytest.approx(2.1005e12), "of_copy": None}
    assert used(step, 0.0, 4e12) == {"bytes_per_s": None, "of_copy": None}


def test_the_llama3_1b_shape_has_tied_weights_of_its_published_size():
    pytest.importorskip("transformers")
    import transformers

    from nimble.cli.decoders import CAUSAL_LMS, config_of

    config = config_of("llama3_1b")
    assert "llama3_1b" in CAUSAL_LMS and config.tie_word_embeddings
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size) == \
        (2048, 16, 32, 8, 8192, 128256)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # 1,235,814,400 parameters: each layer's attention (2048 x (2048 + 2 x 512 + 2048)), MLP
    # (3 x 2048 x 8192) and two norms, the tied table once, the final norm
    layer = 2048 * (2048 + 2 * 512 + 2048) + 3 * 2048 * 8192 + 2 * 2048
    assert bw.weight_bytes(model) == 2 * (16 * layer + 128256 * 2048 + 2048)


def test_a_static_caches_slot_is_every_layers_keys_and_values():
    pytest.importorskip("transformers")
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=100)
    model = transformers.LlamaForCausalLM(config).eval()
    cache = transformers.StaticCache(config=config, max_cache_len=40)
    with torch.no_grad():
        model(input_ids=torch.zeros((5, 1), dtype=torch.long), past_key_values=cache,
              use_cache=True)
    # batch 5, 2 key-value heads of 16, float32, keys and values, 3 layers
    assert kv_bytes_per_slot(cache) == 5 * 2 * 16 * 4 * 2 * 3


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_compiled_loop_gives_the_librarys_greedy_tokens(name):
    """The loop with its step run as it is: the tokens of ``generate(do_sample=False)`` with a
    static cache, over two calls on one cache (it is reset between them), per batch size."""
    pytest.importorskip("transformers")
    from test_generate import _tiny

    from nimble.cli.decode_loop import compiled_loop
    from nimble.generate import library_greedy

    model = _tiny(name)
    compiled = []

    def compile(fn, **options):
        compiled.append(options)
        return fn
    torch.manual_seed(3)
    for batch in (1, 2):
        loop = compiled_loop(model, 64, compile=compile)
        for length in (12, 7):
            ids = torch.randint(0, 1000, (batch, length))
            assert torch.equal(loop(ids, 9), library_greedy(model, ids, 9))
    assert compiled == [{"mode": "reduce-overhead", "fullgraph": True}] * 2


def test_the_loops_step_is_one_graph_for_dynamo():
    """``fullgraph=True`` holds: Dynamo traces the step of this transformers without a break
    (its eager backend: no compiler on the CPU), and the tokens stay the library's."""
    pytest.importorskip("transformers")
    from test_generate import _tiny

    from nimble.cli.decode_loop import compiled_loop
    from nimble.generate import library_greedy

    torch._dynamo.reset()
    model = _tiny("llama")
    loop = compiled_loop(model, 64, compile=lambda fn, **options: torch.compile(
        fn, backend="eager", fullgraph=options["fullgraph"]))
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(5))
    assert torch.equal(loop(ids, 6), library_greedy(model, ids, 6))


def test_the_breakdown_says_what_the_weight_prefetch_measured_when_asked():
    from nimble.cli.generate_bench import _breakdown_text

    measured = {"phase": 0, "plan": "gaps", "plain_ms": 1.25, "prefetch_ms": 1.125,
                "windows": 3, "bytes": 60e6, "kept": True}
    info = {"show_breakdown": True, "decode_step": {
        "nimble": {"breakdown_text": "stand-in\n", "prefetch_l2": [measured]},
        "nimble+inductor": {"trace_error": "CudaError: stand-in", "prefetch_l2": None}}}
    assert _breakdown_text(info) == (
        "where nimble's decode step spends its time:\nstand-in\n"
        "  weight prefetch (gaps): 1.250 ms per launch without, 1.125 with 3 prefetches of "
        "60.0 MB in all; kept\n"
        "where nimble+inductor's decode step spends its time:\n"
        "(no trace: CudaError: stand-in)")
    assert _breakdown_text({**info, "show_breakdown": False}) == ""


def test_the_breakdown_says_what_the_programmatic_edges_measured():
    from nimble.cli.generate_bench import _breakdown_text

    timed = {"phase": 0, "plain_ms": 1.25, "programmatic_ms": 1.2, "edges": 40,
             "measured": True, "kept": True}
    served = {"phase": None, "edges": 12, "measured": False, "kept": True}
    info = {"show_breakdown": True, "decode_step": {
        "nimble+inductor": {"breakdown_text": "stand-in\n", "programmatic": [timed]},
        "nimble": {"breakdown_text": "stand-in\n", "programmatic": [served]}}}
    assert _breakdown_text(info) == (
        "where nimble+inductor's decode step spends its time:\nstand-in\n"
        "  programmatic edges: 1.250 ms per launch without, 1.200 with 40 edge(s); kept\n"
        "where nimble's decode step spends its time:\nstand-in\n"
        "  programmatic edges: served unmeasured: 12 edge(s); kept")


@pytest.mark.parametrize("prefetch,programmatic", [(False, None), (True, None), (False, True),
                                                   (False, False), (True, False)])
def test_the_nimble_steps_are_prepared_with_the_levers_asked_for(monkeypatch, prefetch,
                                                                 programmatic):
    """--prefetch-l2 and --programmatic / --no-programmatic reach PrepareOptions; neither
    given: its defaults (programmatic edges on)."""
    import argparse

    import nimble.generate as generate_module
    from nimble.cli import generate_bench

    asked = []
    monkeypatch.setattr(generate_module, "prepare_with_nimble",
                        lambda options=None, compile_steps=False, **inductor: asked.append(
                            (options and (options.prefetch_l2, options.programmatic_launch),
                             compile_steps, inductor)))
    monkeypatch.setattr(generate_module, "Generator", lambda *args, **kwargs: "generator")
    args = argparse.Namespace(prompt_lengths=[8], new_tokens=4, prefetch_l2=prefetch,
                              programmatic=programmatic)
    assert generate_bench.nimble_generators(None, args, 1) == {"nimble": "generator",
                                                         "nimble+inductor": "generator"}
    default = {"compile_mode": None, "compile_options": None}
    want = None if not prefetch and programmatic is None else \
        (prefetch, True if programmatic is None else programmatic)
    assert asked == [(want, False, {}), (want, True, default)]
    from nimble.cli.generate_levers import add_lever_arguments

    parser = argparse.ArgumentParser()
    add_lever_arguments(parser)
    assert [parser.parse_args(a).programmatic for a in ([], ["--programmatic"],
                                                         ["--no-programmatic"])] == \
        [None, True, False]


def test_nimble_inductors_kernels_are_compiled_as_the_bench_is_told(monkeypatch):
    """--inductor-mode, --coordinate-descent and --combo-kernels reach torch.compile for
    nimble+inductor (the settings reach the rows that compile themselves too: the next test);
    a mode that makes CUDA graphs of its own, or both at once, is an InputError."""
    import argparse

    import nimble.generate as generate_module
    from nimble.cli import generate_bench
    from nimble.errors import InputError

    asked = []
    monkeypatch.setattr(generate_module, "prepare_with_nimble",
                        lambda options=None, compile_steps=False, **inductor: asked.append(
                            (compile_steps, inductor)))
    monkeypatch.setattr(generate_module, "Generator", lambda *args, **kwargs: "generator")
    args = argparse.Namespace(prompt_lengths=[8], new_tokens=4,
                              inductor_mode="max-autotune-no-cudagraphs")
    generate_bench.nimble_generators(None, args, 1)
    args = argparse.Namespace(prompt_lengths=[8], new_tokens=4, coordinate_descent=True)
    generate_bench.nimble_generators(None, args, 1)
    args = argparse.Namespace(prompt_lengths=[8], new_tokens=4, combo_kernels=True,
                              coordinate_descent=True)
    generate_bench.nimble_generators(None, args, 1)
    assert asked == [
        (False, {}), (True, {"compile_mode": "max-autotune-no-cudagraphs",
                             "compile_options": None}),
        (False, {}), (True, {"compile_mode": None,
                             "compile_options": {"coordinate_descent_tuning": True}}),
        (False, {}), (True, {"compile_mode": None,
                             "compile_options": {"coordinate_descent_tuning": True,
                                                 "combo_kernels": True}})]
    monkeypatch.undo()
    with pytest.raises(InputError, match="without its CUDA graphs"):
        generate_module.prepare_with_nimble(None, True, compile_mode="reduce-overhead")
    with pytest.raises(InputError, match="not both"):
        generate_module.prepare_with_nimble(None, True, compile_mode="default",
                                            compile_options={"coordinate_descent_tuning": True})


def test_the_rows_that_compile_themselves_compile_under_the_nimble_rows_settings():
    """A setting of Inductor's is every row's lever: the compiled loop and generate()'s
    compiled forward compile under --coordinate-descent and --combo-kernels as nimble+inductor
    does, and run as they are without them."""
    import argparse

    import torch._inductor.config as inductor_config

    from nimble.cli.generate_levers import compiled_under

    def run(ids, new):
        return (inductor_config.coordinate_descent_tuning, inductor_config.combo_kernels, new)
    plain = argparse.Namespace()
    assert compiled_under(run, plain) is run
    before = run(None, 1)
    tuned = compiled_under(run, argparse.Namespace(coordinate_descent=True, combo_kernels=True))
    assert tuned(None, 3) == (True, True, 3)
    assert run(None, 1) == before  # the settings are the call's alone
    only = compiled_under(run, argparse.Namespace(combo_kernels=True))
    assert only(None, 2)[1:] == (True, 2)


def test_the_bench_puts_every_rows_attention_on_the_kernel_only_where_asked(monkeypatch):
    import argparse

    import nimble.decode_attention as da
    from nimble.cli.generate_bench import _header
    from nimble.cli.generate_levers import attention_if_asked

    swapped = []
    monkeypatch.setattr(da, "decode_attention", lambda model: swapped.append(model))
    info: dict = {}
    attention_if_asked("model", argparse.Namespace(), info)
    assert not swapped and "decode_attention" not in info
    attention_if_asked("model", argparse.Namespace(decode_attention=True), info)
    assert swapped == ["model"] and info["decode_attention"] is True
    head = _header({"model": "m", "dtype": "bfloat16", "batch": 1, "new_tokens": 64,
                    "rounds": 1, "decode_attention": True})
    assert any("nimble::decode_attention" in line for line in head)


def test_the_decode_steps_shape_comes_from_one_trace_at_the_timed_tokens_middle(tmp_path):
    from test_breakdown import _diamond

    from nimble.cli.generate_bench import _decode_step_shape
    from nimble.debug.timeline import Timeline

    graph, schedule, times = _diamond()
    traced = []

    class Decode:
        def __init__(self, fails: bool) -> None:
            self.graph, self.schedule, self.fails = graph, schedule, fails
            self.programmatic_edges = [(0, 1)]

        def trace(self, ids, position):
            traced.append((tuple(ids.shape), int(position)))
            if self.fails:
                raise RuntimeError("stand-in\nsecond line")
            return Timeline(graph, schedule, times)

    def generator(fails: bool):
        return SimpleNamespace(steps=lambda batch: (Decode(fails), None),
                               model=torch.nn.Linear(2, 2), decode_position=16)
    needed = StepBytes(weights=6 << 20, kv_per_slot=0, slots_read=167.5)
    shape = _decode_step_shape(generator(False), 3, needed, 1e12)
    assert traced == [((3, 1), 166)]  # the step at position 166 reads 167 slots
    assert shape["concurrency"] == pytest.approx(47 / 40)
    assert shape["breakdown"]["tasks"] == 4 and shape["breakdown"]["copy_bytes_per_s"] == 1e12
    assert "4 tasks in 40.0 µs" in shape["breakdown_text"]
    assert shape["prefetch_l2"] is None and "trace_error" not in shape
    assert shape["programmatic_edges"] == 1 and shape["programmatic"] is None
    kept = _decode_step_shape(generator(False), 3, needed, 1e12, trace_file=tmp_path / "t.json")
    assert kept["trace_file"] == str(tmp_path / "t.json")
    again = Timeline.from_chrome(json.loads((tmp_path / "t.json").read_text()))
    assert again.times == times  # the run analysed again offline, as nimble inspect reads it
    failed = _decode_step_shape(generator(True), 1)
    assert traced[-1] == ((1, 1), 16) and failed["concurrency"] is None
    assert failed["trace_error"] == "RuntimeError: stand-in second line"  # one line
    assert "breakdown" not in failed


def test_the_8b_shape_is_llama_3_8b_and_built_on_the_gpu():
    pytest.importorskip("transformers")
    from nimble.cli.decoders import BUILT_ON_GPU, CAUSAL_LMS, config_of

    config = config_of("llama3_8b")
    assert "llama3_8b" in CAUSAL_LMS and "llama3_8b" in BUILT_ON_GPU
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size,
            config.num_key_value_heads, config.vocab_size) == (4096, 32, 14336, 8, 128256)
    assert not config.tie_word_embeddings


def test_the_nimble_steps_are_prepared_with_the_attention_kernels_asked_for(monkeypatch):
    """--sdpa-backends: the Generators are made (recorded, compiled) inside torch's
    sdpa_kernel of those backends, and only they; a name torch has not is a usage error."""
    import argparse

    import torch

    import nimble.generate as generate_module
    from nimble.cli import generate_levers

    seen = []
    monkeypatch.setattr(generate_module, "prepare_with_nimble", lambda *a, **k: None)
    monkeypatch.setattr(generate_module, "Generator", lambda *a, **k: seen.append(
        (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())))
    args = argparse.Namespace(prompt_lengths=[8], new_tokens=4,
                              sdpa_backends=generate_levers.parse_sdpa_backends("flash"))
    generate_levers.nimble_generators(None, args, 1)
    assert seen == [(True, False), (True, False)]
    assert torch.backends.cuda.math_sdp_enabled()  # as it was, after
    with pytest.raises(argparse.ArgumentTypeError, match="fast.*not attention backends"):
        generate_levers.parse_sdpa_backends("flash,fast")
