"""A graph's dependency edges with their data: which are programmatic (issue 53).

A kernel launched with programmatic stream serialization (``launch_pdl`` in Triton, which
Inductor asks for under ``torch._inductor.config.triton.enable_pdl``) is captured behind a
*programmatic* edge: it may start before its predecessor ends, and waits for it only where its
code runs ``griddepcontrol.wait``.  :func:`programmatic_pairs` reads those edges out of a
captured graph; :func:`add_programmatic_dependencies` puts such edges into a graph Nimble builds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .calls import bindings, call


def _is_programmatic(data) -> bool:
    return int(data.type) == int(
        bindings().CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)


@dataclass(frozen=True)
class GraphEdge:
    """One dependency edge of a graph: its ends as indices into the node list it was read
    against (None: a node not in that list), and whether it is programmatic."""

    source: int | None
    target: int | None
    programmatic: bool


def graph_edges(graph, nodes: Sequence) -> list[GraphEdge]:
    """Every edge of ``graph`` (``cuGraphGetEdges``), its ends located in ``nodes``."""
    count = int(call("cuGraphGetEdges", graph, 0)[3])
    if not count:
        return []
    sources, targets, data, count = call("cuGraphGetEdges", graph, count)
    index = {int(node): i for i, node in enumerate(nodes) if node is not None}
    return [GraphEdge(index.get(int(u)), index.get(int(v)), _is_programmatic(d))
            for u, v, d in zip(list(sources)[:count], list(targets)[:count], list(data)[:count])]


def programmatic_pairs(graph, nodes: Sequence) -> list[tuple[int, int]]:
    """``(u, v)`` indices into ``nodes`` (every node of ``graph``, as
    :func:`~nimble.driver.nodes.graph_nodes` lists them) of each programmatic edge ``u -> v``
    of ``graph``."""
    return [(e.source, e.target) for e in graph_edges(graph, nodes) if e.programmatic]


def add_programmatic_dependencies(graph, pairs: Sequence[tuple[Any, Any]]) -> None:
    """Add a programmatic edge ``u -> v`` for each kernel node pair of ``pairs``: ``v`` may start
    once every block of ``u`` has triggered its dependents or ended (``u``'s programmatic port),
    and sees ``u``'s writes after its own ``griddepcontrol.wait``.  No call for no pairs."""
    pairs = list(pairs)
    if not pairs:
        return
    drv = bindings()
    data = []
    for _ in pairs:
        edge = drv.CUgraphEdgeData()
        edge.type = drv.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
        edge.from_port = drv.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
        data.append(edge)
    call("cuGraphAddDependencies", graph, [u for u, _ in pairs], [v for _, v in pairs], data,
         len(pairs))
