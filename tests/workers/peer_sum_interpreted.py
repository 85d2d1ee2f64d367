"""One rank of the peer sum under Triton's interpreter, for ``tests/test_peer_sum.py``: run as
one process per rank with ``TRITON_INTERPRET=1``, ``RANK WORLD DIR`` as arguments (the test
imports its constants).

The ranks' buffers are files in ``DIR`` (made and zeroed by the test, one per dtype and rank,
``{dtype}-{rank}``) that every rank maps shared, so each reaches the others' as GPUs reach
their peers' memory.  Each rank makes the same calls, of :data:`SIZES` elements, its input of
each drawn from a seed of its own; it draws its peers' too, to know the sum.  One JSON line per
call: whether the sum equals the float32 sum in rank order rounded to the dtype bit for bit
(:func:`rounded`), or a gathering call (:data:`GATHERS`) every rank's tensor in rank order,
and a digest of its bytes (the test holds the ranks' digests equal).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from nimble.peer_sum import PeerSumLayout, launch_peer_sum

#: The elements of each call: within one program's block, over several programs, ragged, the
#: most (over 3 programs of 4096: two blocks for the first), one, then calls in a row of each
#: slot parity.
SIZES = (64, 512, 1000, 13000, 1, 64, 300, 300)
#: The calls that gather rather than sum (through the same buffers, between sums).
GATHERS = (2, 6)
#: The most elements a call takes, and the programs a call launches (few: blocks in turn).
MAX_NUMEL, PROGRAMS = 13000, 3
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "wrapping": torch.bfloat16}


def layout(world: int, dtype: torch.dtype) -> PeerSumLayout:
    return PeerSumLayout.for_elements(MAX_NUMEL, world, dtype, max_programs=PROGRAMS)


def drawn(rank: int, call: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + call)
    return torch.randn(n, generator=generator).to(dtype)


def rounded(total: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 sum in ``dtype`` as the interpreter rounds it: to nearest, except to
    bfloat16, which it rounds toward zero (the GPU to nearest even)."""
    if dtype != torch.bfloat16:
        return total.to(dtype)
    return (total.view(torch.int32) & -65536).view(torch.float32).to(dtype)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    rank, world, folder = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    for name, dtype in DTYPES.items():
        shape = layout(world, dtype)
        buffers = [torch.from_file(str(folder / f"{name}-{r}"), shared=True, size=shape.nbytes,
                                   dtype=torch.uint8) for r in range(world)]
        table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
        for call, n in enumerate(SIZES):
            gather = call in GATHERS
            got = launch_peer_sum(drawn(rank, call, n, dtype), table, rank, shape, gather)
            if gather:
                want = torch.stack([drawn(r, call, n, dtype) for r in range(world)])
            else:
                want = rounded(sum(drawn(r, call, n, dtype).float() for r in range(world)),
                               dtype)
            print(json.dumps({"dtype": name, "call": call, "rank": rank, "gather": gather,
                              "equal": torch.equal(got, want), "shape": list(got.shape),
                              "digest": hashlib.sha256(got.view(torch.uint8).numpy()
                                                       .tobytes()).hexdigest()}), flush=True)


if __name__ == "__main__":
    main()
