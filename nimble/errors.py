"""Typed errors.  Each says what went wrong and what to do about it."""
from __future__ import annotations


class NimbleError(Exception):
    """Base class of every error Nimble raises on purpose."""


class NoGpuError(NimbleError):
    """No usable NVIDIA GPU or driver on this machine."""


class InputError(NimbleError, ValueError):
    """A model or an input Nimble cannot take as it is (on the CPU, not a tensor, wrong shape...)."""


class CaptureError(NimbleError):
    """The model's forward could not be captured into a CUDA graph."""


class RecordError(NimbleError):
    """The capture succeeded but its nodes could not be decoded into a complete TaskGraph."""


class BuildError(NimbleError):
    """The scheduled TaskGraph could not be turned into a CUDA graph."""


class VerificationError(NimbleError):
    """The rebuilt graph did not reproduce the single-stream reference bit for bit.
    ``recording``: the file ``prepare`` saved the recording to for a bug report (None where it
    saved none)."""

    def __init__(self, message: str, recording: str | None = None) -> None:
        super().__init__(message)
        self.recording = recording


class GraphFaultError(VerificationError):
    """A kernel faulted on the GPU while the rebuilt graph was being proven, and took the
    process's CUDA context with it: restart the process.  ``fault`` is the ``CUDA_ERROR_*``
    name; ``recording`` the file the recording was saved to for a bug report (None if it could
    not be written); ``stage`` the proof's stage when the fault showed (the recording's own
    replays, or the rebuilt graph's launches)."""

    def __init__(self, message: str, fault: str, recording: str | None,
                 stage: str = "") -> None:
        super().__init__(message, recording)
        self.fault = fault
        self.stage = stage


class WeightsChangedError(NimbleError):
    """A weight the prepared graph reads changed in a way the graph cannot follow (its dtype,
    shape or layout, or it is gone): prepare again."""


class SaveError(NimbleError):
    """A prepared graph that cannot be written down as it is (a kernel whose binary is on no
    disk, a node that names memory of this process only): the message says what avoids it."""


class LoadError(NimbleError):
    """A saved graph that cannot be loaded here: a damaged or truncated file, a format of
    another version, another GPU architecture or driver, a library or kernel not found, weights
    that do not fit.  Nothing of it stays allocated."""


class CudaError(NimbleError):
    """A CUDA driver call failed.  ``call`` names the function, ``name`` the ``CUDA_ERROR_*`` code."""

    def __init__(self, call: str, code: int, name: str, detail: str = "") -> None:
        self.call = call
        self.code = code
        self.name = name
        msg = f"{call} failed with {name} ({code})"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)
