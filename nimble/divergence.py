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
:func:`first_nonfinite` does the same for NaN or Inf (not counting the infinities that padding and
masking ops write on purpose, :data:`INF_SENTINEL_OPS`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .errors import InputError
from .taskgraph import Access, TaskGraph

#: ``(rtol, atol)`` per dtype name.  A tensor agrees with eager's when its largest difference is
#: within ``atol + rtol *`` its largest magnitude: rounding in a long sum is relative to the size
#: of its terms, so near a zero crossing it is measured against the tensor's scale, not the
#: element's.  These absorb only library algorithms that differ between an eager call and the
#: recording (cuDNN's benchmark cache keys on pointer alignment, so eager may pick another).
#: ``"tf32"`` is float32 while torch lets convolutions or matmuls round their inputs to TF32
#: (``torch.backends.cudnn.allow_tf32``, on by default): another algorithm then differs by
#: TF32's rounding, as much as half precision's.
TOLERANCES = {"float64": (1e-7, 1e-9), "float32": (1e-4, 1e-5), "tf32": (1e-2, 1e-3),
              "float16": (1e-2, 1e-3), "bfloat16": (2e-2, 1e-2)}


#: Seconds between two progress lines of a walk.
PROGRESS_SECONDS = 5.0

#: Ops that write an infinity on purpose, as a sentinel the next op absorbs: padding before a
#: max pool ("same" pooling in timm's NASNet and PNASNet pads with -inf), attention masks
#: before a softmax.  The NaN hunt counts only NaN in their outputs, or it would stop at every
#: such pad.
INF_SENTINEL_OPS = frozenset({"aten::constant_pad_nd", "aten::masked_fill", "aten::masked_fill_",
                              "aten::fill", "aten::fill_", "aten::full", "aten::full_like",
                              "aten::new_full", "aten::where", "aten::scalar_tensor"})


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


def tolerance(dtype, tf32: bool | None = None) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing tensors of ``dtype`` (exact for integers and bools);
    float32 gets TF32's when ``tf32`` (default: whether torch allows TF32 now)."""
    name = str(dtype).removeprefix("torch.")
    if name == "float32" and (tf32_allowed() if tf32 is None else tf32):
        name = "tf32"
    return TOLERANCES.get(name, (0.0, 0.0))


def tf32_allowed() -> bool:
    """Whether torch lets cuDNN convolutions or cuBLAS matmuls compute float32 in TF32."""
    import torch

    return bool(torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32)


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
    if not want.numel():
        return True, 0.0
    rtol, atol = tolerance(want.dtype)
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    # NaN where eager has NaN and the same infinities are agreement; any other non-finite is not
    same_nonfinite = bool(torch.equal(torch.isnan(got), torch.isnan(want))) and bool(
        torch.equal(got[torch.isinf(want)], want[torch.isinf(want)]))
    if not same_nonfinite or not bool(torch.isfinite(got[finite]).all()):
        return False, float("inf")
    diff = (got[finite] - want[finite]).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    scale = float(want[finite].abs().max()) if diff.numel() else 0.0
    return worst <= atol + rtol * scale, worst


def _walk(run_until: Callable[[int], Any], graph: TaskGraph, ops: Sequence[AlignedOp],
          wrong: Callable[[Any, AlignedOp], tuple[bool, float]],
          progress: Callable[[str], None] | None = None) -> tuple[AlignedOp, float] | None:
    """The first of ``ops`` (in order) for which ``wrong(snapshot, op)`` says so; ``progress``
    gets a line every few seconds on a long walk."""
    with_tasks = {t.op for t in graph.tasks}
    todo = [op for op in ops if op.pairs and op.index in with_tasks]
    last = time.monotonic()
    for k, op in enumerate(todo):
        bad, diff = wrong(run_until(op.index), op)
        if bad:
            return op, diff
        if progress is not None and time.monotonic() - last > PROGRESS_SECONDS:
            progress(f"compared {k + 1} of {len(todo)} ops: up to op {op.index} all agree")
            last = time.monotonic()
    return None


def _found(graph: TaskGraph, op: AlignedOp, diff: float, what: str) -> Divergence:
    return Divergence(op.index, op.name, op.module,
                      [t.id for t in graph.tasks if t.op == op.index], diff,
                      f"op {op.index} {op.name} in {op.module or 'the model'} {what}")


def first_divergence(run_until: Callable[[int], Any], graph: TaskGraph,
                     aligned: Sequence[AlignedOp],
                     progress: Callable[[str], None] | None = None) -> Divergence | None:
    """The first op (in recorded order) whose outputs, as ``run_until(op)`` (a
    :class:`nimble.stepper.Snapshot`) leaves them, differ from eager's; None if none does."""
    def differs(snap, op: AlignedOp) -> tuple[bool, float]:
        worst, bad = 0.0, False
        for access, want in op.pairs:
            ok, diff = _compare(_range(snap, access), want)
            bad |= not ok
            worst = max(worst, diff)
        return bad, worst
    hit = _walk(run_until, graph, aligned, differs, progress)
    return None if hit is None else _found(graph, hit[0], hit[1],
                                           f"differs from eager by up to {hit[1]:.3g}")


def first_nonfinite(run_until: Callable[[int], Any], graph: TaskGraph,
                    aligned: Sequence[AlignedOp],
                    progress: Callable[[str], None] | None = None) -> Divergence | None:
    """The first op (in recorded order) whose floating-point outputs hold NaN or Inf (only NaN
    for the ops of :data:`INF_SENTINEL_OPS`, whose infinities are meant)."""
    found: dict[int, str] = {}

    def nonfinite(snap, op: AlignedOp) -> tuple[bool, float]:
        kinds = nonfinite_kinds([graph_tensor(_range(snap, a), t.cpu())
                                 for a, t in op.pairs if t.is_floating_point()])
        if op.name.split(".")[0] in INF_SENTINEL_OPS:
            kinds.discard("Inf")
        if kinds:
            found[op.index] = " and ".join(sorted(kinds, reverse=True))
        return bool(kinds), float("nan")
    hit = _walk(run_until, graph, aligned, nonfinite, progress)
    return None if hit is None else _found(graph, hit[0], hit[1],
                                           f"is the first to write {found[hit[0].index]}")


def nonfinite_kinds(tensors: Sequence) -> set[str]:
    """Which of ``"NaN"`` and ``"Inf"`` the floating-point ``tensors`` hold."""
    import torch

    kinds = set()
    for t in tensors:
        if bool(torch.isnan(t).any()):
            kinds.add("NaN")
        if bool(torch.isinf(t).any()):
            kinds.add("Inf")
    return kinds


def _range(snap, access: Access):
    return snap.buffer(access.buffer)[access.offset:access.offset + access.size]
