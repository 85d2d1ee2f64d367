"""A Generator served with programmatic edges, saved and loaded in one fresh process.

``python programmatic_load_worker.py FILE NEW_TOKENS [DECODE_FILE]``: keeps the kernel binaries (a process
that ran cuBLAS before cannot save its kernels), builds the swapped tiny Llama's Generator with
its GEMV prologues folded and ``programmatic_launch="always"``, saves it to ``FILE``, loads it
twice (``loading.LOAD_WAITING_EDGES`` off, then on as by default) and checks that each load decodes
the saved Generator's tokens, the second again and again while another stream keeps the GPU
busy; with ``DECODE_FILE``, also saves the decode step of batch 1 alone there (its static
cache the file's external memory), for the C runtime.  The last line of stdout is JSON: the
programmatic edges of each decode step of batch 1.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    path, new_tokens = Path(sys.argv[1]), int(sys.argv[2])
    decode_file = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    import nimble

    nimble.keep_kernel_binaries()
    import torch

    from helpers import busy_gpu, swapped_llama_small
    from nimble.engine import loading
    from nimble.engine.options import PrepareOptions
    from nimble.gemv_prologue_pass import fusing
    from nimble.generate import Generator, prepare_with_nimble

    model, swap = swapped_llama_small()
    torch.manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (1, 64), device="cuda")
    with fusing():
        saved = Generator(model, max_cache_len=64 + new_tokens, prompt_buckets=[64],
                          batch_sizes=[1],
                          prepare_step=prepare_with_nimble(
                              PrepareOptions(programmatic_launch="always"), True))
    saved_edges = saved.steps(1)[0].programmatic_edges
    want = saved.generate(ids, new_tokens)
    saved.save(path)
    if decode_file is not None:
        saved.steps(1)[0].save(decode_file)
    saved.close()
    swap.undo()

    loading.LOAD_WAITING_EDGES = False
    plain = Generator.load(path)
    plain_edges = plain.steps(1)[0].programmatic_edges
    if not torch.equal(plain.generate(ids, new_tokens), want):
        raise SystemExit("the default load decoded other tokens than the saved Generator")
    plain.close()

    loading.LOAD_WAITING_EDGES = True
    loaded = Generator.load(path)
    loaded_edges = loaded.steps(1)[0].programmatic_edges
    with busy_gpu():
        for _ in range(3):
            if not torch.equal(loaded.generate(ids, new_tokens), want):
                raise SystemExit("the load with its programmatic edges decoded other tokens")
    loaded.close()
    print(json.dumps({"saved_edges": len(saved_edges), "plain_edges": len(plain_edges),
                      "loaded_edges": len(loaded_edges),
                      "same_edges": sorted(map(tuple, loaded_edges))
                      == sorted(map(tuple, saved_edges))}))


if __name__ == "__main__":
    main()
