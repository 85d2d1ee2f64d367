"""What a folded GEMV's (or GEMM of rows') prologue computes: the kernels' ``PROLOGUE``
codes, shared by :mod:`nimble.gemv_prologues`, :mod:`nimble.gemm_rows` and the fold pass."""
from __future__ import annotations

#: What a prologue computes (the kernel's ``PROLOGUE``): an RMS norm of the input, or of the
#: input plus a residual; a SiLU-gated product of two inputs; a layer norm of the input, or of
#: the input plus a residual; GELU of the input, by its tanh approximation or its error
#: function.  Where a residual sum or a GELU reads a projection's output, the projection's
#: bias may be added in first (``bias``).
RMSNORM, ADD_RMSNORM, SILU_GATED, LAYERNORM, ADD_LAYERNORM, GELU_TANH, GELU_ERF = range(7)
ALL = frozenset(range(7))
#: The prologues that add a residual (and return the sum), that normalise, that take a bias.
ADDS = frozenset({ADD_RMSNORM, ADD_LAYERNORM})
NORMS = frozenset({RMSNORM, ADD_RMSNORM, LAYERNORM, ADD_LAYERNORM})
BIASED = frozenset({ADD_RMSNORM, ADD_LAYERNORM, GELU_TANH, GELU_ERF})


def second_input(prologue: int) -> bool:
    """Whether ``prologue`` reads a second input of the first's shape (a residual, the up
    projection's half)."""
    return prologue in ADDS or prologue == SILU_GATED
