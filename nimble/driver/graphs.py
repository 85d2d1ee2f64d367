"""Graphs another library captured and owns (torch's ``CUDAGraph``), read through the raw
integer handle it hands out.

Nimble never frees such a graph: the library that made it does.  These functions only read it,
so the rest of Nimble never builds a ``CUgraph`` from an integer itself.
"""
from __future__ import annotations

from typing import Any

from .calls import bindings
from .edges import programmatic_pairs
from .nodes import graph_nodes, node_count


def borrowed_graph(raw_handle: int) -> Any:
    """A ``CUgraph`` for a graph another library owns, from its raw integer handle."""
    return bindings().CUgraph(int(raw_handle))


def graph_nodes_of(raw_handle: int) -> list:
    """Every node of the graph whose raw handle is ``raw_handle``, in the driver's order
    (creation order for a captured graph)."""
    return graph_nodes(borrowed_graph(raw_handle))


def node_count_of(raw_handle: int) -> int:
    """How many nodes the graph whose raw handle is ``raw_handle`` holds."""
    return node_count(borrowed_graph(raw_handle))


def programmatic_edges_of(raw_handle: int, nodes: list) -> list[tuple[int, int]]:
    """``(u, v)`` indices into ``nodes`` (the graph's, as :func:`graph_nodes_of` lists them) of
    the graph's programmatic edges (:func:`~nimble.driver.edges.programmatic_pairs`)."""
    return programmatic_pairs(borrowed_graph(raw_handle), nodes)
