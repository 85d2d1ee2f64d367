"""The limits no schedule of a phase beats, and where a measured run loses time against them.

**Limits.**  The *critical-path limit* is the longest chain of isolated task times
(:func:`nimble.engine.task_timing.measure_task_durations`: each task alone, the cost of the
event records around it taken off).  Two things it leaves out bound a real run as well:

- *per-task launch cost*: a graph does not start a kernel the moment its predecessor ends.  A
  single-stream launch of the phase runs its ``n`` tasks in ``T`` µs against ``sum(isolated)``
  µs of kernel time, so each task costs ``(T - sum) / n`` µs more than its kernel in a chain.
  Adding that to every task gives the *launch-aware* critical path;
- *the GPU's capacity*: kernels side by side share the SMs.  A kernel of ``b`` blocks, each
  taking a share ``f`` of some resource of an SM (threads, registers, shared memory, block
  slots: :attr:`nimble.analysis.resources.Occupancy.sm_share`), holds ``min(1, b * f /
  sm_count)`` of that resource on the whole GPU while it runs alone, so the phase takes at
  least the sum over tasks of that share times the isolated time.  This assumes no block runs
  faster beside other kernels' blocks than beside its own kernel's, which holds for blocks
  that compute and is an estimate for blocks that wait on memory.

:func:`phase_limits` gives all three; the tightest bound is their largest.

**Where the time goes.**  :func:`path_breakdown` walks the chain a measured run really waited on
(:func:`nimble.debug.timeline.executed_critical_path`) and splits its length into the tasks'
isolated times, their *stretch* (how much longer each ran beside others than alone) and the
*waits* between a task's predecessor ending and the task starting (launch latency, a
synchronization's latency, or blocks waiting for SMs held by other kernels).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .deps import Dag, critical_path


@dataclass(frozen=True)
class PhaseLimits:
    """Lower bounds on one phase's time, in µs (:func:`phase_limits`)."""

    tasks: int
    isolated_sum_us: float  # every task's isolated time, summed
    critical_path_us: float  # the longest chain of isolated times
    launch_us: float  # per task, what a single-stream launch adds to its kernel time
    launch_aware_path_us: float  # the longest chain of isolated time plus launch cost
    capacity_us: float  # the GPU's share each task holds alone, times its time, summed

    @property
    def tightest_us(self) -> float:
        return max(self.critical_path_us, self.launch_aware_path_us, self.capacity_us)

    @property
    def tightest(self) -> str:
        """Which limit is the tightest: ``"critical path"``, ``"launch-aware path"`` or
        ``"capacity"`` (the first of them on a tie)."""
        named = (("critical path", self.critical_path_us),
                 ("launch-aware path", self.launch_aware_path_us),
                 ("capacity", self.capacity_us))
        return max(named, key=lambda kv: kv[1])[0]

    def as_dict(self) -> dict:
        return {"tasks": self.tasks, "isolated_sum_us": self.isolated_sum_us,
                "critical_path_us": self.critical_path_us, "launch_us": self.launch_us,
                "launch_aware_path_us": self.launch_aware_path_us,
                "capacity_us": self.capacity_us, "tightest_us": self.tightest_us,
                "tightest": self.tightest}


def gpu_share(blocks: int, sm_share: float, sm_count: int) -> float:
    """The share of the GPU a kernel of ``blocks`` blocks holds while it runs alone, each block
    taking ``sm_share`` of its SM's scarcest resource (1 for a kernel that fills the GPU; 0 for
    a task that is no kernel)."""
    if blocks < 1 or sm_share <= 0 or sm_count < 1:
        return 0.0
    return min(1.0, blocks * sm_share / sm_count)


def phase_limits(dag: Dag, isolated_us: Sequence[float], single_stream_us: float,
                 shares: Sequence[float]) -> PhaseLimits:
    """The limits of a phase of ``dag.n`` tasks: ``isolated_us`` per task, the measured time of
    one single-stream launch of the phase (``single_stream_us``; 0 when not measured: no launch
    cost) and each task's :func:`gpu_share`."""
    n = dag.n
    if len(isolated_us) != n or len(shares) != n:
        raise ValueError(f"{len(isolated_us)} times and {len(shares)} shares for {n} tasks")
    total = float(sum(isolated_us))
    launch = max(0.0, (single_stream_us - total) / n) if n and single_stream_us > 0 else 0.0
    return PhaseLimits(
        tasks=n, isolated_sum_us=total,
        critical_path_us=critical_path(dag, isolated_us).length,
        launch_us=launch,
        launch_aware_path_us=critical_path(dag, [d + launch for d in isolated_us]).length,
        capacity_us=float(sum(d * s for d, s in zip(isolated_us, shares))))


@dataclass(frozen=True)
class PathBreakdown:
    """A measured run's executed critical path split into what it spent (µs)."""

    tasks: int
    makespan_us: float  # from the phase's first start to the path's last end
    isolated_us: float  # the path's tasks, each as long as alone
    stretch_us: float  # how much longer they ran than alone (negative: faster)
    wait_us: float  # between each task's predecessor on the path ending and its start
    #: Of the path's steps from one task to the next, those that change stream, and their
    #: waits (0 where no streams were given).
    cross_stream_steps: int = 0
    cross_stream_wait_us: float = 0.0

    def as_dict(self) -> dict:
        return {"tasks": self.tasks, "makespan_us": self.makespan_us,
                "isolated_us": self.isolated_us, "stretch_us": self.stretch_us,
                "wait_us": self.wait_us, "cross_stream_steps": self.cross_stream_steps,
                "cross_stream_wait_us": self.cross_stream_wait_us}


def path_breakdown(times: Sequence[tuple[float, float]], isolated_us: Sequence[float],
                   path: Sequence[int], begin: float | None = None,
                   stream_of: Sequence[int] | None = None) -> PathBreakdown:
    """Split the executed path ``path`` (task ids, first to last) of a run measured as
    ``times`` (``(start, end)`` µs per task) into isolated time, stretch and waits; the first
    task's wait counts from ``begin`` (the phase's first start; that task's own start when
    None).  isolated + stretch + wait is the makespan.  With ``stream_of`` (each task's
    stream), the steps that change stream and their waits are counted apart."""
    if not path:
        return PathBreakdown(0, 0.0, 0.0, 0.0, 0.0)
    first = times[path[0]][0] if begin is None else begin
    reach, wait, ran, alone = first, 0.0, 0.0, 0.0
    cross, cross_wait = 0, 0.0
    for k, t in enumerate(path):
        start, end = times[t]
        waited = max(0.0, start - reach)
        wait += waited
        if k and stream_of is not None and stream_of[t] != stream_of[path[k - 1]]:
            cross += 1
            cross_wait += waited
        ran += end - max(start, reach)
        alone += isolated_us[t]
        reach = max(reach, end)
    return PathBreakdown(len(path), reach - first, alone, ran - alone, wait, cross, cross_wait)
