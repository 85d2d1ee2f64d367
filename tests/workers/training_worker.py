"""One rank of tests/test_gpu_collectives.py's data-parallel training tests (``torchrun``).

``training_worker.py average``: the same small network twice on each rank, one wrapped in
eager ``DistributedDataParallel`` as the reference, one prepared with ``training=True,
average_gradients=True`` (its gradients averaged over the ranks inside the backward graph);
both take two SGD steps on the rank's own batches (a DDP given to ``Nimble`` itself:
``ddp_worker.py``).  One JSON line per rank: the error prepare raised, or how far Nimble's
gradients are from DDP's at each step and how many collectives the backward graph holds.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from ranks import nccl_rank, note_failure, report

#: Eager steps before DDP's first measured or captured one: its host-side statistics take ten
#: (torch's CUDA-graph notes ask for 11); a capture among them fails.
DDP_WARMUP = 11


def _network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 10)).cuda().train()


def _ddp(rank: int, x) -> DistributedDataParallel:
    side = torch.cuda.Stream()  # torch's CUDA-graph notes: build DDP on a side stream
    with torch.cuda.stream(side):
        ddp = DistributedDataParallel(_network(), device_ids=[rank], broadcast_buffers=False)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(DDP_WARMUP):
        ddp(x).sum().backward()
    ddp.zero_grad(set_to_none=False)
    return ddp


def _step(call, model, optimizer, x) -> list:
    optimizer.zero_grad(set_to_none=False)
    call(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    return grads


def _prepared(rank: int, x):
    """``(model whose parameters train, the prepared Nimble)``."""
    import nimble

    served = _network()
    return served, nimble.Nimble(served).prepare(x, training=True, average_gradients=True)


def main() -> None:
    from nimble.ir.kernel_names import collective_kernel

    mode = sys.argv[1]
    rank = nccl_rank()
    seen: dict = {"rank": rank, "mode": mode}
    torch.manual_seed(1 + rank)
    batches = [torch.randn(8, 3, 16, 16, device="cuda") for _ in range(2)]
    eager = _ddp(rank, batches[0])
    try:
        served, nm = _prepared(rank, batches[0])
        backward = range(nm.graph.meta["phases"][0], len(nm.graph.tasks))
        seen["streams"] = len(nm.schedule.streams)
        seen["collectives"] = sum(collective_kernel(nm.graph.tasks[t].name) for t in backward)
        opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
        opt_s = torch.optim.SGD(served.parameters(), lr=0.1)
        diffs, scales = [], []
        for x in batches:
            want = _step(eager, eager, opt_e, x)
            got = _step(nm, served, opt_s, x)
            diffs.append(max(float((a - b).abs().max()) for a, b in zip(got, want)))
            scales.append(max(float(a.abs().max()) for a in want))
        seen["grad_diffs"], seen["grad_scales"] = diffs, scales
    except Exception as e:  # reported to the test, which judges it
        note_failure(seen, e)
    report(seen)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
