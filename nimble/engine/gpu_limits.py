"""The limits of a live recording's phase on the current GPU (:mod:`nimble.analysis.limits`):
its tasks timed alone, and each kernel's share of the GPU from its launch geometry and the
registers and shared memory its function takes.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from ..analysis import limits, resources
from ..analysis.deps import build_dag, transitive_reduction
from .priority_trials import device_limits, kernel_resources
from .task_timing import time_recording


class TaskShares(NamedTuple):
    """Per task, the share of the GPU it holds alone (:func:`nimble.analysis.limits.gpu_share`)
    and what bounds it (:attr:`nimble.analysis.resources.Profile.bound`)."""

    shares: list[float]
    bounds: list[str]


def task_gpu_shares(rec, durations: Sequence[float] | None = None) -> TaskShares:
    """Every task's share of the current GPU; ``durations`` (isolated µs) let a kernel of no
    known family count as memory-bound by its bandwidth."""
    device = device_limits()
    functions = kernel_resources(rec.graph, rec.nodes)
    profiles = resources.profile_tasks(rec.graph, device, durations,
                                       [f.registers for f in functions],
                                       [f.static_shared for f in functions])
    shares = [limits.gpu_share(p.blocks, p.occupancy.sm_share, device.sm_count)
              if p.occupancy is not None else 0.0 for p in profiles]
    return TaskShares(shares, [p.bound for p in profiles])


def recording_limits(rec, single_stream_us: float,
                     isolated_us: Sequence[float] | None = None) -> limits.PhaseLimits:
    """The critical-path, launch-aware and capacity limits of ``rec``'s phase, from each task
    timed alone (``isolated_us``, or timed here) and one single-stream call's time (µs; 0: no
    launch cost)."""
    isolated = list(isolated_us) if isolated_us is not None else time_recording(rec)
    dag = transitive_reduction(build_dag(rec.graph))
    return limits.phase_limits(dag, isolated, single_stream_us,
                               task_gpu_shares(rec, isolated).shares)
