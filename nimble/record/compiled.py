"""What Nimble needs to know of a module compiled with ``torch.compile``.

A compiled module is prepared like any other: its forward is captured, and the Triton kernels
Inductor generates are traced by their launches (:mod:`nimble.record.tracer`).  Two compile
settings cannot be captured into Nimble's graph and are refused up front, with what to use
instead.
"""
from __future__ import annotations

import sys

from ..errors import InputError


def compiler_config(module) -> dict | None:
    """The Inductor options ``torch.compile`` was given for ``module``; None if not compiled."""
    getter = getattr(module, "get_compiler_config", None)
    if getter is None:
        return None
    try:
        config = getter()
    except Exception:  # noqa: BLE001 - a backend without a config is still compiled
        return {}
    return dict(config) if isinstance(config, dict) else {}


def is_compiled(module) -> bool:
    """Whether ``module`` is the result of ``torch.compile``."""
    return compiler_config(module) is not None or hasattr(module, "_orig_mod")


def module_name(module) -> str:
    """A module's class name for messages; a compiled module is named by the module inside."""
    inner = getattr(module, "_orig_mod", module)
    name = type(inner).__name__
    return f"{name} (compiled)" if inner is not module else name


def check_compiled(module) -> None:
    """Raise :class:`InputError` if ``module`` was compiled to run its own CUDA graphs.

    ``mode="reduce-overhead"`` and ``mode="max-autotune"`` wrap the compiled code in CUDA graphs
    of their own (cudagraph trees), whose replay cannot be captured into another graph.
    """
    config = compiler_config(module)
    if config is None:
        return
    inductor = sys.modules.get("torch._inductor.config")
    global_cudagraphs = bool(getattr(getattr(inductor, "triton", None), "cudagraphs", False))
    if config.get("triton.cudagraphs", global_cudagraphs):
        raise InputError(
            "this module was compiled with CUDA graphs of its own (torch.compile with mode="
            "'reduce-overhead' or 'max-autotune', or torch._inductor.config.triton.cudagraphs "
            "set), which cannot be captured into Nimble's graph; Nimble replaces them: compile "
            "with torch.compile(model) or mode='max-autotune-no-cudagraphs' and pass that")
