"""Where output goes (no GPU): progress on the ``nimble`` logger, silent in the library until the
application configures logging, on stderr in the command line unless ``-q``; ``-`` as stdout for
every output-file option; one meaning and one syntax per flag across commands."""
from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest
import torch

import nimble.cli.main as cli
from nimble import progress
from nimble.analysis import report as ins
from nimble.cli import bench as bench_cli
from nimble.cli import models
from nimble.debug.timeline import Timeline
from nimble.ir.synthetic import branchy_graph

from test_bench_format import _info

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def graph_file(tmp_path):
    return branchy_graph().save(tmp_path / "g.json.gz")


# ---- logging --------------------------------------------------------------------------------

def test_the_library_prints_nothing_and_logs_on_the_nimble_logger(capsys, caplog):
    with caplog.at_level(logging.INFO, logger="nimble"):
        progress.say("scheduling 3 tasks", tag="bench")
        progress.say("hidden at INFO", quiet=True)
    assert capsys.readouterr() == ("", "")
    [record] = [r for r in caplog.records if r.name == "nimble"]
    assert record.getMessage() == "scheduling 3 tasks" and record.tag == "bench"
    assert record.levelno == logging.INFO
    assert any(isinstance(h, logging.NullHandler) for h in progress.logger.handlers)


def test_quiet_logs_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="nimble"):
        progress.say("detail", quiet=True)
    assert [(r.getMessage(), r.levelno) for r in caplog.records] == [("detail", logging.DEBUG)]


def test_no_print_outside_the_command_line():
    """The library logs; only ``nimble/cli`` prints."""
    calls = []
    for path in (ROOT / "nimble").rglob("*.py"):
        if "cli" in path.relative_to(ROOT / "nimble").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert calls == []


def test_the_command_line_logs_progress_on_stderr_and_q_silences_it(graph_file, capsys):
    assert cli.main(["inspect", str(graph_file), "--schedule"]) == 0
    out, err = capsys.readouterr()
    assert "loaded" in err and "scheduled in" in err and "schedule" in out
    assert cli.main(["inspect", str(graph_file), "--schedule", "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_the_command_line_leaves_the_logger_as_it_found_it(graph_file, capsys):
    before = (progress.logger.level, list(progress.logger.handlers), progress.logger.propagate)
    assert cli.main(["inspect", str(graph_file)]) == 0
    assert (progress.logger.level, list(progress.logger.handlers),
            progress.logger.propagate) == before
    capsys.readouterr()
    progress.say("after the command")  # the library is quiet again
    assert capsys.readouterr().err == ""


def test_tagged_lines(monkeypatch, capsys):
    from nimble.cli.output import logging_to_stderr

    with logging_to_stderr(quiet=False):
        progress.say("timing", tag="bench")
        progress.say("bare", tag=None)
    assert capsys.readouterr().err == "[bench] timing\nbare\n"


# ---- '-' is stdout --------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["--export", "--dot", "--simulated-trace", "--json"])
def test_every_inspect_output_takes_dash_for_stdout(option, graph_file, tmp_path, capsys,
                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["inspect", str(graph_file), option, "-"]) == 0
    out, err = capsys.readouterr()
    assert not (tmp_path / "-").exists()
    if option == "--dot":
        assert out.startswith("digraph taskgraph {")
    else:
        json.loads(out)
    if option != "--json":  # the text report moved to stderr
        assert "tasks:" in err and "tasks:" not in out


def test_two_outputs_on_stdout_are_refused(graph_file, capsys):
    assert cli.main(["inspect", str(graph_file), "--export", "-", "--json", "-"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--json" in err and "--export" in err and "stdout" in err


def test_json_is_a_file_everywhere_and_the_text_report_stays(graph_file, tmp_path, capsys):
    report = tmp_path / "report.json"
    assert cli.main(["inspect", str(graph_file), "--json", str(report), "-q"]) == 0
    out, _ = capsys.readouterr()
    assert "tasks:" in out and json.loads(report.read_text())["tasks"] > 0
    assert cli.main(["inspect", str(graph_file), "--json"]) == 0  # bare: stdout, as before
    assert json.loads(capsys.readouterr().out)["tasks"] > 0


def test_bench_json_dash_is_stdout_and_its_tables_go_to_stderr(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(bench_cli, "bench_model",
                        lambda name, args, dtype: _info(name, 0.5, dtype, quick=args.quick))
    assert cli.main(["bench", models.BUILTIN, "--quick", "--json", "-", "-q"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["results"][0]["model"] == models.BUILTIN
    assert "x graph" in err


# ---- flags ----------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["record", "branchy"], ["debug", "branchy"], ["bench"]])
@pytest.mark.parametrize("batch", ["0", "-3", "x"])
def test_a_bad_batch_is_named_before_the_gpu_check(command, batch, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main([*command, "--batch", batch]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--batch" in err and "GPU" not in err


def test_batch_has_one_syntax_a_list_where_several_make_sense():
    bench = cli.build_parser("bench").parse_args(["bench", "--batch", "32,64"])
    record = cli.build_parser("record").parse_args(["record", "branchy", "--batch", "32"])
    debug = cli.build_parser("debug").parse_args(["debug", "branchy", "--batch", "8"])
    assert bench.batches == [32, 64] and record.batch == 32 and debug.batch == 8
    with pytest.raises(SystemExit):
        cli.build_parser("record").parse_args(["record", "branchy", "--batch", "32,64"])


def test_inspect_trace_names_its_new_spelling(graph_file, capsys):
    assert cli.main(["inspect", str(graph_file), "--trace", "t.json"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--simulated-trace" in err


def test_a_measured_trace_is_summarised_and_refuses_graph_options(tmp_path, capsys):
    graph = branchy_graph()
    schedule = ins.analyze(graph).schedule
    trace = Timeline(graph, schedule, ins.simulate(graph, schedule)).to_chrome()
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(trace))
    assert cli.main(["inspect", str(path)]) == 0
    assert "measured trace" in capsys.readouterr().out
    assert cli.main(["inspect", str(path), "--memplan"]) == 2
    err = capsys.readouterr().err
    assert "measured trace" in err and "--memplan" in err


def test_a_plan_export_gives_streams_syncs_and_arena(graph_file, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert cli.main(["inspect", str(graph_file), "--export", str(plan), "-q"]) == 0
    capsys.readouterr()
    assert cli.main(["inspect", str(plan), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    data = json.loads(plan.read_text())
    assert summary["streams"] == data["num_streams"]
    assert summary["sync_edges"] == len(data["sync_edges"])
    assert summary["arena_bytes"] == data["arena_bytes"]


def test_a_path_taken_by_json_is_named_and_nothing_is_written(graph_file, capsys):
    before = graph_file.read_bytes()
    assert cli.main(["inspect", "--json", str(graph_file)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--json -" in err
    assert graph_file.read_bytes() == before


@pytest.mark.parametrize("command", [["record", "branchy", "-o"], ["bench", "--json"],
                                     ["debug", "branchy", "--trace"]])
def test_an_output_that_cannot_be_written_is_named_before_any_work(command, tmp_path,
                                                                    monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def must_not_run(*a, **k):
        raise AssertionError("work started")

    monkeypatch.setattr(bench_cli, "bench_model", must_not_run)
    monkeypatch.setattr(torch.cuda, "get_device_name", must_not_run)
    monkeypatch.setattr(models, "create", must_not_run)
    for target, why in ((tmp_path / "no_dir" / "out.json", "no directory"),
                        (tmp_path, "a directory")):
        assert cli.main([*command, str(target)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and why in err, err
