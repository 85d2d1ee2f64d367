"""One rank of tests/test_gpu_collectives.py's data-parallel training test (``torchrun``).

Each rank builds the same small network twice: one wrapped in eager
``DistributedDataParallel`` as the reference, one prepared with ``training=True,
average_gradients=True`` (its gradients averaged over the ranks inside the backward graph).
Both take two SGD steps on the rank's own batches; one JSON line says how far Nimble's
gradients are from DDP's at each step, and how many all-reduces the backward graph holds.
"""
from __future__ import annotations

import json
import os
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

#: Eager steps before DDP's first measured one: its host-side statistics take ten.
DDP_WARMUP = 11


def _network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 10)).cuda().train()


def _step(call, model, optimizer, x) -> list:
    optimizer.zero_grad(set_to_none=False)
    call(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    return grads


def main() -> None:
    import nimble
    from nimble.ir.kernel_names import collective_kernel

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    seen: dict = {"rank": rank}
    torch.manual_seed(1 + rank)
    batches = [torch.randn(8, 3, 16, 16, device="cuda") for _ in range(2)]
    eager = DistributedDataParallel(_network(), device_ids=[rank], broadcast_buffers=False)
    for _ in range(DDP_WARMUP):
        eager(batches[0]).sum().backward()
    served = _network()
    try:
        nm = nimble.Nimble(served).prepare(batches[0], training=True, average_gradients=True)
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
    except Exception as e:  # reported to the test, which fails on it
        seen["error"] = f"{type(e).__name__}: {e}"[:2000]
        seen["trace"] = traceback.format_exc()[-3000:]
    print(json.dumps(seen), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
