"""The GPU as torch sees it: whether there is one to run on, and cuDNN's autotuning switch.

Every check for a GPU (the recorder's, the driver context's, the command line's) is
:func:`require_gpu`, so a machine without one gets the same message everywhere.  torch is imported
on first use: importing Nimble never touches the GPU.
"""
from __future__ import annotations

from ..errors import NoGpuError


def require_gpu(who: str = "Nimble") -> None:
    """Raise :class:`NoGpuError` unless torch sees a CUDA GPU; ``who`` names what needs one
    (``"nimble bench"``, say)."""
    try:
        import torch
    except ImportError as e:
        raise NoGpuError(f"{who} needs torch, which is not importable here ({e})") from e
    if not torch.cuda.is_available():
        raise NoGpuError(
            f"{who} needs an NVIDIA GPU, and no CUDA GPU/driver is visible here "
            "(torch.cuda.is_available() is False); run it on a machine with one. "
            "`nimble inspect` works on recorded TaskGraph files without a GPU.")


def use_cudnn_benchmark() -> None:
    """Let cuDNN time its algorithms for each convolution shape and keep the fastest
    (``torch.backends.cudnn.benchmark``): how every recording, benchmark, tool and GPU test runs
    its models, so that they all meet the same kernels."""
    import torch

    torch.backends.cudnn.benchmark = True
