"""Which recorded kernels are Nimble's own that wait for their predecessor in their code
(:mod:`nimble.kernel_waits`), and what each reads before its wait: the table behind the
programmatic edges a prepare may build (:func:`nimble.analysis.programmatic.waiting_edges`) and
a saved file may list (:mod:`nimble.ir.saved_graph_check`).  Plain data on the TaskGraph."""
from __future__ import annotations

from .taskgraph import BufferKind, TaskGraph, TaskKind

#: Nimble's kernels that wait in every program before they read what a predecessor writes
#: (:mod:`nimble.kernel_waits`): per (recorded operator, kernel name), the indices of the kernel
#: parameters whose buffers it may read before its wait (a GEMV's weight; the rotary
#: attention's cache of keys and values, :data:`nimble.decode_attention.CACHE_BEFORE_WAIT`; a
#: GEMM of rows' weight, its split's reduction nothing; the peer sum its table of the ranks'
#: buffers, :mod:`nimble.peer_sum`).
WAITING_KERNELS: dict[tuple[str, str], tuple[int, ...]] = {
    ("nimble::gemv", "gemv_kernel"): (1,),
    ("nimble::gemv_rmsnorm", "gemv_prologue_kernel"): (3,),
    ("nimble::gemv_add_rmsnorm", "gemv_prologue_kernel"): (3,),
    ("nimble::gemv_gated", "gemv_prologue_kernel"): (3,),
    ("nimble::gemv_prologue", "gemv_prologue_kernel"): (3,),
    ("nimble::gemv_joined", "gemv_joined_kernel"): (),
    ("nimble::gemm_rows", "gemm_rows_kernel"): (1,),
    ("nimble::gemm_rows", "gemm_rows_reduce_kernel"): (),
    **{(op, kernel): reads for op in ("nimble::gemm_rows_rmsnorm", "nimble::gemm_rows_add_rmsnorm",
                                      "nimble::gemm_rows_gated", "nimble::gemm_rows_prologue")
       for kernel, reads in (("gemm_rows_kernel", (1,)), ("gemm_rows_reduce_kernel", ()))},
    ("nimble::peer_sum", "nimble_peer_sum_kernel"): (2,),
    ("nimble::peer_gather", "nimble_peer_sum_kernel"): (2,),
    **{(op, kernel): () for op in ("nimble::decode_attention", "nimble::decode_attention_parts")
       for kernel in ("attend", "join")},
    **{(op, kernel): reads for op in ("nimble::decode_attention_rope",
                                      "nimble::decode_attention_rope_parts")
       for kernel, reads in (("attend", (1, 2)), ("join", ()))},
}

#: Buffers a waiting kernel may read before its wait: the model's and the memory outside the
#: recording (a static cache), never moved by the plan.
CONSTANT_KINDS = frozenset({BufferKind.PARAM, BufferKind.EXTERNAL})


def _param_buffer(task, index: int) -> int | None:
    """The buffer the pointer in ``task``'s parameter ``index`` points into, or None."""
    if index >= len(task.param_layout):
        return None
    offset = task.param_layout[index][0]
    return next((p.buffer for p in task.pointers if p.location == offset and p.buffer >= 0),
                None)


def _key(graph: TaskGraph, task) -> tuple[str, str] | None:
    """``task``'s (recorded operator, kernel name) where it is a kernel of a known op."""
    if task.kind != TaskKind.KERNEL or not 0 <= task.op < len(graph.ops):
        return None
    return graph.ops[task.op].name, task.name


def has_waiting_kernels(graph: TaskGraph) -> bool:
    """Whether some kernel of ``graph`` is one of :data:`WAITING_KERNELS` (most graphs, with
    none of Nimble's kernels, have no edge a prepare could make programmatic)."""
    return any(_key(graph, t) in WAITING_KERNELS for t in graph.tasks)


def writers(graph: TaskGraph) -> dict[int, frozenset[int]]:
    """Per buffer some task of ``graph`` writes, the tasks that write it."""
    found: dict[int, set[int]] = {}
    for t in graph.tasks:
        for a in t.accesses:
            if a.write:
                found.setdefault(a.buffer, set()).add(t.id)
    return {b: frozenset(ts) for b, ts in found.items()}


def _read_before_its_writers(graph: TaskGraph, task, buffer: int,
                             written: dict[int, frozenset[int]]) -> bool:
    """Whether ``task`` may read ``buffer`` before its wait: a constant kind (the plan lays
    nothing over it), and every task that writes it recorded after ``task``, which reads it
    (so the graph orders each such write after ``task``, behind the hazard of a write after a
    read: it cannot run while ``task``'s early read does, whatever is launched early around
    ``task``; a write recorded before it might)."""
    if graph.buffers[buffer].kind not in CONSTANT_KINDS:
        return False
    later = written.get(buffer, frozenset())
    if not later:
        return True
    reads = any(a.buffer == buffer and not a.write for a in task.accesses)
    return reads and min(later) > task.id


def waits_safely(graph: TaskGraph, task_id: int, written: dict[int, frozenset[int]]) -> bool:
    """Whether task ``task_id`` is a kernel of :data:`WAITING_KERNELS` whose reads before its
    wait, if any, are of buffers it may read so (``written``: :func:`writers`)."""
    task = graph.tasks[task_id]
    key = _key(graph, task)
    if key not in WAITING_KERNELS:
        return False
    for index in WAITING_KERNELS[key]:
        buffer = _param_buffer(task, index)
        if buffer is None or not _read_before_its_writers(graph, task, buffer, written):
            return False
    return True


def may_be_programmatic(graph: TaskGraph, u: int, v: int,
                        written: dict[int, frozenset[int]]) -> bool:
    """Whether edge ``u -> v`` may be programmatic by the waiting kernels' rule: from a kernel
    into a kernel that :func:`waits_safely`."""
    return graph.tasks[u].kind == TaskKind.KERNEL and waits_safely(graph, v, written)
