"""Nimble: ahead-of-time scheduled, multi-stream CUDA graph execution for PyTorch models.

Importing this package never touches the GPU: the analysis half (TaskGraph, dependencies, stream
assignment, memory planning, inspection) is plain Python and numpy and runs anywhere.  The types
the :class:`Nimble` object returns are importable from here too; each loads its module on first
use (:data:`RESULT_TYPES`), so ``import nimble`` loads neither torch nor the CUDA driver.
"""
from __future__ import annotations

import importlib

from .errors import (BuildError, CaptureError, CudaError, GraphFaultError, InputError,
                     LoadError, NimbleError, NoGpuError, RecordError, SaveError,
                     VerificationError, WeightsChangedError)
from .api import Nimble, keep_kernel_binaries, load
from .engine.serving import BucketView, PhaseView
from .engine.options import PrepareOptions
from .record.gradient_average import GradientAverage
from .ir.taskgraph import Access, Buffer, BufferKind, Op, Pointer, Task, TaskGraph, TaskKind, TensorRef

from ._version import __version__

#: What the Nimble object's methods and properties return, by the module that defines each.
RESULT_TYPES = {
    "Timeline": "nimble.debug.timeline",          # Nimble.trace()
    "Snapshot": "nimble.debug.step_through",      # Nimble.run_until()
    "Divergence": "nimble.debug.divergence",      # Nimble.first_divergence()
    "Recording": "nimble.record.recorder",        # Nimble.recording
    "Schedule": "nimble.analysis.schedule",       # Nimble.schedule
    "MemPlan": "nimble.analysis.memplan",         # Nimble.memplan
    "Picked": "nimble.analysis.backfill",         # Nimble.backfill_trials
    "RngCells": "nimble.engine.launcher",         # Nimble.rng_cells
    "Prepared": "nimble.engine.prepared",         # Nimble.engine
    "MemoryReport": "nimble.engine.serving",      # Nimble.device_bytes
    "PrepareReport": "nimble.engine.serving",     # Nimble.prepare_report
}

__all__ = [
    "__version__", "Nimble", "load", "keep_kernel_binaries", "PrepareOptions", "GradientAverage", "PhaseView", "BucketView",
    "NimbleError", "NoGpuError", "InputError", "CaptureError", "RecordError",
    "BuildError", "VerificationError", "GraphFaultError", "WeightsChangedError", "CudaError",
    "SaveError", "LoadError",
    "Access", "Buffer", "BufferKind", "Op", "Pointer", "Task", "TaskGraph", "TaskKind", "TensorRef",
    *RESULT_TYPES,
]


def __getattr__(name: str):
    module = RESULT_TYPES.get(name)
    if module is None:
        raise AttributeError(f"module 'nimble' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(RESULT_TYPES))
