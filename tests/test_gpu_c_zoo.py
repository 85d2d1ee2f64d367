"""Every zoo model, in float32 and float16, saved by ``nimble save`` and run from C with no
Python in the process (issue 49's test of the zoo): the C load's proof holds each graph bit
for bit to the saving process's outputs; each case prints its load and call numbers (run with
``-s`` for the table's rows).

The saves of every case this process runs happen first, in one process of their own that
calls the command once per case (:data:`_SAVE_ALL`): a ``nimble save`` process per case spent
most of its time starting Python and torch, seven times over in each share of the GPU suite."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nimble.cli.models import ZOO
from test_gpu_c_runtime import _python_host_us, run_saved  # noqa: F401 - the fixture

pytestmark = pytest.mark.gpu

#: One process saving every case it is given (``[[model, dtype, path], ...]``) through the
#: command's own entry point, a model's failure (its status or exception) leaving the others.
_SAVE_ALL = """
import json, os, sys
from nimble.cli.main import main
status = {}
for name, dtype, path in json.loads(sys.argv[1]):
    try:
        status[path] = main(["save", name, "--dtype", dtype, "-o", path, "-q"])
    except BaseException as e:
        status[path] = f"{type(e).__name__}: {e}"
    # the resident memory after each save: what grows in a process saving many models
    resident = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    print(f"saved {name} {dtype}: {status[path]} ({resident / 2**30:.1f} GiB resident)",
          file=sys.stderr, flush=True)
    with open(sys.argv[2], "w") as f:
        json.dump(status, f)
"""
TEST = "test_a_zoo_model_saved_by_the_command_runs_from_c"


@pytest.fixture(scope="module")
def saved_zoo(request, tmp_path_factory) -> tuple[Path, dict, str]:
    """``(folder, status per file path, the saving process's stderr)`` of every case of
    :data:`TEST` this pytest process runs (its share of them, in the GPU suite)."""
    cases = sorted({(item.callspec.params["name"], item.callspec.params["dtype"])
                    for item in request.session.items
                    if getattr(item, "originalname", None) == TEST})
    folder = tmp_path_factory.mktemp("zoo")
    plan = [[name, dtype, str(folder / f"{name}-{dtype}.nimble")] for name, dtype in cases]
    done = subprocess.run([sys.executable, "-c", _SAVE_ALL, json.dumps(plan),
                           str(folder / "status.json")], capture_output=True, text=True,
                          timeout=300 + 120 * len(plan))
    status_file = folder / "status.json"
    status = json.loads(status_file.read_text()) if status_file.exists() else {}
    # A process killed (a signal, the host's memory) leaves its status negative and its
    # stderr short: both go in the failure's message.
    return folder, status, f"{done.stderr}\n[the saving process exited {done.returncode}]"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", ZOO)
def test_a_zoo_model_saved_by_the_command_runs_from_c(run_saved, saved_zoo,  # noqa: F811
                                                      name, dtype):
    pytest.importorskip("torchvision")
    folder, status, stderr = saved_zoo
    saved = folder / f"{name}-{dtype}.nimble"
    assert status.get(str(saved)) == 0, \
        f"nimble save {name} --dtype {dtype}: {status.get(str(saved), 'never ended')}; the " \
        f"saving process's stderr ends:\n{stderr[-3000:]}"
    done = subprocess.run([str(run_saved), str(saved), "--bench", "1000"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr  # the C load's proof passed
    numbers = json.loads(done.stdout.strip().splitlines()[-1])
    numbers["host_us_python_call"] = _python_host_us(saved, 1000)
    print(f"C {name} {dtype}: {json.dumps(numbers)}")
    assert numbers["load_to_first_call_ms"] > 0
