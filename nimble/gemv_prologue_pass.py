"""An Inductor graph pass that folds the kernel before a GEMV into it (issue 53): where a
compiled graph feeds :func:`nimble.fast_gemv`'s ``nimble::gemv`` (or, with :data:`FOLD_ROWS`,
``nimble::gemm_rows``) an RMS or layer norm (of a residual sum or of a plain vector), a
SiLU-gated product or a GELU, the pass calls the GEMV of :mod:`nimble.gemv_prologues` that
computes that vector itself, and the separate kernel goes.  Where the residual sum or the GELU
reads a projection's output plus its bias (GPT-2's and BERT's projections), the bias is added
in too, so that the kernel of the bias's add goes as well.

The patterns (:mod:`nimble.gemv_prologue_patterns`) are the operations as Inductor hands them
over after its decompositions, on vectors of the GEMV's input width, every tensor of the
GEMV's dtype.  What it does not match stays as it was: the pass only ever replaces a GEMV by
one that computes the same vector, and where the norm's input is a residual sum the layer goes
on to read, the new GEMV writes that sum for it.  Turn it on around a compilation with
:func:`fusing` (or set ``torch._inductor.config.post_grad_custom_post_pass`` to
:data:`PASS`); the step's compile cache keys on this pass's source.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import fx

from .fast_gemv import GemvConfig
from . import gemv_prologue_patterns, gemv_prologues  # gemv_prologues registers the operators
from .fx_patterns import VIEWS, aten
from .fx_patterns import is_call as _is
from .fx_patterns import strip_views as _strip_views
from .fx_patterns import val as _val
from .gemv_prologue_patterns import (Norm, biased, match_gated, match_gelu, match_layernorm,
                                     match_rmsnorm, residual_sum)

log = logging.getLogger("nimble")

#: Whether the pass folds layer norms and GELUs (GPT-2's, BERT's, Phi's) as well as RMS norms
#: and gated activations.  Off until measured faster: on GPT-2 at batch 1 (an H100, every
#: projection on the GEMV) the folds took a step from 116 tasks to 79 and its busy time from
#: 288.6 to 257.9 µs, but the token from 0.331 to 0.341 ms (docs/results.md);
#: ``tools/experiments/decode_levers.py``'s ``layer-norms`` lever turns it on.
FOLD_LAYER_NORMS = False
#: Whether the pass folds into ``nimble::gemm_rows`` too (a GEMM of 2 to 16 rows: a decode
#: step at a small batch), not only into the GEMV.  Off until measured on the GPU: its kernel
#: is checked under Triton's interpreter and compiled for sm_90 in the CPU tests only
#: (``tools/experiments/decode_levers.py``'s ``fold-rows`` lever turns it on).
FOLD_ROWS = False


@dataclass
class Fused:
    """What one run of the pass folded, by kind."""

    rmsnorm: int = 0
    add_rmsnorm: int = 0
    gated: int = 0
    joined: int = 0  # attentions whose split's join the GEMV after them took
    gemvs: int = 0  # the graph's GEMVs, folded or not
    gemms_of_rows: int = 0  # the graph's GEMMs of rows (nimble.gemm_rows), folded or not
    roped: int = 0  # attentions that took their rotary embedding and cache read
    layernorm: int = 0
    add_layernorm: int = 0
    gelu: int = 0

    @property
    def total(self) -> int:
        return (self.rmsnorm + self.add_rmsnorm + self.gated + self.joined + self.layernorm
                + self.add_layernorm + self.gelu)


# ---- the rewrite ----------------------------------------------------------------------------

def _flat(graph: fx.Graph, node, k: int, rows: int = 1):
    """``node`` as the kernel reads it: a vector of ``k`` (one row), else ``rows x k``."""
    shape = [k] if rows == 1 else [rows, k]
    view = graph.call_function(aten.reshape.default, (node, shape))
    view.meta["val"] = _val(node).reshape(shape)
    return view


def _before(graph: fx.Graph, nodes, where) -> bool:
    """Whether every fx node of ``nodes`` comes before ``where`` in ``graph``."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    return all(order[n] < order[where] for n in nodes if isinstance(n, fx.Node))


#: Operations on a weight that read no data (a view of the parameter, re-laid or not):
#: copied to where a folded operator needs its weight earlier than the graph computes it.
_WEIGHT_VIEWS = VIEWS + (aten.permute.default, aten.t.default)


def _available_before(graph: fx.Graph, node, where):
    """``node``, or a copy of its chain of views of earlier nodes made right before ``where``
    (a Conv1D's weight is ``weight.t()``, taken where the product is), so that an operator
    placed at ``where`` can read it; None where it is computed otherwise."""
    if not isinstance(node, fx.Node) or _before(graph, (node,), where):
        return node
    if not _is(node, *_WEIGHT_VIEWS):
        return None
    source = _available_before(graph, node.args[0], where)
    if source is None:
        return None
    with graph.inserting_before(where):
        copy = graph.call_function(node.target, (source, *node.args[1:]), dict(node.kwargs))
    copy.meta["val"] = _val(node)
    return copy


def _first_reader(graph: fx.Graph, node):
    """The first node of ``graph`` that reads ``node``."""
    readers = set(node.users)
    return next(n for n in graph.nodes if n in readers)


def _only_feeds(node, gemv) -> bool:
    """Whether ``node``'s one reader is a chain of views that ends at ``gemv``."""
    while True:
        users = list(node.users)
        if len(users) != 1:
            return False
        if users[0] is gemv:
            return True
        if not _is(users[0], *VIEWS):
            return False
        node = users[0]


def _attentions() -> tuple:
    from . import attention_rope  # noqa: F401  (registers decode_attention_rope)

    return (torch.ops.nimble.decode_attention.default,
            torch.ops.nimble.decode_attention_rope.default)


def match_joined_attention(x, gemv, k: int):
    """``(attention node, parts layout)`` where ``x`` is a batch-1 ``nimble::decode_attention``
    (or ``decode_attention_rope``) whose cache the kernel splits, read by ``gemv`` alone."""
    from . import decode_attention as da

    if not _is(x, *_attentions()) or not _only_feeds(x, gemv):
        return None
    query, key = _val(x.args[0]), _val(x.args[1])
    if query is None or key is None or query.shape[0] != 1 or query.numel() != k \
            or query.dtype != _val(gemv.args[1]).dtype:
        return None
    layout = da.parts_layout(query.shape, key.shape)
    return (x, layout) if layout.splits >= 2 else None


def _fold_joined(graph, gemv, attention, layout, weight, config):
    roped = attention.target == torch.ops.nimble.decode_attention_rope.default
    with graph.inserting_before(gemv):
        parts = graph.call_function(
            torch.ops.nimble.decode_attention_rope_parts.default if roped
            else torch.ops.nimble.decode_attention_parts.default,
            (*attention.args[:5], layout.splits, *attention.args[5:]))
        part = graph.call_function(operator.getitem, (parts, 0))
        stat = graph.call_function(operator.getitem, (parts, 1))
        new = graph.call_function(torch.ops.nimble.gemv_joined.default,
                                  (part, stat, weight, layout.groups, layout.kv_heads,
                                   layout.splits, layout.head_dim, *config))
    like = _val(attention)
    part_val = like.new_empty((layout.rows(1), layout.block_d), dtype=torch.float32)
    stat_val = like.new_empty((layout.rows(1), 2), dtype=torch.float32)
    parts.meta["val"] = (part_val, stat_val)
    part.meta["val"], stat.meta["val"] = part_val, stat_val
    new.meta["val"] = _val(gemv)
    gemv.replace_all_uses_with(new)


def fuse(graph: fx.Graph, join_attention: bool = False, tune_launches: bool = False) -> Fused:
    """Fold what each ``nimble::gemv`` (and with :data:`FOLD_ROWS` each ``nimble::gemm_rows``)
    of ``graph`` reads into it where a pattern matches; with ``join_attention``, also the join of a split attention
    that only a GEMV reads; with ``tune_launches``, each folded GEMV launched as
    :mod:`nimble.gemv_prologue_tuning` measures fastest (else as the plain GEMV's
    configuration; a GEMM of rows keeps its own)."""
    done = Fused()
    products = (torch.ops.nimble.gemv.default,) + (
        (torch.ops.nimble.gemm_rows.default,) if FOLD_ROWS else ())
    for product in [n for n in graph.nodes if _is(n, *products)]:
        x, weight, *config = product.args
        w = _val(weight)
        one_row = product.target == torch.ops.nimble.gemv.default
        if w is None or not (one_row or _val(x) is not None):
            continue
        k, dtype = w.shape[1], w.dtype
        rows = 1 if one_row else _val(x).shape[0]
        if one_row:
            done.gemvs += 1
        else:
            done.gemms_of_rows += 1
        source = _strip_views(x)
        joined = match_joined_attention(source, product, k) if join_attention and one_row \
            else None
        if joined is not None:
            _fold_joined(graph, product, *joined, weight, config)
            done.joined += 1
            continue
        if one_row:
            def launch(prologue, w=w, config=config):
                return _launch_args(prologue, w, config, tune_launches)
        else:
            def launch(prologue, config=config):
                return (*config, 1)[:5]  # a GEMM of rows keeps its launch, split included
        kind = _fold_prologue(graph, product, source, weight, k, dtype, rows, launch)
        if kind is not None:
            setattr(done, kind, getattr(done, kind) + 1)
    if done.total:
        graph.eliminate_dead_code()
    return done


def _prologue_op(kind: str, rows: int):
    """The operator that folds ``kind`` into a GEMV (one row) or a GEMM of ``rows`` rows."""
    return getattr(torch.ops.nimble, ("gemv_" if rows == 1 else "gemm_rows_") + kind).default


def _fold_prologue(graph, product, source, weight, k: int, dtype, rows: int,
                   launch) -> Optional[str]:
    """``product`` (a GEMV or a GEMM of ``rows`` rows of ``source``) replaced by the operator
    that computes its input itself, where ``source`` is a gated activation, a GELU, or an RMS
    or layer norm (of a residual sum); the kind folded, else None.  ``launch(prologue)``: the
    new operator's launch arguments."""
    gated = match_gated(source, k, dtype, rows)
    if gated is not None:
        with graph.inserting_before(product):
            args = [_flat(graph, t, k, rows) for t in gated]
            new = graph.call_function(_prologue_op("gated", rows),
                                      (*args, weight, *launch(gemv_prologues.SILU_GATED)))
        new.meta["val"] = _val(product)
        product.replace_all_uses_with(new)
        return "gated"
    gelu = match_gelu(source, k, dtype, rows) if FOLD_LAYER_NORMS else None
    if gelu is not None:
        kind = gemv_prologues.GELU_TANH if gelu.tanh else gemv_prologues.GELU_ERF
        first, bias = biased(gelu.value, k, dtype, rows) or (gelu.value, None)
        _fold_generic(graph, product, kind, Folded(first, bias=bias), weight, launch, k, rows)
        return "gelu"
    norm = match_rmsnorm(source, k, dtype, rows) or (
        match_layernorm(source, k, dtype, rows) if FOLD_LAYER_NORMS else None)
    if norm is None:
        return None
    # the sum beneath any views of it (OPT flattens its rows before the norm)
    sum_node = _strip_views(norm.value)
    summed = residual_sum(sum_node, k, dtype, rows)
    if summed is not None:
        norm = dataclasses.replace(norm, value=sum_node)
    after_sum = norm.value.next  # a weight's view the fold needs is copied before it
    if summed is not None and _before(graph, (*summed, norm.weight, norm.bias), norm.value):
        weight = _available_before(graph, weight, after_sum) or weight
    if summed is not None and _before(graph, (*summed, norm.weight, norm.bias, weight),
                                      after_sum):
        first, second, bias = _bias_beneath(summed, k, dtype, rows)
        if not norm.centred and bias is None:
            _fold_add_rmsnorm(graph, product, norm.value, summed, norm.weight, norm.eps, weight,
                              launch(gemv_prologues.ADD_RMSNORM), k, rows)
            return "add_rmsnorm"
        kind = gemv_prologues.ADD_LAYERNORM if norm.centred else gemv_prologues.ADD_RMSNORM
        _fold_generic(graph, product, kind, Folded(first, second, bias, norm), weight, launch,
                      k, rows)
        return "add_layernorm" if norm.centred else "add_rmsnorm"
    if norm.centred:
        _fold_generic(graph, product, gemv_prologues.LAYERNORM, Folded(norm.value, norm=norm),
                      weight, launch, k, rows)
        return "layernorm"
    with graph.inserting_before(product):
        new = graph.call_function(_prologue_op("rmsnorm", rows),
                                  (_flat(graph, norm.value, k, rows), norm.weight, norm.eps,
                                   weight, *launch(gemv_prologues.RMSNORM)))
    new.meta["val"] = _val(product)
    product.replace_all_uses_with(new)
    return "rmsnorm"


def _bias_beneath(summed: tuple, k: int, dtype, rows: int) -> tuple:
    """``(first, second, bias)`` of a residual sum's operands ``summed``: where one of them is a
    projection's output plus its bias, that output first and the bias apart (the kernel adds
    it in), else the operands as they are and no bias."""
    for first, second in (summed, summed[::-1]):
        found = biased(first, k, dtype, rows)
        if found is not None:
            return found[0], second, found[1]
    return summed[0], summed[1], None


@dataclass(frozen=True)
class Folded:
    """What a generic prologue operator (``nimble::gemv_prologue``, ``gemm_rows_prologue``)
    reads: its input, the residual's other operand, the projection's bias added to the input
    first, and the norm (for a norm's kinds)."""

    first: fx.Node
    second: Optional[fx.Node] = None
    bias: Optional[fx.Node] = None
    norm: Optional[Norm] = None


def _fold_generic(graph, product, kind: int, folded: Folded, weight, launch, k: int,
                  rows: int) -> None:
    """``product`` replaced by the generic prologue operator of ``kind``; for a residual sum's
    kinds placed right after the sum (``folded.norm.value``), whose every other reader takes
    the new kernel's copy of it."""
    norm = folded.norm
    adds = kind in gemv_prologues.ADDS
    op = (torch.ops.nimble.gemv_prologue.default if rows == 1
          else torch.ops.nimble.gemm_rows_prologue.default)
    # a residual sum's kinds right after the sum (any copy of the weight's view made for it
    # lies between the two), the others where the product was
    where = _first_reader(graph, norm.value) if adds else product
    with graph.inserting_before(where):
        first = _flat(graph, folded.first, k, rows)
        second = None if folded.second is None else _flat(graph, folded.second, k, rows)
        new = graph.call_function(op, (
            first, second, folded.bias, None if norm is None else norm.weight,
            None if norm is None else norm.bias, 0.0 if norm is None else norm.eps, weight,
            kind, *launch(kind)))
        y = graph.call_function(operator.getitem, (new, 0))
        total = graph.call_function(operator.getitem, (new, 1))
        shaped = graph.call_function(aten.reshape.default, (total, list(_val(norm.value).shape))
                                     ) if adds else None
    y.meta["val"] = _val(product)
    like = _val(folded.first)
    total.meta["val"] = like.new_empty([k] if rows == 1 else [rows, k]) if adds \
        else like.new_empty(0)
    new.meta["val"] = (y.meta["val"], total.meta["val"])
    product.replace_all_uses_with(y)
    if adds:
        shaped.meta["val"] = _val(norm.value)
        norm.value.replace_all_uses_with(shaped)


def _launch_args(prologue: int, weight, config, tune: bool) -> tuple:
    """The folded operator's launch arguments: the plain GEMV's configuration, or with
    ``tune`` the launch :func:`nimble.gemv_prologue_tuning.choose` measured fastest (its
    configuration, programs a multiprocessor and tiles ahead)."""
    if not tune:
        return tuple(config)
    from . import gemv_prologue_tuning as tuning

    why_not = tuning.tunable(weight.device)
    if why_not is not None:
        log.info("gemv prologues: a folded GEMV keeps its plain launch (%s)", why_not)
        return tuple(config)
    shape = tuning.PrologueShape(prologue, weight.shape[0], weight.shape[1], weight.dtype,
                                 weight.device)
    chosen = tuning.choose(shape, GemvConfig(*config)).launch
    return (*chosen.config.args, chosen.per_sm, chosen.ahead)


def _fold_add_rmsnorm(graph, gemv, value, summed, norm_weight, eps, weight, config, k,
                      rows: int = 1):
    """The GEMV (or GEMM of ``rows`` rows) of ``rmsnorm(a + b)`` placed where the sum was
    computed; the sum's every other reader takes the new kernel's copy of it."""
    with graph.inserting_before(_first_reader(graph, value)):  # in order, after the sum
        a, b = (_flat(graph, t, k, rows) for t in summed)
        new = graph.call_function(_prologue_op("add_rmsnorm", rows),
                                  (a, b, norm_weight, eps, weight, *config))
        y = graph.call_function(operator.getitem, (new, 0))
        total = graph.call_function(operator.getitem, (new, 1))
        shaped = graph.call_function(aten.reshape.default, (total, list(_val(value).shape)))
    y.meta["val"] = _val(gemv)
    total.meta["val"] = _val(value).reshape([k] if rows == 1 else [rows, k])
    shaped.meta["val"] = _val(value)
    new.meta["val"] = (y.meta["val"], total.meta["val"])
    gemv.replace_all_uses_with(y)
    value.replace_all_uses_with(shaped)


# ---- turning it on --------------------------------------------------------------------------

def _source_hash() -> str:
    digest = hashlib.sha256()
    from . import decode_attention

    from . import attention_rope, attention_rope_pass, gemv_prologue_tuning

    for path in (Path(__file__), Path(gemv_prologues.__file__), Path(decode_attention.__file__),
                 Path(gemv_prologue_patterns.__file__),
                 Path(attention_rope.__file__), Path(attention_rope_pass.__file__),
                 Path(gemv_prologue_tuning.__file__)):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _make_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class GemvPrologues(CustomGraphPass):
        """The pass as Inductor's ``post_grad_custom_post_pass``; it chains to the pass that
        was set before it (``then``)."""

        def __init__(self, then=None, join_attention: bool = False,
                     rope_attention: bool = False, tune_launches: bool = False) -> None:
            self.then = then
            self.join_attention = join_attention
            self.rope_attention = rope_attention
            self.tune_launches = tune_launches
            self.runs: list[Fused] = []  # what each graph compiled with the pass folded

        def __call__(self, graph: fx.Graph) -> None:
            roped = 0
            if self.rope_attention:
                from .attention_rope_pass import fold_rope

                roped = fold_rope(graph)
            done = fuse(graph, self.join_attention, self.tune_launches)
            done.roped = roped
            self.runs.append(done)
            if done.total or roped:
                log.info("gemv prologues: %d of %d GEMVs and %d GEMMs of rows folded (%d RMS "
                         "and %d layer norms of a residual sum, %d RMS and %d layer norms, %d "
                         "gated activations, %d GELUs, %d attention joins); %d attentions "
                         "took their rotary embedding", done.total, done.gemvs,
                         done.gemms_of_rows, done.add_rmsnorm, done.add_layernorm,
                         done.rmsnorm, done.layernorm, done.gated, done.gelu, done.joined,
                         roped)
            if self.then is not None:
                self.then(graph)

        def uuid(self):
            then = self.then.uuid() if self.then is not None else None
            joins = "-joins" if self.join_attention else ""
            rope = "-rope" if self.rope_attention else ""
            tuned = "-tuned" if self.tune_launches else ""
            # the module's switches change what the pass folds: a compilation cached with one
            # setting is not the other's
            rows = "-rows" if FOLD_ROWS else ""
            layer_norms = "-layer-norms" if FOLD_LAYER_NORMS else ""
            return (f"nimble-gemv-prologues{joins}{rope}{tuned}{rows}{layer_norms}-"
                    f"{_source_hash()}-{then}")

    return GemvPrologues


def make_pass(then=None, join_attention: bool = False, rope_attention: bool = False,
              tune_launches: bool = False):
    """A fresh pass (chained to ``then``, a pass set before it; ``join_attention`` and
    ``tune_launches``: see :func:`fuse`; ``rope_attention``:
    :func:`nimble.attention_rope_pass.fold_rope` first)."""
    return _make_pass()(then, join_attention, rope_attention, tune_launches)


@contextlib.contextmanager
def fusing(join_attention: bool = False, rope_attention: bool = False,
           tune_launches: bool = False) -> Iterator:
    """Inductor's compilations inside the block run the pass (after any pass already set);
    yields the pass, whose ``runs`` say what it folded in each graph.  ``join_attention``
    also folds the join of a split ``nimble::decode_attention`` into the GEMV that reads it,
    ``rope_attention`` the rotary embedding and the cache read into the attention
    (:mod:`nimble.attention_rope_pass`).  Both off unless asked: on the 1B Llama shape the join
    measured slower, the rotary fold faster (docs/results.md), and
    :func:`nimble.fast_decoding.fast_generator` asks for it.  ``tune_launches``: each folded
    GEMV launched as timed fastest on its own kernel (:mod:`nimble.gemv_prologue_tuning`)."""
    import torch._inductor.config as inductor_config

    the_pass = make_pass(inductor_config.post_grad_custom_post_pass, join_attention,
                         rope_attention, tune_launches)
    with inductor_config.patch(post_grad_custom_post_pass=the_pass):
        yield the_pass
