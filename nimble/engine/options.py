"""The engineering switches of ``Nimble.prepare``: how the graph is built and checked.

What a user of the model chooses (training or inference, streams, copies, progress) stays a
keyword of :meth:`nimble.Nimble.prepare`; the switches here are for measuring, debugging and
embedding, and their defaults are what a user wants.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PrepareOptions:
    """How ``prepare()`` builds and checks the graph (``nm.prepare(x, options=...)``).

    Attributes
    ----------
    arena_limit : int, "pool" or None
        Caps the arena, in bytes; ``"pool"`` is the memory torch's own graph of the model takes.
        Where full concurrency would need more, streams are merged until the plan fits (never
        below one stream).  None lifts the cap.
    device_launch : bool
        Instantiates the graph for launch from the device as well, which makes each host
        launch a short constant-cost submission.  Where the driver refuses, the plain graph is
        used, with a ``RuntimeWarning`` saying why (``nm.launch_mode`` tells which).
    gather_inputs : bool
        The graph copies each (contiguous-slot) input in itself from an address the call
        writes into a cell (``nm.input_cells``), so a call costs one small stream write per
        input instead of a driver memcpy.
    verify : bool
        Runs the built graph ``relaunches`` times against the recording with its old buffers
        poisoned; it must match bit for bit (:class:`~nimble.errors.VerificationError`).
    relaunches : int or None
        Launches of the proof; None: 100 for inference, 20 for a training step.
    fuzz : bool
        After those launches, the proof runs a verification-only copy of each phase with a
        delay kernel before the tasks that touch bytes another stream's tasks touch, a new
        draw each launch (the writers of the schedule's synchronizations held back first), so
        that a missing synchronization shows (:mod:`nimble.engine.fuzz`); it takes at most
        about three times as long as the launches before it.  The served graph has no delay
        nodes.
    keep_recording : bool
        Keeps the live recording (``nm.recording``) for debugging and for a later prepare.
    recording : Recording or None
        A live :class:`~nimble.record.recorder.Recording` of this model (from
        :func:`nimble.record.recorder.record` or an earlier ``keep_recording=True``) to use
        instead of recording again.
    priorities : bool
        Gives every kernel of a multi-stream graph a scheduling priority from its slack on the
        critical path (:mod:`nimble.analysis.priorities`; each task is timed alone once for
        it), so that where kernels compete for the GPU, those the run waits for get the SMs
        first.  ``nm.kernel_priorities`` shows them.
    backfill : bool or None
        Lets a phase whose critical path ends in narrow kernels run work with slack beside
        them, if that measures faster at prepare (:mod:`nimble.analysis.backfill`).  None: on
        for a training step, off for inference.  ``nm.backfill_trials`` says what was measured,
        ``nm.late_edges`` what was kept.
    resource_order : bool or str
        Also builds each phase with resource-aware kernel priorities (memory-bound kernels and
        compute kernels with small footprints ahead of others of similar slack,
        :mod:`nimble.analysis.resources`) and keeps them where they measure faster at prepare.
        Needs ``priorities``.  ``nm.graph.meta["resource_order"]`` says what was measured and
        kept.  Off until measured on the GPU.  A rule's name
        (:data:`nimble.analysis.resources.RULES`) serves that rule's priorities unmeasured,
        for side-by-side timing (``tools/experiments/resource_ab.py``).
    prefetch_l2 : bool or str
        Also builds each phase with weight prefetches beside its kernels: nodes that ask the
        L2 for the weights of the kernels ahead while the current ones run
        (:mod:`nimble.analysis.prefetch`, ``kernels/prefetch_l2.ptx``), and keeps them where
        the phase measures faster at prepare.  True times both plans, ``"windows"`` (every
        weight, a window of the L2 ahead) and ``"gaps"`` (only the weights read after kernels
        that read none, fetched while those run), and keeps the fastest; a plan's name times
        that one alone; a graph of collectives, whose ranks must launch alike, times nothing
        and serves a plan asked for by name unmeasured.  A prefetch only reads weights: the
        outputs
        and the proof are unchanged.  ``nm.graph.meta["prefetch_l2"]`` says what was measured
        and kept.  Off until measured on the GPU; not written by ``save`` (a loaded graph
        runs without them).
    programmatic_launch : bool or "always"
        Builds the edges into Nimble's own kernels (its GEMVs and decode attention:
        :mod:`nimble.kernel_waits`) as programmatic ones, so that each launches while its
        predecessor ends and asks for its first weight tile before its wait for the
        predecessor's end (:func:`nimble.analysis.programmatic.waiting_edges`), and keeps them
        where the phase measures faster at prepare (``"always"``: served unmeasured).
        ``nm.graph.meta["programmatic"]`` says what was measured and kept.  The edges between
        Inductor's kernels that an earlier rule kept, trusting Inductor's own waits, are
        withdrawn: graphs built so gave wrong outputs on a busy GPU
        (:data:`nimble.analysis.programmatic.WITHDRAWN`, docs/findings.md).  On by default:
        a graph with none of Nimble's kernels has no such edge and times nothing; a saved
        graph is loaded with the file's edges into those kernels built so
        (:data:`nimble.engine.loading.LOAD_WAITING_EDGES`).
    """

    arena_limit: int | str | None = "pool"
    device_launch: bool = True
    gather_inputs: bool = True
    verify: bool = True
    relaunches: int | None = None
    fuzz: bool = True
    keep_recording: bool = False
    recording: Any = None
    priorities: bool = True
    backfill: bool | None = None
    resource_order: bool | str = False
    prefetch_l2: bool | str = False
    programmatic_launch: bool | str = True

    def __post_init__(self) -> None:
        from ..analysis.resources import RULES
        from ..errors import InputError

        if self.programmatic_launch not in (False, True, "always"):
            raise InputError(f"PrepareOptions(programmatic_launch={self.programmatic_launch!r}): "
                             "True (kept where measured faster), 'always' (served unmeasured) "
                             "or False")

        from ..analysis.prefetch import PLANS

        if self.prefetch_l2 not in (False, True, *PLANS):
            raise InputError(f"PrepareOptions(prefetch_l2={self.prefetch_l2!r}): True (every "
                             f"plan timed, the fastest kept), a plan ({', '.join(PLANS)}) or "
                             "False")

        order = self.resource_order
        if isinstance(order, str) and order not in RULES:
            raise InputError(f"PrepareOptions(resource_order={order!r}): a rule is one of "
                             f"{', '.join(RULES)} (or True to measure them all)")
        if order and not self.priorities:
            raise InputError(f"PrepareOptions(resource_order={order!r}) orders kernels by "
                             "their priorities: leave priorities=True")

    def proof_launches(self, training: bool) -> int:
        """How many launches the proof runs (``relaunches``, or its default for the kind)."""
        if self.relaunches is not None:
            return self.relaunches
        return 20 if training else 100

    def backfill_on(self, training: bool) -> bool:
        """Whether the tail backfill is tried (``backfill``, or its default for the kind)."""
        return training if self.backfill is None else self.backfill


def _switches() -> frozenset:
    return frozenset(f.name for f in dataclasses.fields(PrepareOptions))


def options_with(options: PrepareOptions | None, switches: dict) -> PrepareOptions:
    """``options`` (or the defaults) with the switches passed to prepare() as keywords, the
    form before :class:`PrepareOptions`; it stays for one release, with a DeprecationWarning."""
    options = options if options is not None else PrepareOptions()
    if not switches:
        return options
    unknown = sorted(set(switches) - _switches())
    if unknown:
        raise TypeError(f"prepare() got an unexpected keyword argument '{unknown[0]}'")
    given = ", ".join(f"{k}={v!r}" for k, v in switches.items())
    warnings.warn(f"prepare()'s keyword(s) {', '.join(switches)} are deprecated: pass "
                  f"options=nimble.PrepareOptions({given})", DeprecationWarning, stacklevel=3)
    return dataclasses.replace(options, **switches)
