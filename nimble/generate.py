"""Greedy decoding of a Hugging Face causal LM as one graph launch per token, over a static cache.

A :class:`Generator` holds, per batch size, one transformers ``StaticCache`` (its key and value
tensors allocated once, before any recording, so every graph reads and writes them in place at
fixed addresses) and two kinds of step module over it:

- :class:`PrefillStep` (one graph per prompt-length bucket, all of a batch size's buckets
  prepared as one Nimble whose shape buckets share one arena): ``(ids (B, P), last (1,))`` ->
  ``(next token (B,), its logits (B, V))``.  It starts the cache's position counters at 0,
  writes slots ``0..P-1``, and ends with the counters at ``last + 1``: a prompt of ``n`` tokens
  runs in the smallest bucket ``P >= n``, padded on the right (causal attention keeps the real
  tokens from seeing the padding, and the decode steps' mask hides the padded slots until they
  are overwritten), and ``last = n - 1`` picks the logits of its last real token.
- :class:`DecodeStep` (one graph per batch size): ``(ids (B, 1), position (1,))`` ->
  ``(next token (B,), its logits (B, V))``.  It sets the counters to ``position`` first, so the
  token is written to slot ``position`` and attends to slots ``0..position``, and the position
  ids are ``position`` for every row (prompts of one length, unpadded, as ``generate()`` sees
  them).

transformers keeps a static cache's position in the cache itself (``cumulative_length``, a
tensor per layer that ``update`` advances on the GPU), not in an argument: the step modules set
those counters from their inputs inside the graph, which keeps every launch independent of how
many launches ran before (the per-task timing and the proof in ``prepare()`` launch the graph
many times).  The key and value tensors are state that a launch reads as the earlier launches
left it; the proof restores that state before every launch (:mod:`nimble.engine.proof`).

A generation is one prefill launch, then per token one cell write for each of the two inputs,
one launch and one copy of the token into the result, with no host round trip: the argmax is
taken in the graph and the token goes back in as the next step's input.
"""
from __future__ import annotations

import bisect
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from .decode_steps import (INDUCTOR_MODES, DecodeStep, PrefillStep, PrepareStep,
                           _cache_tensors, library_greedy, pad_right, prepare_with_nimble,
                           run_eagerly, unit_in_last_place)
from .errors import CaptureError, InputError

log = logging.getLogger("nimble")

#: The step modules and their preparation live in :mod:`nimble.decode_steps`; they are named
#: here too, where a Generator's users reach for them.
__all__ = ["EOS_CHECK_EVERY", "INDUCTOR_MODES", "POSITION_CHECK_ULPS", "DecodeStep",
           "Generator", "Limits", "PrefillStep", "PrepareStep", "library_greedy", "pad_right",
           "prepare_with_nimble", "run_eagerly", "unit_in_last_place"]

#: With an end-of-sequence token, how many tokens a generation runs between two looks from the
#: host at whether every sequence finished (each look waits for the GPU).
EOS_CHECK_EVERY = 8
#: How far a decode step run at another position than the one it was prepared at may stray
#: from the step run eagerly there (at least), in units in the last place of its logits' dtype
#: at their largest: the same step captured and run eagerly differ by about one unit
#: (transformers' mask code takes its capture branch under capture), Inductor's fusions by a
#: few, a step frozen at another position by about as much as the two positions' logits differ.
POSITION_CHECK_ULPS = 16


@dataclass(frozen=True)
class Limits:
    """What a :class:`Generator` was prepared for."""

    max_cache_len: int
    prompt_buckets: tuple[int, ...]  # ascending prompt lengths, one prefill graph each
    batch_sizes: tuple[int, ...]  # ascending

    @classmethod
    def checked(cls, max_cache_len: int, prompt_buckets: Sequence[int],
                batch_sizes: Sequence[int]) -> "Limits":
        """The limits, or an :class:`InputError` saying which argument is wrong."""
        buckets, batches = tuple(sorted(set(prompt_buckets))), tuple(sorted(set(batch_sizes)))
        if not buckets or not batches:
            raise InputError("give at least one prompt-length bucket and one batch size "
                             f"(got prompt_buckets={list(prompt_buckets)}, "
                             f"batch_sizes={list(batch_sizes)})")
        if any(not isinstance(v, int) or v < 1 for v in buckets + batches + (max_cache_len,)):
            raise InputError("prompt buckets, batch sizes and max_cache_len must be positive "
                             f"integers (got prompt_buckets={list(prompt_buckets)}, batch_sizes="
                             f"{list(batch_sizes)}, max_cache_len={max_cache_len!r})")
        if buckets[-1] >= max_cache_len:
            raise InputError(f"the largest prompt bucket ({buckets[-1]} tokens) leaves no room "
                             f"to generate in a cache of {max_cache_len} tokens: raise "
                             "max_cache_len or lower the bucket")
        return cls(max_cache_len, buckets, batches)

    def bucket_for(self, prompt_len: int) -> int:
        """The smallest prompt bucket that holds ``prompt_len`` tokens."""
        if prompt_len < 1:
            raise InputError("the prompt is empty: give at least one token per sequence")
        at = bisect.bisect_left(self.prompt_buckets, prompt_len)
        if at == len(self.prompt_buckets):
            raise InputError(
                f"a prompt of {prompt_len} tokens is longer than the largest prepared bucket "
                f"({self.prompt_buckets[-1]} tokens; buckets {list(self.prompt_buckets)}, cache "
                f"{self.max_cache_len} tokens): shorten it, or build the Generator with a "
                "larger bucket (and max_cache_len)")
        return self.prompt_buckets[at]

    def check(self, batch: int, prompt_len: int, max_new_tokens: int) -> int:
        """The bucket for a generation, or an :class:`InputError` naming the limit it breaks."""
        if batch not in self.batch_sizes:
            raise InputError(f"batch size {batch} was not prepared; the Generator has "
                             f"{list(self.batch_sizes)}: build it with batch_sizes including "
                             f"{batch}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive integer (got {max_new_tokens!r})")
        bucket = self.bucket_for(prompt_len)
        # every generated token but the last is written to the cache
        needed = prompt_len + max_new_tokens - 1
        if needed > self.max_cache_len:
            raise InputError(
                f"a prompt of {prompt_len} tokens and {max_new_tokens} new tokens need a cache of "
                f"{needed} tokens; the cache holds {self.max_cache_len}: generate at most "
                f"{self.max_cache_len - prompt_len + 1} new tokens, or build the Generator with "
                f"max_cache_len >= {needed}")
        return bucket


def _kept(tokens, eos_token_id: int) -> int:
    """Of generated ``tokens`` (new tokens x B), how many the result keeps: up to the one where
    the last sequence produced ``eos_token_id`` (its first), or all."""
    ends = tokens == eos_token_id
    first = torch.where(ends.any(0), ends.int().argmax(0), len(tokens))
    return min(int(first.max()) + 1, len(tokens))


@dataclass
class _BatchSteps:
    """One batch size's cache and prepared steps."""

    cache: Any
    decode: Callable | None  # None until prepared
    prefill: Callable | None  # every prompt bucket's, dispatched by the ids' shape


def refuse_training(model) -> None:
    """A model in training mode refused, as a :class:`Generator` refuses it."""
    if getattr(model, "training", False):
        raise InputError("the model is in training mode: call model.eval() before building "
                         "a Generator")


class Generator:
    """Greedy generation with a static cache: one prefill launch per prompt, one launch per
    token.

    ``model`` is a transformers causal LM (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...) on the
    GPU in ``eval()`` mode; ``max_cache_len`` the static cache's length; ``prompt_buckets`` the
    prompt lengths to prepare a prefill graph for (per batch size, one Nimble with a shape
    bucket per prompt length, in one arena sized by the largest); ``batch_sizes`` the batch
    sizes to prepare.
    ``prepare_step`` says how a step module runs (default: :func:`prepare_with_nimble`).
    ``fuse_projections=True`` first makes each attention's query, key and value projections
    and each gated MLP's gate and up projections one GEMM
    (:func:`nimble.fused_projections.fuse_projections`, in place: the model's weights become
    views of one concatenated tensor per group, names and ``state_dict`` kept); a decode step's
    lever where the small projections are latency-bound (batch 1), whose tokens may depart
    from the unfused model's at near-ties (another GEMM kernel rounds otherwise).
    """

    #: Groups of sibling projections made one GEMM by ``fuse_projections=True`` (None: not
    #: asked for, or a Generator loaded from a file).
    fused_projections: int | None = None
    #: What :func:`nimble.fast_decoding.fast_generator` did to the model and its compilation
    #: (a :class:`~nimble.fast_decoding.DecodeLevers`; None: a Generator built otherwise).
    levers: Any = None

    def __init__(self, model, max_cache_len: int, prompt_buckets: Sequence[int],
                 batch_sizes: Sequence[int] = (1,), prepare_step: PrepareStep | None = None,
                 pad_id: int = 0, fuse_projections: bool = False) -> None:
        self.limits = Limits.checked(max_cache_len, prompt_buckets, batch_sizes)
        refuse_training(model)
        if fuse_projections:
            from .fused_projections import fuse_projections as fuse

            self.fused_projections = fuse(model)
            log.info("fused %d group(s) of sibling projections into one GEMM each",
                     self.fused_projections)
        self.model = model
        self.pad_id = pad_id
        self._steps: dict[int, _BatchSteps] = {}
        prepare_step = prepare_step or prepare_with_nimble()
        try:
            for batch in self.limits.batch_sizes:
                self._prepare_batch(batch, prepare_step)
        except BaseException:
            self.close()
            raise

    def _prepare_batch(self, batch: int, prepare_step: PrepareStep) -> None:
        """Prepare ``batch``'s steps into ``self._steps`` as they come (so that a failure
        closes those already prepared)."""
        import transformers

        device = next(self.model.parameters()).device
        cache = transformers.StaticCache(config=self.model.config,
                                         max_cache_len=self.limits.max_cache_len)
        ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        with torch.no_grad():  # allocates the cache's tensors before any capture
            self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        steps = self._steps[batch] = _BatchSteps(cache, None, None)
        prefill = PrefillStep(self.model, cache).eval()
        examples = [(torch.zeros((batch, bucket), dtype=torch.long, device=device),
                     torch.full((1,), bucket - 1, dtype=torch.long, device=device))
                    for bucket in self.limits.prompt_buckets]
        with _where(f"the prefill of batch {batch} (prompt buckets "
                    f"{list(self.limits.prompt_buckets)})"):
            steps.prefill = prepare_step(prefill, examples)
        position = torch.full((1,), self.decode_position, dtype=torch.long, device=device)
        with _where(f"the decode step of batch {batch}, prepared at cache position "
                    f"{self.decode_position}"):
            steps.decode = prepare_step(DecodeStep(self.model, cache).eval(), [(ids, position)])
        self._check_at_another_position(batch, steps)

    def _check_at_another_position(self, batch: int, steps: "_BatchSteps") -> None:
        """The decode step prepared at :attr:`decode_position` serves every position only if
        the model's kernels and their arguments do not depend on it beyond what the graph
        reads from its inputs (a Python-side counter, or a branch on the position taken at
        recording, would be frozen in the graph).  Run it at the last slot a decode step
        writes, beside the step run eagerly there and at the prepared position, all on the
        same cache contents: a :class:`CaptureError` naming the position prepared unless it
        lands within rounding of the eager step at its own position (the larger of
        :data:`POSITION_CHECK_ULPS` units in the last place and a quarter of how far the two
        positions' eager logits lie apart).  The cache is left as it was found."""
        other = self.limits.max_cache_len - 1
        if other == self.decode_position:
            return
        device = next(self.model.parameters()).device
        ids = torch.full((batch, 1), 1, dtype=torch.long, device=device)
        eager = DecodeStep(self.model, steps.cache)
        runs = (("here", eager, other), ("prepared", eager, self.decode_position),
                ("graph", steps.decode, other))
        state = _cache_tensors(steps.cache)
        saved = [t.clone() for t in state]
        logits = {}
        try:
            with torch.no_grad():
                for name, step, at in runs:
                    logits[name] = step(ids, torch.full((1,), at, dtype=torch.long,
                                                        device=device))[1].clone()
                    for t, s in zip(state, saved):
                        t.copy_(s)
        finally:
            for t, s in zip(state, saved):
                t.copy_(s)
        ulp = unit_in_last_place(float(logits["here"].float().abs().max()), logits["here"].dtype)
        here, graph = logits["here"].float(), logits["graph"].float()
        off = float((graph - here).abs().max()) if graph.shape == here.shape else float("inf")
        apart = float((logits["prepared"].float() - here).abs().max())
        if not off <= max(POSITION_CHECK_ULPS * ulp, apart / 4):
            raise CaptureError(
                f"the decode step of batch {batch} was prepared at cache position "
                f"{self.decode_position}; at position {other} its logits differ from the model "
                f"run eagerly there by up to {off:.3g} (the model's own logits at the two "
                f"positions lie {apart:.3g} apart): the model's kernels or their arguments "
                "depend on the position beyond the position ids and the cache it is given (a "
                "Python-side counter, or a branch on the position), so one graph cannot serve "
                f"every position; prepared positions: {self.decode_position} only")

    @property
    def decode_position(self) -> int:
        """The cache position the decode steps are recorded at (the smallest prompt bucket): one
        graph then serves every position, since the position is an input the graph reads on
        the GPU."""
        return self.limits.prompt_buckets[0]

    @property
    def caches(self) -> dict[int, Any]:
        """Each batch size's ``StaticCache``."""
        return {batch: steps.cache for batch, steps in self._steps.items()}

    def steps(self, batch: int) -> tuple[Callable, Callable]:
        """``(decode step, prefill)`` prepared for ``batch``: the prefill takes ids of every
        prompt bucket's shape (with :func:`prepare_with_nimble`, one Nimble whose
        ``buckets`` are the prompt buckets, in one arena)."""
        steps = self._steps[batch]
        return steps.decode, steps.prefill

    def generate(self, input_ids, max_new_tokens: int, eos_token_id: int | None = None):
        """``input_ids`` (B, n) followed by the greedy tokens ``model.generate(input_ids,
        do_sample=False, cache_implementation="static", max_new_tokens=...,
        eos_token_id=eos_token_id, pad_token_id=pad_id)`` chooses.

        Without ``eos_token_id`` every sequence gets ``max_new_tokens`` tokens, (B, n +
        max_new_tokens).  With it, a sequence that produced it gets ``pad_id`` from then on,
        and the result ends at the token where the last sequence finished (as the library's
        does); the host looks every :data:`EOS_CHECK_EVERY` tokens, so up to that many steps
        past the end run and are dropped."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or \
                input_ids.dtype != torch.long:
            raise InputError("input_ids must be a (batch, prompt length) tensor of int64 token "
                             f"ids (got {_described(input_ids)})")
        batch, prompt_len = input_ids.shape
        bucket = self.limits.check(batch, prompt_len, max_new_tokens)
        steps = self._steps[batch]
        device = input_ids.device
        last = torch.full((1,), prompt_len - 1, dtype=torch.long, device=device)
        token, _ = steps.prefill(pad_right(input_ids, bucket, self.pad_id), last)
        tokens = torch.empty((max_new_tokens, batch), dtype=torch.long, device=device)
        tokens[0].copy_(token)
        positions = torch.arange(prompt_len, prompt_len + max_new_tokens - 1,
                                 dtype=torch.long, device=device).view(-1, 1)
        decode = steps.decode
        finished = None if eos_token_id is None else tokens[0] == eos_token_id
        filled = 1
        for t in range(max_new_tokens - 1):
            if finished is not None and t and t % EOS_CHECK_EVERY == 0 and \
                    bool(finished.all()):
                break
            token, _ = decode(tokens[t].view(batch, 1), positions[t])
            if finished is None:
                tokens[t + 1].copy_(token)
            else:
                tokens[t + 1].copy_(token.masked_fill(finished, self.pad_id))
                finished |= tokens[t + 1] == eos_token_id
            filled = t + 2
        kept = filled if finished is None else _kept(tokens[:filled], eos_token_id)
        return torch.cat([input_ids, tokens[:kept].t()], dim=1)

    def save(self, path, *, weights: bool = True, quiet: bool = True):
        """Write every batch size's prefill and decode graphs to one file at ``path`` (their
        kernels, the model's weights and the static caches' bytes shared), with the limits,
        for :meth:`load` in another process; returns the path.  The steps must be Nimble's
        (:func:`prepare_with_nimble`, the default); ``weights=False`` is refused, since a load
        reads the file's weights."""
        from .engine.saving import save_graphs
        from .errors import SaveError

        if not weights:
            raise SaveError("a Generator's file carries its weights: Generator.load reads them "
                            "from it (save with weights=True)")
        graphs, steps = [], {}
        for batch, batch_steps in sorted(self._steps.items()):
            for role, step in (("prefill", batch_steps.prefill), ("decode", batch_steps.decode)):
                serving = getattr(step, "_serving", None)
                if serving is None:
                    raise SaveError(f"the {role} step of batch {batch} is no prepared Nimble "
                                    "graph (prepare_step=run_eagerly?): nothing to save")
                graphs.append((f"{role}/{batch}", serving))
            steps[str(batch)] = {"prefill": f"prefill/{batch}", "decode": f"decode/{batch}"}
        extra = {"generator": {"max_cache_len": self.limits.max_cache_len,
                               "prompt_buckets": list(self.limits.prompt_buckets),
                               "batch_sizes": list(self.limits.batch_sizes),
                               "pad_id": self.pad_id, "steps": steps}}
        return save_graphs(graphs, path, weights=True, quiet=quiet, extra=extra)

    @classmethod
    def load(cls, path, *, model=None, verify: bool = True, quiet: bool = True) -> "Generator":
        """A Generator serving the graphs :meth:`save` wrote at ``path``, built in this process
        and proven against the outputs saved with them (:func:`nimble.load`'s proof), with no
        recording or preparing: ``generate`` runs as on the Generator saved.  Each batch
        size's static cache lives in memory of its own, starting as it was saved; ``caches``
        holds None (no transformers cache object backs it).  The weights are the file's, or
        with ``model`` (the model the Generator was made of, made again here as it was then)
        the model's, by name: what steps whose sums over the ranks are Nimble's peer sums
        need (:mod:`nimble.peer_sum`: the model's table names the buffers made here)."""
        from .api import Nimble
        from .engine.loading import load_graphs
        from .errors import LoadError

        manifest, graphs = load_graphs(path, None if model is None else step_weights(model),
                                       verify=verify, quiet=quiet)
        spec = manifest.get("generator")
        if spec is None:
            for _, serving in graphs:
                serving.close()
            raise LoadError(f"{path} holds no Generator (saved by Nimble.save): load it with "
                            "nimble.load")
        named = dict(graphs)
        generator = cls.__new__(cls)
        generator.limits = Limits.checked(spec["max_cache_len"], spec["prompt_buckets"],
                                          spec["batch_sizes"])
        generator.model, generator.pad_id, generator._steps = None, spec["pad_id"], {}
        for batch in generator.limits.batch_sizes:
            pair = spec["steps"][str(batch)]
            generator._steps[batch] = _BatchSteps(
                None, Nimble(None)._adopt(named[pair["decode"]], False),
                Nimble(None)._adopt(named[pair["prefill"]], False))
        return generator

    def close(self) -> None:
        """Free every prepared graph (idempotent)."""
        for steps in self._steps.values():
            for step in (steps.decode, steps.prefill):
                close = getattr(step, "close", None)
                if close is not None:
                    close()
        self._steps = {}


def step_weights(model) -> torch.nn.Module:
    """A module naming ``model``'s weights as the Generator's prepared steps name them: the
    step module's ``model.``, and ``_orig_mod.model.`` for a step compiled by
    ``torch.compile`` (its wrapper's name for the module inside)."""
    compiled = torch.nn.Module()
    compiled.model = model
    named = torch.nn.Module()
    named.model, named._orig_mod = model, compiled
    return named


@contextmanager
def _where(step: str) -> Iterator[None]:
    """A :class:`CaptureError` of ``step`` says which step, at which position, and why one graph
    cannot serve a forward that picks its work from the position on the host."""
    try:
        yield
    except CaptureError as e:
        raise CaptureError(
            f"{step}: {e}. A decoding step runs as one graph for every cache position, with the "
            "position read on the GPU; a forward that chooses its kernels from the position on "
            "the host (another attention path at position 0, a Python branch on the cache's "
            "length) cannot: keep the choice on the GPU (torch.where) or take the same path at "
            "every position") from e


def _described(value) -> str:
    shape = getattr(value, "shape", None)
    return f"{type(value).__name__} of shape {tuple(shape)} and dtype {value.dtype}" \
        if shape is not None else type(value).__name__
