"""One rank of tests/test_gpu_collectives.py's test of transformers' own tensor parallelism
(``torchrun``).

``tp_plan_worker.py DIR``: rank 0 saves the zoo's small Llama to ``DIR``; every rank loads it
with ``from_pretrained(DIR, tp_plan="auto")``, which splits its weights over the ranks as
DTensors, takes transformers' greedy tokens from it and from the whole model, then decodes the
same prompt with a :class:`nimble.generate.Generator` prepared on the split model.  One JSON
line per rank: the weights' type, whether each decode equals the whole model's tokens, and the
decode step's all-reduce kernels.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from ranks import nccl_rank, note_failure, report

NEW_TOKENS = 16
PROMPT = 16


def main(path: str) -> None:
    import transformers

    from nimble.cli.decoders import causal_lm
    from nimble.generate import Generator, library_greedy
    from nimble.ir.kernel_names import collective_kernel

    rank = nccl_rank()
    seen: dict = {"rank": rank, "world": int(os.environ["WORLD_SIZE"])}
    try:
        whole = causal_lm("llama_small", "float16")
        if rank == 0:
            whole.save_pretrained(path)
        dist.barrier()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, tp_plan="auto", dtype=torch.float16).eval()
        seen["weight_types"] = sorted({type(p).__name__ for p in model.parameters()})
        torch.manual_seed(5)
        ids = torch.randint(0, whole.config.vocab_size, (1, PROMPT), device="cuda")
        want = library_greedy(whole, ids, NEW_TOKENS)
        eager = library_greedy(model, ids, NEW_TOKENS)
        generator = Generator(model, max_cache_len=PROMPT + NEW_TOKENS, prompt_buckets=[PROMPT],
                              batch_sizes=[1])
        got = generator.generate(ids, NEW_TOKENS)
        decode, _ = generator.steps(1)
        seen.update(eager_equal=bool(torch.equal(eager, want)),
                    nimble_equal=bool(torch.equal(got, want)),
                    nimble_equal_eager=bool(torch.equal(got, eager)),
                    all_reduces=sum(collective_kernel(t.name) for t in decode.graph.tasks),
                    layers=len(model.model.layers))
    except Exception as e:  # noqa: BLE001 - the test reports it with the rank
        note_failure(seen, e)
    report(seen)
    os._exit(0)  # after captured collectives, destroying the process group can hang


if __name__ == "__main__":
    main(sys.argv[1])
