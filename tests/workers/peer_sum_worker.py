"""One rank of tests/test_gpu_collectives.py's peer-sum test (``torchrun``).

Each rank sums tensors over the ranks with :class:`nimble.peer_sum.PeerSum` in every dtype it
takes, of one program's size, several, ragged and the largest, and holds each sum against the
float32 sum of every rank's tensor (gathered by NCCL) in rank order, rounded once: equal bit
for bit, on every rank alike.  Then calls captured in a CUDA graph replayed many times (the
slots' parities and the counters cycle), and a model whose forward sums one branch while an
independent branch runs beside it, prepared by Nimble on one stream, on several, and with the
gap prefetch served (the proof replays both ranks' graphs in step), called on fresh inputs
against eager.  One JSON line per
rank.
"""
from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist
from ranks import nccl_rank, run_and_exit
from torch import nn

#: Elements of each eager call: one program, a batch-8 step's hidden state, ragged, the most.
SIZES = (2048, 16384, 1000, 1, 32768)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _drawn(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(7919 * rank + n + salt)
    return torch.randn(n, device="cuda", generator=generator).to(dtype)


def _rank_order_sum(x: torch.Tensor, world: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    return total.to(x.dtype)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def eager_calls(rank: int, world: int) -> dict:
    from nimble.peer_sum import PeerSum

    equal, digests = [], []
    for dtype in DTYPES:
        summed = PeerSum(max(SIZES), dtype)
        for n in SIZES:
            x = _drawn(rank, n, dtype)
            got = summed(x)
            equal.append(bool(torch.equal(got, _rank_order_sum(x, world))))
            digests.append(_digest(got))
    return {"eager_equal": equal, "eager_digests": digests}


def captured_calls(rank: int, world: int) -> dict:
    """Eight sums of 8 KiB captured in one graph, replayed 50 times on new inputs."""
    from nimble.peer_sum import PeerSum

    summed = PeerSum(4096, torch.bfloat16)
    inputs = [_drawn(rank, 4096, torch.bfloat16, salt=k) for k in range(8)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        [summed(x) for x in inputs]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [summed(x) for x in inputs]
    equal = True
    for replay in range(50):
        for k, x in enumerate(inputs):
            x.copy_(_drawn(rank, 4096, torch.bfloat16, salt=100 * replay + k))
        graph.replay()
        equal &= all(torch.equal(out, _rank_order_sum(x, world))
                     for out, x in zip(outputs, inputs))
    return {"graph_equal": bool(equal)}


class SummedBranch(nn.Module):
    """One branch summed over the ranks while an independent branch runs beside it (its
    weight, read after the sum and an activation that read none, a gap prefetch's)."""

    def __init__(self, summed) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(1024, 2048), nn.Linear(1024, 2048)
        self.summed = summed

    def forward(self, x):
        return torch.relu(self.summed(self.a(x))) + self.b(x)


#: The prepares of the model: on one stream, on several, and on several with the gap prefetch
#: (served unmeasured, as a graph of collectives serves it).
PREPARES = {"single": {"use_multi_stream": False}, "multi": {"use_multi_stream": True},
            "gaps": {"use_multi_stream": True, "prefetch_l2": "gaps"}}


def prepared_calls(rank: int) -> dict:
    import nimble
    from nimble.ir.kernel_names import collective_kernel
    from nimble.peer_sum import PeerSum

    torch.manual_seed(0)
    model = SummedBranch(PeerSum(8 * 2048, torch.float16)).cuda().half().eval()
    seen: dict = {}
    with torch.no_grad():
        for name, settings in PREPARES.items():
            x = torch.randn(8, 1024, device="cuda", dtype=torch.float16) * (rank + 1)
            prefetch = settings.get("prefetch_l2", False)
            nm = nimble.Nimble(model).prepare(
                x, use_multi_stream=settings["use_multi_stream"],
                options=nimble.PrepareOptions(prefetch_l2=prefetch))
            equal = []
            for k in range(20):
                fresh = _drawn(rank, 8 * 1024, torch.float16, salt=k).view(8, 1024)
                equal.append(bool(torch.equal(nm(fresh), model(fresh))))
            seen[f"prepared_equal_{name}"] = all(equal)
            seen[f"collectives_{name}"] = sum(collective_kernel(t.name) for t in nm.graph.tasks)
            seen[f"streams_{name}"] = len(nm.schedule.streams)
            seen[f"prefetch_{name}"] = nm.graph.meta.get("prefetch_l2", [])
    return seen


def main() -> None:
    rank, world = nccl_rank(), int(os.environ["WORLD_SIZE"])
    run_and_exit({"rank": rank, "world": world}, lambda: {
        **eager_calls(rank, world), **captured_calls(rank, world), **prepared_calls(rank)})


if __name__ == "__main__":
    main()
