"""Readable short names for mangled CUDA kernel names (no c++filt needed)."""
from __future__ import annotations

import re

_SUBSTITUTIONS = {"St": "std"}


def _read_source_name(s: str, i: int) -> tuple[str, int] | None:
    m = re.match(r"\d+", s[i:])
    if not m:
        return None
    n = int(m.group())
    start = i + len(m.group())
    if start + n > len(s):
        return None
    return s[start:start + n], start + n


def short_kernel_name(mangled: str, limit: int = 80) -> str:
    """The qualified function name of an Itanium-mangled kernel, without template arguments.

    ``_ZN2at6native29vectorized_elementwise_kernelILi4E...`` gives
    ``at::native::vectorized_elementwise_kernel``; names that are not mangled (cuBLAS and cuDNN
    ship many) come back as they are, cut to ``limit`` characters.
    """
    if not mangled.startswith("_Z"):
        return mangled[:limit]
    i = 2
    if i < len(mangled) and mangled[i] == "L":  # internal linkage marker
        i += 1
    parts: list[str] = []
    if mangled.startswith("N", i):
        i += 1
        while i < len(mangled) and mangled[i] not in "EI":
            if mangled.startswith(("St",), i):
                parts.append(_SUBSTITUTIONS["St"])
                i += 2
                continue
            if mangled[i] in "KVrL":  # qualifiers before a name
                i += 1
                continue
            got = _read_source_name(mangled, i)
            if got is None:
                break
            name, i = got
            parts.append(name)
    else:
        got = _read_source_name(mangled, i)
        if got is not None:
            parts.append(got[0])
    if not parts:
        return mangled[:limit]
    return "::".join(parts)[:limit]


def library_kernel(name: str) -> bool:
    """Whether a kernel (its mangled or plain name) is a library's (cuBLAS, cuDNN, CUTLASS...):
    neither ATen's own (``at::native::``), nor a Triton kernel, nor one of Nimble's."""
    short = short_kernel_name(name, limit=len(name))
    return not ("at::native::" in name or short.startswith("at::native::")
                or short.startswith(("triton", "nimble_")))


#: torch's collectives over symmetric memory (``torch.ops.symm_mem``): each rank's kernel reads
#: the others' buffers and meets them at barriers in signal pads, through pointer tables in
#: device memory.
SYMMETRIC_MEMORY_COLLECTIVES = frozenset({
    "one_shot_all_reduce_kernel", "two_shot_all_reduce_kernel",
    "two_shot_all_reduce_kernel_inplace", "multimem_all_reduce_kernel",
    "multimem_one_shot_all_reduce_kernel", "multimem_all_gather_kernel"})


#: Nimble's own collectives (:mod:`nimble.peer_sum`): each rank's kernel reads the others'
#: buffers and meets them at flags there, through a pointer table in device memory.
NIMBLE_COLLECTIVES = frozenset({"nimble_peer_sum_kernel"})


def collective_kernel(name: str) -> bool:
    """Whether a kernel is a collective (an all-reduce, all-gather...) of NCCL, of torch's
    symmetric memory or of Nimble's: one that meets the same kernel of every other rank
    through memory they share, so its launches must keep their order on every rank and that
    memory must stay where its owner keeps it."""
    short = short_kernel_name(name, limit=len(name))
    return short.startswith(("ncclDevKernel", "ncclKernel")) or \
        short.rsplit("::", 1)[-1] in SYMMETRIC_MEMORY_COLLECTIVES | NIMBLE_COLLECTIVES
