"""Which recorded kernels are Nimble's own that wait for their predecessor in their code
(:mod:`nimble.kernel_waits`), and what each reads before its wait: the table behind the
programmatic edges a prepare may build (:func:`nimble.analysis.programmatic.waiting_edges`) and
a saved file may list (:mod:`nimble.ir.saved_graph_check`).  Plain data on the TaskGraph."""
from __future__ import annotations

from .taskgraph import BufferKind, TaskGraph, TaskKind

#: Nimble's kernels that wait in every program before they read what a predecessor writes
#: (:mod:`nimble.kernel_waits`): per (recorded operator, kernel name), the index of the kernel
#: parameter whose buffer it reads before its wait (a GEMV's weight), or None for nothing.
WAITING_KERNELS: dict[tuple[str, str], int | None] = {
    ("nimble::gemv", "gemv_kernel"): 1,
    ("nimble::gemv_rmsnorm", "gemv_prologue_kernel"): 3,
    ("nimble::gemv_add_rmsnorm", "gemv_prologue_kernel"): 3,
    ("nimble::gemv_gated", "gemv_prologue_kernel"): 3,
    ("nimble::gemv_joined", "gemv_joined_kernel"): None,
    **{(op, kernel): None
       for op in ("nimble::decode_attention", "nimble::decode_attention_parts",
                  "nimble::decode_attention_rope", "nimble::decode_attention_rope_parts")
       for kernel in ("attend", "join")},
}

#: Buffers a waiting kernel may read before its wait: the model's, never moved by the plan.
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


def written_buffers(graph: TaskGraph) -> set[int]:
    """The buffers some task of ``graph`` writes."""
    return {a.buffer for t in graph.tasks for a in t.accesses if a.write}


def waits_safely(graph: TaskGraph, task_id: int, written: set[int]) -> bool:
    """Whether task ``task_id`` is a kernel of :data:`WAITING_KERNELS` whose read before its
    wait, if any, is of a constant buffer (:data:`CONSTANT_KINDS`) no task writes
    (``written``: :func:`written_buffers`)."""
    task = graph.tasks[task_id]
    key = _key(graph, task)
    if key not in WAITING_KERNELS:
        return False
    index = WAITING_KERNELS[key]
    if index is None:
        return True
    buffer = _param_buffer(task, index)
    return (buffer is not None and buffer not in written
            and graph.buffers[buffer].kind in CONSTANT_KINDS)


def may_be_programmatic(graph: TaskGraph, u: int, v: int, written: set[int]) -> bool:
    """Whether edge ``u -> v`` may be programmatic by the waiting kernels' rule: from a kernel
    into a kernel that :func:`waits_safely`."""
    return graph.tasks[u].kind == TaskKind.KERNEL and waits_safely(graph, v, written)
