"""Key-value caches that grow by reallocating cannot be a CUDA graph's state.

transformers' ``DynamicCache`` appends each step's keys and values with ``torch.cat``: every
forward makes new tensors and rebinds the cache to them.  Captured, a graph reads the tensors the
cache held at capture and writes new ones where the cache then points; a replay never grows the
cache, and the next step reads the same old keys and values: a silently wrong decode step.  A
static cache (``StaticCache``) allocates its tensors once and writes each step into them in
place, which a graph replays.

What is detected is the library's own contract, not a class name: a transformers cache, and each
of its layers, says whether it is ``is_compileable`` (tensors of fixed shape at fixed
addresses).  An object of the cache protocol (:data:`CACHE_PROTOCOL`) that is not, found in the
module's state (an attribute of any submodule, or an item of a list, tuple or dict attribute),
among the inputs or in the forward's result, is an :class:`~nimble.errors.InputError`.  A cache
the forward makes and drops within itself (transformers' default with ``use_cache=True`` and no
``past_key_values``) is a temporary like any other, captured and replayed correctly, and is not
rejected; nor can a cache reachable only through a closure or a global be seen.
"""
from __future__ import annotations

from typing import Any, Iterator

from ..errors import InputError

STATIC_CACHE_ADVICE = (
    "hold a static cache in the module instead (transformers' StaticCache(config=..., "
    "max_cache_len=...), passed as past_key_values), return tensors only, or pass "
    "use_cache=False")


#: What a key-value cache's class has (transformers' ``Cache`` and its layers; a quantizer
#: also says whether it is ``is_compileable``, and is no cache).
CACHE_PROTOCOL = ("is_compileable", "update", "get_seq_length")


def is_growing_cache(value: Any) -> bool:
    """Whether ``value`` is a key-value cache that says its tensors are not of fixed shape and
    address."""
    if not all(hasattr(type(value), attr) for attr in CACHE_PROTOCOL):
        return False
    return not bool(value.is_compileable)


def growing_cache_error(value: Any, where: str) -> InputError:
    """The error for the growing cache ``value`` found at ``where`` ("input 0", ...)."""
    return InputError(
        f"{where} is a {type(value).__name__}, a key-value cache that reallocates its tensors "
        f"as it grows: a CUDA graph would keep reading the keys and values of the step it "
        f"captured; {STATIC_CACHE_ADVICE}")


def _state_values(module) -> Iterator[tuple[str, Any]]:
    """``(path, value)`` of every plain attribute of ``module`` and its submodules (not their
    parameters, buffers or children), and of the items of list, tuple and dict attributes."""
    import torch

    modules = module.named_modules() if isinstance(module, torch.nn.Module) else [("", module)]
    for prefix, m in modules:
        for attr, value in vars(m).items() if hasattr(m, "__dict__") else ():
            if attr in ("_parameters", "_buffers", "_modules") or isinstance(value, torch.nn.Module):
                continue
            path = f"{prefix}.{attr}" if prefix else attr
            yield path, value
            if isinstance(value, (list, tuple)):
                yield from ((f"{path}[{i}]", item) for i, item in enumerate(value))
            elif isinstance(value, dict):
                yield from ((f"{path}[{key!r}]", item) for key, item in value.items())


def check_module_caches(module, name: str) -> None:
    """Raise :class:`InputError` for a growing cache held in ``module``'s state."""
    for path, value in _state_values(module):
        if is_growing_cache(value):
            raise growing_cache_error(value, f"the attribute '{path}' of {name}")


def check_result_caches(result, name: str) -> None:
    """Raise :class:`InputError` for a growing cache in the result of ``name``'s forward."""
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten(result, is_leaf=is_growing_cache)
    for leaf in leaves:
        if is_growing_cache(leaf):
            raise growing_cache_error(leaf, f"a part of the result of the forward of {name}")
