"""Host synchronisation, judged on the path that runs under capture, and where it came from.

A forward that synchronises with the host (``.item()``, ``.cpu()``, ``torch.nonzero``, a Python
``if`` on a CUDA tensor) cannot be captured into a CUDA graph.  Libraries know it, and take
another path while a stream is capturing: transformers' mask code skips its packed-sequence
check (a ``.all()`` on a CUDA tensor) when ``torch.cuda.is_current_stream_capturing()`` says so,
exactly so that CUDA graphs can capture its decoders.  A check run eagerly, before the capture,
judges the eager path and rejects such a model although its captured path never synchronises.

So the check runs *during the real capture*: :func:`sync_errors_raised` sets torch's sync debug
mode to ``"error"`` around each captured phase, and the capture itself is the run that is
judged.  Every library sees the capture it asks about (through whatever function it asks with,
Python or C++), so the path judged is the path recorded.  Torch checks the mode *before* it
makes the synchronising CUDA call, so the forward raises while the capture is still valid: the
capture ends cleanly, its partial graph is freed, and no stream stays in capture mode (a
synchronising CUDA call made under capture would instead invalidate it, and can leave torch's
random generator believing it is still capturing).  A CUDA call that torch does not check
(``torch.cuda.synchronize()``, a library's own ``cudaMemcpy``) still fails the capture; that
failure is reported the same way.

Where: the exception's traceback holds the Python frames of the failing call, innermost last.
:func:`sync_site` names the innermost frame outside torch and Nimble (the dispatch-mode tracer
and ``nn.Module.__call__`` sit between the model's code and the C++ check), which is the line
that made the synchronising call: the model's own, or the library's it calls.
"""
from __future__ import annotations

import contextlib
import linecache
import os
import traceback
import warnings
from dataclasses import dataclass
from typing import Iterator, Sequence

from ..errors import CaptureError

HOST_SYNC_HELP = ("must not synchronise with the host (.item(), .cpu(), printing a tensor, "
                  "data-dependent Python control flow) and must keep its work on the GPU")

#: What torch says when it refuses a synchronising call: its sync debug mode, and its own check
#: of a copy to or from pageable host memory under capture (``.cpu()``).
TORCH_SYNC_MESSAGES = ("called a synchronizing CUDA operation",
                       "Cannot copy between CPU and CUDA tensors during CUDA graph capture")


@dataclass(frozen=True)
class SyncSite:
    """A line of Python code: where a failing call was made."""

    file: str
    line: int
    function: str
    code: str = ""  # the source line, stripped; empty where the file cannot be read

    def __str__(self) -> str:
        where = f"{self.file}:{self.line} (in {self.function})"
        return f"{where}: {self.code}" if self.code else where


def library_roots() -> tuple[str, ...]:
    """The package directories of torch and Nimble: frames there are never the model's call."""
    import torch

    nimble_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return (os.path.dirname(os.path.abspath(torch.__file__)), nimble_root)


def _inside(path: str, roots: Sequence[str]) -> bool:
    path = os.path.abspath(path)
    return any(path == root or path.startswith(root + os.sep) for root in roots)


def sync_site(frames: Sequence[traceback.FrameSummary],
              skip: Sequence[str]) -> SyncSite | None:
    """The innermost of ``frames`` (outermost first, as a traceback lists them) whose file is a
    real file outside every directory in ``skip``; ``None`` if there is none."""
    for frame in reversed(frames):
        if frame.filename.startswith("<") or _inside(frame.filename, skip):
            continue
        code = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
        return SyncSite(frame.filename, frame.lineno or 0, frame.name, code)
    return None


def _chain(error: BaseException) -> list[BaseException]:
    """``error``, the exception it was raised from or while handling, that one's, and so on."""
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and all(e is not seen for seen in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def exception_site(error: BaseException, skip: Sequence[str]) -> SyncSite | None:
    """Where ``error`` was raised, as :func:`sync_site` names it; or, where its own frames are
    all torch's and Nimble's, the exception it was raised from or while handling (a capture
    that fails raises again when it ends, from torch's frames), and so on inward."""
    for e in _chain(error):
        site = sync_site(traceback.extract_tb(e.__traceback__), skip)
        if site is not None:
            return site
    return None


def capture_failure(error: BaseException, what: str, name: str,
                    site: SyncSite | None, last_op: str = "") -> CaptureError:
    """The :class:`CaptureError` for ``error``, raised while capturing the ``what`` ("forward",
    "backward") of ``name``, made at ``site``; ``last_op`` names the last op the capture
    traced before it (where no line of the user's says where it broke)."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    after = f"; the last op traced before it: {last_op}" if last_op else ""
    at = f" at {site}" if site else \
        f" (no line outside torch and Nimble on the call's stack{after})"
    if any(m in str(e) for e in _chain(error) for m in TORCH_SYNC_MESSAGES):
        cause = f"it synchronises with the host{at}"
    else:
        cause = f"{first_line}; raised{at}"
    help_text = f"A {what} {HOST_SYNC_HELP}."
    if what == "backward" and site is None and INVALIDATED in str(error):
        help_text += f"  {HELD_ACCUMULATORS_HELP}"
    return CaptureError(f"the {what} of {name} cannot be captured into a CUDA graph: {cause}. "
                        f"{help_text}")


#: What the driver says when an earlier call broke the capture without raising itself.
INVALIDATED = "previous error during capture"
#: The other cause of a backward's capture broken with no line of the user's: the parameters'
#: gradient-accumulation nodes made earlier, on another stream, and still alive
#: (:mod:`nimble.record.stand_ins`; a DistributedDataParallel's are captured on stand-ins).
HELD_ACCUMULATORS_HELP = (
    "It also breaks when the parameters' gradient-accumulation nodes were made earlier on "
    "another stream and are still alive: an autograd graph of an eager step still held (a "
    "loss kept in a variable: del it first), or an object that keeps them (a data-parallel "
    "wrapper other than DistributedDataParallel, which Nimble handles).")


#: The error mode of every capture: only this thread's unsafe calls (a host sync, an
#: allocation) break it.  Under torch's default, "global", another thread's unsafe call breaks
#: a capture it has nothing to do with and fails itself: a server's thread that synchronises,
#: or NCCL's watchdog querying the end of a collective enqueued before the capture.
CAPTURE_ERROR_MODE = "thread_local"


@contextlib.contextmanager
def sync_errors_raised() -> Iterator[None]:
    """Make every synchronising call torch checks raise (torch's sync debug mode ``"error"``)
    for the duration, and restore the previous mode after."""
    import torch

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # torch's note that the mode is a prototype: not the user's
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
