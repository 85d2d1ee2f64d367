"""What ``torch.compile(model, backend="nimble", options={...})`` and ``mode=`` may say.

``options`` takes every field of :class:`~nimble.engine.options.PrepareOptions` by name
(``{"relaunches": 10, "fuzz": False}``), the keywords of :meth:`nimble.Nimble.prepare` that
make sense per compiled graph (``use_multi_stream``, ``max_streams``, ``return_copies``,
``quiet``), and the backend's own:

* ``max_shapes`` (int, default 8): how many prepared graphs one of Dynamo's graphs may get.  A
  graph Dynamo compiled for dynamic shapes (``dynamic=True``, ``mark_dynamic``, or the automatic
  recompilation after a second shape) gets one prepared graph per concrete shape it is called
  with; the one past this count is refused with :class:`~nimble.errors.InputError`.
* ``fallback`` (bool, default False): where Nimble cannot prepare a graph (it syncs with the
  host, reads a CPU tensor, is past ``max_shapes``...), run Inductor's code for it without a
  graph instead of raising, with a warning on the ``nimble`` logger, counted
  (:attr:`nimble.compile_backend.NimbleBackend.fallbacks`).  Off: no silent eager run.
* ``share_arena`` (bool, default False): the concrete shapes of a graph compiled for dynamic
  shapes share one arena, as :meth:`nimble.Nimble.prepare`'s buckets do, where every number
  Dynamo passes with the graph is a size of one of its tensors.  An arena is laid out from
  every bucket's plan before anything is allocated, so each new shape prepares every shape of
  the graph again (the graph serving the shapes before keeps serving until the new one is
  proven): memory for preparing time.  Inference only; a training step keeps its own arena.
* ``inductor`` (dict): Inductor config patches for this compile (``{"max_autotune": True}``);
  ``triton.cudagraphs`` stays off, since Nimble's graph replaces Inductor's.

``mode=`` is taken as Inductor's settings of that mode without its CUDA graphs, which
Nimble's graph replaces: ``"reduce-overhead"`` is the default's, ``"max-autotune"`` that of
``"max-autotune-no-cudagraphs"``.

A misspelt or unknown key, or a value of the wrong type, is an :class:`~nimble.errors.InputError`
naming the nearest known key, raised when Dynamo hands over the first graph.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any

from ..engine.options import PrepareOptions
from ..errors import InputError

#: ``torch.compile``'s modes, each as the mode whose Inductor settings the backend takes: the
#: CUDA graphs that ``reduce-overhead`` and ``max-autotune`` add are Nimble's own graph here
#: (transformers' ``CompileConfig`` passes ``mode="reduce-overhead"`` unless told otherwise).
MODES = {"default": "default", "reduce-overhead": "default",
         "max-autotune-no-cudagraphs": "max-autotune-no-cudagraphs",
         "max-autotune": "max-autotune-no-cudagraphs"}


@dataclass(frozen=True)
class BackendOptions:
    """Everything the backend was told, parsed and checked (:func:`parse_options`)."""

    prepare: PrepareOptions = field(default_factory=PrepareOptions)
    use_multi_stream: bool = True
    max_streams: int | None = None
    #: torch.compile's contract is eager's: every call returns tensors of its own.  False
    #: returns views into the arena, overwritten by the region's next call (cheaper).
    return_copies: bool = True
    quiet: bool = True
    max_shapes: int = 8
    fallback: bool = False
    share_arena: bool = False
    inductor: dict = field(default_factory=dict)


def _field_types(options: type, leave_out: str) -> dict:
    """Each field of the dataclass ``options`` but ``leave_out``, and the types its annotation
    names: read off the class, so that a field added there is taken by ``options={...}`` too."""
    hints = typing.get_type_hints(options)
    return {f.name: typing.get_args(hints[f.name]) or hints[f.name]
            for f in dataclasses.fields(options) if f.name != leave_out}


#: The backend's own keys (``prepare`` is the PrepareOptions the other keys make).
_BACKEND_KEYS = _field_types(BackendOptions, "prepare")
#: PrepareOptions' fields (``recording``, one model's, is refused by :func:`parse_options`).
_PREPARE_TYPES = _field_types(PrepareOptions, "recording")


def known_keys() -> list[str]:
    """Every key ``options`` may hold."""
    return sorted(set(_BACKEND_KEYS) | set(_PREPARE_TYPES))


def _unknown_key(key: str) -> InputError:
    near = difflib.get_close_matches(key, known_keys(), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return InputError(f"torch.compile(backend='nimble', options=...) has no option {key!r}"
                      f"{hint}; the options are: {', '.join(known_keys())}")


def _check_type(key: str, value: Any, expected) -> None:
    types = expected if isinstance(expected, tuple) else (expected,)
    # bool is an int to Python; an option that takes an int takes no bool.
    wrong = isinstance(value, bool) and bool not in types
    if wrong or not isinstance(value, types):
        names = " or ".join("None" if t is type(None) else t.__name__ for t in types)
        raise InputError(f"torch.compile(backend='nimble', options={{{key!r}: {value!r}}}): "
                         f"{key} takes {names}, not {type(value).__name__}")


def _inductor_patches(mode: str | None, patches: dict) -> dict:
    """Inductor's config for ``mode`` with the user's ``patches``, CUDA graphs off."""
    inductor_mode = MODES.get(mode or "default")
    if inductor_mode is None:
        raise InputError(f"torch.compile(backend='nimble', mode={mode!r}): the modes are "
                         f"{', '.join(MODES)}")
    settled: dict = {}
    if inductor_mode != "default":
        from torch._inductor import list_mode_options

        settled = dict(list_mode_options(inductor_mode))
    if patches.get("triton.cudagraphs"):
        raise InputError("options={'inductor': {'triton.cudagraphs': True}} asks for Inductor's "
                         "own CUDA graphs, which cannot be captured into Nimble's: leave it out")
    settled.update(patches)
    settled["triton.cudagraphs"] = False
    return settled


def parse_options(options: dict | None = None, mode: str | None = None) -> BackendOptions:
    """``options`` and ``mode`` as torch.compile passed them, checked; InputError otherwise."""
    options = dict(options or {})
    for key, value in options.items():
        if key == "recording":
            raise InputError("options={'recording': ...} holds one recording of one model, but "
                             "the backend records every graph Dynamo compiles itself: leave it "
                             "out")
        expected = _BACKEND_KEYS.get(key) or _PREPARE_TYPES.get(key)
        if expected is None:
            raise _unknown_key(key)
        _check_type(key, value, expected)
    if options.get("max_shapes", 1) < 1:
        raise InputError(f"options={{'max_shapes': {options['max_shapes']}}}: a compiled graph "
                         "needs at least one prepared graph; give 1 or more")
    prepare = {k: options.pop(k) for k in list(options) if k in _PREPARE_TYPES}
    options["inductor"] = _inductor_patches(mode, options.get("inductor", {}))
    return BackendOptions(prepare=PrepareOptions(**prepare), **options)

