"""Nimble's graphs in a process where a profiler ran, or that a CUDA tool is injected into.

``torch.profiler`` (Kineto) attaches NVIDIA's CUPTI when a profiler starts, whatever activities it
records, and leaves it attached for the rest of the process unless the environment has
``TEARDOWN_CUPTI=1`` when the profiler stops.  With CUPTI attached, the kernels of a graph
instantiated for *device launch* (Nimble's default, :class:`~nimble.engine.options.PrepareOptions`)
run about a fifth slower on the GPU, while the same graph instantiated for host launch, and
``torch.cuda.graph``'s graphs, run as before; every driver call also costs the host far more, in
any graph runtime (the measurements: docs/findings.md, "A profiler run and device-launchable
graphs").

So Nimble watches the profiler: :func:`watch_profiler` wraps ``torch.autograd.profiler``'s
start hook once (both ``torch.profiler.profile`` and ``torch.autograd.profiler.profile`` call it),
as :mod:`nimble.engine.weights` wraps ``Module._apply``.  A start without ``TEARDOWN_CUPTI=1``
marks CUPTI attached for good and bumps the weights epoch, so the next call of every prepared
graph leaves the fast path; there :func:`host_launch_if_profiled` rebuilds each device-launchable
phase for host launch (same nodes, same arena) and swaps it in, and a later ``prepare()``
instantiates for host launch from the start.  One ``RuntimeWarning`` per process says what
happened and what to do.  A profiler that ran before the first :class:`nimble.Nimble` was made is
not seen: the watch starts then.

A process started under ``compute-sanitizer`` (its ``NV_SANITIZER_INJECTION_*`` environment) or
with a CUDA tool injected (``CUDA_INJECTION64_PATH``: Nsight Systems and other CUPTI tools) builds
for host launch from the start, with the same one warning: the sanitizer's ``synccheck``
reports barrier errors in cuDNN's and Triton's kernels when they run inside a device-launchable
graph, and none for the same graph instantiated for host launch (docs/findings.md), and an
injected CUPTI tool is an attached CUPTI.
"""
from __future__ import annotations

import functools
import logging
import os
import warnings

from .weights import EPOCH

log = logging.getLogger("nimble")

_state = {"watching": False, "attached": False, "warned": False, "reason": ""}

#: What the warning says, once per process, after a profiler run.
ADVICE = (
    "a torch profiler ran in this process and left CUPTI attached (Kineto keeps it unless "
    "TEARDOWN_CUPTI=1 is in the environment when the profiler stops); with CUPTI attached a "
    "device-launchable graph runs slower on the GPU, so Nimble's graphs now launch from the "
    "host (nm.launch_mode == 'host'); a graph of hundreds of streams still runs 2-3% slower "
    "host-launched under CUPTI. Every driver call, in any graph runtime, also costs the host "
    "more while CUPTI stays attached. To keep both as before, set TEARDOWN_CUPTI=1 before "
    "profiling, or profile in another process.")


#: ... and in a process a CUDA tool was injected into (``{tool}`` names it).
TOOL_ADVICE = (
    "{tool} is attached to this process; kernels inside a device-launchable graph run slower "
    "under it, and compute-sanitizer misreports them, so Nimble's graphs launch from the host "
    "(nm.launch_mode == 'host'). Outside the tool they are device-launchable again.")


def injected_tool() -> str:
    """The CUDA tool injected into this process by its environment ("" for none)."""
    if any(name.startswith("NV_SANITIZER_INJECTION") for name in os.environ):
        return "compute-sanitizer"
    path = os.environ.get("CUDA_INJECTION64_PATH")
    return f"a CUDA tool ({os.path.basename(path)})" if path else ""


def cupti_attached() -> bool:
    """Whether a profiler started in this process since the watch began without asking Kineto
    to tear CUPTI down (``TEARDOWN_CUPTI=1``), or a CUDA tool was injected into it."""
    return _state["attached"] or bool(injected_tool())


#: ... and in a process that keeps its kernel binaries for saving (``nimble.keep_kernel_binaries``).
KEEP_ADVICE = (
    "this process keeps its kernel binaries for saving graphs (nimble.keep_kernel_binaries), "
    "which attaches CUPTI; with CUPTI attached a device-launchable graph runs slower, so "
    "Nimble's graphs here launch from the host (nm.launch_mode == 'host'). A graph saved here "
    "and loaded in another process launches from the device there.")


def note_cupti_attached(reason: str) -> None:
    """Nimble itself attached CUPTI (``reason`` says why): from now on graphs launch from the
    host, as after a profiler run."""
    if _state["attached"]:
        return
    _state["attached"] = True
    _state["reason"] = reason
    EPOCH[0] += 1


def _profiler_started() -> None:
    if os.environ.get("TEARDOWN_CUPTI") == "1" or _state["attached"]:
        return
    _state["attached"] = True
    EPOCH[0] += 1  # every prepared graph's next call takes the general path
    log.info("a profiler started without TEARDOWN_CUPTI=1: Nimble's graphs will launch "
             "from the host")


def watch_profiler() -> None:
    """Start watching for profiler runs (idempotent; needs torch)."""
    if _state["watching"]:
        return
    _state["watching"] = True
    from torch.autograd import profiler

    original = getattr(profiler, "_run_on_profiler_start", None)
    if original is None or getattr(original, "_nimble_watch", False):
        return  # a torch without the hook: nothing to watch

    @functools.wraps(original)
    def started(*args, **kwargs):
        _profiler_started()
        return original(*args, **kwargs)
    started._nimble_watch = True  # type: ignore[attr-defined]
    profiler._run_on_profiler_start = started


def warn_once(stacklevel: int = 3) -> None:
    """The one warning of the process about an attached CUPTI (:data:`ADVICE`)."""
    if _state["warned"]:
        return
    _state["warned"] = True
    tool = "" if _state["attached"] else injected_tool()
    advice = TOOL_ADVICE.format(tool=tool) if tool else \
        KEEP_ADVICE if _state.get("reason") else ADVICE
    warnings.warn(advice, RuntimeWarning, stacklevel=stacklevel)


def device_launch_allowed(requested: bool) -> bool:
    """Whether a graph built now should be device-launchable (warning once where the request
    is turned down because CUPTI is attached)."""
    if requested and cupti_attached():
        warn_once(stacklevel=4)
        return False
    return requested


def host_launch_if_profiled(prepared) -> bool:
    """Rebuild every device-launchable phase of ``prepared`` for host launch where CUPTI is
    attached; True if any was.  Call holding the phases' launch lock.

    The copies are built as served (:meth:`~nimble.engine.prepared.Prepared.phase_builder`:
    the built nodes, the current weight addresses, the gathers, priorities and late edges), so
    only the instantiation changes; each old exec is freed after the launches queued on it.
    """
    if not cupti_attached() or not any(b.device_launch for b in prepared.builts):
        return False
    from .. import driver
    from .rebuild import PhaseOptions

    builder = prepared.phase_builder()
    replaced = []
    try:
        for k, built in enumerate(prepared.builts):
            if built.device_launch:
                replaced.append((k, builder.build(k, PhaseOptions(device_launch=False))))
    except BaseException:
        for _, copy in replaced:
            copy.close()
        raise
    last = prepared.launchers[0].last_stream
    if last is not None:
        driver.stream_synchronize(last)
    for k, copy in replaced:
        old, prepared.builts[k] = prepared.builts[k], copy
        prepared.launchers[k].set_exec(copy.exec.handle)
        old.close()
    warn_once(stacklevel=5)
    return True
