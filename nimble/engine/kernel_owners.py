"""The Python objects that own a prepared graph's Triton kernels, kept as long as the graph is.

A graph's kernel nodes hold ``CUfunction`` handles only.  The modules of Triton's kernels
belong to Python objects (Triton's ``CompiledKernel``, Inductor's static launchers), and each
unloads its module when it is collected: a compiled model dropped after ``prepare()``, or
``torch._dynamo.reset()``, would leave the graph launching code no longer loaded, which
computes anything or faults.  So a graph recorded in this process keeps the owners of the
Triton kernels it launches (:func:`nimble.record.binaries.triton_owners`); kernels of
libraries belong to libraries the process never unloads, and a graph loaded from a file owns
its libraries already.
"""
from __future__ import annotations

import sys
import time
from typing import Sequence

from .. import driver
from ..errors import CudaError
from ..ir.taskgraph import TaskKind
from ..progress import logger as log
from ..record import binaries
from .prepared import Prepared


def kernel_functions(prepared: Prepared) -> set[int]:
    """The ``CUfunction`` handles the kernel nodes of ``prepared``'s built phases run.  (A
    node made from a library's ``CUkernel`` may carry a ``func`` of no use in this context; no
    Triton object holds it, so it matches no owner.)"""
    functions: set[int] = set()
    for phase in range(len(prepared.builts)):
        for task, node in zip(prepared.graph.tasks, prepared.built_nodes(phase)):
            if node is not None and task.kind == TaskKind.KERNEL:
                function = driver.kernel_node_params(node).func
                if function is not None and int(function):
                    functions.add(int(function))
    return functions


def keep_owners(graphs: Sequence[Prepared]) -> None:
    """Give each of ``graphs`` the objects owning the Triton kernels it launches, found in one
    scan of the process's objects for all of them (none where Triton was never imported: no
    Triton kernel can be loaded then)."""
    if "triton" not in sys.modules:
        return
    began = time.perf_counter()
    try:
        functions = [kernel_functions(p) for p in graphs]
    except CudaError as e:
        log.warning("could not read the kernels of a prepared graph (%s): the objects owning "
                    "its Triton kernels are not kept, so keep the compiled model alive as "
                    "long as the graph", e)
        return
    owners = binaries.triton_owners(set().union(*functions))
    for p, mine in zip(graphs, functions):
        p.kernel_owners = [o for f in sorted(mine) for o in owners.get(f, ())]
    log.debug("kept the owners of %d Triton kernel(s) in %.3f s", len(owners),
              time.perf_counter() - began)
