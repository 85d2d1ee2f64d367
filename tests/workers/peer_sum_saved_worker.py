"""One rank of tests/test_gpu_collectives.py's saved peer-sum test (``torchrun``), in two runs.

``peer_sum_saved_worker.py save DIR``: each rank prepares :class:`SummedBranch` (its sum over
the ranks a :class:`nimble.peer_sum.PeerSum`), saves the graph to ``DIR/rank{r}.nimble`` (every
rank at once: saving launches the graph) and the model's eager outputs on fixed inputs.
``peer_sum_saved_worker.py load DIR``: in fresh processes each rank makes the model again
(the same seed: the same weights; new buffers every rank maps), loads its own file with it,
and compares its outputs with those saved and with eager's here; loading another rank's file
is refused.  One JSON line per rank and run.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from peer_sum_worker import SummedBranch, _drawn
from ranks import nccl_rank, run_and_exit

CALLS = 5


def _model():
    from nimble.peer_sum import PeerSum

    torch.manual_seed(0)
    return SummedBranch(PeerSum(8 * 2048, torch.float16)).cuda().half().eval()


def _inputs(rank: int) -> list:
    return [_drawn(rank, 8 * 1024, torch.float16, salt=k).view(8, 1024) for k in range(CALLS)]


def save(rank: int, folder: Path) -> dict:
    import nimble

    model = _model()
    with torch.no_grad():
        nm = nimble.Nimble(model).prepare(_inputs(rank)[0])
        path = nm.save(folder / f"rank{rank}.nimble", weights=False)
        torch.save([model(x).cpu() for x in _inputs(rank)], folder / f"want{rank}.pt")
    return {"saved": path.name}


def load(rank: int, world: int, folder: Path) -> dict:
    import nimble
    from nimble.errors import LoadError
    from nimble.ir.kernel_names import collective_kernel

    model = _model()
    want = torch.load(folder / f"want{rank}.pt")
    try:
        nimble.load(folder / f"rank{(rank + 1) % world}.nimble", model=model)
        refused = ""
    except LoadError as e:
        refused = str(e)
    with torch.no_grad():
        nm = nimble.load(folder / f"rank{rank}.nimble", model=model)
        got = [nm(x).clone() for x in _inputs(rank)]
        eager = [model(x) for x in _inputs(rank)]
    return {"equal_saved": all(torch.equal(g.cpu(), w) for g, w in zip(got, want)),
            "equal_eager": all(torch.equal(g, e) for g, e in zip(got, eager)),
            "collectives": sum(collective_kernel(t.name) for t in nm.graph.tasks),
            "other_rank_refused": refused}


def main() -> None:
    mode, folder = sys.argv[1], Path(sys.argv[2])
    rank, world = nccl_rank(), int(os.environ["WORLD_SIZE"])
    run_and_exit({"rank": rank, "world": world, "mode": mode},
                 lambda: save(rank, folder) if mode == "save" else load(rank, world, folder))


if __name__ == "__main__":
    main()
