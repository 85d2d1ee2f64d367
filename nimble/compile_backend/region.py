"""One graph Dynamo handed to the backend: its inputs told apart, and a prepared graph per shape.

Dynamo calls the backend once per graph it compiles: once per region between graph breaks, and
again for each recompilation (a new input shape, a changed grad mode).  Each such graph is a
:class:`Region`.  Its inputs are of three kinds (:class:`GraphInput`): parameters and buffers
Dynamo lifted out of the model (marked static by Dynamo: read where they are, never copied per
call), tensors the call brings, and numbers (the sizes of a graph compiled for dynamic shapes).

A region prepares lazily: at the first call with a given *signature* (the shapes, strides and
dtypes of the tensors the call brings, and the numbers), the prepare function
(:func:`nimble.compile_backend.holder.prepare_with_nimble` outside the tests) records, schedules,
plans and proves one graph for it, and that graph serves every later call with the same
signature.  A graph Dynamo compiled for static shapes has one signature (Dynamo's guards send
any other shape to another graph), so after its first call a region skips the signature.

Each signature's graph has its arena of its own by default: an arena of buckets is laid out
from every bucket's plan before anything is allocated (:mod:`nimble.engine.arena_layout`), and
Dynamo's shapes come one at a time, each after the graphs before it are proven and serving.
With ``share_arena``, a graph compiled for dynamic shapes whose numbers are all sizes of its
tensors (:attr:`GraphInput.size_of`) pays for one arena in preparing time: each new signature
prepares every signature so far again, as buckets of one Nimble graph, which then serves them
all (the one before serves until it is proven, then is closed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from ..errors import InputError, NimbleError
from ..progress import logger as log
from .options import BackendOptions


@dataclass(frozen=True)
class GraphInput:
    """One placeholder of a Dynamo graph."""

    #: The placeholder's name (Dynamo names it after its source: ``l_self_modules_fc_...``).
    name: str
    #: A parameter or buffer Dynamo lifted as an input: its address does not change per call.
    static: bool
    #: A number (a size of a graph compiled for dynamic shapes), not a tensor.
    number: bool
    #: For a number that is a size of a tensor input: ``(that input's position, dim)``.
    size_of: tuple[int, int] | None = None
    #: A static tensor no module owns (``mark_static_address``: transformers' static cache):
    #: state the graph may update in place, kept where it is rather than bound as a weight.
    state: bool = False


def graph_inputs(placeholders: Sequence[Any], example_inputs: Sequence[Any]) -> list[GraphInput]:
    """Each input of a graph: Dynamo marks the tensors it lifted out of modules static
    (``_dynamo_static_input_type``, on the example and in the placeholder's metadata)."""
    import torch

    found = []
    sizes = _size_symbols(placeholders)
    for node, example in zip(placeholders, example_inputs):
        tensor_meta = getattr(node, "meta", {}).get("tensor_dict", {})
        static = isinstance(example, torch.Tensor) and bool(
            tensor_meta.get("_dynamo_static_input_type")
            or getattr(example, "_dynamo_static_input_type", None)
            or isinstance(example, torch.nn.Parameter))
        number = not isinstance(example, torch.Tensor)
        size_of = sizes.get(_symbol(node.meta.get("example_value"))) if number else None
        state = static and not _module_owned(node, example)
        found.append(GraphInput(node.name, static, number, size_of, state))
    return found


def _module_owned(node, example) -> bool:
    """Whether a static input is a module's parameter or buffer (Dynamo's source for it goes
    through ``_parameters`` or ``_buffers``, and names the placeholder after it)."""
    import torch

    if isinstance(example, torch.nn.Parameter):
        return True
    where = f"{getattr(node, '_dynamo_source', '')} {node.name}"
    return "_buffers" in where or "_parameters" in where


def _symbol(value) -> str | None:
    """The name of the symbol a symbolic number is (``s77``), None for anything else."""
    expr = getattr(getattr(value, "node", None), "expr", None)
    return str(expr) if expr is not None and getattr(expr, "is_Symbol", False) else None


def _size_symbols(placeholders: Sequence[Any]) -> dict[str, tuple[int, int]]:
    """Per symbol that is a dimension of a tensor input, the first ``(input, dim)`` it is."""
    found: dict[str, tuple[int, int]] = {}
    for i, node in enumerate(placeholders):
        shape = getattr(getattr(node, "meta", {}).get("example_value"), "shape", None)
        for d, size in enumerate(shape or ()):
            name = _symbol(size)
            if name is not None:
                found.setdefault(name, (i, d))
    return found


def has_symbols(example_inputs: Sequence[Any]) -> bool:
    """Whether Dynamo compiled this graph for dynamic shapes (a symbolic number or size)."""
    import torch

    symbolic = (torch.SymInt, torch.SymFloat, torch.SymBool)
    for x in example_inputs:
        if isinstance(x, symbolic):
            return True
        if isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape):
            return True
    return False


@dataclass
class PrepareRequest:
    """What a prepare function gets for one signature of a region."""

    region: str
    compiled: Callable  # Inductor's code for the graph, called with every input
    args: tuple  # the call's arguments, every input of the graph in order
    inputs: list[GraphInput]
    training: bool
    options: BackendOptions
    #: With ``share_arena``: the call's tensors of every signature so far (this one last), to
    #: be prepared as buckets of one arena.
    buckets: list[tuple] | None = None


#: What a run returns instead of outputs when the state tensors Dynamo passes are not those
#: it was prepared with (a new static cache): the region then prepares the signature again.
STALE = object()


class Run(Protocol):
    """A prepared signature: called with the region's arguments, returns the graph's outputs
    (or :data:`STALE`, having run nothing)."""

    def __call__(self, args: tuple) -> Any: ...


PrepareFn = Callable[[PrepareRequest], Run]


class InductorRun:
    """A signature Nimble could not take, run by Inductor's code alone (``fallback`` on)."""

    def __init__(self, compiled: Callable) -> None:
        self.compiled = compiled

    def __call__(self, args: tuple):
        return self.compiled(*args)


def close_run(run) -> None:
    """Free what ``run`` holds, where it holds anything (a stand-in or Inductor's code holds
    nothing to close; None: no run)."""
    close = getattr(run, "close", None)
    if close is not None:
        close()


def _number(x) -> bool:
    return isinstance(x, (bool, int, float))


class Region:
    """One graph Dynamo compiled, and a prepared graph per signature it was called with."""

    def __init__(self, name: str, compiled: Callable, inputs: list[GraphInput], dynamic: bool,
                 options: BackendOptions, prepare: PrepareFn, held: Sequence[str] = ()) -> None:
        self.name = name
        #: Parameters requiring grad that the graph holds as attributes, not inputs.
        self.held = list(held)
        self.compiled = compiled
        self.inputs = inputs
        self.dynamic = dynamic
        self.options = options
        self._prepare_fn = prepare
        #: Per signature, what serves it (a Nimble graph, or Inductor's code where it fell back).
        self.runs: dict[tuple, Run] = {}
        #: Signatures that run on Inductor's code alone (``fallback`` on).
        self.fallbacks = 0
        self._moving = [i for i, g in enumerate(inputs) if not g.static]
        # A static graph has one signature: after its first call, its run serves every call.
        self._only: Run | None = None
        #: With ``share_arena``: whether this graph's signatures are buckets of one Nimble
        #: graph (dynamic, and every number it takes a size of one of its tensors).
        self.shares = options.share_arena and dynamic and all(
            g.size_of is not None for g in inputs if g.number)
        # Per shared signature, copies of its tensors: the examples of the next prepare.
        self._examples: dict[tuple, tuple] = {}
        self._shared: Run | None = None

    def __call__(self, *args):
        only = self._only
        if only is not None:
            out = only(args)
            if out is not STALE:
                return out
        return self._dispatch(args)

    def signature(self, args: tuple) -> tuple:
        """The shapes, strides and dtypes of the tensors a call brings, and its numbers."""
        key = []
        for i in self._moving:
            x = args[i]
            key.append(x if _number(x) else (tuple(x.shape), x.stride(), x.dtype, x.device))
        return tuple(key)

    @property
    def prepared(self) -> int:
        """How many signatures run on a Nimble graph."""
        return len(self.runs) - self.fallbacks

    def _dispatch(self, args: tuple):
        if len(args) != len(self.inputs):
            raise InputError(f"graph {self.name} takes {len(self.inputs)} inputs, got "
                             f"{len(args)}")
        key = self.signature(args)
        run = self.runs.get(key)
        if run is not None:
            out = run(args)
            if out is not STALE:
                return out
            self._forget(run)
        run = self._new_run(args, key)
        self.runs[key] = run
        if not self.dynamic:
            self._only = run
        return run(args)

    def _forget(self, run: Run) -> None:
        """Drop ``run`` (its state tensors were replaced) from every signature it served."""
        log.info("graph %s: Dynamo passes other state tensors than the graph was prepared with "
                 "(a new static cache?): preparing it again", self.name)
        for key in [k for k, r in self.runs.items() if r is run]:
            del self.runs[key]
            self._examples.pop(key, None)
        if run is self._shared:
            self._shared = None
            self._examples.clear()
        self._only = None
        close_run(run)

    def _new_run(self, args: tuple, key: tuple) -> Run:
        training = _training(args)
        try:
            self._check_call(args)
            if self.shares and not training:
                return self._share(args, key)
            return self._prepare_fn(PrepareRequest(self.name, self.compiled, args, self.inputs,
                                                   training, self.options))
        except NimbleError as e:
            if not self.options.fallback:
                if hasattr(e, "add_note"):
                    e.add_note(f"(graph {self.name}, which torch.compile handed to backend "
                               "'nimble'; options={'fallback': True} runs such graphs on "
                               "Inductor's code alone, counted and logged)")
                raise
            self.fallbacks += 1
            log.warning("graph %s runs on Inductor's code without a Nimble graph for inputs "
                        "%s (fallback %d of this graph): %s", self.name, _describe(key),
                        self.fallbacks, e)
            return InductorRun(self.compiled)

    def _share(self, args: tuple, key: tuple) -> Run:
        """Every shared signature and this one prepared again as buckets of one arena; the
        graph that served them before is closed once the new one is proven."""
        import torch

        tensors = tuple(args[i].detach().clone() for i in self._moving
                        if isinstance(args[i], torch.Tensor))
        run = self._prepare_fn(PrepareRequest(
            self.name, self.compiled, args, self.inputs, False, self.options,
            buckets=[*self._examples.values(), tensors]))
        previous, self._shared = self._shared, run
        self._examples[key] = tensors
        for k in self._examples:
            self.runs[k] = run
        close_run(previous)
        return run

    def _check_call(self, args: tuple) -> None:
        """InputError for what a prepared graph cannot take, said for torch.compile's user."""
        import torch

        if self.held and torch.is_grad_enabled():
            raise InputError(
                f"graph {self.name} holds the model's parameters ({self.held[0]}, ... "
                f"{len(self.held)} in all) as its own attributes, not as inputs (Dynamo with "
                "torch._dynamo.config.inline_inbuilt_nn_modules=False), and grad mode is on: "
                "a prepared graph would give outputs without gradients. Call it under "
                "torch.no_grad() for inference; for training, leave inline_inbuilt_nn_modules "
                "at its default (True), which lifts the parameters as inputs")
        if self.prepared >= self.options.max_shapes:
            raise InputError(
                f"graph {self.name} was called with more than {self.options.max_shapes} "
                f"signatures (shapes, or numbers Dynamo passes as inputs, such as sizes of a "
                f"graph compiled for dynamic shapes): each gets a prepared graph and an arena "
                f"of its own. Raise options={{'max_shapes': ...}}, or compile with "
                f"dynamic=False and call with fewer shapes")
        devices = {x.device for x in args if isinstance(x, torch.Tensor)}
        for i in self._moving:
            x, g = args[i], self.inputs[i]
            if isinstance(x, torch.Tensor):
                others = devices - {x.device}
                if others and x.device.type == "cpu":
                    raise InputError(
                        f"input {g.name} of graph {self.name} is a tensor on the CPU, the "
                        f"others on {sorted(map(str, others))[0]}: a CUDA graph reads no host "
                        "values. Dynamo passes a Python number that crosses a graph break (an "
                        ".item()) this way; keep the value a GPU tensor, or set "
                        "options={'fallback': True} to run this graph without Nimble")
            elif not _number(x):
                raise InputError(f"input {g.name} of graph {self.name} is a "
                                 f"{type(x).__name__}; a prepared graph takes tensors and "
                                 "numbers")


def _training(args: tuple) -> bool:
    """Whether a call records a training step: grad mode on and some input requiring grad (a
    parameter Dynamo lifted, or an activation from the region before a graph break)."""
    import torch

    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in args)


def _describe(key: tuple) -> str:
    return ", ".join(str(list(k[0])) if isinstance(k, tuple) else repr(k) for k in key) or "()"

