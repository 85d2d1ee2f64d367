"""Checked calls into ``cuda.bindings.driver``, and the current context.

This module owns the one lazily imported copy of the bindings (:func:`bindings`; the module
itself is held in ``_drv`` here and nowhere else), the turning of a ``(CUresult, *values)`` tuple
into values or a :class:`CudaError` naming the call and its ``CUDA_ERROR_*`` code (:func:`call`,
:func:`checked_status` and :func:`raise_status` for the per-call path, and :func:`probe` for
calls whose failure is an answer), and the helpers that set up and query the context and device Nimble runs in
(:func:`ensure_context` and the like).
"""
from __future__ import annotations

from typing import Any

from ..errors import CudaError, NoGpuError
from .gpu import require_gpu

_drv: Any = None


def bindings():
    """The ``cuda.bindings.driver`` module (imported on first use)."""
    global _drv
    if _drv is None:
        try:
            from cuda.bindings import driver
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise NoGpuError(
                "cuda-bindings is not installed: python -m pip install 'cuda-bindings>=13.3,<14' "
                f"(the CUDA driver API for Python) to record or run models ({e})") from e
        _drv = driver
    return _drv


def _error_name(code) -> str:
    drv = bindings()
    try:
        err, name = drv.cuGetErrorName(code)
        if err == drv.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - the name is a courtesy; the code is still reported
        pass
    return getattr(code, "name", f"CUresult({int(code)})")


def _unwrap(result, name: str, detail: str = ""):
    code = result[0]
    if code != _drv.CUresult.CUDA_SUCCESS:
        raise CudaError(name, int(code), _error_name(code), detail)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def call(name: str, *args, detail: str = ""):
    """Call driver function ``name``; return its values (none, one, or a tuple); raise on error."""
    return _unwrap(getattr(bindings(), name)(*args), name, detail)


def checked_status(name: str):
    """Driver function ``name``, which returns no value, bound once and checked with one tuple
    read and one test: the per-call path's launch, writes and event calls."""
    fn = getattr(bindings(), name)

    def status_call(*args):
        code = fn(*args)[0]
        if code:  # CUresult is an int; CUDA_SUCCESS is 0
            raise_status(name, code)
    status_call.__name__ = name
    return status_call


def raise_status(name: str, code) -> None:
    """Raise the :class:`CudaError` for driver call ``name`` having returned ``code``: the check
    of a call whose ``(CUresult,)`` tuple the hottest path reads itself (see
    :attr:`CallPath.graph_launch`)."""
    raise CudaError(name, int(code), _error_name(code), "")


def probe(name: str, *args):
    """Call a driver function whose failure is an expected answer: ``(ok, values)``."""
    result = getattr(bindings(), name)(*args)
    if result[0] != _drv.CUresult.CUDA_SUCCESS:
        return False, None
    return True, (result[1] if len(result) == 2 else result[1:] if len(result) > 2 else None)


def ensure_context() -> Any:
    """Initialise the driver and make torch's primary context current on this thread.

    Raises :class:`NoGpuError` where there is no GPU or driver.
    """
    require_gpu()
    import torch

    torch.cuda.init()
    drv = bindings()
    call("cuInit", 0)
    ctx = call("cuCtxGetCurrent")
    if ctx is None or int(ctx) == 0:
        dev = call("cuDeviceGet", torch.cuda.current_device())
        ctx = call("cuDevicePrimaryCtxRetain", dev)
        # The reference is kept: torch may not have made its own yet (its CUDA init is lazy),
        # and releasing the only one would destroy the context under us.
        call("cuCtxSetCurrent", ctx)
    return ctx if isinstance(ctx, drv.CUcontext) else drv.CUcontext(int(ctx))


def current_context() -> Any:
    """The ``CUcontext`` current on this thread."""
    return call("cuCtxGetCurrent")


def use_context(context) -> None:
    """Make ``context`` (another thread's :func:`current_context`) current on this thread: a
    worker thread starts with none, and torch's current device there need not be the
    caller's."""
    call("cuCtxSetCurrent", context)


def synchronize_context() -> None:
    """Wait for all work in the current context."""
    call("cuCtxSynchronize")


#: Errors a kernel leaves on its context: every later call in the process fails with them.
CONTEXT_FAULTS = frozenset({
    "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ASSERT", "CUDA_ERROR_LAUNCH_TIMEOUT",
    "CUDA_ERROR_CONTEXT_IS_DESTROYED"})


def context_fault() -> str | None:
    """The ``CUDA_ERROR_*`` name of the fault that left the current context unusable, or None
    (no driver, no context current, or a healthy one: this waits for its work).  Asked on a
    failure path, it never raises in its turn."""
    try:
        drv = bindings()
    except Exception:  # noqa: BLE001 - no driver here: then there is no context to lose
        return None
    err, ctx = drv.cuCtxGetCurrent()
    if err != drv.CUresult.CUDA_SUCCESS or ctx is None or int(ctx) == 0:
        return None
    (code,) = drv.cuCtxSynchronize()
    name = _error_name(code) if code != drv.CUresult.CUDA_SUCCESS else None
    return name if name in CONTEXT_FAULTS else None


def device_supports_stream_writes(ordinal: int) -> bool:
    """Whether the GPU takes 64-bit stream memory writes (``cuStreamWriteValue64``)."""
    drv = bindings()
    attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
    return bool(call("cuDeviceGetAttribute", attr, call("cuDeviceGet", ordinal)))


def device_attributes(ordinal: int, names: dict[str, str]) -> dict[str, int]:
    """The device's attributes by the keys of ``names``, each value the name of a
    ``CUdevice_attribute`` without its ``CU_DEVICE_ATTRIBUTE_`` prefix
    (``{"sm_count": "MULTIPROCESSOR_COUNT"}``); one checked ``cuDeviceGetAttribute`` each."""
    drv = bindings()
    device = call("cuDeviceGet", ordinal)
    return {key: int(call("cuDeviceGetAttribute",
                          getattr(drv.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{attr}"), device,
                          detail=attr))
            for key, attr in names.items()}
