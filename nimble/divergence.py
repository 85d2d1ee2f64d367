"""First divergence: the first ATen op whose output in the prepared graph differs from eager's.

:func:`eager_ops` runs the model eagerly under a dispatch mode that keeps every op's fresh outputs;
:func:`align` pairs each op of the recording with its eager twin (same position, same name; a
different sequence means data-dependent control flow, refused) and each eager output with the
written byte range of the recorded op that holds it.  :func:`first_divergence` walks the ops in
recorded (topological) order: for each it runs the prepared graph up to that op
(:func:`nimble.stepper.run_until`) and compares the op's outputs with eager's, within a
tolerance that depends on the dtype, and stops at the first that differs.  A walk, not a
bisection: a wrong value propagates only along its own branch, so ops on parallel branches after
the faulty one still agree, and "some op up to here differs" is not monotone in the op index.
:func:`first_nonfinite` does the same for NaN or Inf.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .errors import InputError
from .taskgraph import Access, TaskGraph

#: ``(rtol, atol)`` per dtype name: the same kernels run in both, so these only absorb
#: library algorithms that differ between an eager call and a graph replay.
TOLERANCES = {"float64": (1e-7, 1e-9), "float32": (1e-4, 1e-5), "float16": (1e-2, 1e-3),
              "bfloat16": (2e-2, 1e-2)}


@dataclass
class EagerOp:
    """One op of an eager run: its name and copies of the tensors it returned fresh."""

    name: str
    outputs: list = field(default_factory=list)


@dataclass
class AlignedOp:
    """A recorded op, with each eager output and the written range of the graph that holds it."""

    index: int
    name: str
    module: str
    pairs: list[tuple[Access, Any]]  # (written range, eager tensor)


@dataclass
class Divergence:
    """The first op whose output differs (or holds NaN/Inf), and by how much."""

    op: int
    name: str
    module: str
    tasks: list[int]
    max_abs_diff: float
    detail: str


def eager_ops(model, inputs: Sequence) -> list[EagerOp]:
    """Run ``model(*inputs)`` eagerly, keeping every dispatched op's fresh outputs (copies)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from .tracer import op_name, tensors_of

    ops: list[EagerOp] = []

    class Keep(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            schema = func._schema
            returns = out if isinstance(out, (tuple, list)) and len(schema.returns) > 1 else (out,)
            fresh = [t.detach().clone() for ret, value in zip(schema.returns, returns)
                     if ret.alias_info is None for t in tensors_of(value)]
            ops.append(EagerOp(op_name(func), fresh))
            return out

    with torch.no_grad(), Keep():
        model(*inputs)
    return ops


def span_bytes(shape: Sequence[int], strides: Sequence[int], element: int) -> int:
    """Bytes from a tensor's lowest element to its highest (what the tracer records)."""
    if any(s == 0 for s in shape):
        return 0
    return element * (1 + sum((s - 1) * abs(st) for s, st in zip(shape, strides)))


def align(graph: TaskGraph, eager: Sequence[EagerOp]) -> list[AlignedOp]:
    """Pair the recording's ops with the eager run's; raise :class:`InputError` if the two
    dispatched different op sequences."""
    if [o.name for o in graph.ops] != [e.name for e in eager]:
        first = next((k for k, (o, e) in enumerate(zip(graph.ops, eager)) if o.name != e.name),
                     min(len(graph.ops), len(eager)))
        raise InputError(
            f"the eager run dispatched other ops than the recording (first at op {first}: "
            f"{graph.ops[first].name if first < len(graph.ops) else 'none'} recorded, "
            f"{eager[first].name if first < len(eager) else 'none'} eager); a forward with "
            "data-dependent control flow cannot be compared op by op")
    out = []
    for op, twin in zip(graph.ops, eager):
        written = [a for a in op.accesses if a.write]
        used: set[int] = set()
        pairs = []
        for t in twin.outputs:
            size = span_bytes(t.shape, t.stride(), t.element_size())
            k = next((i for i, a in enumerate(written) if i not in used and a.size == size),
                     None)
            if k is not None and size:
                used.add(k)
                pairs.append((written[k], t))
        out.append(AlignedOp(op.index, op.name, op.module, pairs))
    return out


def tolerance(dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing tensors of ``dtype`` (exact for integers and bools)."""
    return TOLERANCES.get(str(dtype).removeprefix("torch."), (0.0, 0.0))


def graph_tensor(raw, like):
    """The bytes ``raw`` of a written range seen with ``like``'s dtype, shape and strides."""
    return raw.view(like.dtype).as_strided(tuple(like.shape), tuple(like.stride()))


def _compare(raw, want) -> tuple[bool, float]:
    import torch

    got = graph_tensor(raw, want.cpu())
    want = want.cpu()
    if not want.is_floating_point():
        same = bool(torch.equal(got, want))
        return same, 0.0 if same else float("inf")
    rtol, atol = tolerance(want.dtype)
    diff = (got.double() - want.double()).abs()
    worst = float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0
    ok = bool(torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol, equal_nan=True))
    return ok, worst


def _walk(run_until: Callable[[int], Any], graph: TaskGraph, ops: Sequence[AlignedOp],
          wrong: Callable[[Any, AlignedOp], tuple[bool, float]]) -> tuple[AlignedOp, float] | None:
    """The first of ``ops`` (in order) for which ``wrong(snapshot, op)`` says so."""
    with_tasks = {t.op for t in graph.tasks}
    for op in ops:
        if op.pairs and op.index in with_tasks:
            bad, diff = wrong(run_until(op.index), op)
            if bad:
                return op, diff
    return None


def _found(graph: TaskGraph, op: AlignedOp, diff: float, what: str) -> Divergence:
    return Divergence(op.index, op.name, op.module,
                      [t.id for t in graph.tasks if t.op == op.index], diff,
                      f"op {op.index} {op.name} in {op.module or 'the model'} {what}")


def first_divergence(run_until: Callable[[int], Any], graph: TaskGraph,
                     aligned: Sequence[AlignedOp]) -> Divergence | None:
    """The first op (in recorded order) whose outputs, as ``run_until(op)`` (a
    :class:`nimble.stepper.Snapshot`) leaves them, differ from eager's; None if none does."""
    def differs(snap, op: AlignedOp) -> tuple[bool, float]:
        worst, bad = 0.0, False
        for access, want in op.pairs:
            ok, diff = _compare(_range(snap, access), want)
            bad |= not ok
            worst = max(worst, diff)
        return bad, worst
    hit = _walk(run_until, graph, aligned, differs)
    return None if hit is None else _found(graph, hit[0], hit[1],
                                           f"differs from eager by up to {hit[1]:.3g}")


def first_nonfinite(run_until: Callable[[int], Any], graph: TaskGraph,
                    aligned: Sequence[AlignedOp]) -> Divergence | None:
    """The first op (in recorded order) whose floating-point outputs hold NaN or Inf."""
    import torch

    def nonfinite(snap, op: AlignedOp) -> tuple[bool, float]:
        bad = any(not bool(torch.isfinite(graph_tensor(_range(snap, a), t.cpu())).all())
                  for a, t in op.pairs if t.is_floating_point())
        return bad, float("nan")
    hit = _walk(run_until, graph, aligned, nonfinite)
    return None if hit is None else _found(graph, hit[0], hit[1],
                                           "is the first to write NaN or Inf")


def _range(snap, access: Access):
    return snap.buffer(access.buffer)[access.offset:access.offset + access.size]
