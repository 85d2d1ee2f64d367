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


def test_bench_zoo_model_without_its_package_is_one_line(no_gpu, monkeypatch, capsys):
    monkeypatch.setattr(common, "_installed", lambda package: False)
    assert cli.main(["bench", "branchy", "resnet50"]) == 2
    assert "resnet50 needs torchvision" in _one_error_line(capsys)
    assert cli.main(["bench", "pnasnet5large"]) == 2
    assert "pnasnet5large needs timm" in _one_error_line(capsys)


@no_real_gpu
@pytest.mark.skipif(common._installed("torchvision"), reason="torchvision is installed here")
def test_record_zoo_model_without_torchvision_is_one_line(capsys):
    assert cli.main(["record", "googlenet"]) == 2
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
