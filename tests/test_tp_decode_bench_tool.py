"""tools/tp_decode_bench.py on the CPU: its arguments and its report lines."""
from __future__ import annotations

import pytest
from helpers import load_tool

bench = load_tool("tp_decode_bench")


def test_the_arguments_default_to_the_issues_case():
    args = bench.parse_args([])
    assert (args.model, args.dtype, args.batch, args.prompt, args.new_tokens) == \
        ("llama_1b", "bfloat16", [1, 8], 128, 64)
    assert bench.parse_args(["llama_small", "--batch", "2,4"]).batch == [2, 4]


def test_a_row_reports_its_time_or_its_error():
    row = {"token_ms_median": 1.2345, "token_ms_p90": 1.5, "tokens_per_s": 6480.4}
    assert bench.report_line(2, 8, "nimble", row) == \
        "2 GPU(s), batch 8, nimble: 1.234 ms/token (p90 1.500), 6480 tokens/s"
    assert bench.report_line(1, 1, "compiled loop", {"error": "Unsupported: x"}) == \
        "1 GPU(s), batch 1, compiled loop: failed: Unsupported: x"


def test_modes_are_chosen_by_name_and_an_unknown_one_is_refused(capsys):
    assert bench.parse_args([]).modes == ["nimble", "compiled loop"]
    assert bench.parse_args(["--modes", "nimble+inductor"]).modes == ["nimble+inductor"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--modes", "nimble,fast"])
    assert "modes are nimble, nimble+inductor, nimble+fast, compiled loop" in \
        capsys.readouterr().err


def test_a_generator_row_says_how_its_decode_step_is_launched():
    row = {"token_ms_median": 2.0, "token_ms_p90": 2.5, "tokens_per_s": 4000.0, "launch": "host"}
    assert bench.report_line(2, 8, "nimble", row).endswith(
        "4000 tokens/s, decode step host-launched")
    assert not bench.parse_args([]).graph_mixing
    assert bench.parse_args(["--graph-mixing"]).graph_mixing


def test_the_all_reduce_is_chosen_by_name():
    assert bench.parse_args([]).all_reduce == "nccl"
    assert bench.parse_args(["--all-reduce", "one_shot"]).all_reduce == "one_shot"
    assert bench.parse_args(["--all-reduce", "peer"]).all_reduce == "peer"
    assert bench.parse_args([]).head == "vocab"
    assert bench.parse_args(["--head", "whole"]).head == "whole"
    assert bench.parse_args([]).prefetch is None
    assert bench.parse_args(["--prefetch", "gaps"]).prefetch == "gaps"
    with pytest.raises(SystemExit):
        bench.parse_args(["--all-reduce", "ring"])
