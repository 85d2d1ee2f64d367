"""The strongest stock-PyTorch way to decode greedily, the baseline ``nimble bench --generate``
measures against (issue 53): gpt-fast's tight loop.

transformers' ``StaticCache``; the prompt run eagerly into it; then per token one call of
``torch.compile(step, mode="reduce-overhead", fullgraph=True)``, where ``step`` is the model's
forward at one position followed by the argmax, so the token never leaves the GPU and the host
does nothing per token but mark the CUDA-graph step, launch, clone the token and advance the
position (on the GPU).  ``generate()`` with a compiled static cache does more host work per
token (its logits processors, stopping criteria, the cache's bookkeeping), which this loop does
not pay: timing Nimble against ``generate()`` alone would flatter it.
"""
from __future__ import annotations

import inspect
from typing import Callable


def takes_cache_position(model) -> bool:
    """Whether ``model``'s forward names ``cache_position`` (transformers before the cache kept
    its position in its own counters): then the loop passes it, as gpt-fast's recipe does."""
    return "cache_position" in inspect.signature(model.forward).parameters


def compiled_loop(model, max_cache_len: int, compile: Callable | None = None) -> Callable:
    """``generate(ids (B, n), new) -> (B, n + new)``: ``model``'s greedy tokens by the tight
    loop, over one ``StaticCache`` of ``max_cache_len`` tokens kept across calls (its addresses
    fixed, as the CUDA graphs need).  ``compile`` stands in for ``torch.compile`` (the CPU tests
    pass one that returns the function as it is); it is called once, here."""
    import torch
    import transformers

    from ..decode_steps import greedy

    cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
    by_position = takes_cache_position(model)

    def forward(ids, positions):
        extra = {"cache_position": positions[0]} if by_position else {}
        return model(input_ids=ids, position_ids=positions, past_key_values=cache,
                     use_cache=True, **extra).logits[:, -1]

    def step(token, position):
        positions = position.view(1, 1).expand(token.shape[0], 1)
        return greedy(forward(token, positions)).unsqueeze(-1)

    compiled = (compile or torch.compile)(step, mode="reduce-overhead", fullgraph=True)

    def generate(ids, new: int):
        batch, n = ids.shape
        cache.reset()
        out = torch.empty((batch, n + new), dtype=ids.dtype, device=ids.device)
        out[:, :n] = ids
        with torch.no_grad():
            prompt = torch.arange(n, device=ids.device).expand(batch, n)
            token = forward(ids, prompt).argmax(-1, keepdim=True)
            out[:, n:n + 1] = token
            position = torch.full((1,), n, dtype=torch.long, device=ids.device)
            for t in range(n + 1, n + new):
                torch.compiler.cudagraph_mark_step_begin()
                # the graph's output is overwritten by its next replay
                token = compiled(token, position).clone()
                out[:, t:t + 1] = token
                position += 1
        return out
    return generate
