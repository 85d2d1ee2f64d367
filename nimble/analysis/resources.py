"""What each kernel asks of an SM, and priorities that let complementary kernels share the GPU.

Streams make kernels eligible to run side by side, and priorities decide whose pending blocks
the block scheduler dispatches first (:mod:`nimble.analysis.priorities`).  Kernels share an SM
well when they want different things of it: a memory-bound kernel (elementwise, pooling,
normalisation, concatenation, layout copies) waits on DRAM while a compute-bound one
(convolutions, GEMMs) keeps the tensor cores busy, and a compute kernel whose blocks take little
shared memory leaves room on its SMs for another kernel's blocks, where one that takes most of
an SM's shared memory does not.

**Profiles.**  :func:`profile_tasks` classifies every task by its kernel's name family
(:data:`COMPUTE_FAMILIES`, :data:`MEMORY_FAMILIES`; a kernel of neither family counts as
memory-bound when its recorded bytes over its isolated time reach :data:`MEMORY_BOUND_SHARE` of
the device's DRAM bandwidth), and works out its footprint on one SM from its launch geometry
against the device's :class:`SmLimits` (:func:`resident_blocks`).  The TaskGraph records a
launch's dynamic shared memory only: a kernel's registers and static shared memory are its
function's, which the engine reads from the driver and passes in.

**Candidates.**  Each candidate rule (:data:`RULES`) marks some kernels to go one step behind
the others of similar slack: a marked kernel sits one level below the unmarked kernels of its
slack level (:func:`nimble.analysis.priorities.priority_levels`), level with those of the next;
the lowest level stays the lowest.  ``large_last`` marks compute-bound kernels whose blocks
take more than :data:`LARGE_SHARE` of some resource of an SM (no two of them fit on one SM);
``compute_last`` marks every compute-bound kernel, so memory-bound work gets the SMs first and
fills them beside the compute kernels already running.  Nothing else changes: the edges, streams
and arena plan are the schedule's own.

**Whether they pay** is measured at prepare like the tail backfill: the phase is built with each
candidate's priorities and timed against the plain ones, and one is kept only when it gains
(:func:`nimble.analysis.backfill.fastest`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from .priorities import priority_levels
from ..ir.taskgraph import TaskGraph, TaskKind

#: Name fragments (lower case) of compute-bound kernels: tensor-core and SIMT GEMMs and
#: convolutions of cuBLAS, cuBLASLt, cuDNN, CUTLASS and Triton's matmul templates, attention.
COMPUTE_FAMILIES = ("gemm", "xmma", "cutlass", "nvjet", "wgmma", "convolve", "conv2d", "conv_",
                    "winograd", "wgrad", "dgrad", "fprop", "sdpa", "flash", "triton_tem",
                    "triton_mm", "cublas", "cudnn_generated")
#: Name fragments of memory-bound kernels, tried before :data:`COMPUTE_FAMILIES`: some of them
#: carry a compute word in their name (a split-K GEMM's reduction, a depthwise convolution,
#: which reads each input once per output channel, a matrix-vector product, cuBLAS's vector
#: scaling, a GEMM's separate epilogue; the transforms around cuDNN's FFT convolutions: the
#: tiles' FFTs, the filters' flip, the layout changes).
MEMORY_FAMILIES = ("elementwise", "reduce", "pool", "bn_fw", "bn_bw", "batch_norm", "norm",
                   "cat", "copy", "nchwtonhwc", "nhwctonchw", "scalepacked", "gather", "scatter",
                   "softmax", "triton_poi", "triton_per", "triton_red", "depthwise",
                   "gemv", "scal", "splitkreduce", "epilogue", "scan", "dropout", "fill",
                   "transpose", "embedding", "init_device_workspace", "fft2d_", "flip_filter",
                   "region_transform")
#: A kernel of no known family that moves at least this share of the DRAM bandwidth (its
#: recorded bytes over its isolated time) is memory-bound.
MEMORY_BOUND_SHARE = 0.3
#: A block that takes more than this share of some resource of an SM leaves no room for a
#: second block like it: its kernel has a large footprint.
LARGE_SHARE = 0.5


class Bound:
    """What limits a task: DRAM traffic, arithmetic, or unknown."""

    MEMORY = "memory"
    COMPUTE = "compute"
    OTHER = "other"


@dataclass(frozen=True)
class SmLimits:
    """One SM's resources and the device's size (defaults: sm_90, an H100 SXM; the H200 has the
    same SM).  The engine fills them from the device's attributes (``nimble.driver``)."""

    shared_per_sm: int = 228 * 1024
    shared_per_block: int = 227 * 1024
    #: Shared memory the driver keeps for itself per resident block.
    shared_reserved_per_block: int = 1024
    registers_per_sm: int = 64 * 1024
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32
    sm_count: int = 132
    #: DRAM bandwidth, GB/s.
    dram_gbps: float = 3350.0

    @property
    def warps_per_sm(self) -> int:
        return self.threads_per_sm // 32


#: The device attributes each field of :class:`SmLimits` is read from (the bandwidth comes
#: from the memory clock and bus width: :func:`limits_from_attributes`).
DEVICE_ATTRIBUTES = {
    "shared_per_sm": "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR",
    "shared_per_block": "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
    "shared_reserved_per_block": "RESERVED_SHARED_MEMORY_PER_BLOCK",
    "registers_per_sm": "MAX_REGISTERS_PER_MULTIPROCESSOR",
    "threads_per_sm": "MAX_THREADS_PER_MULTIPROCESSOR",
    "blocks_per_sm": "MAX_BLOCKS_PER_MULTIPROCESSOR",
    "sm_count": "MULTIPROCESSOR_COUNT",
    "memory_clock_khz": "MEMORY_CLOCK_RATE",
    "bus_bits": "GLOBAL_MEMORY_BUS_WIDTH",
}


def limits_from_attributes(attributes: dict[str, int]) -> SmLimits:
    """:class:`SmLimits` from the values of :data:`DEVICE_ATTRIBUTES` (double data rate: two
    transfers of the bus's width per memory clock)."""
    values = dict(attributes)
    clock_khz, bus_bits = values.pop("memory_clock_khz"), values.pop("bus_bits")
    return SmLimits(**values, dram_gbps=2 * clock_khz * 1e3 * bus_bits / 8 / 1e9)


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


class Occupancy(NamedTuple):
    """How one kernel's blocks sit on an SM."""

    resident_blocks: int  # blocks of this kernel one SM holds at once (0: it cannot launch)
    occupancy: float  # the share of the SM's threads those blocks keep
    sm_share: float  # the largest share of any one SM resource a single block takes
    limited_by: str  # the resource that bounds resident_blocks


def resident_blocks(threads: int, shared_mem: int, limits: SmLimits,
                    registers: int | None = None) -> Occupancy:
    """The theoretical occupancy of a kernel with ``threads`` per block, ``shared_mem`` bytes of
    shared memory per block and, if known, ``registers`` per thread (allocated per warp in units
    of 256), on one SM of ``limits``."""
    if threads < 1:
        raise ValueError(f"a block has at least one thread, not {threads}")
    warps = -(-threads // 32)
    shared = shared_mem + limits.shared_reserved_per_block
    if shared_mem > limits.shared_per_block or threads > limits.threads_per_sm:
        return Occupancy(0, 0.0, max(1.0, shared / limits.shared_per_sm), "launch")
    bounds = {"blocks": limits.blocks_per_sm, "threads": limits.warps_per_sm // warps,
              "shared memory": limits.shared_per_sm // shared if shared else limits.blocks_per_sm}
    shares = {"blocks": 1 / limits.blocks_per_sm, "threads": warps / limits.warps_per_sm,
              "shared memory": shared / limits.shared_per_sm}
    if registers:
        per_warp = _round_up(registers * 32, 256)
        bounds["registers"] = (limits.registers_per_sm // per_warp) // warps
        shares["registers"] = per_warp * warps / limits.registers_per_sm
    limited_by = min(bounds, key=bounds.__getitem__)
    blocks = bounds[limited_by]
    return Occupancy(blocks, blocks * warps / limits.warps_per_sm, max(shares.values()),
                     limited_by)


class Profile(NamedTuple):
    """One task's resource use: what bounds it and its footprint on an SM."""

    bound: str  # a :class:`Bound`
    blocks: int
    threads: int  # per block
    shared_mem: int  # bytes per block, dynamic and static
    occupancy: Occupancy | None  # None for a task that is no kernel

    @property
    def large(self) -> bool:
        """Whether no two of its blocks fit on one SM (:data:`LARGE_SHARE`)."""
        return self.occupancy is not None and self.occupancy.sm_share > LARGE_SHARE


def family_bound(name: str) -> str:
    """The :class:`Bound` a kernel's name family says, or ``Bound.OTHER``."""
    low = name.lower()
    if any(f in low for f in MEMORY_FAMILIES):
        return Bound.MEMORY
    if any(f in low for f in COMPUTE_FAMILIES):
        return Bound.COMPUTE
    return Bound.OTHER


_WORD = re.compile(r"[A-Za-z_]\w*")


def _name_of(task) -> str:
    """The name to classify: the readable short name, else the mangled one with its template
    arguments (which name the functor: ``...elementwise_kernel<..., AddFunctor ...>``)."""
    return task.short_name or " ".join(_WORD.findall(task.name))


def task_bytes(graph: TaskGraph) -> list[int]:
    """The bytes each task reads or writes (its recorded accesses, summed)."""
    return [sum(a.size for a in t.accesses) for t in graph.tasks]


def profile_tasks(graph: TaskGraph, limits: SmLimits = SmLimits(),
                  durations: Sequence[float] | None = None,
                  registers: Sequence[int | None] | None = None,
                  static_shared: Sequence[int] | None = None) -> list[Profile]:
    """Every task's :class:`Profile`.  ``durations`` (isolated µs) let a kernel of no known
    family count as memory-bound by its bandwidth; ``registers`` (per thread, per task) add the
    register limit to the occupancy, and ``static_shared`` (bytes per block, per task) adds to
    the launch's dynamic shared memory."""
    n = len(graph.tasks)
    for what, given in (("durations", durations), ("register counts", registers),
                        ("static shared memory sizes", static_shared)):
        if given is not None and len(given) != n:
            raise ValueError(f"{len(given)} {what} for {n} tasks")
    moved = task_bytes(graph)
    out: list[Profile] = []
    for t in graph.tasks:
        if t.kind != TaskKind.KERNEL:
            out.append(Profile(Bound.MEMORY, 1, 1, 0, None))
            continue
        bound = family_bound(_name_of(t))
        if bound == Bound.OTHER and durations is not None and durations[t.id] > 0:
            gbps = moved[t.id] / (durations[t.id] * 1e3)  # bytes per ns are GB/s
            if gbps >= MEMORY_BOUND_SHARE * limits.dram_gbps:
                bound = Bound.MEMORY
        threads = t.block[0] * t.block[1] * t.block[2]
        shared = t.shared_mem + (static_shared[t.id] if static_shared is not None else 0)
        occupancy = resident_blocks(threads, shared, limits,
                                    registers[t.id] if registers is not None else None)
        out.append(Profile(bound, t.grid[0] * t.grid[1] * t.grid[2], threads, shared,
                           occupancy))
    return out


# ---- candidate priorities --------------------------------------------------------------------

def _large_last(p: Profile) -> bool:
    return p.bound == Bound.COMPUTE and p.large


def _compute_last(p: Profile) -> bool:
    return p.bound == Bound.COMPUTE


#: The candidate rules, in the order tried: which kernels go one level behind.
RULES = {"large_last": _large_last, "compute_last": _compute_last}


class ResourceTrial(NamedTuple):
    """One candidate's priority levels (``0`` the highest) and how they differ from the plain
    ones."""

    rule: str
    levels: tuple[int, ...]
    marked: int  # kernels the rule marks
    changed: int  # tasks whose level differs from the plain levels (marked, not already lowest)


def plan_trials(n: int, edges: Sequence[tuple[int, int]], durations: Sequence[float],
                levels: int, profiles: Sequence[Profile],
                phases: Sequence[range] | None = None) -> list[ResourceTrial]:
    """The distinct candidates of :data:`RULES` that differ from the plain slack levels (same
    arguments as :func:`~nimble.analysis.priorities.priority_levels`), to be measured."""
    if len(profiles) != n:
        raise ValueError(f"{len(profiles)} profiles for {n} tasks")
    plain = priority_levels(n, edges, durations, levels, phases)
    out: list[ResourceTrial] = []
    for rule, marks in RULES.items():
        marked = [int(marks(p)) for p in profiles]
        got = tuple(priority_levels(n, edges, durations, levels, phases, secondary=marked))
        changed = sum(a != b for a, b in zip(got, plain))
        if changed and all(got != other.levels for other in out):
            out.append(ResourceTrial(rule, got, sum(marked), changed))
    return out


class ResourcePicked(NamedTuple):
    """What prepare measured for one phase: median ms per launch with the plain priorities and
    with each candidate's, and the rule kept (None: the plain priorities)."""

    phase: int
    plain_ms: float
    trial_ms: tuple[float, ...]
    rules: tuple[str, ...]
    changed: tuple[int, ...]  # per candidate, the tasks of the phase whose priority it changed
    kept: str | None

    def as_meta(self) -> dict:
        """The measurement as plain data (``graph.meta["resource_order"]``)."""
        return {"phase": self.phase, "plain_ms": self.plain_ms,
                "trials": [{"rule": r, "ms": ms, "changed": c}
                           for r, ms, c in zip(self.rules, self.trial_ms, self.changed)],
                "kept": self.kept}


def summary(profiles: Sequence[Profile]) -> dict[str, int]:
    """How many tasks of each bound, and how many compute kernels have a large footprint."""
    counts = {Bound.MEMORY: 0, Bound.COMPUTE: 0, Bound.OTHER: 0}
    for p in profiles:
        counts[p.bound] += 1
    counts["large compute"] = sum(_large_last(p) for p in profiles)
    return counts
