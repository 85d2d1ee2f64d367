"""One rank of tests/test_gpu_collectives.py, run under ``torchrun --nproc_per_node=2``.

Each rank prepares a model whose forward all-reduces an activation across the ranks, on one
stream and on several, calls it on fresh inputs, and prints one JSON line per prepare with what
it saw: whether the prepare (and its proof) passed, the streams, and how far each call's output
is from eager's, whose all-reduce meets the other rank outside any graph.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from ranks import nccl_rank, note_failure, report


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
            note_failure(seen, e)
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
    rank = nccl_rank()
    torch.manual_seed(0)
    model = ReducedBranch().cuda().eval()
    with torch.no_grad():
        for multi in (False, True):
            report(_prepare_and_call(model, rank, multi))
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
