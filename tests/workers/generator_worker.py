"""A Generator saved in one process and loaded in another: what a decoding server's workers do.

``python generator_worker.py save FILE IDS OUT``: keeps the kernel binaries, builds a Generator
on the tiny GPT-2 (float16, prompt bucket 32, cache 96, batch 1), writes the greedy tokens of
the prompt in ``IDS`` (a ``torch.save``d tensor) to ``OUT`` and saves the Generator to ``FILE``.
``python generator_worker.py load FILE IDS OUT``: ``Generator.load(FILE)``, the same tokens to
``OUT``, and the load's seconds on stdout.
``python generator_worker.py save-decode FILE IDS OUT``: as ``save``, but saves the decode step
of batch 1 alone (one graph, its static cache as the file's external memory), for the C runtime.
``python generator_worker.py save-swapped FILE IDS OUT``: as ``save``, on the tiny Llama in
bfloat16 with its single-query attention on ``nimble.decode_attention`` and the steps on
Inductor's kernels (prompt bucket 64, cache 80).
"""
from __future__ import annotations

import json
import sys
import time

NEW_TOKENS = 16


def main() -> None:
    mode, path, ids_path, out = sys.argv[1:5]
    if mode.startswith("save"):
        import nimble

        nimble.keep_kernel_binaries()
    import torch

    from nimble.generate import Generator

    ids = torch.load(ids_path).cuda()
    if mode.startswith("save"):
        from nimble.cli.decoders import causal_lm

        if mode == "save-swapped":
            from nimble.decode_attention import decode_attention
            from nimble.generate import prepare_with_nimble

            model = causal_lm("llama_small", "bfloat16")
            decode_attention(model)
            generator = Generator(model, max_cache_len=80, prompt_buckets=[64],
                                  batch_sizes=[1], prepare_step=prepare_with_nimble(None, True))
        else:
            generator = Generator(causal_lm("gpt2_tiny", "float16"), max_cache_len=96,
                                  prompt_buckets=[32], batch_sizes=[1])
        tokens = generator.generate(ids, NEW_TOKENS)
        if mode in ("save", "save-swapped"):
            generator.save(path)
        else:
            generator.steps(1)[0].save(path)
        seconds = 0.0
    else:
        torch.zeros(1, device="cuda")
        began = time.perf_counter()
        generator = Generator.load(path)
        seconds = time.perf_counter() - began
        tokens = generator.generate(ids, NEW_TOKENS)
    torch.save(tokens.cpu(), out)
    print(json.dumps({"mode": mode, "load_s": round(seconds, 4)}))


if __name__ == "__main__":
    main()
