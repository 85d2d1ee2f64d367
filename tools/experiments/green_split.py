"""SM partitioning by green contexts: the tasks off the critical path confined to K SMs.

    python3 tools/experiments/green_split.py MODEL [DTYPE] [--all-green] [--aten-only]

A graph kernel node given a ``CUkernel`` (``kern``, with ``func`` cleared) and a green context's
``CUcontext`` (``ctx``) runs its blocks only on that green context's SMs, inside a graph
launched on a primary-context stream; with ``func`` set, ``ctx`` is ignored.  Every kernel node
torch records carries both handles, so any task can be confined.

From one recording of MODEL (batch 1, DTYPE default float32), the served graph is timed against
variants whose tasks with slack above a fraction of the critical path (0.001: about the path
alone on every SM; 0.03) run in a green context of 116, 100 or 66 SMs (the driver rounds up to
a multiple of 8), the rest on all SMs.  ``--all-green`` instead puts every kernel in a green
context of 132 or 128 SMs (the cost of the green context itself); ``--aten-only`` confines only
ATen's own kernels (``at::``).  Each variant is proven (8 poisoned launches, bitwise), then all
are timed in 7 interleaved rounds of 50 calls.

This is an experiment, not a Nimble feature: it patches two functions of
``nimble.driver.nodes`` while the variants are built (the node's handles and context, and its
launch attributes copied one by one, since the driver refuses to copy them between nodes of
two contexts) and talks to ``cuda.bindings`` itself for the green contexts.
"""
from __future__ import annotations

import re
import sys

import torch
from cuda.bindings import driver as cu

import nimble
import nimble.driver.nodes as nodes
from nimble.analysis.deps import build_dag, task_durations, transitive_reduction
from nimble.analysis.priorities import slack
from nimble.cli import models
from nimble.cli.harness import time_rounds, to_dtype
from nimble.driver.gpu import use_cudnn_benchmark

PROOF = {"relaunches": 8, "fuzz": False}
SPLITS = ((0.001, (116, 100, 66)), (0.03, (116, 100, 66)))
ALL_GREEN = ((-1.0, (132, 128)),)
LAUNCH_ATTRIBUTES = ("CLUSTER_DIMENSION", "CLUSTER_SCHEDULING_POLICY_PREFERENCE", "PRIORITY",
                     "MEM_SYNC_DOMAIN", "MEM_SYNC_DOMAIN_MAP", "PREFERRED_SHARED_MEMORY_CARVEOUT",
                     "PREFERRED_CLUSTER_DIMENSION", "COOPERATIVE",
                     "PROGRAMMATIC_STREAM_SERIALIZATION")


def checked(result, what: str):
    result = result if isinstance(result, tuple) else (result,)
    if result[0] != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed with {result[0]}")
    return result[1] if len(result) == 2 else (result[1:] if len(result) > 2 else None)


class GreenContexts:
    """Green contexts of the first device, one per SM count asked for."""

    def __init__(self):
        self.device = checked(cu.cuDeviceGet(0), "cuDeviceGet")
        self.primary = checked(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        self.sms = checked(cu.cuDeviceGetDevResource(
            self.device, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource")
        self.made: dict[int, tuple] = {}

    def context(self, sm_count: int) -> tuple:
        """``(CUcontext, SMs it got)`` of a green context of at least ``sm_count`` SMs."""
        if sm_count not in self.made:
            groups, _, _ = checked(cu.cuDevSmResourceSplitByCount(1, self.sms, 0, sm_count),
                                   "cuDevSmResourceSplitByCount")
            desc = checked(cu.cuDevResourceGenerateDesc([groups[0]], 1),
                           "cuDevResourceGenerateDesc")
            green = checked(cu.cuGreenCtxCreate(
                desc, self.device, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM),
                "cuGreenCtxCreate")
            ctx = checked(cu.cuCtxFromGreenCtx(green), "cuCtxFromGreenCtx")
            checked(cu.cuCtxSetCurrent(self.primary), "cuCtxSetCurrent")
            self.made[sm_count] = (green, ctx, groups[0].sm.smCount)
        _, ctx, got = self.made[sm_count]
        return ctx, got


class Confine:
    """While active, kernel nodes of the tasks in ``tasks`` are built into ``ctx``."""

    def __init__(self, device):
        self.device, self.ctx, self.tasks, self.moved = device, None, set(), set()
        self.add, self.copy = nodes.add_kernel_node, nodes.copy_kernel_attributes
        nodes.add_kernel_node, nodes.copy_kernel_attributes = self._add, self._copy

    def _add(self, graph, deps, params, detail=""):
        task = re.match(r"task (\d+) ", detail)
        kern = params.kern
        if (self.ctx is None or task is None or int(task.group(1)) not in self.tasks
                or kern is None or int(kern) == 0):
            return self.add(graph, deps, params, detail)
        shared = int(params.sharedMemBytes)
        if shared > 48 * 1024:
            checked(cu.cuKernelSetAttribute(
                cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared,
                kern, self.device), "cuKernelSetAttribute")
        params.func, params.ctx = None, self.ctx
        node = self.add(graph, deps, params, detail)
        self.moved.add(int(node))
        return node

    def _copy(self, node, model):
        if int(node) not in self.moved:
            return self.copy(node, model)
        ids = cu.CUkernelNodeAttrID
        for name in LAUNCH_ATTRIBUTES:  # a cluster kernel without its cluster shape traps
            attr = getattr(ids, "CU_LAUNCH_ATTRIBUTE_" + name)
            got = cu.cuGraphKernelNodeGetAttribute(model, attr)
            if got[0] == cu.CUresult.CUDA_SUCCESS:
                cu.cuGraphKernelNodeSetAttribute(node, attr, got[1])
        return None


def main(argv: list[str]) -> int:
    flags = {a for a in argv if a.startswith("--")}
    args = [a for a in argv if not a.startswith("--")]
    name, dtype = args[0], (args[1] if len(args) > 1 else "float32")
    use_cudnn_benchmark()
    model, x = to_dtype(models.create(name).cuda().eval(), models.example_input(name, 1), dtype)
    greens = GreenContexts()
    confine = Confine(greens.device)
    with torch.no_grad():
        served = nimble.Nimble(model).prepare(
            x, options=nimble.PrepareOptions(keep_recording=True, **PROOF))
        rec = served.recording
        graph = rec.graph
        dag = transitive_reduction(build_dag(graph))
        timing = slack(dag.n, dag.edges(), task_durations(graph))
        variants = {"served": served}
        for fraction, counts in (ALL_GREEN if "--all-green" in flags else SPLITS):
            off = {t for t in range(dag.n) if timing.slack[t] > fraction * timing.length}
            if "--aten-only" in flags:
                off = {t for t in off
                       if (graph.tasks[t].short_name or graph.tasks[t].name).startswith("at::")}
            for count in counts:
                ctx, got = greens.context(count)
                label = f"slack > {fraction} on {got} SMs"
                confine.ctx, confine.tasks = ctx, off
                variants[label] = nimble.Nimble(model).prepare(
                    x, options=nimble.PrepareOptions(recording=rec, **PROOF))
                confine.ctx = None
                print(f"{label}: {len(off)} tasks confined, {variants[label].launch_mode} "
                      "launch, proven", flush=True)
        samples = time_rounds({k: (lambda nm=nm: nm(x)) for k, nm in variants.items()}, 7, 50)
    for label, rounds in samples.items():
        rounds = sorted(rounds)
        print(f"{name} {dtype} {label:<28} {rounds[len(rounds) // 2]:.3f} ms "
              f"({rounds[0]:.3f}-{rounds[-1]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
