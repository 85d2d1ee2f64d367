"""The Python objects that own a prepared graph's Triton kernels, kept as long as the graph is.

A graph's kernel nodes hold ``CUfunction`` handles only.  The modules of Triton's kernels
belong to Python objects (Triton's ``CompiledKernel``, Inductor's static launchers), and each
unloads its module when it is collected: a compiled model dropped after ``prepare()``, or
``torch._dynamo.reset()``, would leave the graph launching code no longer loaded, which
computes anything or faults.  So a graph recorded in this process keeps the owners of the
Triton kernels it launches (:func:`nimble.record.binaries.triton_owners`); kernels of
libraries belong to libraries the process never unloads, and a graph loaded from a file owns
its libraries already.

An owner kept is not always enough: Inductor's static launcher also unloads its module when
closed, which its autotuner does to the configurations it did not choose, whatever else holds
the object.  So the prepare also takes what a save needs of each Triton kernel while it is
loaded (:func:`kernel_facts`), and a save reads that rather than the driver.
"""
from __future__ import annotations

import sys
import time
from typing import Iterator, Sequence

from .. import driver
from ..errors import CudaError
from ..ir.taskgraph import TaskKind
from ..progress import logger as log
from ..record import binaries
from .kernel_binaries import LiveKernel
from .prepared import Prepared


def kernel_nodes(prepared: Prepared) -> Iterator[tuple]:
    """``(task, CUfunction handle)`` for every kernel node of ``prepared``'s built phases.  (A
    node made from a library's ``CUkernel`` may carry a ``func`` of no use in this context; no
    Triton object holds it, so it matches no owner.)"""
    for phase in range(len(prepared.builts)):
        for task, node in zip(prepared.graph.tasks, prepared.built_nodes(phase)):
            if node is not None and task.kind == TaskKind.KERNEL:
                function = driver.kernel_node_params(node).func
                if function is not None and int(function):
                    yield task, int(function)


def kernel_functions(prepared: Prepared) -> set[int]:
    """The ``CUfunction`` handles the kernel nodes of ``prepared``'s built phases run."""
    return {function for _, function in kernel_nodes(prepared)}


def kernel_facts(prepared: Prepared, loaded: dict) -> dict[int, LiveKernel]:
    """What a save needs of each Triton kernel of ``prepared`` (``loaded``: what Triton's
    objects say of each function, :func:`nimble.record.binaries.triton_loaded`), taken while
    the prepare holds it loaded: a save later reads these, not the driver, so a kernel whose
    module an owner closed since is still written down (from its cubin, found by its hash).
    A kernel already unloaded is left out, with a warning; one the driver answers otherwise
    for is left to the save to ask again."""
    facts: dict[int, LiveKernel] = {}
    for task, function in kernel_nodes(prepared):
        if function in facts or function not in loaded:
            continue
        threads = task.block[0] * task.block[1] * task.block[2]
        try:
            facts[function] = LiveKernel.of(task.name, function, threads, task.shared_mem,
                                            loaded[function].hash, loaded[function].image)
        except CudaError as e:
            if e.name != "CUDA_ERROR_INVALID_HANDLE":
                # a driver without a query a save needs: the save asks again, and says why
                log.debug("no save facts for kernel %s: %s", task.name, e)
                continue
            log.warning("kernel %s of a graph being prepared is no longer loaded (%s): its "
                        "owner unloaded it during the prepare, and the graph's calls may launch "
                        "code no longer loaded", task.name, e)
    return facts


def keep_owners(graphs: Sequence[Prepared]) -> None:
    """Give each of ``graphs`` the objects owning the Triton kernels it launches, found in one
    scan of the process's objects for all of them (none where Triton was never imported: no
    Triton kernel can be loaded then), and what a save needs of those kernels
    (:func:`kernel_facts`)."""
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
    owners, loaded = binaries.triton_owners_and_loaded(set().union(*functions))
    for p, mine in zip(graphs, functions):
        p.kernel_owners = [o for f in sorted(mine) for o in owners.get(f, ())]
        p.kernel_facts = kernel_facts(p, loaded)
    log.debug("kept the owners of %d Triton kernel(s) in %.3f s", len(owners),
              time.perf_counter() - began)
