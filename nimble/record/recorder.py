"""Recording: from a PyTorch module and example inputs to a :class:`Recording`.

``record()`` warms the model up on a side stream (cuDNN autotuning, lazy initialisation), then
captures one forward on a single stream (:mod:`nimble.record.capture`: op tracer and allocator
history), decodes every node (:mod:`nimble.record.decode`) and resolves addresses into buffers
(:mod:`nimble.record.resolve`).  ``record_step()`` does the same for a training step: the
forward and its backward, captured as two graphs sharing one pool, become one TaskGraph of two
*phases* (``meta["phases"]``: the task count of each).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .. import driver
from .decode import AddressOracle, decode_node
from .capture import (Captured, Phase, capture, gradient_hooks_set_aside, quiet_backward,
                      warm_up)
from .compiled import check_compiled, module_name
from ..driver.gpu import require_gpu
from ..errors import CaptureError, InputError, RecordError
from .module_weights import module_weights
from .kv_cache import check_module_caches, check_result_caches, growing_cache_error, \
    is_growing_cache
from ..progress import say
from .raw import DeviceRange, RawCapture, TensorSpec
from .resolve import build_taskgraph, unresolved_in_pool
from .gradient_average import GradientAverage, averaged_gradients
from .rng_cells import find_rng_cells
from ..ir.taskgraph import LIBRARY_MEMORY, BufferKind, TaskGraph
from .twin import moved_words
from .programmatic import programmatic_edges


@dataclass
class Recording:
    """A live recording: the TaskGraph plus the CUDA objects needed to rebuild and check it.

    ``torch_graph`` is the captured single-stream graph (the reference); ``nodes[i]`` is the
    ``CUgraphNode`` of task ``i``; ``static_inputs``/``static_outputs`` are the tensors the capture
    read and wrote.
    """

    graph: TaskGraph
    torch_graph: Any
    nodes: list
    static_inputs: list
    static_outputs: list
    output_spec: Any
    seconds: dict = field(default_factory=dict)
    #: Every captured graph in launch order (one for inference; forward, backward for training).
    torch_graphs: list = field(default_factory=list)
    #: For a training recording, how its flat inputs and outputs map to the autograd step.
    step: "StepLayout | None" = None

    def replay_reference(self, inputs: Sequence) -> list:
        """Run the captured single-stream graph(s) on ``inputs``; return copies of the outputs."""
        import torch

        with torch.no_grad():  # a training input that requires grad is a leaf
            for dst, src in zip(self.static_inputs, inputs):
                dst.copy_(src)
        for g in self.torch_graphs or [self.torch_graph]:
            g.replay()
        return [o.clone() for o in self.static_outputs]


@dataclass(slots=True)
class StepLayout:
    """How a training recording's flat inputs and outputs map onto one autograd step.

    The recording's inputs are the forward's ``forward_inputs`` inputs, then one incoming
    gradient per ``differentiable`` forward output; its outputs are the forward's
    ``forward_outputs`` outputs, then the gradients the backward computes.  The gradient
    *targets* are the inputs in ``inputs_with_grad`` followed by ``params``; ``grad_output_of``
    gives, per target, the index of its gradient among the recording's outputs (-1 where the
    target gets no gradient: a parameter the forward does not use).
    """

    forward_inputs: int
    forward_outputs: int
    differentiable: list[int]
    inputs_with_grad: list[int]
    params: list
    grad_output_of: list[int]


def _as_tensor_list(example_inputs) -> list:
    import torch

    if isinstance(example_inputs, torch.Tensor):
        items = [example_inputs]
    elif isinstance(example_inputs, (tuple, list)):
        items = list(example_inputs)
    else:
        raise InputError(
            f"example inputs must be a tensor or a tuple of tensors, got "
            f"{type(example_inputs).__name__}")
    for i, x in enumerate(items):
        if is_growing_cache(x):
            raise growing_cache_error(x, f"input {i}")
        if not isinstance(x, torch.Tensor):
            raise InputError(f"input {i} is a {type(x).__name__}; Nimble takes tensors (or a "
                             f"tuple of tensors) as inputs")
        if not x.numel():
            raise empty_input_error(i, x)
        if x.device.type != "cuda":
            raise InputError(f"input {i} is on {x.device}; move it to the GPU first "
                             f"(x.cuda() or x.to('cuda'))")
        if x.layout != torch.strided:
            raise InputError(f"input {i} has layout {x.layout}; only dense tensors are supported")
    return items


def empty_input_error(i: int, x) -> InputError:
    """The error for example input ``i``, a tensor ``x`` with no elements: a recording of it
    has nothing to read (and a slot of 0 bytes)."""
    batch = " (a batch of 0)" if x.dim() and x.shape[0] == 0 else ""
    return InputError(f"input {i} has shape {tuple(x.shape)}, no elements{batch}: prepare() and "
                      "record() run the model once on the example, so give one with at least one "
                      "element (one row of the batch), as the model is called later")


def check_module(module) -> None:
    """Raise :class:`InputError` if a parameter or buffer of ``module`` is not on the GPU, or if
    it was compiled to run CUDA graphs of its own."""
    import torch

    check_compiled(module)
    if not isinstance(module, torch.nn.Module):
        if callable(module):
            return
        raise InputError(f"expected a torch.nn.Module, got {type(module).__name__}")
    for kind, named in (("parameter", module.named_parameters()),
                        ("buffer", module.named_buffers())):
        for name, t in named:
            if t.device.type != "cuda":
                raise InputError(f"{kind} '{name}' is on {t.device}; move the model to the GPU "
                                 f"first (model.cuda())")


def _statics(module, static_inputs) -> list[DeviceRange]:
    """Parameters and buffers (one range per storage) and the inputs, as device ranges."""
    import torch

    ranges: dict[int, DeviceRange] = {}
    if isinstance(module, torch.nn.Module):
        for name, t in module_weights(module).items():
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in ranges:
                ranges[st.data_ptr()] = DeviceRange(st.data_ptr(), st.nbytes(), name,
                                                    BufferKind.PARAM)
    for i, x in enumerate(static_inputs):
        st = x.untyped_storage()
        ranges[st.data_ptr()] = DeviceRange(st.data_ptr(), max(st.nbytes(), 1), f"input{i}",
                                            BufferKind.INPUT)
    return list(ranges.values())


def _tensor_spec(t) -> TensorSpec:
    return TensorSpec(t.data_ptr(), list(t.shape), list(t.stride()),
                      str(t.dtype).removeprefix("torch."))


def explain_pointer(graph: TaskGraph, raw: RawCapture, task: int, pointer) -> str:
    """One line on an unresolved pointer: where it is, and every allocation near its value."""
    t = graph.tasks[task]
    op = graph.op_of(t)
    where = f"{op.name} [op {op.index}, allocations {raw.ops[op.index].alloc_begin}.." \
            f"{raw.ops[op.index].alloc_end}) in {op.module or '?'}" if op else "no op"
    near = sorted(raw.allocs, key=lambda a: min(abs(pointer.value - a.address),
                                                abs(pointer.value - a.address - a.size)))[:3]
    desc = ", ".join(f"#{a.ordinal} [{a.address:#x}+{a.size:#x})" for a in near)
    return (f"  task {task} {t.short_name} ({where}) param byte {pointer.location} = "
            f"{pointer.value:#x}; nearest allocations during capture: {desc or 'none'}")


def record(module, example_inputs, *, warmup: int = 3, name: str | None = None,
           quiet: bool = True, strict: bool = False) -> Recording:
    """Record one forward of ``module`` on ``example_inputs`` (a tensor or tuple of tensors).

    Raises :class:`InputError` for inputs or models not on the GPU, :class:`CaptureError` for a
    forward that cannot be captured (one that synchronises with the host, say), and
    :class:`RecordError` if a node cannot be decoded or a pointer into the captured memory pool
    resolves to no buffer.
    """
    inputs = _as_tensor_list(example_inputs)
    check_module(module)
    driver.ensure_context()
    static_inputs = [x.detach().clone() for x in inputs]

    def forward():
        return module(*static_inputs)

    return record_callable(forward, static_inputs, module=module, warmup=warmup,
                           name=name or module_name(module), quiet=quiet, strict=strict,
                           training=bool(getattr(module, "training", False)))


def _warm(fn: Callable[[], Any], warmup: int, name: str, quiet: bool) -> float:
    t0 = time.perf_counter()
    say(f"warming up {name} ({warmup} iterations)", quiet)
    try:
        warm_up(fn, warmup)
    except RuntimeError as e:
        raise CaptureError(f"the model failed to run on the example inputs: {e}") from e
    return time.perf_counter() - t0


def _meta(name: str, static_inputs: list, training: bool, device: int) -> dict:
    import torch

    return {"model": name, "training": training,
            "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "batch": int(static_inputs[0].shape[0])
            if static_inputs and static_inputs[0].dim() else 0,
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _tensor_leaves(value, name: str, what: str = "forward") -> tuple[list, Any]:
    """The flat tensors of a forward's result and its tree structure; InputError otherwise."""
    import torch
    from torch.utils._pytree import tree_flatten

    leaves, spec = tree_flatten(value)
    if not leaves or not all(isinstance(x, torch.Tensor) for x in leaves):
        raise InputError(f"the {what} of {name} must return a tensor or a (nested) tuple, list "
                         f"or dict of tensors; got {type(value).__name__}")
    return leaves, spec


def record_callable(fn: Callable[[], Any], static_inputs: list, *, module=None, warmup: int = 3,
                    name: str = "model", quiet: bool = True, training: bool = False,
                    strict: bool = False) -> Recording:
    """Capture ``fn()`` (which reads ``static_inputs``) and decode it; see :func:`record`.

    A kernel argument word that points into the capture's memory pool where no allocation was
    live is taken for a stale value and left as it is (the proof in ``prepare()`` catches a
    real read through one; ``graph.meta["unresolved_report"]`` names them); with ``strict`` it
    is a :class:`RecordError` instead.
    """
    require_gpu()
    seconds = {"warmup": _warm(fn, warmup, name, quiet)}
    if module is not None:  # after the warm-up: a forward may make its cache at its first call
        check_module_caches(module, name)

    t0 = time.perf_counter()
    say("capturing one forward on a single stream", quiet)
    captured = capture([Phase("forward", lambda _: fn())], module, name)
    seconds["capture"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    check_result_caches(captured.results[0], name)
    outputs, out_spec = _tensor_leaves(captured.results[0], name)
    graph, nodes = _decode(captured, _statics(module, static_inputs), static_inputs, outputs,
                           name, quiet, strict,
                           _meta(name, static_inputs, training, captured.device))
    find_rng_cells(captured.torch_graphs, graph, captured.device)
    seconds["decode"] = time.perf_counter() - t0
    graph.meta["record_seconds"] = dict(seconds)
    return Recording(graph, captured.torch_graphs[0], nodes, static_inputs, outputs, out_spec,
                     seconds, torch_graphs=captured.torch_graphs)


def record_step(module, example_inputs, *, warmup: int = 3, name: str | None = None,
                quiet: bool = True, strict: bool = False,
                average: GradientAverage | None = None) -> Recording:
    """Record one training step of ``module``: its forward, then its backward, as two graphs.

    The backward is ``torch.autograd.grad`` of the forward's outputs that require grad, with
    incoming gradients read from static tensors, with respect to the inputs that require grad
    and every parameter that does; both graphs share one memory pool, so the activations the
    forward saves are buffers the backward reads.  The result's ``step``
    (:class:`StepLayout`) says which input and output is which.  Module state the warm-up and
    capture change (batch-norm running statistics) is the caller's to save and restore.  The
    parameters' gradient hooks are not recorded: they run when autograd hands the prepared
    backward's gradients over (:func:`~nimble.record.capture.gradient_hooks_set_aside`).
    With ``average``, the parameters' gradients are averaged over its process group inside
    the backward (:mod:`nimble.record.gradient_average`); every rank must record alike.
    Raises as :func:`record` does, and :class:`InputError` when nothing requires grad.
    """
    inputs = _as_tensor_list(example_inputs)
    check_module(module)
    require_gpu()
    driver.ensure_context()
    name = name or module_name(module)
    static_inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    targets = _grad_targets(module, static_inputs, name)
    with gradient_hooks_set_aside(targets.tensors):
        warm = _warm_step(module, static_inputs, targets, warmup, name, quiet, average)
        check_module_caches(module, name)
        seconds = {"warmup": warm.seconds}

        t0 = time.perf_counter()
        captured = _capture_step_of(module, static_inputs, targets, warm, name, quiet, average)
        seconds["capture"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    forward_out, out_spec = _tensor_leaves(captured.results[0], name)
    computed, grad_output_of = _computed_gradients(captured.results[1], len(forward_out))
    all_inputs = static_inputs + warm.grad_inputs
    outputs = [o.detach() for o in forward_out] + computed
    graph, nodes = _decode(captured, _statics(module, all_inputs), all_inputs, outputs, name,
                           quiet, strict, _meta(name, static_inputs, True, captured.device))
    graph.meta.update(phases=list(captured.node_counts),
                      phase_inputs=[len(static_inputs), len(warm.grad_inputs)],
                      phase_outputs=[len(forward_out), len(computed)])
    find_rng_cells(captured.torch_graphs, graph, captured.device)
    seconds["decode"] = time.perf_counter() - t0
    graph.meta["record_seconds"] = dict(seconds)
    layout = StepLayout(len(static_inputs), len(forward_out), warm.differentiable,
                        targets.inputs_with_grad, targets.params, grad_output_of)
    return Recording(graph, captured.torch_graphs[0], nodes, all_inputs, outputs, out_spec,
                     seconds, torch_graphs=captured.torch_graphs, step=layout)


@dataclass(slots=True)
class _GradTargets:
    """What a training step differentiates with respect to: the inputs that require grad, then
    the parameters that do."""

    inputs_with_grad: list[int]  # positions among the static inputs
    params: list
    tensors: list  # the inputs, then the parameters


def _grad_targets(module, static_inputs: list, name: str) -> _GradTargets:
    """The gradient targets of a training step; InputError where nothing requires grad."""
    import torch

    params = [p for p in module.parameters() if p.requires_grad] \
        if isinstance(module, torch.nn.Module) else []
    with_grad = [i for i, x in enumerate(static_inputs) if x.requires_grad]
    tensors = [static_inputs[i] for i in with_grad] + params
    if not tensors:
        raise InputError(f"nothing in {name} requires grad (no parameter, no input): "
                         "prepare(training=False) for inference")
    return _GradTargets(with_grad, params, tensors)


@dataclass(slots=True)
class _WarmStep:
    """What warming a training step up found out."""

    seconds: float
    differentiable: list[int]  # the forward outputs that require grad
    grad_inputs: list  # per differentiable output, the static tensor of its incoming gradient
    missing: list[bool]  # per gradient target, whether it got no gradient


def _step_gradients(outputs: list, targets: _GradTargets, grad_outputs: list,
                    average: GradientAverage | None) -> tuple:
    """The step's gradients: of ``outputs`` with respect to the targets, the parameters'
    averaged over the ranks where ``average`` asks."""
    import torch

    grads = torch.autograd.grad(outputs, targets.tensors, grad_outputs, allow_unused=True)
    if average is None:
        return grads
    first = len(targets.inputs_with_grad)
    return tuple(grads[:first]) + tuple(averaged_gradients(grads[first:], average))


def _warm_step(module, static_inputs: list, targets: _GradTargets, warmup: int, name: str,
               quiet: bool, average: GradientAverage | None = None) -> _WarmStep:
    """Run the whole step ``warmup`` times; which outputs are differentiated, and static
    tensors for their incoming gradients."""
    import torch

    last: list = []

    def step():
        with torch.enable_grad():
            out = module(*static_inputs)
            leaves, _ = _tensor_leaves(out, name)
            diff = [i for i, o in enumerate(leaves) if o.requires_grad]
            if not diff:
                raise InputError(f"no output of {name} requires grad: there is nothing to "
                                 "train (are all parameters frozen?)")
            grads = _step_gradients([leaves[i] for i in diff], targets,
                                    [torch.ones_like(leaves[i]) for i in diff], average)
        last[:] = [leaves, diff, [g is None for g in grads]]

    with quiet_backward():
        seconds = _warm(step, warmup, name, quiet)
    leaves, diff, missing = last
    return _WarmStep(seconds, diff, [torch.zeros_like(leaves[i]) for i in diff], missing)


def _capture_step_of(module, static_inputs: list, targets: _GradTargets, warm: _WarmStep,
                     name: str, quiet: bool, average: GradientAverage | None) -> Captured:
    """:func:`_capture_step`, on stand-ins for the parameters where something outside the
    step holds their gradient-accumulation nodes (:mod:`nimble.record.stand_ins`); a stand-in
    left without the gradient its parameter got in the warm-up (the module reaches that
    parameter other than through its attribute) is a CaptureError."""
    if average is None or not average.held_accumulators:
        return _capture_step(module, static_inputs, targets, warm, name, quiet, average)
    from .stand_ins import parameter_stand_ins

    inputs = targets.tensors[:len(targets.inputs_with_grad)]
    with parameter_stand_ins(module, targets.params) as fresh:
        captured = _capture_step(module, static_inputs,
                                 _GradTargets(targets.inputs_with_grad, targets.params,
                                              inputs + fresh), warm, name, quiet, average)
    missing = [g is None for g in captured.results[1]]
    if missing != warm.missing:
        lost = [i - len(inputs) for i, (m, w) in enumerate(zip(missing, warm.missing))
                if m and not w and i >= len(inputs)]
        names = {id(p): n for n, p in module.named_parameters()}
        which = ", ".join(names.get(id(targets.params[i]), f"#{i}") for i in lost[:3])
        captured.release()
        raise CaptureError(
            f"{name}'s training step could not be captured on stand-ins for its parameters: "
            f"{len(lost)} parameter(s) ({which}) got a gradient in the warm-up but none on "
            "the stand-ins, so the module reaches them other than through its attributes (a "
            "plain list or dict of tensors?).  Hold them as nn.Parameter attributes or in "
            "nn.ParameterList / nn.ParameterDict" if lost else
            f"{name}'s training step gave other gradients on stand-ins for its parameters "
            "than in its warm-up")
    return captured


def _capture_step(module, static_inputs: list, targets: _GradTargets, warm: _WarmStep,
                  name: str, quiet: bool, average: GradientAverage | None = None) -> Captured:
    """Capture the step's forward and its backward, as two phases."""
    import torch

    def forward(_):
        with torch.enable_grad():
            return module(*static_inputs)

    def backward(out):
        leaves, _ = _tensor_leaves(out, name)
        return _step_gradients([leaves[i] for i in warm.differentiable], targets,
                               warm.grad_inputs, average)

    say("capturing one forward and its backward on a single stream", quiet)
    with quiet_backward():
        return capture([Phase("forward", forward), Phase("backward", backward)], module, name)


def _computed_gradients(grads, first_output: int) -> tuple[list, list[int]]:
    """``(the gradients computed, per target the index of its gradient among the outputs or
    -1)``, the gradients' outputs numbered from ``first_output``."""
    computed = [g for g in grads if g is not None]
    grad_output_of, k = [], first_output
    for g in grads:
        grad_output_of.append(-1 if g is None else k)
        k += g is not None
    return computed, grad_output_of


def _decode(captured: Captured, statics: list[DeviceRange], static_inputs: list, outputs: list,
            name: str, quiet: bool, strict: bool, meta: dict) -> tuple[TaskGraph, list]:
    """``(graph, nodes)``: every node decoded, every address resolved."""
    listed = [(raw, driver.graph_nodes_of(raw))
              for raw in (g.raw_cuda_graph() for g in captured.torch_graphs)]
    nodes = [n for _, graph_nodes in listed for n in graph_nodes]
    programmatic = programmatic_edges(listed)
    say(f"decoding {len(nodes)} graph nodes from {len(captured.ops)} ops", quiet)
    oracle = AddressOracle()
    raw_nodes = [decode_node(n, oracle) for n in nodes]
    moved, evidence = moved_words(raw_nodes, captured.twin, captured.twin_note)
    if moved is None:
        warnings.warn(f"recording {name}: kernel words that resemble pointers are told apart "
                      f"by their values alone ({evidence}); prepare()'s proof still checks the "
                      "rebuilt graph", RuntimeWarning, stacklevel=4)
    pool = captured.pool
    externals = list(captured.externals) + library_memory(oracle.ranges, pool, captured.allocator)
    raw = RawCapture(
        ops=captured.ops, nodes=raw_nodes, allocs=captured.allocs, statics=statics,
        externals=[e for e in externals if not any(
            s.address <= e.address < s.end for s in statics)],
        pool=pool, allocator=list(captured.allocator),
        inputs=[_tensor_spec(x) for x in static_inputs],
        outputs=[_tensor_spec(x) for x in outputs],
        moved_words=moved,
        meta={**meta, "allocations": len(captured.allocs), "pointer_evidence": evidence,
              "triton_launches": sum(1 for op in captured.ops if "::" not in op.name),
              "pool_bytes": sum(r.size for r in pool),
              "pool_segments": [[r.address, r.size] for r in pool]})
    for g in captured.torch_graphs:
        if hasattr(g, "instantiate"):  # keep_graph=True leaves that to replay
            g.instantiate()
    graph = build_taskgraph(raw)
    if programmatic:
        graph.meta["programmatic_edges"] = [list(e) for e in programmatic]
    stale = unresolved_in_pool(graph, raw)
    graph.meta["stale_pool_words"] = len(stale)
    if stale:
        message = (f"{len(stale)} kernel argument word(s) point into the captured memory pool "
                   f"where no allocation was live, and were left as they are:\n"
                   + "\n".join(explain_pointer(graph, raw, t, p) for t, p in stale[:4]))
        if strict:
            raise RecordError(message)
        graph.meta["unresolved_report"] = message
    return graph, nodes


def library_memory(found: Sequence[DeviceRange], pool: Sequence[DeviceRange],
                   allocator: Sequence[DeviceRange]) -> list[DeviceRange]:
    """The driver allocations kernel words point into (``found``) that a library made itself:
    those that overlap neither the capture's pool nor any segment of torch's allocator (free
    allocator memory, or another graph's pool, is not a library's; see
    :mod:`nimble.record.resolve`)."""
    torch_memory = list(pool) + list(allocator)
    return [DeviceRange(r.address, r.size, f"{LIBRARY_MEMORY}{r.address:#x}") for r in found
            if not any(r.overlaps(p) for p in torch_memory)]
