"""The proof of a prepared graph (:func:`prove`) and of a relocated copy of one
(:func:`prove_copy`): poisoned launches held bit for bit to the single-stream recording, then the
race fuzzer's launches (:mod:`nimble.engine.fuzz`); the comparison itself is
:mod:`nimble.engine.proof`'s.
"""
from __future__ import annotations

import time

from ..analysis.deps import communicates
from .arena_layout import shared_state
from .fuzz import FuzzCopies, FuzzStats
from .launcher import run_phases
from .prepared import Prepared
from .proof import FUZZ_TIME_FACTOR, ProofProgress


def gradient_outputs(prepared: Prepared) -> list[int]:
    """The outputs of a training step that are gradients (held to the proof's tolerance)."""
    if prepared.step is None:
        return []
    return list(range(prepared.step.layout.forward_outputs, len(prepared.graph.outputs)))


def low_word_ranges(prepared: Prepared) -> list[tuple[int, int]]:
    """``(address, size)`` of the arena's buffers placed outside it to keep their low 32 bits
    (poisoned with the arena; a private copy of a library's memory, kept so too, is not)."""
    graph = prepared.graph
    return [(prepared.bases[b], graph.buffers[b].size) for b in prepared.low_bits
            if graph.buffers[b].size and graph.buffers[b].relocatable]


def run_all(prepared: Prepared):
    """Run every phase in order on its share of the inputs (for the proof)."""
    return run_phases(prepared.launchers)


#: Fuzz launches the proof runs at most after the served ones (the targeted draws hold back
#: every writer of a synchronization of the zoo's branchy models both ways within about
#: that many: docs/findings.md); fewer when they take longer than their share of the proof's
#: time (:func:`prove`).
FUZZ_LAUNCHES = 200
#: Delay rows drawn (on the host) and uploaded before the first delayed launch; later ones are
#: drawn as they come.  Drawing many up front took longer than the few launches a budget often
#: leaves after the serial orders (32 rows of nasnetalarge: 0.08 s on a CI core).
FUZZ_ROWS = 8


def _fuzz_time_factor(graph) -> float:
    """The fuzz part's time budget: none for a graph that holds NCCL collectives, which runs
    exactly its launches, since a budget in seconds would end each rank's fuzz after a
    different launch and leave a peer's collective waiting."""
    return float("inf") if communicates(graph) else FUZZ_TIME_FACTOR


def prove(prepared: Prepared, rec, relaunches: int, fuzz: bool = True,
          fuzz_launches: int = FUZZ_LAUNCHES, seed: int = 0,
          progress: ProofProgress | None = None) -> None:
    """The proof: ``relaunches`` poisoned launches equal the recording bit for bit (a training
    step's gradients: within the tolerance :mod:`nimble.engine.proof` states); with ``fuzz``,
    then up to ``fuzz_launches`` launches of delay-noded copies of the phases
    (:mod:`nimble.engine.fuzz`), each after a fresh draw of delays, held to the same outputs.

    The fuzz launches stop (after a few) once building and running the copies has taken
    ``FUZZ_TIME_FACTOR`` times as long as the proof before them (:mod:`nimble.engine.proof`).
    The copies are freed before this returns or raises.  What ran goes to
    ``graph.meta["verified"]``, and the seconds of both parts to ``prepared.seconds``
    (``verify_served``, ``verify_fuzz``).

    A graph that draws random numbers is given the same generator state as the reference for
    each input set; the generator is restored afterwards.  ``progress`` is kept at the stage
    under way.
    """
    import torch

    from .proof import FuzzBudget, verify_against_reference

    rng = prepared.launcher.rng
    saved = rng.generator.get_state() if rng else None
    gradients = gradient_outputs(prepared)
    start = rng.generator.get_offset() if rng else 0

    def rng_at(k: int) -> None:
        rng.generator.set_offset(start + 4096 * k * max(rng.increment, 4))
    began = time.perf_counter()
    copies = None
    try:
        if fuzz:
            copies = _fuzz_copies(prepared, rec, seed)
        built = time.perf_counter()
        spread = verify_against_reference(
            prepared.graph, rec.replay_reference, run_all(prepared), rec.static_inputs,
            [(prepared.arena_base, prepared.memplan.arena_bytes)] + low_word_ranges(prepared),
            prepared.launcher.stream(),
            relaunches=relaunches, rng_at=rng_at if rng else None,
            state=shared_state(prepared.graph),
            repeats=4 if prepared.step is not None else 3, gradients=gradients, fuzz=copies,
            fuzz_budget=FuzzBudget(fuzz_launches, time_factor=_fuzz_time_factor(prepared.graph),
                                   spent_seconds=built - began,
                                   at_least=copies.required or 4 if copies else 4),
            progress=progress)
        torch.cuda.synchronize()
        ended = time.perf_counter()
        stats = copies.stats if copies else FuzzStats()
        fuzz_began = stats.first_draw_at or ended
        prepared.seconds["verify_served"] = fuzz_began - built
        prepared.seconds["verify_fuzz"] = (built - began) + (ended - fuzz_began)
        prepared.graph.meta["verified"] = {
            "launches": max(relaunches, 1), "outputs": len(prepared.graph.outputs),
            "not_bitwise": {str(i): d for i, d in sorted(spread.items())},
            "fuzz": fuzz, **stats.as_meta()}
    finally:
        if copies is not None:
            copies.close()
        if saved is not None:
            rng.generator.set_state(saved)


def _fuzz_copies(prepared: Prepared, rec, seed: int):
    """The delay-noded copies of every phase (:class:`nimble.engine.fuzz.FuzzCopies`)."""
    import torch

    device = rec.static_inputs[0].device if rec.static_inputs else torch.device("cuda")
    return FuzzCopies(prepared.phase_builder(), prepared.launchers, device, seed=seed,
                      stream_of=prepared.schedule.stream_of,
                      repoison=[(prepared.arena_base, prepared.memplan.arena_bytes)],
                      offsets=prepared.memplan.offsets, rows=FUZZ_ROWS)


def prove_copy(prepared: Prepared, rec, relaunches: int) -> dict:
    """The short proof of a relocated copy of a proven graph (another model instance, built
    from the same recording and plan over its own arena): ``relaunches`` poisoned launches
    bitwise against the recording, no fuzz.  Returns what ran (as ``meta["verified"]``), which
    stays the proof of the graph first built from the recording."""
    first = prepared.graph.meta.get("verified")
    try:
        prove(prepared, rec, relaunches, fuzz=False)
        return prepared.graph.meta["verified"]
    finally:
        if first is None:
            prepared.graph.meta.pop("verified", None)
        else:
            prepared.graph.meta["verified"] = first
