"""The backend object torch.compile calls: each graph compiled by Inductor, then a Region.

``torch.compile(model, backend="nimble")`` finds :data:`nimble.compile_backend.backend` through
the ``torch_dynamo_backends`` entry point (``pyproject.toml``), with no import of ``nimble``
first.  Dynamo calls it with each FX graph and its example inputs, and ``options=`` / ``mode=``
as torch.compile was given them (``torch._TorchCompileWrapper`` passes each only when set).
The graph is compiled by Inductor at once, as ``torch.compile(model)`` would compile it, and
Nimble prepares it at its first call (:mod:`nimble.compile_backend.region`).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

from ..progress import logger as log
from .options import parse_options
from .region import PrepareFn, Region, graph_inputs, has_symbols

#: ``compile(graph_module, example_inputs, inductor_config_patches) -> callable``.
CompileFn = Callable[[Any, Sequence[Any], dict], Callable]


def inductor_compile(gm, example_inputs: Sequence[Any], patches: dict) -> Callable:
    """Inductor's code for ``gm``, as ``torch.compile(model)`` makes it (AOTAutograd included:
    under grad mode the result is differentiable, with Inductor's backward)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=patches)


def _held_parameters(gm) -> list[str]:
    """The parameters that require grad which the graph holds as its own attributes, not as
    inputs (Dynamo with ``inline_inbuilt_nn_modules=False``)."""
    named = getattr(gm, "named_parameters", None)
    return [n for n, p in named() if p.requires_grad] if named is not None else []


def _graph_name(count: int) -> str:
    """Dynamo's id of the graph being compiled (``frame/recompile``, as ``TORCH_LOGS`` shows
    it), or the backend's own count where there is none."""
    try:
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
    except (ImportError, AttributeError):
        compile_id = None
    return str(compile_id) if compile_id is not None else f"#{count}"


class NimbleBackend:
    """``torch.compile``'s backend ``"nimble"``: every graph Dynamo hands over becomes a
    :class:`~nimble.compile_backend.region.Region`, compiled by Inductor and prepared by Nimble
    at its first call.

    ``compile`` and ``prepare`` replace Inductor and Nimble (the CPU tests pass stand-ins).
    :attr:`regions` lists the live regions, :attr:`fallbacks` counts the signatures that run
    without a Nimble graph (only with ``options={"fallback": True}``).
    """

    #: What Dynamo's messages call the backend (``BackendCompilerFailed``).
    __name__ = "nimble"

    def __init__(self, compile: CompileFn | None = None, prepare: PrepareFn | None = None
                 ) -> None:
        self._compile = compile or inductor_compile
        self._prepare = prepare
        self._regions: list[weakref.ref] = []
        self._count = 0

    def __call__(self, gm, example_inputs, *, options: dict | None = None,
                 mode: str | None = None) -> Region:
        parsed = parse_options(options, mode)
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        inputs = graph_inputs(placeholders, example_inputs)
        self._count += 1
        name = _graph_name(self._count)
        dynamic = has_symbols(example_inputs) or any(g.size_of for g in inputs)
        log.debug("graph %s: %d inputs (%d lifted weights)%s", name, len(inputs),
                  sum(g.static for g in inputs), ", dynamic shapes" if dynamic else "")
        compiled = self._compile(gm, example_inputs, parsed.inductor)
        region = Region(name, compiled, inputs, dynamic, parsed, self._prepare_fn(),
                        held=_held_parameters(gm))
        self._regions.append(weakref.ref(region))
        return region

    def __deepcopy__(self, memo) -> "NimbleBackend":
        # transformers' CompileConfig deep-copies its fields, the backend among them: a copy
        # would keep the regions and counts where the caller cannot see them.
        return self

    def _prepare_fn(self) -> PrepareFn:
        if self._prepare is None:
            from .holder import prepare_with_nimble

            self._prepare = prepare_with_nimble
        return self._prepare

    @property
    def regions(self) -> list[Region]:
        """The regions still alive (Dynamo's cache holds them), in the order compiled."""
        alive = [r() for r in self._regions]
        self._regions = [weakref.ref(r) for r in alive if r is not None]
        return [r for r in alive if r is not None]

    @property
    def fallbacks(self) -> int:
        """Signatures of live regions that run on Inductor's code alone (``fallback``)."""
        return sum(r.fallbacks for r in self.regions)

    def reset(self) -> None:
        """Forget the regions (torch.compile's wrapper calls a backend's ``reset`` on a reset)."""
        self._regions.clear()
        self._count = 0
