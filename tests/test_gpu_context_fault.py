"""A kernel fault that takes the CUDA context, met by the command line's case runner: the
driver names the fault, the remaining cases are not run, and the process ends with one line
instead of torch's abort at exit."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

CHILD = r"""
import torch
import nimble.cli.main as cli
from nimble.cli.harness import Case, run_cases

def out_of_range():
    x = torch.zeros(4, device="cuda")
    x[torch.tensor([99], device="cuda")].sum().item()  # a device-side assert

def healthy():
    return {"sum": torch.ones(4, device="cuda").sum().item()}

kept = torch.ones(1 << 20, device="cuda")  # freed at exit: on a faulted context, an abort
outcome = run_cases([Case("ok", {}, healthy), Case("fault", {}, out_of_range),
                     Case("after", {}, healthy)], str)
print("failed:", [f["error"] for f in outcome.failed])
cli._exit_if_context_lost(outcome.status)
print("not reached")
"""


def test_a_device_side_fault_stops_the_cases_and_exits_in_one_line():
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1, run.stderr[-2000:]
    assert "not run: the CUDA context was lost to CUDA_ERROR_ASSERT in fault" in run.stdout
    assert "not reached" not in run.stdout
    assert "terminate called" not in run.stderr and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(
        "nimble: the CUDA context was lost to CUDA_ERROR_ASSERT")
