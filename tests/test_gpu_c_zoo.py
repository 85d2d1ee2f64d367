"""Every zoo model, in float32 and float16, saved by ``nimble save`` and run from C with no
Python in the process (issue 49's test of the zoo): the C load's proof holds each graph bit
for bit to the saving process's outputs; each case prints its load and call numbers (run with
``-s`` for the table's rows)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nimble.cli.models import ZOO
from test_gpu_c_runtime import _python_host_us, run_saved  # noqa: F401 - the fixture

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", ZOO)
def test_a_zoo_model_saved_by_the_command_runs_from_c(run_saved, tmp_path,  # noqa: F811
                                                      name, dtype):
    pytest.importorskip("torchvision")
    saved = tmp_path / f"{name}.nimble"
    done = subprocess.run([sys.executable, "-m", "nimble", "save", name, "--dtype", dtype,
                           "-o", str(saved), "-q"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run([str(run_saved), str(saved), "--bench", "1000"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr  # the C load's proof passed
    numbers = json.loads(done.stdout.strip().splitlines()[-1])
    numbers["host_us_python_call"] = _python_host_us(saved, 1000)
    print(f"C {name} {dtype}: {json.dumps(numbers)}")
    assert numbers["load_to_first_call_ms"] > 0
