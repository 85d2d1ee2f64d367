"""Nimble's Triton kernels compiled for sm_90 by the GPU machine's Triton (3.6.0, beside
torch 2.11), which is not the Triton CI's torch brings: a kernel one version compiles, another
may refuse (the peer sum's spin over a vector of flags failed Triton 3.6's layout pass on the
GPU machine while 3.9 compiled it).  ``NIMBLE_SECOND_TRITON`` names a folder that Triton was
installed into (``pip install --no-deps --target DIR triton==3.6.0``: ``.ci/run`` does); the
PTX tests run again with it first on the path."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The GPU machine's Triton (FINDINGS: torch 2.11.0+cu130 with Triton 3.6.0).
GPU_MACHINES_TRITON = "3.6.0"
#: The tests that compile Nimble's kernels to PTX on a machine without a GPU.
PTX_TESTS = ("tests/test_kernel_waits.py",
             "tests/test_peer_sum.py::test_the_kernel_compiles_for_a_hopper_gpu_with_its_flags_at_system_scope",
             "tests/test_gemv_prologues.py::test_the_kernels_compile_for_a_hopper_gpu_on_a_machine_without_one",
             "tests/test_gemv_prologues.py::test_the_attend_kernel_compiles_in_both_forms_its_launches_give_it")


def _second_triton() -> str:
    folder = os.environ.get("NIMBLE_SECOND_TRITON")
    if not folder:
        pytest.skip("NIMBLE_SECOND_TRITON is unset: install the GPU machine's Triton with "
                    f"pip install --no-deps --target DIR triton=={GPU_MACHINES_TRITON} and "
                    "point it at DIR (.ci/run does)")
    return folder


def _with(folder: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [folder, str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=1200)


def test_the_kernels_compile_with_the_gpu_machines_triton():
    folder = _second_triton()
    version = _with(folder, "-c", "import triton; print(triton.__version__)")
    assert version.stdout.strip() == GPU_MACHINES_TRITON, (version.stdout, version.stderr)
    done = _with(folder, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PTX_TESTS)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
