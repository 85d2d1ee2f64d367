"""One way to build a phase of a prepared graph: as it is served, or a copy with named changes.

Every build of a phase goes through :class:`PhaseBuilder`: the served graph at prepare, each
tail-backfill trial (:func:`nimble.analysis.backfill.pick`), the step-through's copies
(:mod:`nimble.debug.step_through`), the instrumented copies of the measured timeline
(:mod:`nimble.debug.timeline`) and the proof's fuzz copies (:mod:`nimble.engine.fuzz`).  How a
build differs from the served phase is a :class:`PhaseOptions`; the defaults build the phase as
served.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet as Set, Any, Sequence

from .build import BuiltGraph, DelaySpec, GraphSpec, InputGather, StampSpec, build_graph
from ..ir.taskgraph import TaskGraph


@dataclass(frozen=True)
class PhaseOptions:
    """How one build of a phase differs from the phase as served (the defaults: not at all)."""

    #: The kernel nodes carry the served priorities, and the exec honours them.
    priorities: bool = True
    #: The graph starts with the served input gathers (reading the input cells).
    gathers: bool = True
    #: Device-launchable where the served phase is.
    device_launch: bool = True
    #: The late edges (:mod:`nimble.analysis.backfill`); None: the served phase's.
    late_edges: Sequence[tuple[int, int]] | None = None
    #: Only these tasks of the phase (closed under predecessors); None: every task.
    only: Set[int] | None = None
    #: Timestamp nodes (:class:`~nimble.engine.build.StampSpec`); None: none.
    stamps: StampSpec | None = None
    #: Weight prefetches (:class:`nimble.analysis.prefetch.Prefetch`); None: the served
    #: phase's, ``()``: none.
    prefetch: Sequence | None = None
    # The options below build verification copies only (the proof's fuzz copies and the
    # power tool's broken ones): a served phase never has them.
    #: Delay nodes before tasks (:class:`~nimble.engine.build.DelaySpec`); None: none.
    delays: DelaySpec | None = None
    #: Edges of the schedule left out (the late edges are kept).
    removed_edges: Set[tuple[int, int]] = frozenset()
    #: Where every buffer lives instead of the served bases (two buffers forced to share
    #: bytes, say); None: the served bases.  Memset and memcpy endpoints move only in a build
    #: from the recorded nodes (a builder with ``nodes_relocated`` False).
    bases: Sequence[int] | None = None
    #: No edges between the phase's tasks, late ones neither, and no exec: the base of the
    #: proof's serial orders, whose clones add each order's chain
    #: (:func:`~nimble.engine.build.chained_copy`).
    edgeless: bool = False
    #: These edges programmatic instead of the served ones (:attr:`PhaseBuilder.programmatic`;
    #: empty: every edge a full dependency, a timed trial's: its own); None: the served.  None
    #: go into a build with stamps or other bases, nor into a task with a delay node.
    programmatic_edges: Set[tuple[int, int]] | None = None


AS_SERVED = PhaseOptions()


@dataclass
class PhaseBuilder:
    """What every phase of one prepared graph is built from, and the phases as served.

    ``nodes[k]`` holds, per task, the node phase ``k`` is built from: the recorded node at
    prepare, the served graph's own node for a copy (``nodes_relocated``).  ``device_launch[k]``
    says whether phase ``k`` is (asked to be) device-launchable, ``gathers[k]`` are its input
    gathers, ``late_edges`` the served graph's late edges (all phases).
    """

    graph: TaskGraph
    nodes: list[Sequence]
    bases: Sequence[int]
    edges: Sequence[tuple[int, int]]
    spans: list[range]
    gathers: list[list[InputGather]]
    priorities: Sequence[int] | None
    device_launch: list[bool]
    upload_stream: Any = None
    late_edges: Sequence[tuple[int, int]] = ()
    nodes_relocated: bool = False
    #: Per phase, the weight prefetches it serves (:mod:`nimble.engine.prefetch`); None: none.
    prefetch: list | None = None
    #: The edges of ``edges`` built as programmatic ones
    #: (:func:`nimble.analysis.programmatic.programmatic_edges`); empty: none.
    programmatic: Set[tuple[int, int]] = frozenset()

    def __post_init__(self) -> None:
        if self.prefetch is None:
            self.prefetch = [()] * len(self.spans)

    def spec(self, phase: int, options: PhaseOptions = AS_SERVED) -> GraphSpec:
        """The :class:`~nimble.engine.build.GraphSpec` of phase ``phase`` built with ``options``."""
        late = self.late_edges if options.late_edges is None else options.late_edges
        if options.edgeless:
            edges, late = [], []
        else:
            edges = self.edges if not options.removed_edges else \
                [e for e in self.edges if e not in options.removed_edges]
        return GraphSpec(
            edges=edges, span=self.spans[phase],
            device_launch=options.device_launch and self.device_launch[phase],
            upload_stream=self.upload_stream,
            gathers=tuple(self.gathers[phase]) if options.gathers else (),
            priorities=self.priorities if options.priorities else None,
            late_edges=late, only=options.only, nodes_relocated=self.nodes_relocated,
            stamps=options.stamps, delays=options.delays, instantiate=not options.edgeless,
            prefetch=(self.prefetch[phase] if options.prefetch is None
                      else options.prefetch) if not options.edgeless else (),
            programmatic=self._programmatic(options, edges))

    def _programmatic(self, options: PhaseOptions, edges) -> frozenset:
        """The programmatic edges of a build with ``options`` over ``edges``: the served ones
        still among them, in a build timed and laid out as served."""
        chosen = self.programmatic if options.programmatic_edges is None \
            else options.programmatic_edges
        if (not chosen or options.edgeless or options.stamps is not None
                or options.bases is not None):
            return frozenset()
        kept = set(edges)
        return frozenset(e for e in chosen if e in kept)

    def edges_of(self, phase: int, options: PhaseOptions = AS_SERVED) -> list[tuple[int, int]]:
        """The edges inside phase ``phase`` of a build with ``options``, its late ones
        included (:meth:`spec`'s)."""
        spec = self.spec(phase, options)
        return [(u, v) for u, v in list(spec.edges) + list(spec.late_edges)
                if u in spec.span and v in spec.span]

    def build(self, phase: int, options: PhaseOptions = AS_SERVED) -> BuiltGraph:
        """Phase ``phase`` built and instantiated with ``options``."""
        bases = self.bases if options.bases is None else options.bases
        return build_graph(self.graph, self.nodes[phase], bases, self.spec(phase, options))
