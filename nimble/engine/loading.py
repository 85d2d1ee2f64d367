"""``nimble.load(path, model=None)``: a saved graph rebuilt in this process, and proven.

Nothing is recorded and nothing scheduled: the file says what ``prepare()`` decided
(:mod:`nimble.engine.saving`).  Loading reads and checks the file (checksum, format version,
GPU architecture, driver), loads every kernel from its binary and checks it against its saved
fingerprint (:mod:`nimble.engine.kernel_binaries`), puts the weights in place (the model's, by
name, or the file's), restores the external memory and the private copies of library memory,
then builds every bucket of every instance through the same
:func:`~nimble.engine.prepared.build_prepared` that prepare uses, from stored nodes instead of
recorded ones.

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

import gzip
import json
import time
from dataclasses import dataclass
from typing import Any

from .. import driver
from ..analysis.backfill import Backfill, Picked
from ..analysis.memplan import MemPlan
from ..analysis.schedule import Schedule
from ..errors import LoadError, NoGpuError
from ..ir.saved_format import SavedFile
from ..ir.taskgraph import TaskGraph, TaskKind
from ..progress import say
from .arena_layout import shared_layout, shared_state
from .kernel_binaries import LoadedKernels, load_kernels
from .launcher import CallOrder, run_phases
from .prepared import ArenaRegion, Placement, Prepared, build_prepared
from .profiler_guard import device_launch_allowed
from .saving import SAVED_FORMAT
from .serving import Bucket, BucketCost, PrepareReport, Serving, close_partial
from .weights import named_weights

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


def _field(row: dict, key: str, where: str):
    try:
        return row[key]
    except (KeyError, TypeError):
        raise LoadError(f"{where}: the manifest has no {key!r}: the file is damaged or of "
                        "another Nimble") from None


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


def _weights(manifest: dict, saved: SavedFile, model, device) -> tuple[list[int], list]:
    """Per weight storage of the file, its address now, and the memory to keep alive."""
    import torch

    addresses, keep = [], []
    current = named_weights(model) if model is not None else {}
    for i, row in enumerate(manifest.get("weights", [])):
        if model is None:
            if row.get("blob") is None:
                raise LoadError("the file was saved without its weights (weights=False): pass "
                                "the model, nimble.load(path, model=...)")
            data = saved.blob(row["blob"])
            tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) \
                if data else torch.empty(0, dtype=torch.uint8, device=device)
            keep.append(tensor)
            addresses.append(tensor.data_ptr())
            continue
        addresses.append(_model_storage(row, current, device))
    return addresses, keep


def _model_storage(row: dict, current: dict, device) -> int:
    """Where the model's tensors of one saved storage live: every name there, of the saved
    dtype, shape and strides, at the saved offsets of one storage."""
    base = None
    for entry in row.get("names", []):
        name = entry["name"]
        t = current.get(name)
        if t is None:
            raise LoadError(f"the model has no '{name}', which the saved graph reads: pass the "
                            "model the graph was saved from")
        want = (entry["dtype"], list(entry["shape"]), list(entry["strides"]))
        have = (str(t.dtype).removeprefix("torch."), list(t.shape), list(t.stride()))
        if want != have:
            raise LoadError(f"'{name}' is {have[0]} {have[1]} (strides {have[2]}); the graph "
                            f"was saved for {want[0]} {want[1]} (strides {want[2]}): pass a "
                            "model of the saved dtype and shapes")
        if t.device != device:
            raise LoadError(f"'{name}' is on {t.device}; the graph runs on {device}: move the "
                            "model there first")
        at = t.data_ptr() - int(entry["offset"])
        if base is not None and at != base:
            raise LoadError(f"'{name}' no longer shares its memory with the weights it shared "
                            "it with when saved: pass the model as it was saved")
        base = at
    if base is None:
        raise LoadError("a weight storage of the file names no tensor: the file is damaged")
    return base


def _memory(manifest: dict, saved: SavedFile, device) -> tuple[list[int], list]:
    """The saved external memory, each range in memory of its own, and its owners."""
    import torch

    addresses, keep = [], []
    for row in manifest.get("memory", []):
        data = saved.blob(row.get("blob"))
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data \
            else torch.empty(1, dtype=torch.uint8, device=device)
        keep.append(tensor)
        addresses.append(tensor.data_ptr())
    return addresses, keep


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
    reference: tuple  # (input sets, expected outputs, spread)


def _tensors(saved: SavedFile, refs: list, like: list, device) -> list:
    import torch

    out = []
    for ref, r in zip(refs, like):
        dtype = getattr(torch, r.dtype)
        data = saved.blob(ref)
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else \
            torch.empty(0, dtype=torch.uint8, device=device)
        out.append(flat.view(dtype).reshape(r.shape))
    return out


def _read_bucket(row: dict, k: int, saved: SavedFile, functions: list, weights: list[int],
                 memory: list[int], device) -> _Bucket:
    where = f"bucket {k}"
    try:
        graph = TaskGraph.from_json(json.loads(gzip.decompress(saved.blob(
            _field(row, "graph", where)))))
        schedule = Schedule(**_field(row, "schedule", where))
        schedule.streams = [list(s) for s in schedule.streams]
        schedule.sync_edges = [tuple(e) for e in schedule.sync_edges]
        schedule.barrier_edges = [tuple(e) for e in schedule.barrier_edges]
        plan_row = dict(_field(row, "memplan", where))
        plan_row["offsets"] = {int(b): int(o) for b, o in plan_row["offsets"].items()}
        memplan = MemPlan(**plan_row)
    except (ValueError, TypeError, KeyError, OSError, EOFError) as e:
        raise LoadError(f"{where} of {saved.path}: {e}: the file is damaged") from None
    outside = {}
    for bid, source in _field(row, "outside", where).items():
        if "weight" in source:
            outside[int(bid)] = weights[int(source["weight"])]
        else:
            outside[int(bid)] = memory[int(source["memory"])] + int(source["offset"])
    private = {int(bid): saved.blob(ref) for bid, ref in _field(row, "private", where).items()}
    from torch.utils._pytree import treespec_loads

    spec = row.get("output_spec")
    refs = _field(row, "reference", where)
    sets = [_tensors(saved, s, graph.inputs, device) for s in refs["inputs"]]
    expected = [_tensors(saved, s, graph.outputs, device) for s in refs["outputs"]]
    rec = _SavedRecording(graph, _stored_nodes(graph, _field(row, "nodes", where), functions),
                          sets[0], treespec_loads(spec) if spec else None)
    return _Bucket(rec, schedule, memplan, row, Placement(outside, private),
                   (sets, expected, {int(i): float(d) for i, d in refs["spread"].items()}))


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
        placement=bucket.placement)
    built.backfill = _backfill(row)
    return built


def prove_loaded(prepared: Prepared, reference: tuple, launches: int = LOAD_PROOF_LAUNCHES
                 ) -> None:
    """The proof at load (see the module docstring)."""
    from .proof import Reference, SharedState, poison
    from .proving import low_word_ranges

    graph = prepared.graph
    sets, expected, spread = reference
    state_ranges = {tuple(r) for r in shared_state(graph)}
    moved = [(prepared.bases[b.id], b.size) for b in graph.buffers
             if (b.address, b.size) in state_ranges]
    shared = SharedState(moved) if moved else None
    run = run_phases(prepared.launchers)
    if shared is not None:
        run = shared.before(run)
    try:
        poison([(prepared.arena_base, prepared.memplan.arena_bytes)]
               + low_word_ranges(prepared), prepared.launcher.stream())
        Reference(graph, sets, expected, dict(spread)).launches(run, launches,
                                                               label="load check launch")
    finally:
        if shared is not None:
            shared.close()


def _read(path) -> SavedFile:
    saved = SavedFile.read(path)
    if saved.manifest.get("format") != SAVED_FORMAT:
        raise LoadError(f"{path} is not a saved Nimble graph (format "
                        f"{saved.manifest.get('format')!r})")
    return saved


def load_serving(path, model=None, *, verify: bool = True, quiet: bool = True) -> Serving:
    """Every bucket and instance of the saved graph at ``path``, built here and proven (see the
    module docstring)."""
    import torch

    if not torch.cuda.is_available():
        raise NoGpuError("loading a saved graph needs an NVIDIA GPU with a driver; none is "
                         "visible to this process")
    driver.ensure_context()
    began = time.perf_counter()
    seconds: dict[str, float] = {}
    saved = _read(path)
    manifest = saved.manifest
    device = torch.device("cuda", torch.cuda.current_device())
    _check_machine(manifest, device.index)
    seconds["read"] = time.perf_counter() - began
    kernels: LoadedKernels | None = None
    built: list[list[Prepared]] = []
    arenas: list = []
    orders: list = []
    try:
        t0 = time.perf_counter()
        kernels = load_kernels(_field(manifest, "kernels", path),
                               _field(manifest, "binaries", path), saved)
        seconds["kernels"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        weights, keep = _weights(manifest, saved, model, device)
        memory, kept_memory = _memory(manifest, saved, device)
        buckets = [_read_bucket(row, k, saved, kernels.functions, weights, memory, device)
                   for k, row in enumerate(_field(manifest, "buckets", path))]
        if not buckets:
            raise LoadError(f"{path} holds no bucket: the file is damaged")
        layout = shared_layout([b.rec.graph for b in buckets], [b.memplan for b in buckets])
        seconds["weights_and_memory"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for j in range(max(int(manifest.get("instances", 1)), 1)):
            arenas.append(driver.DeviceMemory.allocate(layout.size))
            orders.append(CallOrder())
            built.append([_build(model, b, ArenaRegion(arenas[j], state, orders[j]))
                          for b, state in zip(buckets, layout.states)])
        seconds["build"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for row in built:
            for b, prepared in zip(buckets, row):
                prepared.owned_memory = [kernels, *keep, *kept_memory]
                if verify:
                    prove_loaded(prepared, b.reference)
        torch.cuda.synchronize()
        seconds["verify"] = time.perf_counter() - t0
    except BaseException:
        close_partial(built, arenas, orders)
        if kernels is not None:
            kernels.close()  # after the execs that ran its kernels
        raise
    report = PrepareReport(buckets=[
        BucketCost(tuple(tuple(r.shape) for r in b.rec.graph.inputs), dict(seconds))
        for b in buckets], total=time.perf_counter() - began)
    for b, prepared in zip(buckets, built[0]):
        prepared.seconds = dict(seconds)
    say(f"loaded {path}: {len(buckets)} bucket(s) x {len(arenas)} instance(s) in "
        f"{report.total:.2f} s", quiet)
    return Serving([Bucket(tuple(tuple(r.shape) for r in b.rec.graph.inputs),
                           [row[k] for row in built]) for k, b in enumerate(buckets)],
                   arenas, layout, bool(manifest.get("pad", False)), report)
