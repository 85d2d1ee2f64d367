"""The command line's error path: one line on stderr and status 2, never a traceback (no GPU)."""
from __future__ import annotations

import types

import pytest
import torch

from nimble.cli import bench as bench_cli

import nimble.cli.main as cli
from nimble.cli import common
from nimble.errors import CaptureError

# On a machine with a GPU, record and debug would start real work instead.
no_real_gpu = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="checks the failure on a machine without a GPU")


def _one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("nimble: ")
    return lines[0]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_bench_without_gpu_is_one_line_before_any_work(no_gpu, monkeypatch, capsys):
    def must_not_run(*a, **k):
        raise AssertionError("bench_model ran without a GPU")

    monkeypatch.setattr(bench_cli, "bench_model", must_not_run)
    assert cli.main(["bench"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("nimble: NoGpuError: ")
    assert "torch.cuda.is_available() is False" in line and "nimble inspect" in line


@no_real_gpu
@pytest.mark.parametrize("command", [["record", "branchy"], ["debug", "branchy"]])
def test_record_and_debug_without_gpu_are_one_line(command, tmp_path, capsys):
    extra = ["-o", str(tmp_path / "g.json.gz")] if command[0] == "record" else []
    assert cli.main(command + extra) == 2
    line = _one_error_line(capsys)
    assert line.startswith("nimble: NoGpuError: ") and f"nimble {command[0]} needs" in line
    assert not (tmp_path / "g.json.gz").exists()


@pytest.mark.parametrize("command", ["bench", "record", "debug"])
def test_unknown_model_is_one_line(command, no_gpu, capsys):
    assert cli.main([command, "no_such_model"]) == 2
    line = _one_error_line(capsys)
    assert "unknown model 'no_such_model'" in line and "branchy" in line


@pytest.mark.parametrize("command", [
    ["bench", "resnet50"], ["bench", "--training"], ["bench", "--training", "googlenet"],
    ["bench", "--serve", "resnet50"], ["bench", "--profiler", "resnet50"],
    ["record", "googlenet"], ["debug", "resnet50"]])
def test_without_a_gpu_the_gpu_is_said_first_not_a_missing_zoo_package(command, no_gpu,
                                                                       monkeypatch, capsys):
    """A machine without a GPU runs none of these, whatever else it lacks."""
    monkeypatch.setattr(common, "_installed", lambda package: False)
    assert cli.main(command) == 2
    line = _one_error_line(capsys)
    assert line.startswith("nimble: NoGpuError: ") and "torchvision" not in line, line


def test_bench_zoo_model_without_its_package_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(common, "require_gpu", lambda command: None)  # as with a GPU
    monkeypatch.setattr(common, "_installed", lambda package: False)
    assert cli.main(["bench", "branchy", "resnet50"]) == 2
    assert "resnet50 needs torchvision" in _one_error_line(capsys)
    assert cli.main(["bench", "pnasnet5large"]) == 2
    assert "pnasnet5large needs timm" in _one_error_line(capsys)


@pytest.mark.parametrize("command", [["record", "googlenet"], ["debug", "googlenet"],
                                     ["bench", "--serve", "googlenet"],
                                     ["bench", "--training", "googlenet"]])
def test_zoo_model_without_torchvision_is_one_line_on_a_gpu_machine(command, monkeypatch,
                                                                    capsys):
    monkeypatch.setattr(common, "require_gpu", lambda command: None)  # as with a GPU
    monkeypatch.setattr(common, "_installed", lambda package: package != "torchvision")
    assert cli.main(command) == 2
    assert "googlenet needs torchvision" in _one_error_line(capsys)


def _fake_debug(monkeypatch, error: BaseException) -> None:
    def run(args):
        raise error

    fake = types.SimpleNamespace(add_arguments=lambda p: p.add_argument("model"), run=run)
    monkeypatch.setattr(cli.importlib, "import_module",
                        lambda name: fake if name == "nimble.cli.debug" else None)


def test_nimble_error_from_a_subcommand_is_one_typed_line(monkeypatch, capsys):
    _fake_debug(monkeypatch, CaptureError("the forward synchronises with the host:\n"
                                          "  remove .item() from forward()"))
    assert cli.main(["debug", "branchy"]) == 2
    assert _one_error_line(capsys) == ("nimble: CaptureError: the forward synchronises with the "
                                       "host: remove .item() from forward()")


def test_other_failures_keep_their_traceback_when_the_gpu_is_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _fake_debug(monkeypatch, RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["debug", "branchy"])


def test_bad_dtype_is_a_usage_error(capsys):
    assert cli.main(["bench", "--dtype", "float16,float64"]) == 2
    assert "float64" in capsys.readouterr().err


def test_record_training_refuses_task_timing_in_one_line(capsys):
    assert cli.main(["record", "branchy", "--training", "--time-tasks"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nimble: InputError:") and "--training" in err


def test_python_dash_m_reports_errors_in_one_line():
    """``python -m nimble`` (how tools/gpu_suite.py runs bench) catches its own errors."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "nimble", "record", "branchy", "--training",
                        "--time-tasks"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("nimble: InputError:"), r.stderr


def test_a_fault_that_takes_the_context_stops_the_remaining_cases(monkeypatch, capsys):
    """After a case whose kernel fault left the CUDA context unusable, every later case would
    fail the same way: they are recorded as not run, naming the fault and the case."""
    from nimble.cli import harness

    faults = iter([None, "CUDA_ERROR_ILLEGAL_INSTRUCTION"])
    monkeypatch.setattr(harness, "context_fault", lambda: next(faults))
    ran = []

    def fails(label):
        def measure():
            ran.append(label)
            raise RuntimeError(f"{label} broke")
        return harness.Case(label, {"model": label}, measure)

    cases = [fails("a"), fails("b"), fails("c"), fails("d")]
    outcome = harness.run_cases(cases, str)
    assert ran == ["a", "b"]  # a failed on a healthy context; b's failure took it
    assert [f["error"] for f in outcome.failed] == [
        "RuntimeError: a broke", "RuntimeError: b broke",
        "not run: the CUDA context was lost to CUDA_ERROR_ILLEGAL_INSTRUCTION in b",
        "not run: the CUDA context was lost to CUDA_ERROR_ILLEGAL_INSTRUCTION in b"]
    out = capsys.readouterr().out
    assert "the remaining cases cannot run in this process" in out


def test_a_lost_context_ends_the_command_without_torchs_exit(monkeypatch, capsys):
    """torch frees its tensors at exit, and on a faulted context each free aborts the process
    with a C++ backtrace: the command line leaves at once, with one line saying why."""
    exits = []
    monkeypatch.setattr(cli, "context_fault", lambda: "CUDA_ERROR_ILLEGAL_ADDRESS")
    monkeypatch.setattr(cli.os, "_exit", exits.append)
    cli._exit_if_context_lost(1)
    assert exits == [1]
    line = _one_error_line(capsys)
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in line
    monkeypatch.setattr(cli, "context_fault", lambda: None)
    cli._exit_if_context_lost(0)
    assert exits == [1]


def test_no_context_fault_where_torch_never_touched_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert common.context_fault() is None
