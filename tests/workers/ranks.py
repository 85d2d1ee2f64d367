"""What every ``torchrun`` worker of the multi-GPU tests does alike: join the NCCL process
group on the rank's own GPU, note a failure for the test to judge, and print a JSON line in one
write (ranks share the pipe: a line written in two parts can be split by another rank's)."""
from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist


def nccl_rank() -> int:
    """This process's rank, its GPU made current and the NCCL process group joined."""
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    return rank


def note_failure(seen: dict, error: BaseException) -> None:
    """``error`` and the end of its trace in ``seen``, for the test to report."""
    seen["error"] = f"{type(error).__name__}: {error}"[:2000]
    seen["trace"] = traceback.format_exc()[-3000:]


def report(seen: dict) -> None:
    """``seen`` as one JSON line on stdout, in one write."""
    sys.stdout.write(json.dumps(seen) + "\n")
    sys.stdout.flush()


def run_and_exit(seen: dict, work) -> None:
    """``seen`` updated with what ``work()`` returns (or its failure noted), reported, and the
    process ended at once: after captured collectives, destroying the process group can
    hang."""
    try:
        seen.update(work())
    except Exception as e:  # noqa: BLE001 - the test reports it with the rank
        note_failure(seen, e)
    report(seen)
    os._exit(0)
