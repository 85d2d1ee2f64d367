"""One rank of tests/test_gpu_collectives.py's unchanged-DDP tests (``torchrun``).

``ddp_worker.py VARIANT``: the same DDP training script three times on each rank, from the same
start, on the rank's own batches: twice eagerly (the second gives the run-to-run floor) and once
with its one changed line, the ``DistributedDataParallel`` called through
``nimble.Nimble(ddp).prepare(x, training=True)``.  Variants: ``defaults`` (DDP's defaults:
buffers broadcast from rank 0 in every forward), ``settings`` (tiny ``bucket_cap_mb`` for
several buckets, ``gradient_as_bucket_view``, ``static_graph``, no buffer broadcast),
``syncbn`` (the network's batch norm converted to ``SyncBatchNorm``).  One JSON line per rank:
how far Nimble's parameters and buffers are from eager DDP's after the steps, against the
floor, whether every rank holds the same parameters, and the collectives of each graph.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from ranks import nccl_rank, note_failure, report

STEPS = 5
VARIANTS = {
    "defaults": {},
    "settings": dict(bucket_cap_mb=0.004, gradient_as_bucket_view=True, static_graph=True,
                     broadcast_buffers=False),
    "syncbn": {},
}


def _network(variant: str) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    if variant == "syncbn":
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    return net.cuda().train()


def _script(variant: str, rank: int, batches: list, through_nimble: bool):
    """The DDP script: wrap, (prepare), train ``STEPS`` SGD steps; the DDP and its Nimble."""
    import nimble

    ddp = DistributedDataParallel(_network(variant), device_ids=[rank], **VARIANTS[variant])
    call = nimble.Nimble(ddp).prepare(batches[0][0], training=True) if through_nimble else ddp
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(call(x), y).backward()
        optimizer.step()
    torch.cuda.synchronize()
    return ddp, call


def _vector(tensors) -> torch.Tensor:
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _collectives(nm) -> list[int]:
    """NCCL collective kernels per phase (forward, backward) of ``nm``'s graph."""
    from nimble.ir.kernel_names import collective_kernel

    first = nm.graph.meta["phases"][0]
    nccl = [t.id for t in nm.graph.tasks if t.kind == "kernel" and collective_kernel(t.name)]
    return [sum(t < first for t in nccl), sum(t >= first for t in nccl)]


def _planned_buckets(ddp) -> int:
    from nimble.engine.data_parallel import ddp_average
    from nimble.record.gradient_average import bucket_plan

    average = ddp_average(ddp)
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    return len(bucket_plan([p.numel() * p.element_size() for p in params],
                           [str(p.dtype) for p in params], average.bucket_bytes,
                           average.first_bucket_bytes))


def _same_on_every_rank(v: torch.Tensor) -> bool:
    gathered = [torch.empty_like(v) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, v)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def main() -> None:
    variant = sys.argv[1]
    rank = nccl_rank()
    seen: dict = {"rank": rank, "variant": variant}
    torch.manual_seed(1 + rank)  # each rank its own batches
    batches = [(torch.randn(8, 3, 16, 16, device="cuda"),
                torch.randint(0, 10, (8,), device="cuda")) for _ in range(STEPS)]
    try:
        eager, _ = _script(variant, rank, batches, False)
        again, _ = _script(variant, rank, batches, False)
        served, nm = _script(variant, rank, batches, True)
        want = _vector(eager.parameters())
        seen["param_err"] = _relative(_vector(served.parameters()), want)
        seen["param_floor"] = _relative(_vector(again.parameters()), want)
        floats = [b for b in eager.buffers() if b.is_floating_point()]
        want_b = _vector(floats)
        seen["buffer_err"] = _relative(
            _vector(b for b in served.buffers() if b.is_floating_point()), want_b)
        seen["buffer_floor"] = _relative(
            _vector(b for b in again.buffers() if b.is_floating_point()), want_b)
        seen["tracked"] = [int(b) for b in served.buffers() if not b.is_floating_point()]
        seen["collectives"] = _collectives(nm)
        seen["planned_buckets"] = _planned_buckets(served)
        seen["ranks_equal"] = _same_on_every_rank(_vector(served.parameters()))
        seen["eager_ranks_equal"] = _same_on_every_rank(want)
    except Exception as e:  # reported to the test, which judges it
        note_failure(seen, e)
    report(seen)
    dist.barrier()
    torch.cuda.synchronize()
    # docs/findings.md: destroy_process_group() can hang once a graph captured an NCCL
    # collective, so the worker ends here, after its last collective
    os._exit(0)


if __name__ == "__main__":
    main()
