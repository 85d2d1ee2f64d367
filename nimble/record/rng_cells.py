"""Where the captured random kernels read the generator's seed and offset (the RNG cells),
found on the GPU by one replay; :func:`~nimble.record.resolve.mark_rng_cells` marks them in the
TaskGraph.
"""
from __future__ import annotations

import os
from typing import Sequence

from .. import driver
from ..errors import RecordError
from ..ir.taskgraph import BufferKind, TaskGraph
from .resolve import RNG_OFFSET, RNG_SEED, mark_rng_cells


def find_rng_cells(torch_graphs: Sequence, graph: TaskGraph, device: int) -> int:
    """Find where the captured RNG kernels read the generator's seed and offset; mark them.

    One replay of the first captured graph with a distinctive seed and offset shows both: torch's
    replay writes them into the two cells its Philox kernels read, and advances the generator's
    offset by what the whole graph consumes.  Every 8-byte word that a kernel points at in op
    scratch or outside memory is read back; the words holding the seed and the offset are the
    cells (:func:`~nimble.record.resolve.mark_rng_cells`).  The generator's state is restored.
    Returns the offset increment per launch (0 for a graph that draws no random numbers), also
    kept in ``graph.meta["rng"]``.
    """
    import torch

    gen = torch.cuda.default_generators[device]
    saved = gen.get_state()
    seed = int.from_bytes(os.urandom(7), "little") | 1 << 56
    offset = 4 * (int.from_bytes(os.urandom(4), "little") | 1 << 32)
    cells: dict[int, str] = {}
    try:
        gen.manual_seed(seed)
        gen.set_offset(offset)
        torch_graphs[0].replay()
        torch.cuda.synchronize()
        increment = gen.get_offset() - offset
        if increment:
            candidates = sorted({p.value for t in graph.tasks for p in t.pointers
                                 if p.buffer >= 0 and graph.buffers[p.buffer].kind in
                                 (BufferKind.SCRATCH, BufferKind.EXTERNAL)
                                 and p.offset + 8 <= graph.buffers[p.buffer].size})
            for value in candidates:
                word = int.from_bytes(driver.copy_to_host(value, 8), "little")
                if word in (seed, offset):
                    cells[value] = RNG_SEED if word == seed else RNG_OFFSET
        later = offset + increment
        for g in torch_graphs[1:]:
            g.replay()
        torch.cuda.synchronize()
        if gen.get_offset() != later:
            raise RecordError("the backward draws random numbers of its own; Nimble supports "
                              "random ops in the forward only")
    finally:
        gen.set_state(saved)
    if not increment:
        return 0
    if set(cells.values()) != {RNG_SEED, RNG_OFFSET}:
        raise RecordError(
            f"the forward draws random numbers (each replay advances the CUDA generator's "
            f"offset by {increment}), but Nimble found no kernel reading the generator's seed "
            "and offset cells; random ops that take their own torch.Generator are not "
            "supported: use the default generator (torch.manual_seed)")
    try:
        mark_rng_cells(graph, cells)
    except ValueError as e:
        raise RecordError(f"cannot isolate the random generator's cells: {e}") from e
    graph.meta["rng"] = {"increment": increment, "cells": len(cells)}
    return increment
