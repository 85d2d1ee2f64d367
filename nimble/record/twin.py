"""Evidence for pointers: the same work captured a second time, at other addresses.

A kernel's parameter block is bytes; which 8-byte words in it are device pointers is a guess
from their values (:mod:`nimble.record.resolve`).  The guess is good while the capture's memory
pool sits at addresses no integer resembles (``0x7f66_0d80_0000``), and fails where the driver
hands the pool low addresses (it may, once other device memory was reserved and freed in the
process): there two 32-bit integers, such as a width and a kernel size, read as an address
inside a live buffer.  Relocating such a "pointer" rewrites the integers, and the rebuilt graph
computes wrong results even on one stream.

So the phases are captured twice.  The second capture (the *twin*) goes into a fresh memory pool
while the first capture's pool is still held, so every allocation of the twin lies at another
address.  A word that points into the first capture's pool and is the same in the twin is not a
pointer: a pointer into the pool would have moved with its allocation.  The twin only vetoes
words (:func:`moved_words`); the other rules still apply to the words that moved.

The twin costs a second capture (no warm-up) and, for its duration, a second pool's memory.
Where it cannot be had (out of memory, or a twin whose kernels differ from the first capture's),
the recording says why in ``graph.meta["pointer_evidence"]`` and relies on the value rules alone;
the proof in ``prepare()`` still checks the result.
"""
from __future__ import annotations

import gc
from typing import Sequence

from .. import driver
from .decode import node_signature
from .host_sync import CAPTURE_ERROR_MODE
from .raw import RawNode
from ..ir.taskgraph import TaskKind

#: ``graph.meta["pointer_evidence"]`` when every kernel word into the pool was checked.
TWIN_EVIDENCE = "twin capture"


def capture_twin(phases: Sequence, clear_workspaces) -> tuple[list[tuple] | None, str]:
    """Capture ``phases`` once more into a fresh pool; ``(node signatures, "")``, or
    ``(None, why not)``.  The twin's graphs and pool are freed before this returns.

    ``clear_workspaces`` drops library workspaces cached per stream, so that the twin's GEMMs
    allocate theirs in the twin's pool (a workspace shared by both captures would not move, and
    the words pointing at it would be vetoed).
    """
    import torch

    graphs: list = []
    clear_workspaces()
    collecting = gc.isenabled()
    gc.disable()  # as in the first capture: no arena may be freed while capturing
    try:
        value = None
        for phase in phases:
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(graph, pool=graphs[0].pool() if graphs else None,
                                  capture_error_mode=CAPTURE_ERROR_MODE):
                value = phase.run(value)
            graphs.append(graph)
        del value
        return [node_signature(n) for g in graphs
                for n in driver.graph_nodes_of(g.raw_cuda_graph())], ""
    except torch.cuda.OutOfMemoryError:
        return None, "not enough device memory for a second capture"
    except Exception as e:  # noqa: BLE001 - the first capture succeeded; report, don't fail
        torch.cuda.synchronize()
        return None, f"the second capture failed: {type(e).__name__}: {e}"
    finally:
        for graph in graphs:
            graph.reset()
        graphs.clear()
        clear_workspaces()
        if collecting:
            gc.enable()
        torch.cuda.empty_cache()  # the twin's pool, back to the driver for the arena


def moved_words(nodes: Sequence[RawNode], twin: Sequence[tuple] | None,
                why_not: str = "") -> tuple[list[frozenset[int]] | None, str]:
    """Per node, the byte offsets of its pointer-like kernel words that differ in the twin.

    Returns ``(moved, TWIN_EVIDENCE)``, or ``(None, reason)`` when the twin is missing or is not
    the same work (another node count, kind, kernel or parameter size at some node).
    """
    if twin is None:
        return None, why_not or "no twin capture"
    if len(twin) != len(nodes):
        return None, f"the twin capture has {len(twin)} nodes, the first {len(nodes)}"
    moved: list[frozenset[int]] = []
    for i, (node, (kind, name, params)) in enumerate(zip(nodes, twin)):
        if node.kind != kind or node.kind == TaskKind.KERNEL and (
                node.name != name or len(node.params) != len(params)):
            return None, (f"node {i} differs in the twin capture ({node.kind} {node.short_name} "
                          f"against {kind} {name[:60]})")
        moved.append(frozenset(
            off for off, _ in node.pointers
            if isinstance(off, int) and params[off:off + 8] != node.params[off:off + 8]))
    return moved, TWIN_EVIDENCE
