"""What the graph passes of the decode levers (:mod:`nimble.gemv_prologue_pass`,
:mod:`nimble.attention_rope_pass`) ask of an FX node as Inductor hands a graph over after its
decompositions: its value's metadata, its operator, and the node beneath views and dtype
conversions."""
from __future__ import annotations

from typing import Optional

import torch
from torch import fx

aten, prims = torch.ops.aten, torch.ops.prims
VIEWS = (aten.reshape.default, aten.view.default)
CONVERT = prims.convert_element_type.default


def val(node) -> Optional[torch.Tensor]:
    """The fake value Inductor's metadata holds for ``node`` (None for anything else)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def is_call(node, *targets) -> bool:
    """Whether ``node`` calls one of ``targets``."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def strip_views(node):
    """``node`` beneath any reshapes and views."""
    while is_call(node, *VIEWS):
        node = node.args[0]
    return node


def strip_convert(node, dtype=None):
    """``node`` without a dtype conversion on top (to ``dtype`` where given)."""
    if is_call(node, CONVERT) and (dtype is None or node.args[1] == dtype):
        return node.args[0]
    return node


def other_operand(node, one):
    """The operand of a binary ``node`` that is not ``one``, or None."""
    a, b = node.args[:2]
    return b if a is one else a if b is one else None


def operand_orders(node) -> tuple:
    """A binary ``node``'s two operands in both orders."""
    a, b = node.args[:2]
    return (a, b), (b, a)
