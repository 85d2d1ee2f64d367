"""Nimble: ahead-of-time scheduled, multi-stream CUDA graph execution for PyTorch models.

Importing this package never touches the GPU: the analysis half (TaskGraph, dependencies, stream
assignment, memory planning, inspection) is plain Python and numpy and runs anywhere.
"""
from .errors import (BuildError, CaptureError, CudaError, InputError, NimbleError, NoGpuError,
                     RecordError, VerificationError, WeightsChangedError)
from .api import Nimble
from .ir.taskgraph import Access, Buffer, BufferKind, Op, Pointer, Task, TaskGraph, TaskKind, TensorRef

from ._version import __version__

__all__ = [
    "Nimble", "NimbleError", "NoGpuError", "InputError", "CaptureError", "RecordError",
    "BuildError", "VerificationError", "WeightsChangedError", "CudaError",
    "Access", "Buffer", "BufferKind", "Op", "Pointer", "Task", "TaskGraph", "TaskKind", "TensorRef",
]
