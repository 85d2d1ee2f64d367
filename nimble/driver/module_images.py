"""The code image of every module the driver loads in this process, kept for saving graphs.

Some kernels a graph launches are in no file a later process can read: cuBLASLt's sm90 ``nvjet``
and CUTLASS GEMMs sit outside every fatbin container of its library file (the library unpacks
them itself before loading), and cuDNN's runtime-fused kernels and PyTorch's jiterator kernels
are compiled in the process.  The driver still loads each as a module, and NVIDIA's CUPTI reports
every module load with the cubin loaded (its resource callback ``MODULE_LOADED``).  So
:func:`start` subscribes to that callback and keeps a copy of each image, and a graph saved later
embeds the images its kernels came from.

Only modules loaded *after* :func:`start` are seen: call it before the process runs the model
(``nimble.keep_kernel_binaries()``; ``nimble save`` does).  While CUPTI is attached the process's
device-launchable graphs run slower (Nimble then launches from the host, see
:mod:`nimble.engine.profiler_guard`), and ``torch.profiler`` cannot attach a second subscriber:
keep it to the process that prepares and saves, not the ones that serve.

The library is loaded with ``ctypes`` (CUPTI has no Python binding in cuda-bindings); nothing
here runs before :func:`start` is called.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading

from ..errors import NimbleError

_CB_DOMAIN_RESOURCE = 3  # cupti_callbacks.h: CUPTI_CB_DOMAIN_RESOURCE
_CBID_MODULE_LOADED = 6  # CUPTI_CBID_RESOURCE_MODULE_LOADED
# CUpti_ResourceData: context, resourceHandle, then the resource descriptor pointer;
# CUpti_ModuleResourceData: moduleId (u32, padded), cubinSize (size_t), pCubin.
_DESCRIPTOR_AT, _SIZE_AT, _IMAGE_AT = 16, 8, 16

_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint,
                             ctypes.c_void_p)


class CuptiUnavailable(NimbleError):
    """CUPTI, which reports the modules a process loads, cannot be attached here."""


_state: dict = {"subscriber": None, "callback": None, "library": None}
#: The images kept, each once, in the order first loaded (a dict as an ordered set): libraries
#: load the same module again and again (most of a saving process's module loads are repeats,
#: measured in docs/findings.md), and a process saving many models ran out of host memory.
#: Keys compare whole images, so two images are one only where every byte is.
_images: dict[bytes, None] = {}
_lock = threading.Lock()


def _on_event(_user, domain, cbid, data) -> None:
    if domain != _CB_DOMAIN_RESOURCE or cbid != _CBID_MODULE_LOADED or not data:
        return
    descriptor = ctypes.c_void_p.from_address(data + _DESCRIPTOR_AT).value
    if not descriptor:
        return
    size = ctypes.c_size_t.from_address(descriptor + _SIZE_AT).value
    image = ctypes.c_void_p.from_address(descriptor + _IMAGE_AT).value
    if image and size:
        _keep(ctypes.string_at(image, size))


def _keep(image: bytes) -> None:
    with _lock:
        _images.setdefault(image, None)


def cupti_library_paths() -> list[str]:
    """Where ``libcupti`` may be: already mapped into this process (torch's profiler links it),
    beside the CUDA packages of this Python, or in a CUDA toolkit."""
    found: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            found += sorted({line.split()[-1] for line in f if "libcupti.so" in line})
    except OSError:
        pass
    for root in sys.path:
        found += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcupti.so*")))
        found += sorted(glob.glob(os.path.join(root, "nvidia", "cuda_cupti", "lib",
                                               "libcupti.so*")))
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    found += sorted(glob.glob(os.path.join(home, "extras", "CUPTI", "lib64", "libcupti.so*")))
    return [p for i, p in enumerate(found) if p not in found[:i] and os.path.isfile(p)]


def start() -> None:
    """Keep the image of every module loaded from now on (idempotent).  Raises
    :class:`CuptiUnavailable` where no CUPTI library is found or another subscriber holds it
    (a running ``torch.profiler``)."""
    if _state["subscriber"] is not None:
        return
    paths = cupti_library_paths()
    if not paths:
        raise CuptiUnavailable(
            "no libcupti found (it ships with torch's CUDA packages as nvidia-cuda-cupti, or "
            "with a CUDA toolkit under extras/CUPTI): install it to keep kernel binaries")
    library = ctypes.CDLL(paths[0])
    subscriber = ctypes.c_void_p()
    callback = _CALLBACK(_on_event)
    code = library.cuptiSubscribe(ctypes.byref(subscriber), callback, None)
    if code:
        raise CuptiUnavailable(
            f"cuptiSubscribe failed with CUPTI error {code} (another subscriber, such as a "
            "running torch.profiler, holds CUPTI): keep kernel binaries in a process that "
            "does not profile")
    code = library.cuptiEnableCallback(1, subscriber, _CB_DOMAIN_RESOURCE, _CBID_MODULE_LOADED)
    if code:
        library.cuptiUnsubscribe(subscriber)
        raise CuptiUnavailable(f"cuptiEnableCallback failed with CUPTI error {code}")
    _state.update(subscriber=subscriber, callback=callback, library=library)


def capturing() -> bool:
    """Whether module images are being kept (:func:`start` ran)."""
    return _state["subscriber"] is not None


def images() -> list[bytes]:
    """The distinct images of the modules loaded since :func:`start`, in the order each was
    first loaded."""
    with _lock:
        return list(_images)
