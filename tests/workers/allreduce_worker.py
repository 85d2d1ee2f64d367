"""One rank of tests/test_gpu_collectives.py, run under ``torchrun --nproc_per_node=2``.

Each rank prepares a model whose forward all-reduces an activation across the ranks, on one
stream and on several, calls it on fresh inputs, and prints one JSON line per prepare with what
it saw: whether the prepare (and its proof) passed, the streams, and how far each call's output
is from eager's, whose all-reduce meets the other rank outside any graph.
"""
from __future__ import annotations

import json
import os
import traceback
import warnings

import torch
import torch.distributed as dist
from torch import nn


class ReducedBranch(nn.Module):
    """One branch reduced across ranks while an independent branch runs beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(8, 16, 3, padding=1)
        self.b = nn.Conv2d(8, 16, 3, padding=1)

    def forward(self, x):
        y = self.a(x)
        dist.all_reduce(y)
        return torch.relu(y) + self.b(x)


def _prepare_and_call(model, rank: int, multi: bool) -> dict:
    import nimble

    seen: dict = {"rank": rank, "multi": multi}
    x = torch.randn(2, 8, 16, 16, device="cuda") * (rank + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            nm = nimble.Nimble(model).prepare(x, use_multi_stream=multi)
        except Exception as e:  # reported to the test, which fails on it
            seen["error"] = f"{type(e).__name__}: {e}"[:2000]
            seen["trace"] = traceback.format_exc()[-3000:]
            return seen
    seen["warnings"] = [str(w.message)[:300] for w in caught]
    seen["streams"] = len(nm.schedule.streams)
    diffs, equal = [], []
    for k in range(3):
        torch.manual_seed(100 + k)
        fresh = torch.randn(2, 8, 16, 16, device="cuda") * (rank + 1)
        got = nm(fresh).clone()
        want = model(fresh)
        diffs.append(float((got - want).abs().max()))
        equal.append(bool(torch.equal(got, want)))
    seen["max_diff"], seen["bitwise_equal"] = max(diffs), all(equal)
    seen["scale"] = float(want.abs().max())
    return seen


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    torch.manual_seed(0)
    model = ReducedBranch().cuda().eval()
    with torch.no_grad():
        for multi in (False, True):
            print(json.dumps(_prepare_and_call(model, rank, multi)), flush=True)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
