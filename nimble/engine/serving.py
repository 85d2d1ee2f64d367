"""Serving: shape buckets that share one arena, model instances that run at once, dispatch.

A :class:`Serving` is what one ``Nimble.prepare`` made: per shape bucket (one example's input
shapes) and per model instance one proven :class:`~nimble.engine.prepared.Prepared` graph.  The
buckets of an instance share its arena (:mod:`nimble.engine.arena_layout`) and its lock: calls
of one instance are serialized, so its buckets' plans may overlap.  Instances are independent
copies, each with its own arena, cells and lock, so up to ``instances`` callers run at once
(:class:`InstancePool`).  A call looks its bucket up by the tuple of its input shapes; with
``pad`` a batch that has no bucket of its own runs in the smallest larger one
(:func:`padded_bucket`).

:func:`bucket_examples` checks ``prepare``'s serving arguments and makes each bucket's example.
How the graphs are made is :func:`nimble.engine.preparation.prepare_serving`.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

from .. import driver
from ..errors import InputError
from .arena_layout import SharedArena
from .launcher import TAKE_GENERAL_PATH, not_a_tensor
from .prepared import Prepared

#: The input shapes of one call or bucket, in input order.
Shapes = tuple[tuple[int, ...], ...]


# ---- the examples of the buckets (no GPU) ---------------------------------------------------

def flat_inputs(example) -> list:
    """A tensor or a tuple/list of tensors as a list of tensors; InputError for anything else."""
    import torch

    items = [example] if isinstance(example, torch.Tensor) else \
        list(example) if isinstance(example, (tuple, list)) else None
    if items is None or not all(isinstance(x, torch.Tensor) for x in items):
        what = type(example).__name__ if items is None else \
            type(next(x for x in items if not isinstance(x, torch.Tensor))).__name__
        raise InputError(f"example inputs must be a tensor or a tuple of tensors, got a {what}")
    return items


def shapes_of(example) -> Shapes:
    """The input shapes of an example (a tensor or a tuple of tensors)."""
    return tuple(tuple(x.shape) for x in flat_inputs(example))


def resized(example, batch: int):
    """``example`` with dim 0 of every input resized to ``batch``, its rows taken cyclically."""
    import torch

    items = flat_inputs(example)
    for i, x in enumerate(items):
        if x.dim() == 0 or x.shape[0] == 0:
            raise InputError(f"batch_sizes resizes dim 0 of every input, but input {i} has "
                             f"shape {tuple(x.shape)}: give each bucket's example in "
                             "buckets=[...] instead")
    out = tuple(x[torch.arange(batch, device=x.device) % x.shape[0]] for x in items)
    return out[0] if isinstance(example, torch.Tensor) else out


def _check_sizes(batch_sizes) -> list[int]:
    sizes = list(batch_sizes)
    bad = [b for b in sizes if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if not sizes or bad:
        raise InputError(f"batch_sizes must be positive ints, got {batch_sizes!r}")
    return sizes


def check_pad_shapes(shapes: Shapes, what: str) -> int:
    """The batch of a padded bucket: every input or output has it on dim 0 (else InputError,
    naming ``what``: the bucket's inputs or outputs)."""
    batches = {s[0] if s else None for s in shapes}
    if len(batches) != 1 or None in batches:
        raise InputError(
            f"pad=True runs a smaller batch in a larger bucket and returns its first rows, so "
            f"every input and output must have the batch on dim 0; the {what} have shapes "
            f"{list(shapes)}: prepare without pad")
    return batches.pop()


def bucket_examples(example_inputs, buckets, batch_sizes, *, instances, pad: bool,
                    training: bool) -> list:
    """Each bucket's example from ``prepare``'s arguments, checked: exactly one of
    ``example_inputs`` and ``buckets``; ``batch_sizes`` resizes dim 0 of the example (rows
    taken cyclically); no two buckets of one shape; ``instances`` a positive int; buckets,
    instances and ``pad`` for inference only."""
    if (example_inputs is None) == (buckets is None):
        raise InputError("prepare() takes exactly one of example_inputs and buckets=[...] "
                         "(each bucket's example inputs)")
    if batch_sizes is not None and example_inputs is None:
        raise InputError("batch_sizes resizes dim 0 of example_inputs: pass one example with "
                         "it, or give each bucket's example in buckets=[...]")
    if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
        raise InputError(f"instances must be an int >= 1 (copies of the graph that run at "
                         f"once), got {instances!r}")
    if training and (buckets is not None or batch_sizes is not None or instances != 1 or pad):
        raise InputError("buckets, batch_sizes, instances and pad serve inference: "
                         "prepare(..., training=True) takes one example and one instance")
    if buckets is not None:
        examples = list(buckets)
        if not examples:
            raise InputError("buckets=[] holds no example: give at least one")
    elif batch_sizes is not None:
        examples = [resized(example_inputs, b) for b in _check_sizes(batch_sizes)]
    else:
        examples = [example_inputs]
    seen: dict[Shapes, int] = {}
    for k, example in enumerate(examples):
        for i, x in enumerate(flat_inputs(example)):
            if not x.numel():
                from ..record.recorder import empty_input_error

                raise empty_input_error(i, x)
        shapes = shapes_of(example)
        if shapes in seen:
            raise InputError(f"buckets {seen[shapes]} and {k} both have input shapes "
                             f"{list(shapes)}: give each shape once")
        seen[shapes] = k
        if pad:
            check_pad_shapes(shapes, f"inputs of bucket {k}")
    return examples


# ---- dispatch (no GPU) ----------------------------------------------------------------------

def padded_bucket(prepared: Sequence[Shapes], shapes: Shapes) -> tuple[Shapes, int] | None:
    """The smallest prepared bucket a call of ``shapes`` runs in with padding, and the call's
    rows: every input has the same rows on dim 0, fewer than the bucket's, and otherwise the
    bucket's shape.  None where no bucket takes it."""
    rows = {s[0] if s else None for s in shapes}
    if len(rows) != 1 or None in rows:
        return None
    n = rows.pop()
    fits = [k for k in prepared if len(k) == len(shapes) and all(
        len(a) == len(b) and a[1:] == b[1:] and a[0] > n for a, b in zip(k, shapes))]
    return (min(fits, key=lambda k: k[0][0]), n) if fits else None


class InstancePool:
    """Picks the model instance a call runs on, by its lock (one per instance).

    A thread gets the instance it used last if that one is free, else any free one (taking
    turns), else it waits for its own (or, on its first call, the one whose turn it is).  The
    returned instance's lock is held: :meth:`release` it after the call.
    """

    def __init__(self, locks: Sequence[Any]) -> None:
        self._locks = tuple(locks)
        self._last = threading.local()
        self._turn = itertools.count()

    def __len__(self) -> int:
        return len(self._locks)

    def acquire(self) -> int:
        locks = self._locks
        mine = getattr(self._last, "index", None)
        if mine is not None and locks[mine].acquire(blocking=False):
            return mine
        n = len(locks)
        start = next(self._turn) % n
        for step in range(n):
            k = (start + step) % n
            if k != mine and locks[k].acquire(blocking=False):
                self._last.index = k
                return k
        k = start if mine is None else mine
        locks[k].acquire()
        self._last.index = k
        return k

    def release(self, index: int) -> None:
        self._locks[index].release()


# ---- what prepare made ----------------------------------------------------------------------

@dataclass
class Bucket:
    """One input shape: per model instance, its graph, built in that instance's arena."""

    input_shapes: Shapes
    instances: list[Prepared]

    @property
    def plan_bytes(self) -> int:
        """The bucket's own arena plan (every instance has the same)."""
        return self.instances[0].memplan.arena_bytes


@dataclass(frozen=True)
class MemoryReport:
    """The device memory of a prepared model beyond its weights (``nm.device_bytes``).

    Each instance's arena holds the buckets' plans in one shared region, as large as the
    largest plan, then every bucket's state (input cells, generator cells, private copies of
    library memory); buffers kept at their low address bits live beside the arenas.
    """

    shared_bytes: int  # per instance: the plans' region (the largest bucket's plan)
    state_bytes: int  # per instance: the buckets' states, alignment included
    instance_bytes: list[int]  # per instance: its arena as allocated
    outside_bytes: int = 0  # every instance's low-word buffers, beside the arenas

    @property
    def total_bytes(self) -> int:
        return sum(self.instance_bytes) + self.outside_bytes


@dataclass
class BucketCost:
    """Where one bucket's prepare went: seconds per stage (the recording's own stages, such as
    ``warmup``, ``capture``, ``twin`` and ``decode``, then ``schedule_and_memplan``,
    ``timing``, ``build``, ``verify_served``, ``verify_fuzz``)."""

    input_shapes: Shapes
    seconds: dict[str, float]


@dataclass
class InstanceCost:
    """One bucket built again for another model instance, and its short proof."""

    instance: int
    input_shapes: Shapes
    build: float
    proof: float
    proof_launches: int


@dataclass
class PrepareReport:
    """Where ``prepare`` spent its time (``nm.prepare_report``): per bucket and stage, the
    copies for further instances, the arenas' allocation, and the whole."""

    buckets: list[BucketCost] = field(default_factory=list)
    instances: list[InstanceCost] = field(default_factory=list)
    arena_seconds: float = 0.0
    total: float = 0.0

    def stage_totals(self) -> dict[str, float]:
        """Seconds per stage over every bucket, then ``instance_build``, ``instance_proof``
        and ``arena``."""
        totals: dict[str, float] = {}
        for cost in self.buckets:
            for stage, s in cost.seconds.items():
                totals[stage] = totals.get(stage, 0.0) + s
        totals["instance_build"] = sum(c.build for c in self.instances)
        totals["instance_proof"] = sum(c.proof for c in self.instances)
        totals["arena"] = self.arena_seconds
        return totals


class PhaseView(NamedTuple):
    """One separately launched graph of a prepared model (see :attr:`nimble.Nimble.phases`)."""

    name: str
    tasks: range  # its tasks in :attr:`nimble.Nimble.graph`
    exec_handle: int
    input_cells: list[int]
    input_addresses: list[int]
    output_addresses: list[int]


class BucketView(NamedTuple):
    """One shape bucket of a prepared model (see :attr:`nimble.Nimble.buckets`)."""

    input_shapes: tuple  # per input, its shape
    arena_bytes: int  # the bucket's own arena plan (its share of the one shared region)
    instances: list[PhaseView]  # per model instance, its graph's handles for a C host


def phase_views(state: Prepared) -> list[PhaseView]:
    """The phases of one prepared graph with their handles (:attr:`nimble.Nimble.phases`)."""
    names = ["forward", "backward"] if state.step is not None else ["inference"]
    return [PhaseView(name, built.span, int(built.exec.handle),
                      [s.cell for s in launcher.slots], [s.address for s in launcher.slots],
                      [o.data_ptr() for o in launcher.outputs])
            for name, built, launcher in zip(names, state.builts, state.launchers)]


class Serving:
    """Every bucket of every instance, the arenas, and the call's dispatch."""

    def __init__(self, buckets: list[Bucket], arenas: list[driver.DeviceMemory],
                 layout: SharedArena, pad: bool, report: PrepareReport) -> None:
        self.buckets = buckets
        self.arenas = arenas
        self.layout = layout
        self.pad = pad
        self.report = report
        self._table = {b.input_shapes: b for b in buckets}
        self._keys = [b.input_shapes for b in buckets]
        self._pool = InstancePool([buckets[0].instances[k].launcher.lock
                                   for k in range(len(arenas))])
        #: The bucket with the largest plan, instance 0: what ``nm.engine`` and the single
        #: graph's inspection and debugging tools mean.
        self.primary = max(buckets, key=lambda b: b.plan_bytes).instances[0]

    @property
    def instances(self) -> int:
        return len(self.arenas)

    @property
    def plain(self) -> bool:
        """One bucket, one instance, no padding: calls go straight to its launcher."""
        return len(self.buckets) == 1 and len(self.arenas) == 1 and not self.pad

    def preparations(self) -> list[Prepared]:
        """Every bucket's graph of every instance."""
        return [p for b in self.buckets for p in b.instances]

    def call(self, inputs: Sequence):
        """Run ``inputs`` (flat) in their bucket on a free instance; the model's outputs."""
        try:
            key = tuple(x.shape for x in inputs)
        except AttributeError:
            key = None
        bucket, rows = self._table.get(key), None
        if bucket is None:
            bucket, rows = self._padded(inputs, key)
        pool = self._pool
        k = pool.acquire()
        try:
            launcher = bucket.instances[k].launcher
            flat = launcher.run_flat_held(inputs, rows)
        finally:
            pool.release(k)
        return launcher.unflatten(flat)

    def fast_call(self, weights) -> Callable[[tuple], Any]:
        """:meth:`call` for ``Nimble.__call__``, which takes the general path when ``weights``
        moved (every graph is re-pointed there) or the inputs come as one tuple."""
        from .weights import EPOCH

        call, general = self.call, TAKE_GENERAL_PATH

        def serve(inputs: tuple):
            if weights.epoch != EPOCH[0] or (len(inputs) == 1
                                            and isinstance(inputs[0], (tuple, list))):
                return general
            return call(inputs)
        return serve

    def _padded(self, inputs: Sequence, key) -> tuple[Bucket, int]:
        n = len(self._keys[0])
        if key is None:
            i, x = next((i, x) for i, x in enumerate(inputs) if not hasattr(x, "shape"))
            raise not_a_tensor(i, x, inputs)
        if len(inputs) != n:
            raise InputError(f"the model was prepared with {n} input(s), got {len(inputs)}")
        shapes = tuple(tuple(s) for s in key)
        found = padded_bucket(self._keys, shapes) if self.pad else None
        if found is None:
            raise InputError(
                f"no prepared bucket takes inputs of shapes {list(shapes)}; the model was "
                f"prepared for {[list(k) for k in self._keys]}"
                + ("" if self.pad else " (prepare with pad=True to run a smaller batch in "
                   "the next larger bucket)")
                + ": prepare again with this shape among the buckets")
        return self._table[found[0]], found[1]

    def views(self) -> list[BucketView]:
        """Every bucket with each instance's graph, for a C host (``nm.buckets``)."""
        return [BucketView(b.input_shapes, b.plan_bytes, [phase_views(p)[0] for p in b.instances])
                for b in self.buckets]

    def memory(self) -> MemoryReport:
        outside = sum(p.graph.buffers[b].size for p in self.preparations()
                      for b in p.low_bits)
        return MemoryReport(self.layout.shared_bytes, self.layout.state_bytes,
                            [a.size for a in self.arenas], outside)

    def close(self) -> None:
        """Free every graph now, and each arena once nothing views it (idempotent)."""
        for prepared in self.preparations():
            prepared.close()
        self.arenas = []


def close_partial(built: list[list[Prepared]], arenas: list, orders: list) -> None:
    """Free what a failed prepare built: its graphs, its arenas and their locks' events."""
    driver.close_all((prepared for row in built for prepared in row), orders, arenas)
