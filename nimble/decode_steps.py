"""The step modules a :class:`~nimble.generate.Generator` prepares, how they are prepared, and
transformers' own greedy tokens that a Generator reproduces.

- :class:`PrefillStep`: ``(ids (B, P), last (1,))`` -> ``(next token (B,), its logits (B, V))``,
  starting the static cache's position counters at 0 and ending them at ``last + 1``;
- :class:`DecodeStep`: ``(ids (B, 1), position (1,))`` -> the same, the counters set to
  ``position`` first;
- ``prepare_step`` functions: :func:`prepare_with_nimble` (Nimble's graphs, on eager or
  Inductor's kernels) and :func:`run_eagerly`;
- :func:`library_greedy`: ``generate()``'s greedy tokens with a static cache;
- :func:`greedy`: the steps' (and the compiled loop's) argmax.

transformers keeps a static cache's position in the cache itself (``cumulative_length``, a
tensor per layer), so the steps set those counters from their inputs inside the graph
(:mod:`nimble.generate` says why).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from .errors import InputError

#: ``prepare_step(module, examples) -> callable``: how a step module becomes what runs, called
#: with the module's inputs at the shapes of any of ``examples`` (a list of input tuples, one per
#: shape bucket: every prompt bucket of a batch size for the prefill, one for the decode step).
#: Nimble's prepared graphs by default (one per example, sharing one arena, each call run in the
#: graph of its input shapes); the module itself runs them eagerly.
PrepareStep = Callable[[Any, list], Callable]


def pad_right(input_ids, bucket: int, pad_id: int = 0):
    """``input_ids`` (B, n) padded on the right to (B, bucket) with ``pad_id``."""
    batch, n = input_ids.shape
    if n == bucket:
        return input_ids.contiguous()
    padded = torch.full((batch, bucket), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    padded[:, :n] = input_ids
    return padded


def _counters(cache) -> list:
    """Each layer's position counter (transformers' ``cumulative_length``) of an initialized
    static cache."""
    counters = [getattr(layer, "cumulative_length", None) for layer in cache.layers]
    if any(c is None for c in counters) or not all(layer.is_initialized for layer in cache.layers):
        raise InputError(f"{type(cache).__name__} has layers without a position counter "
                         "(transformers' StaticLayer.cumulative_length): use a StaticCache")
    return counters


def _set_counters(counters: list, value) -> None:
    """Every counter to ``value`` (a one-element tensor), as one plain device copy each: the
    simplest node for a graph to relocate (a fused multi-tensor copy packs its addresses into
    one struct argument)."""
    source = value.view(())
    for counter in counters:
        counter.copy_(source)


def _cache_tensors(cache) -> list:
    """Every tensor of an initialized static cache: each layer's keys, values and counter."""
    return [t for layer in cache.layers
            for t in (layer.keys, layer.values, layer.cumulative_length)]


def unit_in_last_place(value: float, dtype) -> float:
    """The spacing of ``dtype``'s numbers at ``value`` (its smallest normal's at zero)."""
    info = torch.finfo(dtype)
    return info.eps * 2.0 ** math.floor(math.log2(max(abs(value), info.tiny)))


#: Logits per chunk of :func:`split_argmax`.
ARGMAX_CHUNK = 1024
#: Vocabularies from this size on take :func:`split_argmax` under ``torch.compile``.
SPLIT_ARGMAX_FROM = 8 * ARGMAX_CHUNK


def greedy(logits):
    """The argmax token of each row, taken as ``generate(do_sample=False)`` takes it (over the
    logits as float32: the first of equal maxima, the first NaN before any number).

    Under ``torch.compile`` a large vocabulary takes :func:`split_argmax`: Inductor makes one
    program of a row's whole argmax (a 128,256-logit row is one multiprocessor's 22 µs, the
    step's last kernel), where the split's first reduction spreads a row over a program per
    chunk. Eager kernels keep torch's argmax, which spreads a row itself."""
    values = logits.float()
    if values.shape[-1] < SPLIT_ARGMAX_FROM or not torch.compiler.is_compiling():
        return values.argmax(-1)
    return split_argmax(values)


def split_argmax(values, chunk: int = ARGMAX_CHUNK):
    """``values.argmax(-1)`` as two reductions: each chunk's maximum and its first place, then
    the first chunk holding the row's maximum, so ties and NaNs resolve as one argmax would
    (the padding past the row's end is -inf, which no value loses to but another -inf, and an
    all--inf row still picks 0)."""
    lead, width = values.shape[:-1], values.shape[-1]
    chunks = -(-width // chunk)
    pad = chunks * chunk - width
    if pad:
        values = torch.nn.functional.pad(values, (0, pad), value=float("-inf"))
    best, where = values.reshape(*lead, chunks, chunk).max(-1)
    pick = best.argmax(-1, keepdim=True)
    return (pick * chunk + where.gather(-1, pick)).squeeze(-1)


class PrefillStep(torch.nn.Module):
    """``(ids (B, P), last (1,)) -> (token (B,), logits (B, V))`` of the token after position
    ``last``, the prompt's keys and values written to cache slots ``0..P-1`` and the counters
    left at ``last + 1``."""

    def __init__(self, model, cache) -> None:
        super().__init__()
        self.model = model
        self.cache = cache

    def forward(self, ids, last):
        counters = _counters(self.cache)
        for counter in counters:
            counter.zero_()
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        hidden = self.model.base_model(input_ids=ids, position_ids=positions,
                                       past_key_values=self.cache,
                                       use_cache=True).last_hidden_state
        logits = self.model.get_output_embeddings()(hidden.index_select(1, last))[:, 0]
        _set_counters(counters, last + 1)
        return greedy(logits), logits


class DecodeStep(torch.nn.Module):
    """``(ids (B, 1), position (1,)) -> (token (B,), logits (B, V))``: the token at ``position``
    written to the cache and the next one chosen."""

    def __init__(self, model, cache) -> None:
        super().__init__()
        self.model = model
        self.cache = cache

    def forward(self, ids, position):
        _set_counters(_counters(self.cache), position)
        positions = position.view(1, 1).expand(ids.shape[0], 1)
        logits = self.model(input_ids=ids, position_ids=positions, past_key_values=self.cache,
                            use_cache=True).logits[:, -1]
        return greedy(logits), logits


#: torch.compile's modes whose kernels Nimble takes: those that make no CUDA graphs of their own.
INDUCTOR_MODES = ("default", "max-autotune-no-cudagraphs")


def prepare_with_nimble(options=None, compile_steps: bool = False,
                        compile_mode: str | None = None,
                        compile_options: dict | None = None) -> PrepareStep:
    """``prepare_step`` that prepares each step module with Nimble (``options``: a
    :class:`~nimble.PrepareOptions`), one shape bucket per example, all in one arena
    (``Nimble.prepare(buckets=...)``); with ``compile_steps``, on ``torch.compile(module)``'s
    kernels (Inductor's; ``compile_mode`` or ``compile_options`` as ``torch.compile`` takes
    them, ``"max-autotune-no-cudagraphs"`` or ``{"coordinate_descent_tuning": True}`` say:
    fewer, fatter kernels for a decode step, paid for at prepare).  A mode that makes CUDA
    graphs of its own is refused: Nimble makes the graph."""
    if compile_mode is not None and compile_mode not in INDUCTOR_MODES:
        raise InputError(f"compile_mode {compile_mode!r}: Nimble takes Inductor's kernels "
                         f"without its CUDA graphs, so one of {', '.join(INDUCTOR_MODES)}")
    if compile_mode is not None and compile_options:
        raise InputError("pass compile_mode or compile_options, not both (torch.compile takes "
                         "one of them)")
    settings = {"mode": compile_mode} if compile_mode else \
        {"options": dict(compile_options)} if compile_options else {}

    def prepare(module, examples: list):
        from .api import Nimble

        if not compile_steps:
            return Nimble(module).prepare(buckets=list(examples), options=options)
        # static shapes: Nimble records each bucket by running the module at its shapes, and
        # Dynamo compiles each shape as its own graph
        with _compiles_per_shape(len(examples)):
            return Nimble(torch.compile(module, dynamic=False, **settings)).prepare(
                buckets=list(examples), options=options)
    return prepare


@contextmanager
def _compiles_per_shape(shapes: int) -> Iterator[None]:
    """Dynamo allowed a compiled graph for each of ``shapes`` shapes of one module: its
    recompile limit counts the graphs of one module object, and past it the module would run
    its eager kernels, unnoticed, in the buckets recorded last."""
    import torch._dynamo.config as dynamo

    with dynamo.patch(recompile_limit=max(dynamo.recompile_limit, shapes + 1)):
        yield


def run_eagerly(module, examples: list) -> Callable:
    """``prepare_step`` that runs each step module as it is (eager kernels, no graph)."""

    def call(*inputs):
        with torch.no_grad():
            return module(*inputs)
    return call


def library_greedy(model, input_ids, max_new_tokens: int, compiled: bool = False,
                   cache=None, with_logits: bool = False, compile_config=None):
    """transformers' own greedy tokens with a static cache, ``(B, n + max_new_tokens)``: what a
    :class:`Generator` reproduces.  ``generate()`` compiles the decoding forward on a GPU
    whenever the cache is static (``torch.compile``, mode ``"reduce-overhead"``); eager kernels
    unless ``compiled``.  ``cache``: a ``StaticCache`` to reset and generate in (a Generator's
    length gives the attention the same shapes; one cache kept across calls keeps its
    addresses, as ``generate()`` keeps its own); default, one ``generate()`` sizes for the
    prompt and the new tokens.  Never stops early at an end-of-sequence token.  With
    ``with_logits``: ``(tokens, logits)``, the logits each new token was chosen from,
    ``(max_new_tokens, B, V)``.  ``compile_config``: the ``transformers.CompileConfig`` a
    compiled generation uses (its backend, ``"nimble"`` say; default, the library's)."""
    import warnings

    if cache is None:
        where = {"cache_implementation": "static"}
    else:
        cache.reset()
        where = {"past_key_values": cache}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pad and end-of-sequence ids left unset
        if with_logits:
            where.update(output_logits=True, return_dict_in_generate=True)
        if compiled and compile_config is not None:
            where["compile_config"] = compile_config
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             do_sample=False, disable_compile=not compiled,
                             max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
                             **where)
    return (out.sequences, torch.stack(out.logits)) if with_logits else out
