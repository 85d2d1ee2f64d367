"""The programmatic edges of a capture (issue 53): which kernels were launched to start while
their predecessor ends (:mod:`nimble.driver.edges`), kept in ``graph.meta["programmatic_edges"]``
for :mod:`nimble.analysis.programmatic`."""
from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from typing import Iterator

from .. import driver
from ..errors import CudaError


def programmatic_edges(graphs) -> list[tuple[int, int]]:
    """The captured graphs' programmatic edges (kernels launched with programmatic stream
    serialization, :mod:`nimble.driver.edges`) as ``(u, v)`` task ids: node indices over the
    graphs' nodes in order, as the tasks are numbered (``graphs``: each captured graph's raw
    handle and its nodes, as the recorder listed them).  Read only where Inductor made its
    kernels so (``triton.enable_pdl``); where the driver will not say, none, with a warning
    (the graph is then built with full dependencies: slower, never wrong)."""
    config = sys.modules.get("torch._inductor.config")
    if config is None or not getattr(config.triton, "enable_pdl", False):
        return []
    edges, first = [], 0
    try:
        for raw, nodes in graphs:
            edges += [(first + u, first + v)
                      for u, v in driver.programmatic_edges_of(raw, nodes)]
            first += len(nodes)
    except CudaError as e:
        warnings.warn(f"the captured graph's edges could not be read ({e}): its kernels are "
                      "built behind full dependencies, none programmatic", RuntimeWarning,
                      stacklevel=5)
        return []
    return edges


@contextmanager
def launched_programmatically(enabled: bool) -> Iterator[None]:
    """While recording (where ``enabled``: ``PrepareOptions(programmatic_launch=True)``),
    Inductor's Triton kernels made to wait for their data in their own code and launched with
    programmatic stream serialization (``triton.enable_pdl``): a ``torch.compile``'d module
    compiles at its first call, inside the recording.  Kernels compiled before keep how they
    were compiled."""
    if not enabled:
        yield
        return
    import torch._inductor.config as inductor

    with inductor.patch({"triton.enable_pdl": True}):
        yield
