"""Nimble's own kernels behind programmatic edges (issue 53).

Every Triton kernel of Nimble's decode operators (the GEMVs of :mod:`nimble.fast_gemv` and
:mod:`nimble.gemv_prologues`, the attention's of :mod:`nimble.decode_attention`) is compiled to
run ``griddepcontrol.wait`` in every program before it reads anything its predecessors write,
and to write nothing before it; a GEMV asks for its first weight tile before the wait.  Behind
a programmatic edge such a kernel launches while its predecessor ends, and its wait holds it
until that predecessor has ended and its writes are visible; behind a full dependency the wait
returns at once.  Which recorded kernels these are, and what each reads before its wait, is
:data:`nimble.ir.waiting_kernels.WAITING_KERNELS`.
"""
from __future__ import annotations


def waits(device) -> bool:
    """Whether Nimble's kernels on ``device`` (a ``torch.device``) are compiled with their
    wait: on a GPU always; not under Triton's interpreter, which has no such instruction."""
    return device.type == "cuda"
