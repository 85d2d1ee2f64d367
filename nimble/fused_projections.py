"""``fuse_projections(model)``: sibling ``nn.Linear`` layers that read the same input (an
attention's query, key and value projections; a gated MLP's gate and up projections) computed
as one GEMM, a decode step's lever (issue 53): at batch 1 each projection is a GEMV, and the
small ones (a Llama 3.2 1B shape's 2 MB key and value projections) run at a tenth of the memory
bandwidth, latency-bound, each with its kernel boundary on the step's critical path.

The siblings' weights (and biases) become views of one concatenated tensor, so the model keeps
its parameters' names, counts and ``state_dict``, an in-place update of a weight
(``load_state_dict``, ``copy_``) reaches the fused GEMM, and a graph prepared after the fusion
reads the one storage.  A sibling called with the input its group last computed gets its slice
of that output; called with any other input (siblings that do not share theirs), it computes
its own: the result is the same either way, only the kernels differ.  The concatenated weight
is no leaf of autograd, so where a gradient is wanted (grad enabled and the weight requiring
one) each sibling computes its own, as before.

After the fusion, ``.to()``/``.half()`` (which give each parameter a tensor of its own) and
``copy.deepcopy`` (which clones each on its own) leave a group whose members compute their own
outputs again, correct and unfused; fuse again after them.

A fused GEMM may sum in another order than the separate ones (another kernel, another tiling),
so outputs may differ in the last bits, as between any two GEMM kernels.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from .errors import InputError
from .fast_gemv import gemv_linear

log = logging.getLogger("nimble")

#: Groups of sibling attributes that read the same input in the models transformers defines
#: (Llama, Mistral, Qwen, Gemma and their kind); a group is fused where every member is an
#: ``nn.Linear`` of one input width, dtype and device, all with biases or none.
SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Group:
    """The concatenated weight (and bias) of one set of siblings, and its last output."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 spans: Sequence[tuple[int, int]]) -> None:
        self.weight, self.bias, self.spans = weight, bias, list(spans)
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._pending: set[int] = set()
        #: Set where a member's tensors were replaced (``model.to()``, ``.half()``): the
        #: group's concatenated ones are stale, and every member computes its own.
        self.stale = False
        #: The GEMV configuration of a single-row call, and :mod:`nimble.gemm_rows`'s per row
        #: count of a few rows (:func:`nimble.fast_gemv.fast_gemv`).
        self.gemv_config = None
        self.row_configs = None

    def __deepcopy__(self, memo) -> "_Group":
        # Parameter's deepcopy clones each member's weight on its own, so a copy's members
        # view no concatenated tensor: the copy's group runs unfused (fuse the copy again).
        copied = _Group(None, None, self.spans)  # type: ignore[arg-type]
        copied.stale = True
        return copied

    def output_of(self, member: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``member``'s output for ``x``: a slice of the group's GEMM of ``x``, computed
        once for the members that ask with the same ``x``."""
        if self._input is not x or member not in self._pending:
            self._output = gemv_linear(x, self.weight, self.bias, self.gemv_config,
                                       self.row_configs)
            self._input, self._pending = x, set(range(len(self.spans)))
        lo, hi = self.spans[member]
        out = self._output[..., lo:hi]
        self._pending.discard(member)
        if not self._pending:  # every member served: hold no tensor past the forward
            self._input = self._output = None
        return out


class FusedSibling(nn.Module):
    """One sibling of a fused group, in its ``nn.Linear``'s place: the same ``weight`` and
    ``bias`` names (views of the group's tensors), the same output."""

    def __init__(self, linear: nn.Linear, group: _Group, member: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        lo, hi = group.spans[member]
        self.weight = nn.Parameter(group.weight[lo:hi], requires_grad=linear.weight.requires_grad)
        self.bias = None if group.bias is None else nn.Parameter(
            group.bias[lo:hi], requires_grad=linear.bias.requires_grad)
        self._group, self._member = group, member

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wants_grad = torch.is_grad_enabled() and (self.weight.requires_grad or (
            self.bias is not None and self.bias.requires_grad))
        if wants_grad or self._group.stale:
            return F.linear(x, self.weight, self.bias)
        return self._group.output_of(self._member, x)

    def _apply(self, fn, recurse: bool = True):
        # .to(), .half(), .cuda() give each parameter a tensor of its own (or may): the
        # group's concatenated copy would then be stale, so it stops being used.  Caught here,
        # where it happens, rather than by comparing addresses in forward (which torch.compile
        # cannot trace).
        def where() -> tuple:  # a parameter may keep its object and change its data
            return tuple((t.data_ptr(), t.dtype, t.device) for t in (self.weight, self.bias)
                         if t is not None)
        before = where()
        out = super()._apply(fn, recurse)
        moved = where() != before
        if moved and not self._group.stale:
            self._group.stale = True
            log.warning("fused projections: the model was moved or cast after "
                        "fuse_projections; its groups run unfused: call fuse_projections "
                        "after .to()/.half()")
        return out

    def extra_repr(self) -> str:
        lo, hi = self._group.spans[self._member]
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rows {lo}:{hi} of a fused GEMM of {self._group.spans[-1][1]}")


def _fusable(linears: list) -> bool:
    if not all(type(m) in (nn.Linear, FusedSibling) for m in linears):  # a copy fuses again
        return False
    first = linears[0].weight
    return all(m.in_features == linears[0].in_features and m.weight.dtype == first.dtype
               and m.weight.device == first.device and (m.bias is None) == (linears[0].bias is None)
               for m in linears)


def _fuse(parent: nn.Module, names: Sequence[str]) -> None:
    linears = [getattr(parent, n) for n in names]
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears], 0)
        bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears], 0)
    ends = torch.tensor([m.out_features for m in linears]).cumsum(0).tolist()
    group = _Group(weight, bias, list(zip([0] + ends[:-1], ends)))
    for k, (name, linear) in enumerate(zip(names, linears)):
        setattr(parent, name, FusedSibling(linear, group, k))


def fuse_projections(model: nn.Module, siblings: Sequence[Sequence[str]] = SIBLINGS) -> int:
    """Fuse every group of :data:`SIBLINGS` (or ``siblings``) in ``model`` into one GEMM each
    (see the module docstring); the number of groups fused.  Call it before preparing (a graph
    prepared before keeps the separate GEMMs and the old weights)."""
    if not isinstance(model, nn.Module):
        raise InputError(f"fuse_projections takes an nn.Module, got {type(model).__name__}")
    shared = _shared(model)
    fused = 0
    for parent in list(model.modules()):
        for names in siblings:
            linears = [getattr(parent, n, None) for n in names]
            if all(m is not None for m in linears) and _fusable(linears) and \
                    not any(id(m) in shared or id(m.weight) in shared for m in linears):
                _fuse(parent, names)
                fused += 1
    return fused


def _shared(model: nn.Module) -> set[int]:
    """The ids of the modules and parameters reachable from ``model`` more than once (a layer
    or a weight tied to another): fusing one place would untie it from the others."""
    seen: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        seen[id(m)] = seen.get(id(m), 0) + 1
    for _, t in model.named_parameters(remove_duplicate=False):
        seen[id(t)] = seen.get(id(t), 0) + 1
    return {k for k, n in seen.items() if n > 1}
