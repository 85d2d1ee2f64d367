"""Prepares tests/test_gpu_programmatic.py's compiled MLP with programmatic edges and saves it,
in a process that keeps its kernel binaries from its start: cuBLASLt unpacks its GEMM kernels
itself, so only such a process can write them down (a pytest process has run other models
first).

``python programmatic_save_worker.py DIR``: writes ``DIR/p.nimble``, three inputs
(``DIR/in.raw``) and the prepared graph's outputs for them (``DIR/out.raw``), loads the file
back in this process and prints one JSON line: the prepared and the loaded graph's
programmatic edges, and whether the loaded graph gives the same bits.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _raw(t) -> bytes:
    import torch

    return t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()


def main() -> None:
    import nimble

    nimble.keep_kernel_binaries()  # before torch loads cuBLASLt
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from test_gpu_programmatic import _mlp

    out = Path(sys.argv[1])
    model, x = _mlp()
    nm = nimble.Nimble(torch.compile(model, dynamic=False)).prepare(
        x, return_copies=True, options=nimble.PrepareOptions(programmatic_launch="always"))
    saved = nm.save(out / "p.nimble")
    torch.manual_seed(1)
    inputs = [torch.randn_like(x) for _ in range(3)]
    outputs = [nm(i) for i in inputs]
    (out / "in.raw").write_bytes(b"".join(_raw(i) for i in inputs))
    (out / "out.raw").write_bytes(b"".join(_raw(o) for o in outputs))
    loaded = nimble.load(saved)
    same = all(torch.equal(loaded(i), o) for i, o in zip(inputs, outputs))
    print(json.dumps({"edges": sorted(map(list, nm.programmatic_edges)),
                      "loaded_edges": sorted(map(list, loaded.programmatic_edges)),
                      "same": same}))


if __name__ == "__main__":
    main()
