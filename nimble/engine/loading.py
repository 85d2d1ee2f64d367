"""``nimble.load(path, model=None)``: a saved graph rebuilt in this process, and proven.

Nothing is recorded and nothing scheduled: the file says what ``prepare()`` decided
(:mod:`nimble.engine.saving`).  Loading first reads and checks the file's structure on the
CPU: the container (format version, size, section table), every field of the manifest for its
type and range (:mod:`nimble.ir.saved_manifest`), each bucket's graph against its row
(:mod:`nimble.ir.saved_graph_check`), so that a file whose structure does not hold is a
:class:`~nimble.errors.LoadError` on any machine, GPU or not, before anything is allocated.
The whole file's checksum is hashed on threads of its own meanwhile and on through the GPU
work that follows: the GPU's architecture and driver are held against the file's, every
kernel is loaded from its binary and checked against its saved fingerprint
(:mod:`nimble.engine.kernel_loading`, on worker threads, each binary held to its own SHA-256
before the driver sees it) while the weights are put in place (the model's, by name, or the
file's) and the external memory copied, the private copies of library memory restored.  The
checksum must hold before any graph is built: a damaged file is its LoadError, whatever the
damage broke first, and nothing of it has run.  Then every bucket of every instance is built
through the same :func:`~nimble.engine.prepared.build_prepared` that prepare uses, from stored
nodes instead of recorded ones.

**The proof at load** is the served part of prepare's proof: the plan's region of every arena
is poisoned, and each graph is launched on the two saved input sets in turn and must give the
saved outputs bit for bit.  That proves what can differ between two processes: every pointer
relocated into this process's memory, every kernel's binary, the weights and library memory in
place.  The race fuzzer is not run again: it tests the schedule's dependencies, which are the
file's and were proven when the graph was prepared.

A failure at any step frees everything allocated so far and raises a
:class:`~nimble.errors.LoadError` (:class:`~nimble.errors.VerificationError` for outputs that
differ).
"""
from __future__ import annotations

import gc
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .. import driver
from ..analysis.backfill import Backfill, Picked
from ..analysis.memplan import MemPlan
from ..analysis.programmatic import waiting_edges
from ..analysis.schedule import Schedule
from ..errors import InputError, LoadError, NoGpuError
from ..ir.saved_format import PendingChecksum, SavedFile
from ..ir.saved_manifest import graph_rows
from ..ir.taskgraph import TaskGraph, TaskKind
from ..progress import logger as log, say
from .arena_layout import shared_layout
from .kernel_loading import LoadedKernels, load_kernels
from .loaded_memory import host_bytes, low_bits_rows, on_device, place_memory, place_weights
from .launcher import CallOrder, run_phases
from .prepared import ArenaRegion, Placement, Prepared, build_prepared
from .profiler_guard import device_launch_allowed
from .programmatic_pick import ProgrammaticPlan
from .saved_reading import read_checked, wait_for_checksum
from .saving import restored_ranges
from .serving import Bucket, BucketCost, PrepareReport, Serving, close_partial

#: Launches of each loaded graph checked against the saved outputs (the two input sets, twice).
LOAD_PROOF_LAUNCHES = 4


@dataclass
class _SavedRecording:
    """What :func:`build_prepared` takes of a recording, from a saved file."""

    graph: TaskGraph
    nodes: list
    static_inputs: list
    output_spec: Any
    step: Any = None


def _check_machine(manifest: dict, device: int) -> None:
    arch = driver.device_architecture(device)
    if manifest.get("arch") != arch:
        raise LoadError(
            f"the graph was saved on a GPU of compute capability {manifest.get('arch')} "
            f"({manifest.get('device')}); this GPU is {arch}: its kernels are built for "
            "another architecture: prepare and save the model on this kind of GPU")
    version = driver.driver_version()
    if version < int(manifest.get("driver", 0)):
        raise LoadError(
            f"the graph was saved under CUDA driver {manifest.get('driver')}; this machine's "
            f"driver is {version}, older: update the driver, or save the model here")


def _stored_nodes(graph: TaskGraph, rows: list, functions: list) -> list:
    if len(rows) != len(graph.tasks):
        raise LoadError(f"{len(rows)} stored nodes for {len(graph.tasks)} tasks: the file is "
                        "damaged")
    nodes = []
    for task, row in zip(graph.tasks, rows):
        if task.kind == TaskKind.KERNEL and "kernel" in row:
            k = int(row["kernel"])
            if not 0 <= k < len(functions):
                raise LoadError(f"task {task.id} names kernel {k}, which the file does not "
                                "have: the file is damaged")
            nodes.append(driver.StoredNode(
                "kernel", functions[k], task.grid, task.block, task.shared_mem,
                {int(a): bytes.fromhex(v) for a, v in row.get("attributes", {}).items()}))
        elif task.kind == TaskKind.MEMSET and "memset" in row:
            nodes.append(driver.StoredNode("memset", fields=row["memset"]))
        elif task.kind == TaskKind.MEMCPY and "memcpy" in row:
            nodes.append(driver.StoredNode("memcpy", fields=row["memcpy"]))
        elif task.kind == "other:CU_GRAPH_NODE_TYPE_EMPTY":
            nodes.append(None)
        else:
            raise LoadError(f"task {task.id} is a {task.kind} with a stored node of another "
                            "kind: the file is damaged")
    return nodes


@dataclass
class _Bucket:
    """One saved bucket, read: what every instance of it is built from."""

    rec: _SavedRecording
    schedule: Schedule
    memplan: MemPlan
    row: dict
    placement: Placement
    reference: tuple  # (input sets, expected outputs, spread, gradient outputs)


def _tensors(saved: SavedFile, refs: list, like: list, device=None) -> list:
    """The saved tensors ``refs`` shaped as ``like``: on ``device``, or with None on the host
    over the file itself (the reference outputs, which the proof at load compares there: a
    fresh process then loads none of torch's comparison kernels, whose first use costs tens of
    ms, and they take no device memory)."""
    import torch

    return [(host_bytes(saved.blob_view(ref)) if device is None
             else on_device(saved.blob_view(ref), device, 0))
            .view(getattr(torch, r.dtype)).reshape(r.shape) for ref, r in zip(refs, like)]


def _read_bucket(row: dict, k: int, saved: SavedFile, graph: TaskGraph, spec, functions: list,
                 weights: list[int], memory: list[int], device, model=None) -> _Bucket:
    """Bucket ``k`` (its row checked by :func:`_read`, its graph and output structure decoded
    there), with its reference tensors on ``device``."""
    schedule = Schedule(**row["schedule"])
    schedule.streams = [list(s) for s in schedule.streams]
    schedule.sync_edges = [tuple(e) for e in schedule.sync_edges]
    schedule.barrier_edges = [tuple(e) for e in schedule.barrier_edges]
    memplan = MemPlan(**{**row["memplan"], "offsets": {
        int(b): int(o) for b, o in row["memplan"]["offsets"].items()}})
    outside = {}
    for bid, source in row["outside"].items():
        if "weight" in source:
            outside[int(bid)] = weights[int(source["weight"])]
        else:
            outside[int(bid)] = memory[int(source["memory"])] + int(source["offset"])
    # a workspace's copy stored without bytes (null) starts zeroed
    private = {int(bid): saved.blob(ref) for bid, ref in row["private"].items()
               if ref is not None}
    refs = row["reference"]
    sets = [_tensors(saved, s, graph.inputs, device) for s in refs["inputs"]]
    expected = [_tensors(saved, s, graph.outputs) for s in refs["outputs"]]
    rec = _SavedRecording(graph, _stored_nodes(graph, row["nodes"], functions), sets[0], spec,
                          _step_layout(row.get("step"), model, k))
    return _Bucket(rec, schedule, memplan, row, Placement(outside, private),
                   (sets, expected, {int(i): float(d) for i, d in refs["spread"].items()},
                    [int(i) for i in refs.get("gradients", [])]))


def _step_layout(step: dict | None, model, k: int):
    """A training step's autograd layout over ``model``'s parameters (None for inference);
    LoadError where the model does not have the saved parameters."""
    if step is None:
        return None
    from ..record.recorder import StepLayout

    if model is None:
        raise LoadError(f"bucket {k} is a training step: its backward fills the model's "
                        "parameters' .grad, so pass the model, nimble.load(path, model=...)")
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    names = list(step["param_names"])
    if list(named) != names:
        missing = [n for n in names if n not in named] or [n for n in named if n not in names]
        raise LoadError(f"the model's trainable parameters differ from the saved step's "
                        f"(first difference: '{missing[0] if missing else names[0]}'): pass the "
                        "model the step was saved from")
    return StepLayout(int(step["forward_inputs"]), int(step["forward_outputs"]),
                      [int(i) for i in step["differentiable"]],
                      [int(i) for i in step["inputs_with_grad"]], [named[n] for n in names],
                      [int(i) for i in step["grad_output_of"]])


def _backfill(row: dict) -> list[Picked]:
    return [Picked(p["phase"], p["plain_ms"], tuple(p["trial_ms"]),
                   Backfill(**{**p["kept"], "deferred": tuple(p["kept"]["deferred"])})
                   if p["kept"] else None)
            for p in row.get("backfill", [])]


def _build(model, bucket: _Bucket, region: ArenaRegion) -> Prepared:
    row = bucket.row
    built = build_prepared(
        model, bucket.rec, bucket.schedule, bucket.memplan,
        # Device launch as prepare asks for it by default: the saving process may have built
        # for host launch only because CUPTI was attached there (keep_kernel_binaries).
        device_launch=device_launch_allowed(True),
        gather_inputs=bool(row.get("gather_inputs", True)), seconds={},
        priorities=row.get("priorities"), region=region,
        late_edges=[e for p in _backfill(row) if p.kept for e in p.kept.edges()],
        placement=bucket.placement,
        programmatic=loaded_programmatic(row, bucket.rec.graph if bucket.rec else None))
    built.backfill = _backfill(row)
    return built


#: Whether a load builds the edges a file serves programmatic that end in one of Nimble's
#: waiting kernels (:func:`~nimble.ir.waiting_kernels.waits_safely`: safe by that kernel's
#: code, whatever the GPU runs beside it), as the saving process served them; every other edge
#: stays a full dependency.  On: a loaded decode step runs faster with them, its tokens as
#: saved (docs/results.md, "A saved decode step loads its programmatic edges").
LOAD_WAITING_EDGES = True


def loaded_programmatic(row: dict, graph) -> ProgrammaticPlan:
    """The programmatic edges a loaded bucket builds: with :data:`LOAD_WAITING_EDGES` those of
    the file's into a waiting kernel of ``graph``, else none (each a full dependency).  A load
    times no choice: the edges a file lists were chosen by timing in the saving process, and
    files of the withdrawn rule list edges between Inductor's kernels
    (:data:`~nimble.analysis.programmatic.WITHDRAWN`), never built."""
    listed = [tuple(e) for e in row.get("programmatic") or ()]
    served: frozenset = frozenset()
    if LOAD_WAITING_EDGES and listed and graph is not None:
        served = waiting_edges(graph, listed)
    if len(served) < len(listed):
        log.info("the file serves %d edge(s) programmatic; a loaded graph builds %d of them "
                 "so, every other edge as a full dependency", len(listed), len(served))
    return ProgrammaticPlan(served)


def prove_loaded(prepared: Prepared, reference: tuple, launches: int = LOAD_PROOF_LAUNCHES,
                 seconds: dict | None = None) -> None:
    """The proof at load (see the module docstring); ``seconds`` gets ``verify_first`` added,
    the poisoning and the first checked launch (a graph's first launch loads its kernels'
    code into the context where the driver loads it lazily)."""
    from .proof import Reference, SharedState, poison
    from .proving import low_word_ranges

    graph = prepared.graph
    sets, expected, spread, gradients = reference
    moved = restored_ranges(prepared)
    shared = SharedState(moved) if moved else None
    run = run_phases(prepared.launchers)
    if shared is not None:
        run = shared.before(run)
    try:
        began = time.perf_counter()
        poison([(prepared.arena_base, prepared.memplan.arena_bytes)]
               + low_word_ranges(prepared), prepared.launcher.stream())
        check = Reference(graph, sets, expected, dict(spread), gradients)
        check.launches(run, 1, label="load check launch")
        if seconds is not None:
            seconds["verify_first"] = seconds.get("verify_first", 0.0) + \
                time.perf_counter() - began
        check.launches(run, launches, label="load check launch", first=1)
    finally:
        if shared is not None:
            shared.close()


@dataclass
class _Graph:
    """One serving of a file (every bucket, or one of a Generator's steps) as it is built."""

    name: str
    buckets: list[_Bucket]
    instances: int
    pad: bool
    layout: Any = None
    arenas: list = field(default_factory=list)
    orders: list = field(default_factory=list)
    built: list = field(default_factory=list)  # per instance, per bucket

    def build(self, model) -> None:
        """Each instance's arena, and every bucket built in it."""
        self.layout = shared_layout([b.rec.graph for b in self.buckets],
                                    [b.memplan for b in self.buckets])
        for j in range(max(self.instances, 1)):
            self.arenas.append(driver.DeviceMemory.allocate(self.layout.size))
            self.orders.append(CallOrder())
            self.built.append([_build(model, b, ArenaRegion(self.arenas[j], state,
                                                            self.orders[j]))
                               for b, state in zip(self.buckets, self.layout.states)])

    def serving(self, seconds: dict, total: float) -> Serving:
        report = PrepareReport(buckets=[
            BucketCost(tuple(tuple(r.shape) for r in b.rec.graph.inputs), dict(seconds))
            for b in self.buckets], total=total)
        for prepared in self.built[0]:
            prepared.seconds = dict(seconds)
        return Serving([Bucket(tuple(tuple(r.shape) for r in b.rec.graph.inputs),
                               [row[k] for row in self.built])
                        for k, b in enumerate(self.buckets)],
                       self.arenas, self.layout, self.pad, report)


def _weights_beside_kernels(manifest: dict, saved: SavedFile, model, device, seconds: dict,
                            low: dict | None = None, verify: bool = True):
    """``(weight addresses, their owners, memory addresses, their owners, LoadedKernels)``:
    the kernels loaded on a worker (its own threads read, hash and load the binaries) while
    this thread copies the weights and external memory to the GPU; ``seconds`` gets each
    side's time (``kernels``, ``weights_and_memory``).  A failure on either side closes the
    kernels once both have ended."""
    context = driver.current_context()

    def kernels_here() -> LoadedKernels:
        driver.use_context(context)
        began = time.perf_counter()
        loaded = load_kernels(manifest["kernels"], manifest["binaries"], saved)
        seconds["kernels"] = time.perf_counter() - began
        seconds.update(loaded.seconds)
        return loaded

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(kernels_here)
        began = time.perf_counter()
        try:
            weights, keep = place_weights(manifest, saved, model, device, low, verify)
            memory, kept_memory = place_memory(manifest, saved, device, low)
        except BaseException:
            done = pending.exception() is None and pending.result()
            if done:
                done.close()
            raise
        seconds["weights_and_memory"] = time.perf_counter() - began
        return weights, keep, memory, kept_memory, pending.result()


def load_serving(path, model=None, *, instances: int | None = None, verify: bool = True,
                 quiet: bool = True) -> Serving:
    """Every bucket and instance of the saved graph at ``path``, built here and proven (see the
    module docstring).  A file of several graphs (a Generator's) is refused: it loads through
    :meth:`nimble.generate.Generator.load`.  ``instances`` replaces the count saved."""
    if instances is not None and (isinstance(instances, bool) or not isinstance(instances, int)
                                  or instances < 1):
        raise InputError(f"instances must be an int >= 1 (copies of the graph that run at "
                         f"once), got {instances!r}")
    return load_graphs(path, model, verify=verify, quiet=quiet, single=True,
                       instances=instances)[1][0][1]


@contextmanager
def collector_paused():
    """Python's cyclic garbage collector off within (as it was, after).  A process that
    imported torch holds some 10^5 objects, and every full collection that a load's own
    allocations (the JSON of its manifest and graphs, the nodes it builds) set off walks all of
    them; the load makes no cycles it needs collected before it ends (docs/results.md, "The
    read stage and the garbage collector")."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def load_graphs(path, model=None, *, verify: bool = True, quiet: bool = True,
                single: bool = False, instances: int | None = None
                ) -> tuple[dict, list[tuple[str, Serving]]]:
    """The file's checked manifest, and every serving of it (one, or a Generator's steps),
    each with every bucket and instance built here and proven: ``(name, Serving)`` pairs in
    the file's order.  With ``single``, a file of several is a LoadError before anything
    reaches the GPU.  ``instances`` replaces every graph's count saved."""
    with collector_paused():
        return _load_graphs(path, model, verify=verify, quiet=quiet, single=single,
                            instances=instances)


def _load_graphs(path, model, *, verify: bool, quiet: bool, single: bool,
                 instances: int | None) -> tuple[dict, list[tuple[str, Serving]]]:
    began = time.perf_counter()
    seconds: dict[str, float] = {}
    # A file whose structure does not hold stops here, on any machine; its checksum goes on
    # hashing beside the kernels' loading and the weights' copies.
    saved, decoded, checksum = read_checked(path, seconds)
    # Whatever the damage of a damaged file breaks first, the checksum's error is the one said.
    with checksum.blaming():
        manifest = saved.manifest
        rows = graph_rows(manifest)
        if single and len(rows) > 1:
            raise LoadError(f"{path} holds {len(rows)} graphs "
                            f"({', '.join(r['name'] for r in rows)}): a Generator's file, "
                            "which nimble.generate.Generator.load reads")
        check_ranks(manifest, model, path)
        device = _this_gpu(manifest)
        seconds["read"] = time.perf_counter() - began
        graphs = _built(saved, decoded, rows, model, device, checksum, seconds,
                        instances=instances, verify=verify)
    total = time.perf_counter() - began
    say(f"loaded {path}: {len(manifest['buckets'])} bucket(s) of {len(graphs)} graph(s) in "
        f"{total:.2f} s", quiet)
    return manifest, [(graph.name, graph.serving(seconds, total)) for graph in graphs]


def check_ranks(manifest: dict, model, path) -> None:
    """A file whose graphs sum over the ranks (Nimble's peer sums, ``peer_sums`` in its
    manifest) loads only with the model (whose table of the ranks' buffers the graphs read:
    the file's is the saving process's) on the rank that saved it, in a process group of as
    many ranks; else a :class:`LoadError` saying what to do."""
    saved = manifest.get("peer_sums")
    if saved is None:
        return
    import torch.distributed as dist

    rank, ranks = saved["rank"], saved["ranks"]
    if model is None:
        raise LoadError(f"{path} sums over {ranks} ranks through the model's peer sums "
                        "(nimble.peer_sum), whose buffers are made in each process: load it "
                        "with model= (the model made on this rank, its peer sums with it: "
                        "nimble.load(path, model=...), Generator.load(path, model=...))")
    here = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and \
        dist.is_initialized() else None
    if here != (rank, ranks):
        now = f"rank {here[0]} of {here[1]}" if here else "no process group"
        raise LoadError(f"{path} is rank {rank}'s of {ranks}, and this process is {now}: "
                        f"load each rank's file on that rank, in a process group of {ranks}")


def _this_gpu(manifest: dict):
    """The current GPU, its context made, held against the file's architecture and driver."""
    import torch

    if not torch.cuda.is_available():
        raise NoGpuError("loading a saved graph needs an NVIDIA GPU with a driver; none is "
                         "visible to this process")
    driver.ensure_context()
    device = torch.device("cuda", torch.cuda.current_device())
    _check_machine(manifest, device.index)
    return device


def _built(saved: SavedFile, decoded: list, rows: list[dict], model, device,
           checksum: PendingChecksum, seconds: dict, *, instances: int | None,
           verify: bool) -> list[_Graph]:
    """Every graph of the file built here and proven (see the module docstring), after its
    checksum held; a failure at any step closes everything made so far."""
    import torch

    manifest = saved.manifest
    kernels: LoadedKernels | None = None
    graphs: list[_Graph] = []
    try:
        weights, keep, memory, kept_memory, kernels = _weights_beside_kernels(
            manifest, saved, model, device, seconds, low_bits_rows(manifest, decoded), verify)
        t0 = time.perf_counter()
        buckets = [_read_bucket(row, k, saved, graph, spec, kernels.functions, weights,
                                memory, device, model)
                   for k, (row, (graph, spec)) in enumerate(zip(manifest["buckets"], decoded))]
        graphs = [_Graph(r["name"], [buckets[i] for i in r["buckets"]],
                         instances or int(r["instances"]), bool(r["pad"])) for r in rows]
        seconds["weights_and_memory"] += time.perf_counter() - t0  # the buckets read too
        # Until here the file's bytes were only copied (the weights, the reference inputs) or
        # loaded after their own hash held (the kernels' binaries); a graph built from them
        # runs its kernels with the file's arguments, so the whole file's checksum holds first.
        wait_for_checksum(checksum, seconds)
        t0 = time.perf_counter()
        for graph in graphs:
            graph.build(model)
        seconds["build"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for graph in graphs:
            for row in graph.built:
                for b, prepared in zip(graph.buckets, row):
                    prepared.owned_memory = [kernels, *keep, *kept_memory]
                    if verify:
                        prove_loaded(prepared, b.reference, seconds=seconds)
        torch.cuda.synchronize()
        seconds["verify"] = time.perf_counter() - t0
    except BaseException:
        for graph in graphs:
            close_partial(graph.built, graph.arenas, graph.orders)
        if kernels is not None:
            kernels.close()  # after the execs that ran its kernels
        raise
    return graphs
