"""Step-through: run a prepared graph up to a task, then read any buffer it left.

:func:`select_tasks` names the tasks to stop after — by task id, by ATen op index, or by module
path — and :func:`ancestor_closure` adds everything they depend on in their phase.
:func:`run_until` runs that sub-graph (built from the prepared graph's own nodes, over the same
arena; a walk of many stops prunes one whole copy of the phase to each stop's tasks:
:class:`StepThrough`) on the given inputs after the phases before it, and returns a
:class:`Snapshot` from which any buffer can be read as bytes or as a tensor.  The prepared
graph's outputs, and the memory outside the arena the run writes (batch-norm statistics), are
saved before and put back after, so the caller's outputs and the model stay as they were.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..engine.rebuild import PhaseOptions
from ..errors import InputError
from ..analysis.schedule import Schedule, phase_spans
from ..ir.taskgraph import TaskGraph


def select_tasks(graph: TaskGraph, *, task: int | None = None, op: int | None = None,
                 module: str | None = None) -> list[int]:
    """The tasks named by exactly one of ``task`` (an id), ``op`` (an ATen op's index) or
    ``module`` (a module path: the tasks of every op run by it or by a module inside it)."""
    given = [k for k, v in (("task", task), ("op", op), ("module", module)) if v is not None]
    if len(given) != 1:
        raise InputError("name exactly one of task=, op= or module= to stop after")
    if task is not None:
        if not 0 <= task < len(graph.tasks):
            raise InputError(f"task {task} is not one of the graph's {len(graph.tasks)} tasks")
        return [task]
    if op is not None:
        tasks = [t.id for t in graph.tasks if t.op == op]
        if not tasks:
            raise InputError(f"op {op} launched no task (ops 0..{len(graph.ops) - 1}; "
                             "some ops, views for one, launch nothing)")
        return tasks
    ops = {o.index for o in graph.ops
           if o.module == module or o.module.startswith(module + ".")}
    tasks = [t.id for t in graph.tasks if t.op in ops]
    if not tasks:
        known = sorted({o.module for o in graph.ops if o.module})[:5]
        raise InputError(f"no task ran in module {module!r} (modules look like {known})")
    return tasks


def ancestor_closure(schedule: Schedule, targets: Sequence[int], n: int) -> tuple[set[int], range]:
    """``(targets and every task they wait for in their phase, that phase's span)``.

    The targets must lie in one phase; the phases before it run whole.
    """
    spans = phase_spans(schedule.phases, n)
    owning = {next(k for k, s in enumerate(spans) if t in s) for t in targets}
    if len(owning) != 1:
        raise InputError("the tasks to stop after lie in more than one phase (forward and "
                         "backward): stop after tasks of one")
    span = spans[owning.pop()]
    preds: dict[int, list[int]] = {}
    for u, v in schedule.edges():
        if u in span and v in span:
            preds.setdefault(v, []).append(u)
    keep, stack = set(), list(targets)
    while stack:
        t = stack.pop()
        if t not in keep:
            keep.add(t)
            stack += preds.get(t, [])
    return keep, span


@dataclass
class Snapshot:
    """Buffers as a step-through left them: ``buffers[b]`` is a copy of buffer ``b``'s bytes (a
    uint8 tensor on the host, or on the GPU for a walk's runs)."""

    graph: TaskGraph
    tasks: set[int]
    buffers: dict[int, Any]

    def buffer(self, bid: int):
        """Buffer ``bid``'s bytes (a uint8 tensor)."""
        return self.buffers[bid]

    def tensor(self, bid: int, dtype, shape: Sequence[int], offset: int = 0):
        """Buffer ``bid``'s bytes from ``offset`` seen as a contiguous ``dtype`` tensor."""
        import math

        raw = self.buffers[bid]
        count = math.prod(shape)
        size = count * (raw.new_empty((), dtype=dtype).element_size())
        return raw[offset:offset + size].view(dtype).view(*shape)

    def op_outputs(self, op: int) -> list:
        """The bytes each of op ``op``'s written ranges holds (in its access order)."""
        return [self.buffers[a.buffer][a.offset:a.offset + a.size]
                for a in self.graph.ops[op].accesses if a.write]


def stop_options(only: set[int] | None) -> PhaseOptions:
    """How a step-through copy differs from the served phase: only the tasks of ``only`` (all
    when None), no input gathers, no node priorities, a plain exec.

    A step-through reads values, not times.  Its inputs are copied straight into the slots
    (:func:`run_tasks`), so a gather would copy each slot onto itself; priorities and device
    launch change when and how nodes run, never what they compute; and each stop's pruned clone
    is instantiated plainly (:meth:`StepThrough.launch`) whatever the copy was.
    """
    return PhaseOptions(priorities=False, gathers=False, device_launch=False, only=only)


def build_phase(prepared, phase: int, only: set[int] | None):
    """A copy of phase ``phase`` of ``prepared`` from its own nodes, over the same arena: the
    whole phase, or only the tasks of ``only`` (:func:`stop_options`)."""
    return prepared.phase_builder().build(phase, stop_options(only))


class StepThrough:
    """One whole copy of one phase of a prepared graph, from which each stop of a walk runs a
    graph of exactly its tasks: the copy cloned, the other tasks' nodes removed
    (``cuGraphClone``, ``cuGraphDestroyNode``), instantiated for that run.  A walk of
    :mod:`nimble.debug.divergence` stops after each of hundreds of ops; cloning and pruning in the
    driver costs far less than adding every kept node again from Python.

    The stops do not switch nodes off in one exec (``cuGraphNodeSetEnabled``) instead: a copy
    with its later nodes switched off is not reliably kept from running some of them, whose
    values then land in arena ranges the stop reads, while a graph holding only the stop's nodes
    repeats bit for bit.  Owns its graphs; :meth:`close` (idempotent) frees them."""

    def __init__(self, prepared, phase: int):
        self.prepared = prepared
        self.phase = phase
        self.span = prepared.builts[phase].span
        # Built from the buffers' current addresses, not cloned from the served graph: re-pointing
        # moved weights changes the served exec only, so its graph's nodes keep the old addresses.
        self.whole = build_phase(prepared, phase, None)
        self._stop = None  # the last stop's (graph, exec), kept until the next run

    def launch(self, keep: set[int], stream) -> None:
        """Launch on ``stream`` a graph that runs exactly the tasks of ``keep`` (of this phase,
        closed under predecessors)."""
        from .. import driver

        keep = {t for t in keep if t in self.span}
        self._release()
        if not keep:
            return
        if len(keep) == len(self.span):
            driver.launch(self.whole.exec.handle, stream)
            return
        graph = self.whole.graph.copy_without(
            [node for t, node in zip(self.span, self.whole.nodes) if t not in keep])
        try:
            exec_ = driver.GraphExec.instantiate(graph)
        except BaseException:
            graph.close()
            raise
        self._stop = (graph, exec_)
        driver.launch(exec_.handle, stream)

    def _release(self) -> None:
        if self._stop is not None:
            graph, exec_ = self._stop
            self._stop = None
            exec_.close()
            graph.close()

    def close(self) -> None:
        self._release()
        self.whole.close()


def run_until(prepared, targets: Sequence[int], inputs: Sequence | None = None,
              read: set[int] | None = None, stepper: StepThrough | None = None,
              on_device: bool = False) -> Snapshot:
    """Run ``prepared`` (a :class:`nimble.engine.prepared.Prepared`) up to ``targets`` on ``inputs``
    (the flat inputs of every phase; random when None) and copy out every buffer the run
    touched (only those in ``read``, when given).  ``stepper`` (a :class:`StepThrough` of the
    targets' phase) is used for the run when given; without one the kept tasks' sub-graph is
    built for this run alone.  Needs the GPU; the prepared graph's outputs are put back
    afterwards.  The copies are on the host, or ``on_device`` (a walk's, compared there with
    eager's outputs on the GPU)."""
    keep, span = ancestor_closure(prepared.schedule, targets, len(prepared.graph.tasks))
    phase = next(k for k, b in enumerate(prepared.builts) if b.span == span)
    return run_tasks(prepared, phase, keep, inputs, read, stepper, on_device)


def run_before(prepared, op: int, inputs: Sequence | None = None,
               read: set[int] | None = None, stepper: StepThrough | None = None,
               on_device: bool = False) -> Snapshot:
    """Run every task of op ``op``'s phase recorded before op ``op``'s first task (the phases
    before it whole) and copy out the buffers in ``read`` (all it touched when None): what the
    recorded ops before ``op`` left for it to read.  Edges only go forward in recorded order, so
    such a prefix holds its tasks' predecessors; and the arena lets no earlier task overwrite a
    range that a later one still reads.  ``on_device`` as for :func:`run_until`."""
    tasks = [t.id for t in prepared.graph.tasks if t.op == op]
    if not tasks:
        raise InputError(f"op {op} launched no task")
    phase = next(k for k, b in enumerate(prepared.builts) if tasks[0] in b.span)
    span = prepared.builts[phase].span
    return run_tasks(prepared, phase, set(range(span.start, min(tasks))), inputs, read, stepper,
                     on_device)


def run_tasks(prepared, phase: int, keep: set[int], inputs: Sequence | None = None,
              read: set[int] | None = None, stepper: StepThrough | None = None,
              on_device: bool = False) -> Snapshot:
    """Run the tasks ``keep`` of phase ``phase`` (closed under predecessors) after the phases
    before it, on ``inputs`` (random when None), and copy out every buffer the run touched
    (only those in ``read``, when given); see :func:`run_until`."""
    import torch

    from .. import driver
    from ..engine.proof import random_like

    graph = prepared.graph
    launchers = prepared.launchers
    slots = [s for launcher in launchers for s in launcher.slots]
    inputs = list(inputs) if inputs is not None else [random_like(s.tensor) for s in slots]
    if stepper is not None and stepper.phase == phase:
        own = None
    else:  # a single run: the kept tasks' sub-graph alone is less driver work than a stepper
        stepper = None
        own = build_phase(prepared, phase, keep) if keep else None
    ran = [t for b in prepared.builts[:phase] for t in b.span] + sorted(keep)
    # Memory outside the arena that the run writes (batch-norm statistics in training mode,
    # library scratch): saved, and put back afterwards with the outputs.
    outside = sorted({a.buffer for t in ran for a in graph.tasks[t].accesses
                      if a.write and graph.buffers[a.buffer].kind in ("param", "external")})
    try:
        with launchers[0].lock:
            saved = [o.clone() for launcher in launchers for o in launcher.outputs]
            kept = {b: driver.copy_to_host(prepared.bases[b], graph.buffers[b].size)
                    for b in outside}
            prepared.cells_to_own_slots()  # earlier phases then gather each slot onto itself
            stream = launchers[0].stream()
            with torch.no_grad():
                for slot, x in zip(slots, inputs):
                    slot.tensor.copy_(x)
                torch.cuda.synchronize()
                for built in prepared.builts[:phase]:
                    driver.launch(built.exec.handle, stream)
                if stepper is not None:
                    stepper.launch(keep, stream)
                elif own is not None:
                    driver.launch(own.exec.handle, stream)
                driver.stream_synchronize(stream)
                touched = {a.buffer for t in keep for a in graph.tasks[t].accesses}
                if read is not None:
                    touched &= set(read)
                # the prepared graph's GPU, where its outputs and inputs are
                device = [*saved, *(s.tensor for s in slots)][0].device if on_device else None
                buffers = {b: _read(prepared, b, device) for b in sorted(touched)}
                outs = [o for launcher in launchers for o in launcher.outputs]
                for live, old in zip(outs, saved):
                    live.copy_(old)
                torch.cuda.synchronize()
                for b, data in kept.items():
                    driver.copy_to_device(prepared.bases[b], data)
    finally:
        if own is not None:
            own.close()
    return Snapshot(graph, keep, buffers)


def _read(prepared, bid: int, device=None):
    """Buffer ``bid``'s bytes as a uint8 tensor: on the host, or copied on ``device`` (the
    prepared graph's GPU)."""
    import torch

    from .. import driver

    size = prepared.graph.buffers[bid].size
    if device is not None:
        copy = torch.empty(size, dtype=torch.uint8, device=device)
        if size:
            driver.copy_device(copy.data_ptr(), prepared.bases[bid], size)
        return copy
    raw = driver.copy_to_host(prepared.bases[bid], size) if size else b""
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
        torch.empty(0, dtype=torch.uint8)
