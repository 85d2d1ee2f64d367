"""One rank of tests/test_gpu_collectives.py's tensor-parallel decoding test (``torchrun``).

``tp_decode_worker.py [ALL_REDUCE]``: every rank builds the same small Llama (random weights,
one seed), takes transformers' greedy tokens from it whole, then splits it over the ranks as
Megatron does (:mod:`nimble.cli.tp_decoders`; its partial sums all-reduced by NCCL, or as
``ALL_REDUCE`` says) and decodes the same prompt with a :class:`nimble.generate.Generator` on
the split model: its decode step and prefill are prepared graphs holding the all-reduces.
One JSON line per rank: the tokens' agreement with the whole
model's (departures judged at near-ties as the bench judges them), and the all-reduce kernels
of the decode step's graph.
"""
from __future__ import annotations

import os
import sys

import torch
from ranks import nccl_rank, run_and_exit

NEW_TOKENS = 24
PROMPT = 16


def main() -> None:
    from nimble.cli.decoders import causal_lm
    from nimble.cli.generate_bench import _mismatches, wrong_sequences
    from nimble.cli.tp_decoders import split
    from nimble.generate import Generator, library_greedy
    from nimble.ir.kernel_names import collective_kernel

    rank, world = nccl_rank(), int(os.environ["WORLD_SIZE"])
    all_reduce = sys.argv[1] if len(sys.argv) > 1 else "nccl"

    def work() -> dict:
        # float16: the split model sums in another order, and the near-tie judgement (8 units
        # in the last place) is the bench's for this dtype
        model = causal_lm("llama_small", "float16")
        torch.manual_seed(5)
        ids = torch.randint(0, model.config.vocab_size, (1, PROMPT), device="cuda")
        want, logits = library_greedy(model, ids, NEW_TOKENS, with_logits=True)
        split(model, rank, world, all_reduce=all_reduce, max_tokens=PROMPT, max_batch=1)
        generator = Generator(model, max_cache_len=PROMPT + NEW_TOKENS, prompt_buckets=[PROMPT],
                              batch_sizes=[1])
        got = generator.generate(ids, NEW_TOKENS)
        mismatch = _mismatches(got, want, logits, torch.float16)
        decode, _ = generator.steps(1)
        return dict(mismatch=mismatch, wrong=wrong_sequences(mismatch),
                    all_reduces=sum(collective_kernel(t.name) for t in decode.graph.tasks),
                    layers=len(model.model.layers), streams=len(decode.schedule.streams))
    run_and_exit({"rank": rank, "world": world, "all_reduce": all_reduce}, work)

if __name__ == "__main__":
    main()
