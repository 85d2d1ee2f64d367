"""The eager twins of a recording's ops: the model run eagerly under a dispatch mode that keeps
every op's fresh outputs (:func:`eager_ops`), and each recorded op paired with its twin and the
written byte range of the graph that holds each of the twin's outputs (:func:`align`), for
:mod:`nimble.debug.divergence` to compare them and to run a twin again on the graph's own
inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import InputError
from ..ir.taskgraph import Access, TaskGraph


@dataclass(slots=True)
class EagerInput:
    """A tensor argument of an eager op, as the op saw it.

    ``source`` is ``(op, output)``: the fresh output of an earlier eager op whose storage holds
    it, ``offset`` bytes past that output's first byte; None for a tensor no op produced (a
    weight, the model's input), whose copy is ``value``.
    """

    shape: tuple
    stride: tuple
    dtype: Any
    device: Any
    source: tuple[int, int] | None = None
    offset: int = 0
    value: Any = None


class ArgSlot:
    """Where argument ``k`` (an :class:`EagerInput`) goes in an eager op's argument template."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k


@dataclass
class EagerOp:
    """One op of an eager run: its name and copies of the tensors it returned fresh; with
    ``keep_inputs``, also the op itself and its arguments, to run it again on other inputs."""

    name: str
    outputs: list = field(default_factory=list)
    func: Any = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    inputs: list[EagerInput] = field(default_factory=list)


@dataclass
class AlignedOp:
    """A recorded op, with each eager output and the written range of the graph that holds it.

    ``outputs[i]`` is the index among the eager op's fresh outputs of ``pairs[i]``'s tensor;
    ``sources[k]`` the range of the graph holding the eager op's input ``k`` (None where no
    recorded op wrote it: the eager value serves).
    """

    index: int
    name: str
    module: str
    pairs: list[tuple[Access, Any]]  # (written range, eager tensor)
    outputs: list[int] = field(default_factory=list)
    eager: EagerOp | None = None
    sources: list[Access | None] = field(default_factory=list)

    @property
    def isolable(self) -> bool:
        """Whether the op can run again on the graph's inputs (every input found or kept)."""
        e = self.eager
        return e is not None and e.func is not None and all(
            src is not None or inp.value is not None for inp, src in zip(e.inputs, self.sources))


def eager_ops(model, inputs: Sequence, keep_inputs: bool = False) -> list[EagerOp]:
    """Run ``model(*inputs)`` eagerly, keeping every dispatched op's fresh outputs (copies).

    With ``keep_inputs`` each op also keeps what it needs to run again (:class:`EagerInput`):
    where each tensor argument came from, and a copy of those no op produced.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    from ..record.tracer import op_name

    ops: list[EagerOp] = []
    # storage address -> (op, fresh output, byte offset of that output in its storage): the
    # latest fresh output in each live storage (a freed address the allocator hands out again
    # is taken over by its new owner)
    producers: dict[int, tuple[int, int, int]] = {}

    def describe(t, found: list[EagerInput]):
        if not isinstance(t, torch.Tensor):
            return t
        start = t.storage_offset() * t.element_size()
        made = producers.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        entry = EagerInput(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
        if made is not None:
            entry.source, entry.offset = (made[0], made[1]), start - made[2]
        else:
            entry.value = t.detach().clone()
        found.append(entry)
        return ArgSlot(len(found) - 1)

    class Keep(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            record = EagerOp(op_name(func))
            if keep_inputs:
                record.func = func
                record.args = tree_map(lambda v: describe(v, record.inputs), tuple(args))
                record.kwargs = tree_map(lambda v: describe(v, record.inputs), dict(kwargs))
            out = func(*args, **kwargs)
            fresh = fresh_tensors(func, out)
            record.outputs = [t.detach().clone() for t in fresh]
            for i, t in enumerate(fresh):
                producers[t.untyped_storage().data_ptr()] = (
                    len(ops), i, t.storage_offset() * t.element_size())
            ops.append(record)
            return out

    with torch.no_grad(), Keep():
        model(*inputs)
    return ops


def fresh_tensors(func, out) -> list:
    """The tensors among ``func``'s results that alias none of its inputs."""
    from ..record.tracer import tensors_of

    returns = out if isinstance(out, (tuple, list)) and len(func._schema.returns) > 1 else (out,)
    return [t for ret, value in zip(func._schema.returns, returns)
            if ret.alias_info is None for t in tensors_of(value)]


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
    out: list[AlignedOp] = []
    for op, twin in zip(graph.ops, eager):
        written = [a for a in op.accesses if a.write]
        used: set[int] = set()
        pairs, outputs = [], []
        for i, t in enumerate(twin.outputs):
            size = span_bytes(t.shape, t.stride(), t.element_size())
            k = next((i for i, a in enumerate(written) if i not in used and a.size == size),
                     None)
            if k is not None and size:
                used.add(k)
                pairs.append((written[k], t))
                outputs.append(i)
        sources = [_source(out, op, inp) for inp in twin.inputs]
        out.append(AlignedOp(op.index, op.name, op.module, pairs, outputs, twin, sources))
    return out


def _source(aligned: Sequence[AlignedOp], op, inp: EagerInput) -> Access | None:
    """The graph's range holding an eager input of ``op`` (a recorded op) that an earlier op
    produced; None if no op produced it, or if ``op``'s recorded accesses do not cover the
    range where its producer's output lies (then the op is not judged alone)."""
    if inp.source is None:
        return None
    producer, output = inp.source
    made = aligned[producer]
    if output not in made.outputs:
        return None
    holder = made.pairs[made.outputs.index(output)][0]
    element = inp.dtype.itemsize
    size = span_bytes(inp.shape, inp.stride, element)
    if inp.offset < 0 or inp.offset + size > holder.size or any(s < 0 for s in inp.stride):
        return None
    found = Access(holder.buffer, holder.offset + inp.offset, size, False)
    if not any(a.buffer == found.buffer and a.offset <= found.offset and found.end <= a.end
               for a in op.accesses):
        return None
    return found


def rerun(twin: EagerOp, values: Sequence) -> list:
    """``twin``'s fresh outputs, run again with ``values`` as its tensor arguments."""
    import torch
    from torch.utils._pytree import tree_map

    def fill(v):
        return values[v.k] if isinstance(v, ArgSlot) else v
    with torch.no_grad():
        out = twin.func(*tree_map(fill, twin.args), **tree_map(fill, twin.kwargs))
    return fresh_tensors(twin.func, out)
