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

#: Where Nimble's GEMVs let the kernel behind them launch (``griddepcontrol.launch_dependents``):
#: after each program's last weight tile is summed (True), so that the next kernel's programs
#: launch only as this one ends and take no multiprocessor slot while it streams; or at each
#: program's start (False), so that they launch, ask for their first weight tile and wait
#: while this one streams.  The same bits either way (the wait still holds the next kernel
#: until this one has ended); late is the faster decode step (docs/results.md, "Where the
#: GEMVs let the next kernel launch"; ``tools/experiments/decode_levers.py``'s
#: ``late-trigger`` / ``early-trigger``).
LAUNCH_DEPENDENTS_LATE = True


def waits(device) -> bool:
    """Whether Nimble's kernels on ``device`` (a ``torch.device``) are compiled with their
    wait: on a GPU always; not under Triton's interpreter, which has no such instruction."""
    return device.type == "cuda"
