"""A model whose forward all-reduces across two GPUs, prepared on each rank (two GPUs).

``tests/workers/allreduce_worker.py`` runs as two ranks under ``torchrun``: each prepares the
model on one stream and on several (NCCL's kernel and its event nodes rebuilt in the explicit
graph, the proof replaying both ranks' graphs in step), then calls it on fresh inputs against
eager.  A rank that hangs (a collective launched on one rank only) fails the test by timeout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).parent / "workers" / "allreduce_worker.py"


def _two_gpus_or_skip() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs; this machine has {torch.cuda.device_count()}")
    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch has no NCCL")


def test_an_all_reduce_in_the_forward_is_prepared_and_proven_on_both_ranks():
    _two_gpus_or_skip()
    env = {**os.environ, "NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(WORKER)],
        capture_output=True, text=True, timeout=240, env=env)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(lines) == 4, \
        f"rc {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    for seen in lines:
        assert "error" not in seen, f"rank {seen['rank']}: {seen['error']}\n{seen['trace']}"
        # eager's all-reduce runs the same NCCL algorithm on the same bytes
        assert seen["max_diff"] <= 1e-6 * max(seen["scale"], 1.0), seen
    multi = [s for s in lines if s["multi"]]
    assert all(s["streams"] >= 2 for s in multi), multi  # the second conv runs beside the reduce
