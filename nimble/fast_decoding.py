"""``fast_generator(model, ...)``: a :class:`~nimble.generate.Generator` whose decode step has
every lever that measured faster on the GPU, applied in the order they need (issue 53).

Each lever is its own call (docs/inference.md, "Decoding: one launch per token over a static
cache"); they must come in one order, each before the compilation it changes, and one of them
(the GEMVs' margin) depends on another (the folds).  Here, in that order:

1. :func:`~nimble.fused_projections.fuse_projections`: each layer's sibling projections one
   GEMM;
2. :func:`~nimble.fast_gemv.fast_gemv` with :data:`~nimble.fast_gemv.PROLOGUE_MARGIN`: each
   single-row GEMM a Triton GEMV where it measures no more than 10% slower than torch's, since
   the folds below take out the kernel before it;
3. :func:`~nimble.decode_attention.decode_attention`, where the model's attention runs on
   ``sdpa`` (any other is kept, and said so in the log);
4. the steps compiled by Inductor (:func:`~nimble.generate.prepare_with_nimble` with
   ``compile_steps=True``) with its combo kernels and coordinate-descent tuning, and the fold
   pass of :mod:`nimble.gemv_prologue_pass` (RMS and layer norms, gated activations and GELUs
   into the GEMVs, each
   folded GEMV launched as timed fastest on its own kernel, :mod:`nimble.gemv_prologue_tuning`;
   with the attention swapped, the rotary embedding and the cache read into the attention
   kernel);
5. Nimble's prepare with ``options`` (default :class:`~nimble.PrepareOptions`, whose
   programmatic edges are kept only where the step measures faster).

The model is changed in place by 1-3, as each of those calls changes it (its parameters, names
and ``state_dict`` kept); a failure while preparing points the attention back.  What each
lever did is the Generator's :attr:`~nimble.generate.Generator.levers`.  The combination is
what ``tools/experiments/decode_levers.py`` measures as its defaults
(``tuned-prologues+programmatic+rope-attention+coordinate+gemv-prologues``, on fused
projections).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from torch import nn

from . import decode_attention as attention_module
from . import fast_gemv as gemv_module
from . import fused_projections
from . import generate
from . import gemv_prologue_pass
from . import gemv_prologue_tuning
from .errors import InputError

log = logging.getLogger("nimble")

#: Inductor's settings for the steps' compilation (beside the fold pass): fewer, fatter kernels.
INDUCTOR_SETTINGS = {"combo_kernels": True, "coordinate_descent_tuning": True}


@dataclass(frozen=True)
class DecodeLevers:
    """What :func:`fast_generator` did before and while preparing."""

    fused_projections: int  # groups of sibling projections made one GEMM
    gemvs: tuple  # fast_gemv's ShapeChoice per weight shape
    attention: Any  # the AttentionSwap (its undo() points the model back), or None: kept
    folds: tuple  # the fold pass's runs that folded something, one per compiled graph
    # gemv_prologue_tuning's LaunchChoice per folded GEMV shape timed while preparing (a shape
    # timed before in the process keeps its choice and is not timed again)
    launches: tuple = ()
    # graphs Inductor compiled afresh, each through the fold pass (one from Inductor's cache
    # holds its folds and launches and runs no pass)
    compilations: int = 0

    def describe(self) -> str:
        kept = sum(1 for choice in self.gemvs if choice.config is not None)
        folded = sum(run.total for run in self.folds)
        roped = sum(run.roped for run in self.folds)
        head = (f"{self.fused_projections} projection group(s) fused; GEMV for {kept} of "
                f"{len(self.gemvs)} weight shape(s) and row count(s); attention "
                f"{'on nimble_decode' if self.attention else 'not swapped'}; ")
        if not self.compilations:
            return head + "every step's graph from Inductor's cache, its folds with it"
        return head + (f"{folded} kernel(s) folded into GEMVs and {roped} rotary embedding(s) "
                       f"into the attention over {self.compilations} compiled graph(s); "
                       f"{len(self.launches)} folded GEMV launch(es) timed")


def fast_generator(model: nn.Module, max_cache_len: int, prompt_buckets: Sequence[int],
                   batch_sizes: Sequence[int] = (1,), *, options=None,
                   pad_id: int = 0) -> "generate.Generator":
    """A :class:`~nimble.generate.Generator` of ``model`` (a transformers causal LM on the
    GPU, in ``eval()`` mode) with the decode levers of the module docstring; the arguments as
    the Generator's, ``options`` Nimble's :class:`~nimble.PrepareOptions`."""
    import torch._inductor.config as inductor_config

    _check(model, max_cache_len, prompt_buckets, batch_sizes)
    timed_before = len(gemv_prologue_tuning.chosen())
    fused = fused_projections.fuse_projections(model)
    gemvs = tuple(gemv_module.fast_gemv(model, margin=gemv_module.margin_for(folded=True),
                                        rows=gemv_module.decode_rows(batch_sizes)))
    attention = _swap_attention(model)
    on_kernel = _attention(model) == attention_module.NAME
    # the settings around the whole prepare, as decode_levers measures them: the steps compile
    # and their kernels tune (at their first runs) inside it
    try:
        with inductor_config.patch(**INDUCTOR_SETTINGS), \
                gemv_prologue_pass.fusing(rope_attention=on_kernel,
                                          tune_launches=True) as folds:
            generator = generate.Generator(
                model, max_cache_len, prompt_buckets, batch_sizes, pad_id=pad_id,
                prepare_step=generate.prepare_with_nimble(options, compile_steps=True))
    except BaseException:
        if attention is not None:
            attention.undo()
        raise
    generator.levers = DecodeLevers(fused, gemvs, attention,
                                    tuple(run for run in folds.runs if run.total or run.roped),
                                    tuple(gemv_prologue_tuning.chosen()[timed_before:]),
                                    len(folds.runs))
    log.info("fast_generator: %s", generator.levers.describe())
    return generator


def _check(model, max_cache_len: int, prompt_buckets, batch_sizes) -> None:
    """What the Generator would refuse, refused before any lever changes the model."""
    if not isinstance(model, nn.Module):
        raise InputError(f"fast_generator takes a transformers causal LM (an nn.Module), got "
                         f"{type(model).__name__}")
    generate.Limits.checked(max_cache_len, prompt_buckets, batch_sizes)
    generate.refuse_training(model)
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cuda"}:
        raise InputError("fast_generator measures and prepares the model on the GPU: move it "
                         f"to a CUDA device first (its parameters are on {sorted(devices)})")


def _attention(model) -> str | None:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def _swap_attention(model):
    """The model's attention on ``nimble_decode`` where it runs on ``sdpa`` (the swap), else
    kept as it is (None: already on ``nimble_decode``, or on another implementation)."""
    current = _attention(model)
    if current != attention_module.REPLACES:
        if current != attention_module.NAME:
            log.info("fast_generator: the attention stays on %r (decode_attention takes %r)",
                     current, attention_module.REPLACES)
        return None
    return attention_module.decode_attention(model)
