"""Which part of a ``DistributedDataParallel`` breaks the capture of its training step (issue 51).

    torchrun --nproc_per_node=2 tools/ddp_capture_probe.py [PROBE ...]

On two H200s (2026-11-27) ``Nimble(ddp).prepare(x, training=True)`` failed in the backward's
capture ("operation failed due to a previous error during capture", only torch on the stack)
with a fresh DDP and no eager step before it, and with a relaxed capture mode too, while the
same network prepared with ``average_gradients=True`` (the same all-reduce in the same place)
passed.  The likely cause: the DDP's reducer keeps the parameters' gradient-accumulation nodes
alive, made on the default stream, and the autograd engine ends a backward by making the
capture's stream wait on theirs (torch's CUDA-graph notes ask for DDP to be built on a side
stream); Nimble now captures a DDP's step on stand-ins for its parameters
(:mod:`nimble.record.stand_ins`).  Expected with that: ``ddp`` and ``ddp_side_stream`` pass,
``plain_under_ddp`` (no stand-ins, the reducer holding the nodes) fails,
``plain_after_ddp`` passes.  Each probe prepares one small network one way and runs a step;
every rank prints one JSON line per probe: ``ok``, or the error, its cause and the end of its
trace.  The probes, each taking one difference away:

``plain``                 the network with ``average_gradients=True`` (passed)
``ddp``                   the DDP given to Nimble (failed)
``plain_after_ddp``       a DDP built around another network first (its constructor's
                          collectives on the process group), then ``plain`` on a fresh one
``plain_under_ddp``       a DDP built around this network (its reducer's hooks on these
                          parameters), the network itself prepared as ``plain``
``ddp_hooks_removed``     the DDP's reducer hooks removed (``_remove_autograd_hooks``) first
``ddp_no_init_sync``      the DDP built with ``init_sync=False`` (no constructor collectives),
                          where this torch has the argument
``ddp_side_stream``       the DDP built on a side stream, as torch's CUDA-graph notes ask

A probe that fails leaves the process group in an unknown state, so each runs in its own
``torchrun`` when none is named on the command line: the tool then starts itself once per probe.
Multicast stays off.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
from gpu_suite import NO_MULTICAST  # tools/ is a script's first path entry

PROBES = ("plain", "ddp", "plain_after_ddp", "plain_under_ddp", "ddp_hooks_removed",
          "ddp_no_init_sync", "ddp_side_stream")
#: What a probe must keep alive while it runs (the DDP whose hooks it leaves on a network).
_KEPT: list = []


def _network():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).cuda().train()


def _ddp(module, rank: int, **settings):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, device_ids=[rank], broadcast_buffers=False,
                                   **settings)


def prepared(probe: str, rank: int, x):
    """The callable ``probe`` prepares (see the module docstring); None where this torch
    cannot build it."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    import nimble

    def plain(net):
        return nimble.Nimble(net).prepare(x, training=True, average_gradients=True)

    if probe == "plain":
        return plain(_network())
    if probe == "plain_after_ddp":
        _ddp(_network(), rank)
        return plain(_network())
    if probe == "plain_under_ddp":
        net = _network()
        _KEPT.append(_ddp(net, rank))  # the reducer's hooks stay on net's parameters
        return plain(net)
    if probe == "ddp_no_init_sync":
        if "init_sync" not in inspect.signature(DistributedDataParallel.__init__).parameters:
            return None
        return nimble.Nimble(_ddp(_network(), rank, init_sync=False)).prepare(x, training=True)
    if probe == "ddp_side_stream":
        import torch

        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            ddp = _ddp(_network(), rank)
        torch.cuda.current_stream().wait_stream(side)
        return nimble.Nimble(ddp).prepare(x, training=True)
    ddp = _ddp(_network(), rank)
    if probe == "ddp_hooks_removed":
        ddp._remove_autograd_hooks()
    return nimble.Nimble(ddp).prepare(x, training=True)


def run_probe(probe: str) -> dict:
    """One probe on this rank: its line."""
    import torch
    import torch.distributed as dist
    from torch import nn

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    x = torch.randn(8, 3, 16, 16, device="cuda")
    y = torch.randint(0, 10, (8,), device="cuda")
    seen: dict = {"rank": rank, "probe": probe}
    try:
        call = prepared(probe, rank, x)
        if call is None:
            seen["skipped"] = "this torch's DistributedDataParallel has no init_sync"
        else:
            nn.functional.cross_entropy(call(x), y).backward()
            torch.cuda.synchronize()
            seen["ok"] = True
    except Exception as e:  # noqa: BLE001 - the line reports it
        seen["error"] = f"{type(e).__name__}: {e}"[:1500]
        cause = e.__cause__
        seen["cause"] = f"{type(cause).__name__}: {cause}"[:600] if cause else None
        seen["trace"] = traceback.format_exc()[-2000:]
    return seen


def main(argv: list[str]) -> int:
    unknown = [p for p in argv if p not in PROBES + ("-h", "--help")]
    if unknown or "-h" in argv or "--help" in argv:
        print(__doc__)
        return 2 if unknown else 0
    if "RANK" not in os.environ:  # started by hand: one torchrun per probe
        status = 0
        for probe in argv or PROBES:
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run",
                                   "--nproc_per_node=2", __file__, probe],
                                  env={**os.environ, **NO_MULTICAST}, timeout=300)
            status |= done.returncode
        return status
    for probe in argv:
        line = json.dumps(run_probe(probe))
        sys.stdout.write(line + "\n")  # one write: the ranks share the pipe
        sys.stdout.flush()
    os._exit(0)  # a failed capture can leave NCCL unable to shut down cleanly


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
