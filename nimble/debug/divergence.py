"""First divergence: the first ATen op whose output in the prepared graph differs from eager's.

:func:`~nimble.debug.eager_twins.eager_ops` runs the model eagerly under a dispatch mode that
keeps every op's fresh outputs; :func:`~nimble.debug.eager_twins.align` pairs each op of the
recording with its eager twin (same position, same name; a different sequence means
data-dependent control flow, refused) and each eager output with the written byte range of the
recorded op that holds it.  :func:`first_divergence` walks the ops in
recorded (topological) order: for each it runs the prepared graph up to that op
(:func:`nimble.debug.step_through.run_until`) and compares the op's outputs with eager's, within a
tolerance that depends on the dtype, and stops at the first that differs.  A walk, not a
bisection: a wrong value propagates only along its own branch, so ops on parallel branches after
the faulty one still agree, and "some op up to here differs" is not monotone in the op index.
:func:`first_nonfinite` does the same for NaN or Inf (not counting the infinities that padding and
masking ops write on purpose, :data:`INF_SENTINEL_OPS`).

Rounding differences grow with depth: eager and the recording may run other library algorithms,
so deep in a 1,000-op fp16 network an op's output can differ from the eager chain's by more
than one op's tolerance while every op computes right.  So an op that differs from the eager
chain is judged again in isolation (:func:`isolated_difference`): its eager twin runs once more
on the graph's own inputs to it (the values the recorded ops before it left, read after a run
of every task before it), and only a difference from that counts.  Weights, the model's input
and whatever else no recorded op wrote come from the eager run, so a kernel that reads the wrong
weight still shows.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..ir.taskgraph import Access, TaskGraph
from .eager_twins import AlignedOp, rerun

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

#: Ops whose every output element is a sum of products of their inputs (bias included).
#: Two algorithms round such a sum differently by up to a fraction of the magnitudes of its
#: terms, which can be far larger than the sum itself (a ReLU'd input under random-signed weights
#: cancels), and a transform-based algorithm (Winograd, FFT) spreads one element's rounding over
#: its neighbours: run alone on the graph's inputs, such an op is held to a tolerance relative to
#: the largest element of the same op run on its inputs' magnitudes.
SUM_OPS = frozenset({"aten::convolution", "aten::_convolution", "aten::cudnn_convolution",
                     "aten::conv2d", "aten::conv1d", "aten::conv3d", "aten::linear", "aten::mm",
                     "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::mv",
                     "aten::addmv", "aten::dot", "aten::_convolution_mode"})

#: Ops that write an infinity on purpose, as a sentinel the next op absorbs: padding before a
#: max pool ("same" pooling in timm's NASNet and PNASNet pads with -inf), attention masks
#: before a softmax.  The NaN hunt counts only NaN in their outputs, or it would stop at every
#: such pad.
INF_SENTINEL_OPS = frozenset({"aten::constant_pad_nd", "aten::masked_fill", "aten::masked_fill_",
                              "aten::fill", "aten::fill_", "aten::full", "aten::full_like",
                              "aten::new_full", "aten::where", "aten::scalar_tensor"})


@dataclass
class Divergence:
    """The first op whose output differs (or holds NaN/Inf), and by how much."""

    op: int
    name: str
    module: str
    tasks: list[int]
    max_abs_diff: float
    detail: str


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


def _compare(raw, want, magnitude=None) -> tuple[bool, float]:
    """``(agrees, largest difference)`` of the graph's bytes ``raw`` with ``want``; the
    tolerance is relative to ``want``'s largest magnitude, or to ``magnitude``'s largest element
    when given (see :data:`SUM_OPS`)."""
    import torch

    # where eager's outputs are (the GPU): a walk's compares then never cross to the host
    got = graph_tensor(raw.to(want.device), want)
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
    if magnitude is not None:
        largest = magnitude.to(want.device).double()[finite]
        return worst <= atol + rtol * (float(largest.max()) if largest.numel() else 0.0), worst
    scale = float(want[finite].abs().max()) if diff.numel() else 0.0
    return worst <= atol + rtol * scale, worst


@dataclass
class WalkCost:
    """What a walk spent, for its last progress line and the log: step-through runs of a
    group of ops, of one op (a stop of its own), of the tasks before an op (its inputs where it
    writes over them), ops judged again on their own inputs, and the seconds of each kind of
    run and of the whole walk."""

    runs: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    judged_alone: int = 0
    began: float = field(default_factory=time.monotonic)

    def counted(self, kind: str, run: Callable) -> Callable:
        """``run``, counted and timed as a run of ``kind``."""
        def counted_run(*args):
            t0 = time.monotonic()
            try:
                return run(*args)
            finally:
                self.runs[kind] = self.runs.get(kind, 0) + 1
                self.seconds[kind] = self.seconds.get(kind, 0.0) + time.monotonic() - t0
        return counted_run

    def summary(self) -> str:
        runs = ", ".join(f"{n} {kind} ({self.seconds[kind]:.1f} s)"
                         for kind, n in self.runs.items()) or "no run"
        return (f"the walk took {time.monotonic() - self.began:.1f} s: {runs}; "
                f"{self.judged_alone} op(s) judged again on the graph's own inputs")


@dataclass(frozen=True)
class GroupedStops:
    """Stops of several ops in one run (:mod:`nimble.debug.stop_groups`): ``plan`` groups a
    walk's op indices (each group in the walk's order, the groups in the order of their first
    op), ``run`` makes one run for a group and returns a snapshot holding every member's
    outputs.  A member that looks wrong there is always judged on a stop of its own: the plan
    trusts the recorded writes, and a fault the walk hunts (a kernel writing outside them) can
    spoil an earlier member's bytes in the shared run."""

    plan: Callable[[list[int]], list[list[int]]]
    run: Callable[[list[int]], Any]


def _walk(run_until: Callable[[int], Any], graph: TaskGraph, ops: Sequence[AlignedOp],
          wrong: Callable[[Any, AlignedOp], tuple[bool, float]],
          progress: Callable[[str], None] | None = None,
          grouped: GroupedStops | None = None,
          looks_wrong: Callable[[Any, AlignedOp], bool] | None = None
          ) -> tuple[AlignedOp, float] | None:
    """The first of ``ops`` (in order) for which ``wrong(snapshot, op)`` says so; ``progress``
    gets a line every few seconds on a long walk.  With ``grouped``, a group's ops are first
    read from the group's one run; an op that ``looks_wrong`` there (which must say so wherever
    ``wrong`` would) is a suspect, judged on a stop of its own once every op before it has been
    read: the first wrong op in order is the answer, the sequential walk's."""
    with_tasks = {t.op for t in graph.tasks}
    todo = [op for op in ops if op.pairs and op.index in with_tasks]
    position = {op.index: k for k, op in enumerate(todo)}
    groups = grouped.plan([op.index for op in todo]) if grouped is not None \
        else [[op.index] for op in todo]
    read = [False] * len(todo)
    frontier = 0  # every op before this position has been read
    suspects: list[int] = []  # positions, a heap
    found: dict[int, float] = {}  # positions judged wrong on stops of their own
    last = time.monotonic()
    for group in groups:
        shared = grouped.run(group) if grouped is not None and len(group) > 1 \
            and looks_wrong is not None else None
        for index in group:
            k = position[index]
            read[k] = True
            if shared is None:
                bad, diff = wrong(run_until(index), todo[k])
                if bad:
                    found[k] = diff
            elif looks_wrong(shared, todo[k]):
                heapq.heappush(suspects, k)
        while frontier < len(todo) and read[frontier]:
            frontier += 1
        hit = _first_wrong(run_until, todo, wrong, frontier, suspects, found)
        if hit is not None:
            return hit
        if progress is not None and frontier and time.monotonic() - last > PROGRESS_SECONDS:
            progress(f"compared {frontier} of {len(todo)} ops: up to op "
                     f"{todo[frontier - 1].index} all agree")
            last = time.monotonic()
    return None


def _first_wrong(run_until, todo: Sequence[AlignedOp], wrong, frontier: int,
                 suspects: list[int], found: dict[int, float]) -> tuple[AlignedOp, float] | None:
    """The first op before ``frontier`` that is wrong: a position in ``found``, or a suspect
    (taken from the heap in order) that ``wrong`` confirms on a stop of its own."""
    first = min(found, default=len(todo))
    while suspects and suspects[0] < min(frontier, first):
        k = heapq.heappop(suspects)
        bad, diff = wrong(run_until(todo[k].index), todo[k])
        if bad:
            return todo[k], diff
    if first < frontier:
        return todo[first], found[first]
    return None


def _found(graph: TaskGraph, op: AlignedOp, diff: float, what: str) -> Divergence:
    return Divergence(op.index, op.name, op.module,
                      [t.id for t in graph.tasks if t.op == op.index], diff,
                      f"op {op.index} {op.name} in {op.module or 'the model'} {what}")


def first_divergence(run_until: Callable[[int], Any], graph: TaskGraph,
                     aligned: Sequence[AlignedOp],
                     progress: Callable[[str], None] | None = None,
                     run_before: Callable[[int, set[int]], Any] | None = None,
                     grouped: GroupedStops | None = None,
                     cost: WalkCost | None = None) -> Divergence | None:
    """The first op (in recorded order) whose outputs, as ``run_until(op)`` (a
    :class:`nimble.debug.step_through.Snapshot`) leaves them, differ from eager's; None if none does.

    With ``run_before(op, buffers)`` (a snapshot of ``buffers`` after every task before ``op``)
    an op that differs from the eager chain counts only if it also differs from its eager twin
    run on the graph's own inputs (:func:`isolated_difference`); ``run_until(op)`` must then
    hold the ranges those inputs lie in too.  With ``grouped``, ops are read from shared runs
    first (:class:`GroupedStops`), and one that differs from the eager chain there is judged on
    a stop of its own.  ``cost`` counts the ops judged again alone.
    """
    judged: dict[int, str] = {}

    def chain_differs(snap, op: AlignedOp) -> bool:
        return any(not _compare(_range(snap, access), want)[0] for access, want in op.pairs)

    def differs(snap, op: AlignedOp) -> tuple[bool, float]:
        worst, bad = 0.0, False
        for access, want in op.pairs:
            ok, diff = _compare(_range(snap, access), want)
            bad |= not ok
            worst = max(worst, diff)
        if not bad or run_before is None or not op.isolable:
            return bad, worst
        # The inputs as the same run left them, unless the op writes over one of them: two runs
        # of a kernel that sums in a varying order (split-K, atomics) differ by its rounding,
        # which the ops after it would count against themselves.
        inputs = snap if not overwrites_inputs(graph, op) else run_before(
            op.index, {a.buffer for a in op.sources if a})
        alone = isolated_difference(op, inputs, snap)
        if cost is not None:
            cost.judged_alone += 1
        judged[op.index] = (f"differs from eager by up to {worst:.3g}, and by up to "
                            f"{alone[1]:.3g} from its eager twin run on the graph's own inputs")
        return alone
    hit = _walk(run_until, graph, aligned, differs, progress, grouped, chain_differs)
    if hit is None:
        return None
    return _found(graph, hit[0], hit[1], judged.get(
        hit[0].index, f"differs from eager by up to {hit[1]:.3g}"))


def overwrites_inputs(graph: TaskGraph, op: AlignedOp) -> bool:
    """Whether a task of ``op`` writes bytes of a range the op reads its inputs from (in place,
    or scratch the arena placed over an input the op has finished reading)."""
    sources = [a for a in op.sources if a is not None]
    written = [a for t in graph.tasks if t.op == op.index for a in t.accesses if a.write]
    written += [a for a in graph.ops[op.index].accesses if a.write]
    return any(w.buffer == s.buffer and w.offset < s.end and s.offset < w.end
               for w in written for s in sources)


def isolated_difference(op: AlignedOp, before, after) -> tuple[bool, float]:
    """``(differs, largest difference)`` of ``op``'s outputs in ``after`` (a snapshot taken
    after it ran) from its eager twin run again on the inputs the graph gave it, read from
    ``before`` (``after`` itself, or a snapshot of every task before the op where it writes over
    its inputs: :func:`overwrites_inputs`).  Arguments no recorded op wrote keep their eager
    values."""
    twin = op.eager
    values = []
    for inp, src in zip(twin.inputs, op.sources):
        if src is None:
            values.append(inp.value)
            continue
        raw = _range(before, src)
        values.append(raw.view(inp.dtype).as_strided(inp.shape, inp.stride).to(inp.device))
    fresh = rerun(twin, values)
    magnitudes = [None] * len(fresh)
    if op.name.split(".")[0] in SUM_OPS:
        magnitudes = rerun(twin, [v.abs() if v.is_floating_point() else v for v in values])
    worst, bad = 0.0, False
    for (access, _), i in zip(op.pairs, op.outputs):
        ok, diff = _compare(_range(after, access), fresh[i], magnitudes[i])
        bad |= not ok
        worst = max(worst, diff)
    return bad, worst


def first_nonfinite(run_until: Callable[[int], Any], graph: TaskGraph,
                    aligned: Sequence[AlignedOp],
                    progress: Callable[[str], None] | None = None,
                    grouped: GroupedStops | None = None) -> Divergence | None:
    """The first op (in recorded order) whose floating-point outputs hold NaN or Inf (only NaN
    for the ops of :data:`INF_SENTINEL_OPS`, whose infinities are meant); ``grouped`` as for
    :func:`first_divergence`."""
    found: dict[int, str] = {}

    def nonfinite(snap, op: AlignedOp) -> tuple[bool, float]:
        kinds = nonfinite_kinds([graph_tensor(_range(snap, a), t)
                                 for a, t in op.pairs if t.is_floating_point()])
        if op.name.split(".")[0] in INF_SENTINEL_OPS:
            kinds.discard("Inf")
        if kinds:
            found[op.index] = " and ".join(sorted(kinds, reverse=True))
        return bool(kinds), float("nan")
    hit = _walk(run_until, graph, aligned, nonfinite, progress, grouped,
                lambda snap, op: nonfinite(snap, op)[0])
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
