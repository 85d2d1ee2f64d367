"""One rank of tests/test_gpu_collectives.py's saved tensor-parallel Generator test
(``torchrun``), in two runs.

``tp_saved_worker.py save DIR``: each rank splits a small Llama over the ranks, its partial
sums and logits through Nimble's peer sums (:mod:`nimble.cli.tp_decoders`, ``"peer"``), makes
a Generator on it, decodes a prompt and saves the Generator to ``DIR/rank{r}.nimble`` with the
tokens.  ``tp_saved_worker.py load DIR``: in fresh processes each rank splits the same model
again (the same seed: the same weights; new buffers) and loads its file with it
(``Generator.load(path, model=...)``); its tokens must be the saved ones.  One JSON line per
rank and run.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from ranks import nccl_rank, run_and_exit

NEW_TOKENS = 16
PROMPT = 16


def _split_model(rank: int, world: int):
    from nimble.cli.decoders import causal_lm
    from nimble.cli.tp_decoders import split

    model = causal_lm("llama_small", "float16")  # seeded: the same weights in every run
    return split(model, rank, world, all_reduce="peer", max_tokens=PROMPT, max_batch=1)


def _prompt(model):
    torch.manual_seed(5)
    return torch.randint(0, model.config.vocab_size, (1, PROMPT), device="cuda")


def save(rank: int, world: int, folder: Path) -> dict:
    from nimble.generate import Generator

    model = _split_model(rank, world)
    generator = Generator(model, max_cache_len=PROMPT + NEW_TOKENS, prompt_buckets=[PROMPT],
                          batch_sizes=[1])
    tokens = generator.generate(_prompt(model), NEW_TOKENS)
    generator.save(folder / f"rank{rank}.nimble")
    torch.save(tokens.cpu(), folder / f"tokens{rank}.pt")
    return {"tokens": tokens.shape[1]}


def load(rank: int, world: int, folder: Path) -> dict:
    from nimble.generate import Generator

    model = _split_model(rank, world)
    generator = Generator.load(folder / f"rank{rank}.nimble", model=model)
    tokens = generator.generate(_prompt(model), NEW_TOKENS)
    saved = torch.load(folder / f"tokens{rank}.pt")
    return {"equal_saved": bool(torch.equal(tokens.cpu(), saved))}


def main() -> None:
    mode, folder = sys.argv[1], Path(sys.argv[2])
    rank, world = nccl_rank(), int(os.environ["WORLD_SIZE"])
    run_and_exit({"rank": rank, "world": world, "mode": mode},
                 lambda: (save if mode == "save" else load)(rank, world, folder))


if __name__ == "__main__":
    main()
