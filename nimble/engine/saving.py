"""``Nimble.save(path)``: everything ``prepare()`` decided, written down as one file.

Per shape bucket the file holds the recorded TaskGraph (its kernels' parameter blocks and every
pointer's buffer: the relocation list), the schedule, the arena plan, the priorities and late
edges the served graph runs with, one stored node per task (a kernel's binary and launch
attributes, a memset's or memcpy's fields), where each buffer outside the arena comes from (a
weight by name, a snapshot of external memory, the bytes of a private copy of library memory),
and two reference input sets with the outputs the served graph gave for them.  Across buckets:
the kernel binaries (:mod:`nimble.engine.kernel_binaries`), the weights, the external memory.
The container is :mod:`nimble.ir.saved_format`; the manifest's fields are in
``docs/saved-format.md``; :mod:`nimble.engine.loading` reads it back.

A training step is saved with its autograd layout (which flat inputs and outputs are the
forward's, which are gradients, and the parameters by name); its reference outputs include the
gradients, which a load holds to the proof's gradient tolerance.  What the graphs write of the
model's weights (batch norm's running statistics) is put back after the reference runs.

What cannot be written down raises :class:`~nimble.errors.SaveError` before any file is
written: a graph with NCCL collectives (a communicator is a live connection to other
processes; Nimble's peer sums, reached through a table that is the model's, are written down:
each rank saves its graph and loads it with its model, :func:`collectives_through_the_model`), a graph that draws random numbers, a kernel whose binary is on no disk, a node that
names memory of this process (a host-memory copy, an access-policy window).
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import time
from pathlib import Path
from typing import Any

from .. import driver
from .._version import __version__
from ..analysis.deps import communicates
from ..errors import CudaError, SaveError
from ..ir.kernel_names import NIMBLE_COLLECTIVES, collective_kernel, short_kernel_name
from ..ir.saved_format import C_PLAN, ZEROED_WORKSPACES_VERSION, BlobWriter, SavedFile
from ..ir.saved_manifest import FORMAT_NAME
from ..ir.taskgraph import BufferKind, TaskGraph, TaskKind
from ..progress import logger as log
from ..progress import say
from ..record import binaries as found
from .arena_layout import (shared_state_buffers, written_externals, written_weights,
                           zeroed_copies)
from .build import relocated
from .c_plan import c_plan
from .kernel_binaries import BinaryTable, KernelFinder, LiveKernel
from .launcher import run_phases
from .prepared import Prepared
from .proving import gradient_outputs

#: Seed of the reference inputs a saved graph is checked against at load.
REFERENCE_SEED = 0x5A7ED


def collectives_through_the_model(graph: TaskGraph) -> bool:
    """Whether ``graph`` has collectives, all of them Nimble's peer sums
    (:mod:`nimble.peer_sum`) whose only memory outside the arena is the model's (the table of
    the ranks' buffers, a buffer of the model): a load with ``model=`` binds the table the
    model made in that process, where NCCL's communicator or torch's shared buffers would be
    this process's."""
    collectives = [t for t in graph.tasks
                   if t.kind == TaskKind.KERNEL and collective_kernel(t.name)]
    return bool(collectives) and all(
        short_kernel_name(t.name, limit=len(t.name)) in NIMBLE_COLLECTIVES
        and all(graph.buffers[a.buffer].kind != BufferKind.EXTERNAL for a in t.accesses)
        for t in collectives)


def check_savable(prepared: Prepared) -> None:
    """Raise :class:`SaveError` for a graph this version cannot write down."""
    graph = prepared.graph
    if communicates(graph) and not collectives_through_the_model(graph):
        raise SaveError("this graph holds collectives (NCCL's, or torch's over symmetric "
                        "memory), whose communicator or shared buffers are a live connection "
                        "between this process and its peers: prepare it in each process "
                        "instead of loading it, or sum with nimble.peer_sum.PeerSum, whose "
                        "graphs each rank saves and loads with its model")
    if graph.meta.get("rng"):
        raise SaveError("this graph draws random numbers (dropout or sampling in the "
                        "forward), which saving does not support yet: prepare it in the "
                        "serving process, or put the model in eval() mode")


def _task_nodes(prepared: Prepared) -> list:
    nodes: list = [None] * len(prepared.graph.tasks)
    for built in prepared.builts:
        for t, node in zip(built.span, built.nodes):
            nodes[t] = node
    return nodes


def _unrelocated(task, fields: dict, bases, names: dict[str, str]) -> dict:
    """A memset's or memcpy's fields with each endpoint moved back to where it was recorded
    (the loader moves them again, as a build from the recording does)."""
    fields = dict(fields)
    for p in task.pointers:
        name = names.get(p.location) if isinstance(p.location, str) else None
        if name is not None:
            fields[name] = fields[name] - relocated(p, bases) + p.value
    return fields


def _warn_if_unloaded(task, function) -> None:
    """A warning where a kernel the prepare took the facts of was unloaded since: the file is
    written from them, but this process's calls of the graph may launch code no longer
    loaded."""
    try:
        driver.function_fingerprint(function)
    except CudaError as e:
        if e.name != "CUDA_ERROR_INVALID_HANDLE":
            raise
        log.warning("kernel %s of this graph was unloaded after its prepare (%s): the file is "
                    "written from what the prepare took of it (its binary found by its hash), "
                    "but this process's calls of the graph may launch code no longer loaded: "
                    "prepare again before calling it here", task.name, e)


class _Kernels:
    """The distinct kernels of every bucket, in first-seen order."""

    def __init__(self, triton_loaded: dict[int, found.TritonLoaded] | None = None,
                 facts: dict[int, LiveKernel] | None = None) -> None:
        self.kernels: list[LiveKernel] = []
        self._index: dict[Any, int] = {}
        self._by_function: dict[int, int] = {}
        #: ``{function handle: what Triton kept of its loading}`` (read on first use).
        self._triton = triton_loaded
        #: ``{function handle: LiveKernel}`` taken at the prepare
        #: (:func:`nimble.engine.kernel_owners.kernel_facts`): read instead of the driver.
        self._facts = facts or {}

    def index(self, task, function) -> int:
        handle = int(function)
        if handle in self._by_function:
            return self._by_function[handle]
        if handle in self._facts:
            _warn_if_unloaded(task, function)
            return self._add(handle, self._facts[handle])
        if self._triton is None:
            self._triton = found.triton_loaded()
        loaded = self._triton.get(handle)
        threads = task.block[0] * task.block[1] * task.block[2]
        try:
            kernel = LiveKernel.of(task.name, function, threads, task.shared_mem,
                                   loaded.hash if loaded else None,
                                   loaded.image if loaded else None)
        except CudaError as e:
            if e.name != "CUDA_ERROR_INVALID_HANDLE":
                raise
            raise SaveError(
                f"kernel {task.name} of this graph is no longer loaded in this process ({e}): "
                "the object that loaded it (Triton's or Inductor's) unloaded its module after "
                "the graph was prepared, so the graph cannot be written down, and its calls may "
                "launch code no longer loaded: prepare again and save") from None
        return self._add(handle, kernel)

    def _add(self, handle: int, kernel: LiveKernel) -> int:
        k = self._index.setdefault(kernel.key(), len(self.kernels))
        if k == len(self.kernels):
            self.kernels.append(kernel)
        self._by_function[handle] = k
        return k


def _function_of(params):
    """The ``CUfunction`` a built kernel node runs: a node made from a library's ``CUkernel``
    carries the kernel handle, and its ``func`` field is not a function of this context."""
    kern = getattr(params, "kern", None)
    if kern is not None and int(kern):
        return driver.kernel_function_of(kern)
    return params.func


def _owners_state(prepared: Prepared, handle: int) -> str:
    """What the objects a graph keeps for its Triton kernels say of an unloaded ``handle``:
    whether one still holds it (another object, holding the same module, unloaded it) or none
    does any more (an owner was closed: its ``close()`` unloads the module, kept or not)."""
    held = [o for o in prepared.kernel_owners
            if (getattr(o, "__dict__", None) or {}).get("function") == handle]
    closed = [o for o in prepared.kernel_owners
              if (getattr(o, "__dict__", None) or {}).get("function") is None]
    if held:
        return (f"the graph keeps {len(held)} object(s) still holding it "
                f"({', '.join(sorted({type(o).__name__ for o in held}))}): another object "
                "holding its module unloaded it")
    return (f"no object the graph keeps holds it any more; {len(closed)} of the "
            f"{len(prepared.kernel_owners)} it keeps were closed "
            f"({', '.join(sorted({type(o).__name__ for o in closed})) or 'none'})")


def _node_rows(prepared: Prepared, kernels: _Kernels) -> list[dict]:
    """One stored node per task (see the module docstring)."""
    rows = []
    for task, node in zip(prepared.graph.tasks, _task_nodes(prepared)):
        where = f"task {task.id} ({task.short_name or task.kind})"
        if task.kind == TaskKind.KERNEL:
            function = _function_of(driver.kernel_node_params(node))
            try:
                attributes = driver.kernel_node_attributes(node)
            except driver.ProcessBoundNode as e:
                raise SaveError(f"{where} cannot be written down: {e}") from None
            try:
                kernel = kernels.index(task, function)
            except SaveError as e:
                raise SaveError(f"{e} ({_owners_state(prepared, int(function))})") from None
            rows.append({"kernel": kernel,
                         "attributes": {str(k): v.hex() for k, v in attributes.items()}})
        elif task.kind == TaskKind.MEMSET:
            rows.append({"memset": _unrelocated(task, driver.memset_fields(node),
                                                prepared.bases, {"dst": "dst"})})
        elif task.kind == TaskKind.MEMCPY:
            try:
                fields = driver.memcpy_fields(node)
            except ValueError as e:
                raise SaveError(f"{where} cannot be written down: {e}") from None
            rows.append({"memcpy": _unrelocated(task, fields, prepared.bases,
                                                {"src": "srcDevice", "dst": "dstDevice"})})
        elif task.kind == "other:CU_GRAPH_NODE_TYPE_EMPTY":
            rows.append({"empty": True})
        else:
            raise SaveError(f"{where} is a {task.kind} node, which a saved graph cannot hold")
    return rows


def _tensor_bytes(t) -> bytes:
    import torch

    return t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()


class _Outside:
    """The memory outside the arenas that the saved graphs point into: weight storages (by
    their tensors' names) and snapshots of external memory (merged address ranges)."""

    def __init__(self, blobs: BlobWriter, with_weights: bool) -> None:
        self.blobs, self.with_weights = blobs, with_weights
        self.storages: list[dict] = []
        self._storage_at: dict[int, int] = {}
        self.ranges: list[list[int]] = []  # [start, end) of external memory, merged at the end

    def weight(self, prepared: Prepared, bid: int) -> dict | None:
        base = prepared.bases[bid]
        size = prepared.graph.buffers[bid].size
        names = [{"name": b.name, "offset": b.address - base, "shape": list(b.shape),
                  "strides": list(b.strides), "dtype": str(b.dtype).removeprefix("torch.")}
                 for b in prepared.weights.bindings if b.buffer == bid]
        if not names:
            return None
        if base not in self._storage_at:
            self._storage_at[base] = len(self.storages)
            blob = self.blobs.add(driver.copy_to_host(base, size)).as_json() \
                if self.with_weights else None
            self.storages.append({"size": size, "names": names, "blob": blob})
        return {"weight": self._storage_at[base]}

    def external(self, prepared: Prepared, bid: int) -> dict:
        start = prepared.bases[bid]
        self.ranges.append([start, start + prepared.graph.buffers[bid].size])
        return {"memory_at": start}

    def memory_rows(self) -> tuple[list[dict], dict[int, tuple[int, int]]]:
        """The merged ranges with their bytes, and per range start recorded, ``(row,
        offset)``."""
        merged: list[list[int]] = []
        for start, end in sorted(self.ranges):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        rows = [{"size": end - start,
                 "blob": self.blobs.add(driver.copy_to_host(start, end - start)).as_json()}
                for start, end in merged]
        where = {}
        for start, _ in self.ranges:
            for i, (lo, hi) in enumerate(merged):
                if lo <= start < hi:
                    where[start] = (i, start - lo)
        return rows, where


def _placement(prepared: Prepared, outside: _Outside) -> tuple[dict, dict]:
    """Per buffer outside the arena the graph points into, where it comes from; and per
    private copy, its bytes as the graph holds them now."""
    graph = prepared.graph
    private = set(written_externals(graph))
    planned = set(prepared.memplan.offsets) | set(prepared.low_bits)
    pointed = sorted({p.buffer for t in graph.tasks for p in t.pointers if p.buffer >= 0})
    sources: dict[str, dict] = {}
    for bid in pointed:
        b = graph.buffers[bid]
        if bid in planned or bid in private or b.kind == BufferKind.RNG:
            continue
        got = outside.weight(prepared, bid) if b.kind == BufferKind.PARAM else None
        sources[str(bid)] = got if got is not None else outside.external(prepared, bid)
    # a workspace's copy starts zeroed wherever it is built (its bytes carry nothing from one
    # call to the next), so the file holds none of its bytes: null
    zeroed = zeroed_copies(graph)
    private_rows = {str(bid): None if bid in zeroed else outside.blobs.add(
        driver.copy_to_host(prepared.bases[bid], graph.buffers[bid].size)).as_json()
        for bid in sorted(private)}
    return sources, private_rows


def restored_ranges(prepared: Prepared) -> list[tuple[int, int]]:
    """``(address, size)`` where ``prepared`` runs them of the memory a checking run must put
    back: the shared state (:func:`~nimble.engine.arena_layout.shared_state_buffers`) and the
    weights it may write (:func:`~nimble.engine.arena_layout.written_weights`)."""
    graph = prepared.graph
    buffers = shared_state_buffers(graph) + written_weights(graph, prepared.step is not None)
    return [(prepared.bases[b], graph.buffers[b].size) for b in buffers]


def _references(prepared: Prepared, blobs: BlobWriter) -> dict:
    """Two random input sets and the outputs the served graph gives for them (the check a load
    repeats), with the spread of any output the graph itself does not reproduce; the memory the
    graph writes outside the arena (a static cache, batch norm's running statistics) starts
    every run as it was and is left so."""
    import torch

    from .proof import Reference, SharedState

    slots = [s for launcher in prepared.launchers for s in launcher.slots]
    run = run_phases(prepared.launchers)
    state = restored_ranges(prepared)
    shared = SharedState(state) if state else None

    def reference(inputs: list) -> list:
        if shared is not None:
            shared.restore()
        return [o.clone() for o in run(inputs)]
    try:
        ref = Reference.record(prepared.graph, reference, [s.tensor for s in slots],
                               seed=REFERENCE_SEED, repeats=2)
        torch.cuda.synchronize()
    finally:
        if shared is not None:
            shared.close()
    return {"inputs": [[blobs.add(_tensor_bytes(t)).as_json() for t in inputs]
                       for inputs in ref.input_sets],
            "outputs": [[blobs.add(_tensor_bytes(t)).as_json() for t in outputs]
                        for outputs in ref.expected],
            "spread": {str(i): d for i, d in ref.spread.items()},
            "gradients": gradient_outputs(prepared)}


def _step_row(prepared: Prepared) -> dict | None:
    """A training step's autograd layout, its parameters by name (None for inference)."""
    step = prepared.step
    if step is None:
        return None
    layout = step.layout
    return {"forward_inputs": layout.forward_inputs, "forward_outputs": layout.forward_outputs,
            "differentiable": list(layout.differentiable),
            "inputs_with_grad": list(layout.inputs_with_grad),
            "grad_output_of": list(layout.grad_output_of), "param_names": step.param_names}


def _graph_blob(graph: TaskGraph, blobs: BlobWriter) -> list[int]:
    text = json.dumps(graph.to_json(), separators=(",", ":")).encode()
    return blobs.add(gzip.compress(text, compresslevel=6)).as_json()


def _bucket_row(prepared: Prepared, kernels: _Kernels, outside: _Outside,
                blobs: BlobWriter) -> dict:
    from torch.utils._pytree import treespec_dumps

    check_savable(prepared)
    sources, private = _placement(prepared, outside)
    spec = prepared.launcher.output_spec
    return {
        "graph": _graph_blob(prepared.graph, blobs),
        "schedule": dataclasses.asdict(prepared.schedule),
        "memplan": {**dataclasses.asdict(prepared.memplan),
                    "offsets": {str(k): v for k, v in prepared.memplan.offsets.items()}},
        "priorities": prepared.priorities,
        "backfill": [{"phase": p.phase, "plain_ms": p.plain_ms, "trial_ms": list(p.trial_ms),
                      "kept": p.kept._asdict() if p.kept is not None else None}
                     for p in prepared.backfill],
        "device_launch": [b.device_launch for b in prepared.builts],
        "programmatic": sorted([u, v] for u, v in prepared.programmatic),
        "gather_inputs": any(s.cell for s in prepared.launcher.slots),
        "output_spec": treespec_dumps(spec) if spec is not None else None,
        "nodes": _node_rows(prepared, kernels),
        "outside": sources,
        "private": private,
        "reference": _references(prepared, blobs),
        "step": _step_row(prepared),
        "prepare_seconds": dict(prepared.seconds),
    }


def save_serving(serving, path, *, weights: bool = True, quiet: bool = True) -> Path:
    """Write every bucket of ``serving`` (a :class:`~nimble.engine.serving.Serving`) to
    ``path`` (see the module docstring); ``weights=False`` leaves the named weights out, for a
    load that passes the model.  Returns the path."""
    return save_graphs([("model", serving)], path, weights=weights, quiet=quiet)


def save_graphs(graphs: list, path, *, weights: bool = True, quiet: bool = True,
                extra: dict | None = None) -> Path:
    """Write several servings (``(name, Serving)`` pairs: a Generator's prefill and decode
    steps) to one file, sharing its kernels, weights and external memory (a static cache both
    steps write is one memory range).  Their buckets follow one another in ``buckets``, and
    ``graphs`` says which are whose (absent for one serving, whose file is the plain one);
    ``extra`` goes into the manifest as it is.  The C runtime runs single servings only."""
    import torch

    began = time.perf_counter()
    servings = [serving for _, serving in graphs]
    preparations = [b.instances[0] for serving in servings for b in serving.buckets]
    for prepared in preparations:
        check_savable(prepared)
    if any(any(phase) for p in preparations for phase in p.prefetch):
        log.warning("the weight prefetches (prefetch_l2) this graph serves are not written "
                    "down: the loaded graph runs without them")
    device = torch.cuda.current_device()
    torch.cuda.synchronize()
    blobs = BlobWriter()
    facts: dict = {}
    for prepared in preparations:
        facts.update(prepared.kernel_facts)
    kernels, outside = _Kernels(facts=facts), _Outside(blobs, weights)
    say(f"writing down {len(preparations)} bucket(s)", quiet)
    buckets = [_bucket_row(p, kernels, outside, blobs) for p in preparations]
    memory, where = outside.memory_rows()
    for row in buckets:
        for source in row["outside"].values():
            if "memory_at" in source:
                i, offset = where[source.pop("memory_at")]
                source.update(memory=i, offset=offset)
    arch = driver.device_architecture(device)
    table = BinaryTable(blobs, arch)
    say(f"finding the binaries of {len(kernels.kernels)} kernels", quiet)
    found = KernelFinder(arch, table, quiet).locate(kernels.kernels)
    manifest = {
        "format": FORMAT_NAME, "nimble": __version__, "torch": torch.__version__,
        "arch": arch, "device": torch.cuda.get_device_name(device),
        "driver": driver.driver_version(), "pad": servings[0].pad,
        "instances": servings[0].instances, "weights_included": weights,
        "binaries": table.rows,
        "kernels": [{"name": k.name, "binary": b, "fingerprint": k.fingerprint,
                     "layout": k.layout, "attributes": k.attributes}
                    for k, b in zip(kernels.kernels, found)],
        "weights": outside.storages, "memory": memory, "buckets": buckets, **(extra or {}),
    }
    summing = any(communicates(p.graph) for p in preparations)
    if summing:
        manifest["peer_sums"] = _ranks_here()
    if len(graphs) > 1:
        manifest["graphs"] = _graph_rows(graphs)
    why = ("it sums over the ranks through the model's peer sums (nimble.peer_sum): load it "
           "from Python on the rank that saved it, with model=") if summing else \
        "several graphs in one file (a Generator): load it from Python" if len(graphs) > 1 \
        else ""
    if why:
        plan, _ = c_plan(manifest, [], [], 0, unsupported=why)
    else:
        plan, why = c_plan(manifest, preparations, servings[0].layout.states,
                           servings[0].layout.size)
    manifest["c_runtime"] = why or "supported"
    version = ZEROED_WORKSPACES_VERSION if any(
        ref is None for row in buckets for ref in row["private"].values()) else 1
    out = SavedFile(manifest, blobs.getvalue(), version=version, extra={C_PLAN: plan}).write(path)
    say(f"saved {os.path.getsize(out) / 2**20:.1f} MiB to {out} in "
        f"{time.perf_counter() - began:.1f} s", quiet)
    return Path(out)


def _ranks_here() -> dict:
    """This process's rank and the ranks' count (the default group's), for a graph that sums
    over them: a load on another rank would meet its peers with the wrong part."""
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "ranks": dist.get_world_size()}


def _graph_rows(graphs: list) -> list[dict]:
    """Per serving, its name, its buckets' indices in the manifest, its instances and pad."""
    rows, first = [], 0
    for name, serving in graphs:
        count = len(serving.buckets)
        rows.append({"name": name, "buckets": list(range(first, first + count)),
                     "instances": serving.instances, "pad": serving.pad})
        first += count
    return rows
