"""The proof in ``prepare()``: the rebuilt graph reproduces the single-stream recording bit for bit.

A pointer that relocation missed still points at the old, still-mapped memory and can give right
answers by luck; a missing dependency can give right answers most of the time.  So:

1. two sets of fresh random inputs are run through the captured single-stream graph (the
   reference), each ``repeats`` times: an output that differs between replays of the recording
   itself comes from a kernel that is not deterministic (cuDNN's weight-gradient algorithms
   that add with atomics, say), and no schedule can reproduce it bit for bit;
2. every recorded buffer Nimble moved (inputs, outputs, intermediates, scratch at their recorded
   addresses) and the whole arena are filled with a NaN pattern;
3. the rebuilt graph runs ``relaunches`` times, alternating the two input sets (so a race that
   reads the previous launch's values cannot pass by reading identical ones), and every output of
   every launch must equal its reference byte for byte; an output the recording itself does not
   reproduce must stay within ``NONDETERMINISTIC_SLACK`` times the largest difference seen
   between the reference's own replays (such outputs are named in the result);
4. with the race fuzzer (:mod:`nimble.engine.fuzz`), further launches of verification-only
   copies, checked exactly as the served launches: first each phase in a few serial orders
   that together run every pair of tasks the schedule leaves unordered the other way round
   (:mod:`nimble.analysis.orders`), so a missing dependency between two tasks shows whatever
   the GPU's timing; then a copy with delay nodes before tasks and a fresh draw of delays
   before each launch, so that pairs also overlap and interleave in other ways.

A failure raises :class:`~nimble.errors.VerificationError` naming the launch, the first differing
output and the last tasks that wrote it.  Nothing falls back silently.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from .. import driver
from ..errors import VerificationError
from ..ir.taskgraph import BufferKind, TaskGraph

POISON_BYTE = 0xFF  # 0xFFFFFFFF is a NaN in float32 (and 0xFFFF one in float16 / bfloat16)
NONDETERMINISTIC_SLACK = 16.0
#: How far (relative to the largest reference value) a gradient may differ from its reference:
#: cuDNN's backward kernels (weight gradients, batch-norm backward) add with atomics, so the
#: recording itself does not reproduce them bit for bit, and a multi-stream order perturbs them
#: further through every layer below.
GRADIENT_RTOL = 1e-2
#: How long ``prepare()``'s fuzz launches may take (building their copies included), as a
#: multiple of the served proof's time: the proof as a whole within twice the served part.
#: The serial orders (:mod:`nimble.analysis.orders`) run first whatever the budget, and they
#: alone run every pair of tasks the schedule leaves unordered both ways; the delay draws
#: after them add interleavings within the time left (docs/findings.md, "Serial orders").
FUZZ_TIME_FACTOR = 1.0


def random_like(t, generator=None):
    """A fresh random tensor with ``t``'s shape, dtype and device."""
    import torch

    if t.dtype.is_floating_point or t.dtype.is_complex:
        return torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=generator)
    if t.dtype == torch.bool:
        return torch.rand(t.shape, device=t.device, generator=generator) > 0.5
    return torch.randint(0, 2, t.shape, dtype=t.dtype, device=t.device, generator=generator)


def poison_ranges(graph: TaskGraph) -> list[tuple[int, int]]:
    """``(address, size)`` of every recorded buffer the built graph no longer reads there.

    Only memory the recording still owns: the capture's pool (``meta["pool_segments"]``), the
    recorded inputs, and the random generator's cells (which torch rewrites before each of its
    own replays).  A recorded buffer outside them (an allocation the capture made elsewhere and
    has since given back) may belong to someone else by now, and is left alone.
    """
    segments = graph.meta.get("pool_segments")
    owned = None if segments is None else sorted((int(a), int(a) + int(n)) for a, n in segments)

    def inside(b) -> bool:
        if owned is None or b.kind in (BufferKind.INPUT, BufferKind.RNG):
            return True
        return any(lo <= b.address and b.address + b.size <= hi for lo, hi in owned)
    return [(b.address, b.size) for b in graph.buffers
            if (b.kind in BufferKind.RELOCATABLE or b.kind == BufferKind.RNG) and b.size > 0
            and inside(b)]


def poison(ranges: Sequence[tuple[int, int]], stream) -> None:
    """Fill each device range with the poison byte, on ``stream``."""
    for address, size in ranges:
        driver.fill_bytes_async(address, POISON_BYTE, size, stream)


def _as_bytes(t):
    import torch

    return t.contiguous().view(-1).view(torch.uint8)


def same_bits(a, b) -> bool:
    """Bitwise equality (NaNs with equal bits are equal, -0.0 differs from 0.0)."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(_as_bytes(a), _as_bytes(b))


def differing(outputs: Sequence, expected: Sequence) -> list[int]:
    """The indices of ``outputs`` whose bits differ from ``expected``'s (:func:`same_bits`),
    read back with one synchronisation for all of them: a training step's dozens of gradients
    would otherwise cost a host round trip each, every launch.  An expected tensor on the host
    is compared there, its output copied to it (the proof at load: no kernel of torch's to load
    in a fresh process)."""
    import torch

    found, flags = [], []
    for i, (a, b) in enumerate(zip(outputs, expected)):
        if a.shape != b.shape or a.dtype != b.dtype:
            found.append(i)
        elif a.numel():
            if a.device != b.device:  # references kept on the host: the output copied there
                a = a.to(b.device)
            flags.append((i, torch.ne(_as_bytes(a), _as_bytes(b)).any()))
    if flags:
        device = flags[0][1].device
        hits = torch.stack([flag.to(device) for _, flag in flags]).tolist()
        found += [i for (i, _), hit in zip(flags, hits) if hit]
    return sorted(found)


def last_writers(graph: TaskGraph, buffer: int, count: int = 3) -> str:
    """The last ``count`` tasks writing ``buffer``, each with the op it came from."""
    writers = [t for t in graph.tasks if any(a.buffer == buffer and a.write for a in t.accesses)]
    parts = []
    for t in writers[-count:]:
        op = graph.op_of(t)
        parts.append(f"task {t.id} {t.short_name or t.kind}"
                     + (f" ({op.name} in {op.module or 'the model'})" if op else ""))
    return "; ".join(parts) or "no task writes it"


def _max_diff(a, b) -> float:
    diff = (a.double() - b.double()).abs()
    return float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0


class FuzzRuns(Protocol):
    """The proof's fuzz launches (:class:`nimble.engine.fuzz.FuzzCopies`): ``draw()`` before
    each ``run(inputs)``; ``upcoming_seconds(launch)`` estimates what readying launch
    ``launch`` costs beyond the launch itself (building the copies it runs, if not built)."""

    def draw(self) -> None: ...

    def run(self, inputs: list) -> list: ...

    def upcoming_seconds(self, launch: int) -> float: ...


@dataclass(frozen=True)
class FuzzBudget:
    """How many fuzz launches the proof runs after the served ones: ``launches`` at most, and
    once ``at_least`` have run, none after the fuzz part (``spent_seconds`` already spent on it
    beforehand, building the copies, plus its launches) has taken ``time_factor`` times as
    long as the proof before it."""

    launches: int
    time_factor: float = float("inf")
    spent_seconds: float = 0.0
    at_least: int = 4

    def allows(self, launch: int, proof_seconds: float, fuzz_seconds: float) -> bool:
        """Whether fuzz launch number ``launch`` runs."""
        if launch >= self.launches:
            return False
        if launch < self.at_least or self.time_factor == float("inf"):
            return True  # (inf times a proof of 0 s would be NaN, and stop every launch)
        return self.spent_seconds + fuzz_seconds <= self.time_factor * proof_seconds


@dataclass
class ProofProgress:
    """The proof's stage under way: a kernel fault shows at the next synchronization, and the
    stage then tells the recording's own replays from the rebuilt graph's launches."""

    stage: str = "not started"


class Reference:
    """The reference outputs of the proof's two input sets, and how runs are held to them.

    Built once (:meth:`record`), it checks any number of runs: the served graph's launches
    (:meth:`launches`), the fuzz copies' (:meth:`fuzz_launches`), or a broken copy's in a
    measurement of the proof's power (``tools/proof_power.py``).
    """

    def __init__(self, graph: TaskGraph, input_sets: list, expected: list,
                 spread: dict[int, float], gradients: Sequence[int] = (),
                 rng_at: Callable[[int], None] | None = None) -> None:
        self.graph, self.input_sets, self.expected, self.spread = \
            graph, input_sets, expected, spread
        self.tolerant = set(gradients)
        self.rng_at = rng_at

    @classmethod
    def record(cls, graph: TaskGraph, reference: Callable[[list], list],
               example_inputs: Sequence, seed: int = 0,
               rng_at: Callable[[int], None] | None = None, repeats: int = 3,
               gradients: Sequence[int] = ()) -> "Reference":
        """Two fresh random input sets like ``example_inputs`` run through ``reference``."""
        import torch

        gen = torch.Generator(device=example_inputs[0].device if example_inputs else "cuda")
        gen.manual_seed(seed)
        input_sets = [[random_like(x, gen) for x in example_inputs] for _ in range(2)]
        expected, spread = _expected_outputs(reference, input_sets, rng_at, repeats)
        return cls(graph, input_sets, expected, spread, gradients, rng_at)

    def launches(self, run: Callable[[list], list], count: int, label: str = "launch",
                 first: int = 0) -> None:
        """Launches ``first`` to ``count - 1`` of ``run``, alternating the input sets, each
        checked."""
        for launch in range(first, count):
            self._check_one(f"{label} {launch}", run, launch)

    def fuzz_launches(self, fuzz: FuzzRuns, budget: FuzzBudget, proof_seconds: float) -> None:
        """Launches of ``fuzz`` as ``budget`` allows after a proof of ``proof_seconds``, each
        after a fresh draw, checked the same way.  A launch runs only where the budget has
        room for it as well: for what readying it costs and for as long as the launch before
        took, so that the last launch does not carry the fuzz part past its budget."""
        started = time.perf_counter()
        launch, last = 0, 0.0
        while budget.allows(launch, proof_seconds, time.perf_counter() - started
                            + fuzz.upcoming_seconds(launch) + last):
            began = time.perf_counter()
            fuzz.draw()
            self._check_one(f"fuzz launch {launch} (with random delays)", fuzz.run, launch)
            last = time.perf_counter() - began
            launch += 1

    def _check_one(self, label: str, run: Callable[[list], list], launch: int) -> None:
        k = launch % 2
        if self.rng_at is not None:
            self.rng_at(k)
        self.check(label, run(self.input_sets[k]), k)

    def check(self, label: str, outputs: list, k: int) -> None:
        """Raise :class:`VerificationError` unless ``outputs`` match input set ``k``'s."""
        import torch

        spread = self.spread
        if len(outputs) != len(self.expected[k]):
            raise VerificationError(
                f"{label}: {len(outputs)} outputs where the single-stream reference has "
                f"{len(self.expected[k])}")
        for i in differing(outputs, self.expected[k]):
            got, want = outputs[i], self.expected[k][i]
            torch.cuda.synchronize()
            worst = _max_diff(got.to(want.device), want)
            if i in spread and worst <= NONDETERMINISTIC_SLACK * spread[i]:
                continue
            if i in self.tolerant and worst <= GRADIENT_RTOL * float(want.abs().max()):
                spread[i] = max(spread.get(i, 0.0), worst)
                continue
            raise self._failure(label, i, got, worst)

    def _failure(self, label: str, i: int, got, worst: float) -> VerificationError:
        import torch

        graph, spread = self.graph, self.spread
        nan = int(torch.isnan(got).sum().item()) if got.is_floating_point() else 0
        buffer = graph.outputs[i].buffer if i < len(graph.outputs) else -1
        own = (f"; the recording itself varies by up to {spread[i]:.3g} between replays"
               if i in spread else "")
        return VerificationError(
            f"{label}: output {i} differs from the single-stream reference "
            f"(max abs diff {worst:.3g}, {nan} NaN elements of {got.numel()}{own}); the "
            f"last tasks writing it: {last_writers(graph, buffer)}. A NaN means a read of "
            "poisoned memory (a pointer relocation missed); a small difference means two "
            "tasks ran unordered that must not (a missing dependency). Re-run prepare() "
            "with use_multi_stream=False to tell the two apart."
            + (f" The recording left stale-looking words unrelocated; one may be a pointer "
               f"after all: {graph.meta['unresolved_report']}"
               if graph.meta.get("unresolved_report") else ""))


def _expected_outputs(reference: Callable[[list], list], input_sets: list,
                      rng_at: Callable[[int], None] | None, repeats: int
                      ) -> tuple[list, dict[int, float]]:
    """Each input set's reference outputs, and per output the largest difference between the
    reference's own replays (only where it varied)."""
    expected = []
    spread: dict[int, float] = {}
    for k, inputs in enumerate(input_sets):
        for r in range(max(repeats, 1)):
            if rng_at is not None:
                rng_at(k)
            outputs = reference(inputs)
            if not r:
                expected.append(outputs)
                continue
            for i, (again, first) in enumerate(zip(outputs, expected[k])):
                if not same_bits(again, first):
                    spread[i] = max(spread.get(i, 0.0), _max_diff(again, first))
    return expected, spread


class SharedState:
    """Bytes a graph reads and writes that are not its own (a static key-value cache the model
    updates on purpose), saved once and written back before every run.

    A decode step reads the keys and values the earlier launches left: two input sets run in
    turn would each see the other's writes, and the outputs would depend on the order of the
    launches rather than on the inputs.  Every run of the proof (the reference's and the
    rebuilt graph's alike) starts from the saved bytes, so each is held to its reference from
    the same state; :meth:`close` leaves the memory as the proof found it.
    """

    def __init__(self, ranges: Sequence[tuple[int, int]]) -> None:
        import torch

        device = torch.device("cuda", torch.cuda.current_device())
        self.saved = [(address, size, torch.empty(size, dtype=torch.uint8, device=device))
                      for address, size in ranges]
        torch.cuda.synchronize()
        for address, size, copy in self.saved:
            driver.copy_device(copy.data_ptr(), address, size)
        torch.cuda.synchronize()

    def restore(self) -> None:
        """Write the saved bytes back, after every earlier run and before any later one."""
        import torch

        torch.cuda.synchronize()
        for address, size, copy in self.saved:
            driver.copy_device(address, copy.data_ptr(), size)
        torch.cuda.synchronize()

    def before(self, run: Callable[[list], list]) -> Callable[[list], list]:
        """``run`` with the state restored before each call."""
        def restored(inputs: list) -> list:
            self.restore()
            return run(inputs)
        return restored

    def close(self) -> None:
        """Leave the memory as it was saved and let go of the copies."""
        self.restore()
        self.saved = []


class _RestoredFuzz:
    """The fuzz launches of :class:`FuzzRuns`, each from the saved :class:`SharedState`."""

    def __init__(self, fuzz: FuzzRuns, state: SharedState) -> None:
        self.draw, self.run = fuzz.draw, state.before(fuzz.run)
        self.upcoming_seconds = fuzz.upcoming_seconds


def verify_against_reference(graph: TaskGraph, reference: Callable[[list], list],
                             run: Callable[[list], list], example_inputs: Sequence,
                             extra_poison: Sequence[tuple[int, int]], stream,
                             relaunches: int = 100, seed: int = 0,
                             rng_at: Callable[[int], None] | None = None,
                             repeats: int = 3, gradients: Sequence[int] = (),
                             fuzz: FuzzRuns | None = None,
                             fuzz_budget: FuzzBudget | None = None,
                             state: Sequence[tuple[int, int]] = (),
                             progress: ProofProgress | None = None) -> dict[int, float]:
    """Check ``run`` against ``reference`` as the module docstring says.

    ``reference(inputs)`` and ``run(inputs)`` each return the list of output tensors (the
    reference's as copies).  ``extra_poison`` adds device ranges to poison (the arena).  For a
    graph that draws random numbers, ``rng_at(k)`` puts the generator in the state used for
    input set ``k``, before the reference and before every launch on that set.  Outputs listed
    in ``gradients`` (a training step's backward results) that are not bitwise equal must lie
    within ``GRADIENT_RTOL`` of their reference's largest magnitude, or within
    ``NONDETERMINISTIC_SLACK`` times the recording's own spread.  With ``fuzz``, after the
    served launches ``fuzz.run`` is launched as ``fuzz_budget`` allows, each launch after
    ``fuzz.draw()`` and checked the same way on the same alternating input sets.  Returns the
    outputs that were not proven bit for bit, with the largest difference seen (the
    reference's own spread where it varied, else the difference to the rebuilt graph).
    ``state`` lists device ranges outside the graph's own memory that it writes on purpose:
    every run starts from them as they were (:class:`SharedState`), and they are left so.
    ``progress`` is kept at the stage under way (where a failure came from).
    """
    began = time.perf_counter()
    progress = progress if progress is not None else ProofProgress()
    shared = SharedState(state) if state else None
    try:
        if shared is not None:
            reference, run = shared.before(reference), shared.before(run)
            fuzz = _RestoredFuzz(fuzz, shared) if fuzz is not None else None
        progress.stage = "the recording's own replays"
        ref = Reference.record(graph, reference, example_inputs, seed, rng_at, repeats,
                               gradients)
        progress.stage = "the poisoning of the moved buffers and the arena"
        poison(poison_ranges(graph) + list(extra_poison), stream)
        progress.stage = "the rebuilt graph's launches"
        ref.launches(run, max(relaunches, 1))
        if fuzz is not None:
            progress.stage = "the race fuzzer's launches"
            ref.fuzz_launches(fuzz, fuzz_budget or FuzzBudget(launches=max(relaunches, 1)),
                              time.perf_counter() - began)
        progress.stage = "done"
        return ref.spread
    finally:
        if shared is not None:
            shared.close()
