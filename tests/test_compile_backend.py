"""``torch.compile(model, backend="nimble")`` on the CPU: the regions and signatures Dynamo's
graphs become, with stand-ins for Inductor (the FX graph run as it is) and for Nimble's prepare
(the region's module run eagerly, every request noted).  The registration and the options
parsed alone: test_compile_backend_options.py."""
from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from nimble.compile_backend import NimbleBackend, parse_options  # noqa: E402
from nimble.compile_backend.holder import NimbleRun, RegionModule  # noqa: E402
from nimble.compile_backend.region import GraphInput, Region  # noqa: E402
from nimble.engine.options import PrepareOptions  # noqa: E402
from nimble.errors import CaptureError, InputError  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Requests:
    """A prepare function that notes every request and runs the region's module eagerly."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.seen = []
        self.fail = fail

    def __call__(self, request):
        self.seen.append(request)
        if self.fail is not None:
            raise self.fail
        module = RegionModule(request.compiled, request.inputs, request.args, request.training)
        return NimbleRun(module, module)


def _fx_as_is(gm, example_inputs, patches):
    return gm.forward


def _backend(**kwargs):
    requests = Requests(**kwargs)
    return NimbleBackend(compile=_fx_as_is, prepare=requests), requests


# ---- options (parsed alone: test_compile_backend_options.py) ------------------------------------

def test_torch_compile_reports_a_misspelt_option_as_the_backends_input_error():
    compiled = torch.compile(torch.nn.Linear(4, 4), backend=_backend()[0],
                             options={"relaunchs": 1})
    with pytest.raises(Exception) as caught:
        compiled(torch.randn(2, 4))
    inner = getattr(caught.value, "inner_exception", caught.value)
    assert isinstance(inner, InputError) and "relaunches" in str(inner)


# ---- regions and signatures through torch.compile ---------------------------------------------

class Break(torch.nn.Module):
    """Two linear layers with a host read between them: two graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4)
        self.checked = False

    def forward(self, x):
        h = torch.relu(self.a(x))
        # The same value every call: the graph after the break is compiled once.
        self.checked = bool((h.amin() >= 0).item())
        return self.b(h)


def test_a_graph_break_gives_two_regions_each_prepared_once():
    model = Break().eval()
    backend, requests = _backend()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
        for _ in range(3):
            torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
    assert [r.prepared for r in backend.regions] == [1, 1]
    assert len(requests.seen) == 2
    assert not any(r.training for r in requests.seen)


def test_lifted_weights_are_static_and_bound_as_the_models_own_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).eval()
    backend, requests = _backend()
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(3, 4))
    (region,) = backend.regions
    statics = [g for g in region.inputs if g.static]
    assert len(statics) == 6 and not any(g.number for g in region.inputs)
    moving = [g for g in region.inputs if not g.static]
    assert len(moving) == 1
    run = region.runs[next(iter(region.runs))]
    bound = {id(t) for t in list(run.module.parameters()) + list(run.module.buffers())}
    # Eval-mode batch norm reads every buffer but its batch count.
    read = [t for name, t in list(model.named_parameters()) + list(model.named_buffers())
            if not name.endswith("num_batches_tracked")]
    assert bound == {id(t) for t in read}
    assert run.module.tensor_positions == [region.inputs.index(moving[0])]


def test_three_batch_sizes_are_three_prepared_signatures():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    backend, requests = _backend()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for batch in (1, 8, 32, 8, 1):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    # Dynamo compiles the first shape static, then one graph for dynamic shapes, which gets a
    # prepared graph per concrete shape.
    assert [(r.dynamic, r.prepared) for r in backend.regions] == [(False, 1), (True, 2)]
    assert sorted(tuple(r.args[i].shape[0] for i, g in enumerate(r.inputs)
                        if not g.static and not g.number) for r in requests.seen) == \
        [(1,), (8,), (32,)]


def test_past_max_shapes_a_dynamic_graph_is_refused_or_falls_back_counted(caplog):
    model = torch.nn.Linear(8, 8).eval()
    backend, _ = _backend()
    compiled = torch.compile(model, backend=backend, dynamic=True, options={"max_shapes": 2})
    # (Dynamo specializes a size of 1 even with dynamic=True: batches from 2 share a graph.)
    with torch.no_grad():
        compiled(torch.randn(2, 8))
        compiled(torch.randn(3, 8))
        with pytest.raises(InputError, match="more than 2 signatures"):
            compiled(torch.randn(4, 8))

    torch._dynamo.reset()
    backend, _ = _backend()
    compiled = torch.compile(model, backend=backend, dynamic=True,
                             options={"max_shapes": 2, "fallback": True})
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="nimble"):
        for batch in (2, 3, 4, 4):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(compiled(x), model(x))
    assert backend.fallbacks == 1
    assert [r.prepared for r in backend.regions] == [2]
    assert sum("without a Nimble graph" in r.message for r in caplog.records) == 1


def test_a_prepare_failure_raises_its_typed_error_unless_fallback_is_asked_for():
    model = torch.nn.Linear(4, 4).eval()
    backend, _ = _backend(fail=CaptureError("the forward synchronises with the host"))
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), pytest.raises(CaptureError, match="synchronises") as caught:
        compiled(torch.randn(2, 4))
    assert any("fallback" in note for note in getattr(caught.value, "__notes__", [""]))

    torch._dynamo.reset()
    backend, requests = _backend(fail=CaptureError("the forward synchronises with the host"))
    compiled = torch.compile(model, backend=backend, options={"fallback": True})
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        compiled(x)
    assert backend.fallbacks == 1 and len(requests.seen) == 1


@pytest.mark.parametrize("guards", ["default", "module guards skipped"])
def test_a_reassigned_parameter_is_rebound_and_an_in_place_update_read_as_it_is(guards):
    """Also with Dynamo's guards on the modules filtered out (docs/inference.md's recipe for
    the lowest host cost): the reassigned weight still reaches the graph, since Dynamo fetches
    every lifted weight afresh at each call and the region follows it."""
    model = torch.nn.Linear(4, 4).eval()
    backend, requests = _backend()
    options = None if guards == "default" else {
        "guard_filter_fn": torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe}
    compiled = torch.compile(model, backend=backend, options=options)
    x = torch.randn(2, 4)
    with torch.no_grad():
        compiled(x)
        model.weight.mul_(2)  # in place: the bound tensor is the model's
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
        model.weight = torch.nn.Parameter(torch.randn(4, 4))
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    (region,) = backend.regions
    run = region.runs[next(iter(region.runs))]
    assert any(p is model.weight for p in run.module.parameters())
    assert len(requests.seen) == 1, "a re-assigned weight of the same shape is followed"


def test_a_call_under_grad_records_a_training_step_whose_gradients_reach_the_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 2))
    reference.load_state_dict(model.state_dict())
    backend, requests = _backend()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(3, 4)
    compiled(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert [r.training for r in requests.seen] == [True]
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_parameters_held_as_graph_attributes_are_refused_under_grad_and_run_without_it():
    """A graph that keeps the parameters inside it (Dynamo with inline_inbuilt_nn_modules=False
    where torch honours it; here an FX trace handed to the backend as Dynamo would): a call
    under grad mode gets the typed error saying why (a prepared graph would give no
    gradients), not a backward that fails later; under no_grad it is prepared as inference,
    and with fallback on, the call under grad runs on Inductor's differentiable code."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    gm = torch.fx.symbolic_trace(model)
    backend, requests = _backend()
    region = backend(gm, [x])
    with pytest.raises(InputError, match="inline_inbuilt_nn_modules.*no_grad"):
        region(x)
    assert requests.seen == []
    with torch.no_grad():
        torch.testing.assert_close(region(x), model(x))
    assert [r.training for r in requests.seen] == [False]
    backend, requests = _backend()
    region = backend(gm, [x], options={"fallback": True})
    region(x).sum().backward()
    assert requests.seen == [] and backend.fallbacks == 1
    assert all(p.grad is not None for p in model.parameters())


# ---- a region alone ---------------------------------------------------------------------------

def _region(inputs, dynamic, prepare, **options):
    return Region("0/0", lambda *args: args, inputs, dynamic, parse_options(options), prepare)


def test_a_static_region_prepares_once_and_then_skips_the_signature():
    requests = Requests()
    weight = torch.nn.Parameter(torch.ones(2))
    region = _region([GraphInput("w", True, False), GraphInput("x", False, False)], False,
                     requests)
    for _ in range(3):
        region(weight, torch.zeros(2))
    assert len(requests.seen) == 1 and region._only is not None


def test_a_dynamic_region_keys_on_shapes_and_numbers():
    requests = Requests()
    region = _region([GraphInput("s0", False, True), GraphInput("x", False, False)], True,
                     requests)
    for n in (2, 3, 2, 3):
        region(n, torch.zeros(n))
    region(4, torch.zeros(3))  # the same tensor shape with another number
    assert len(requests.seen) == 3 and region.prepared == 3


class Closing(Requests):
    """Requests whose runs note that they were closed."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = []

    def __call__(self, request):
        run = super().__call__(request)
        run.close = lambda run=run: self.closed.append(run)
        return run


def test_with_share_arena_every_shape_so_far_is_prepared_again_as_buckets_of_one_graph():
    requests = Closing()
    inputs = [GraphInput("s0", False, True, size_of=(1, 0)), GraphInput("x", False, False)]
    region = _region(inputs, True, requests, share_arena=True)
    assert region.shares
    for n in (2, 3, 4, 3):
        region(n, torch.zeros(n))
    assert [len(r.buckets) for r in requests.seen] == [1, 2, 3]
    assert [tuple(b[0].shape) for b in requests.seen[-1].buckets] == [(2,), (3,), (4,)]
    latest = set(map(id, region.runs.values()))
    assert len(latest) == 1 and region.prepared == 3
    assert len(requests.closed) == 2 and id(requests.closed[-1]) not in latest


def test_a_number_that_is_no_size_keeps_one_graph_per_signature_even_with_share_arena():
    requests = Requests()
    inputs = [GraphInput("step", False, True), GraphInput("x", False, False)]
    region = _region(inputs, True, requests, share_arena=True)
    assert not region.shares
    for n in (2, 3):
        region(n, torch.zeros(n))
    assert [r.buckets for r in requests.seen] == [None, None]


def test_dynamos_sizes_are_found_on_the_tensors_and_shared_shapes_run_through_one_module():
    model = torch.nn.Linear(8, 8).eval()
    backend, requests = _backend()
    compiled = torch.compile(model, backend=backend, dynamic=True,
                             options={"share_arena": True})
    with torch.no_grad():
        for batch in (2, 3, 4):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    (region,) = backend.regions
    (size,) = [g for g in region.inputs if g.number]
    tensor = next(i for i, g in enumerate(region.inputs) if not g.static and not g.number)
    assert size.size_of == (tensor, 0) and region.shares
    run = region.runs[next(iter(region.runs))]
    # The last request's module serves every shape: its sizes come from the tensors.
    for batch in (2, 3, 4):
        x = torch.randn(batch, 8)
        with torch.no_grad():
            torch.testing.assert_close(run.module(x)[0], model(x), rtol=0, atol=0)


def test_a_host_tensor_among_device_tensors_is_refused_before_prepare():
    requests = Requests()
    region = _region([GraphInput("x", False, False), GraphInput("scale", False, False)], False,
                     requests)
    with pytest.raises(InputError, match=r"\.item\(\)"):
        region(torch.zeros(2, device="meta"), torch.tensor(2.0))
    assert not requests.seen


def test_a_frozen_tensor_that_requires_grad_but_is_no_parameter_is_refused_for_training():
    stray = torch.zeros(2, requires_grad=True)
    with pytest.raises(InputError, match="nn.Parameter"):
        RegionModule(lambda *a: a, [GraphInput("w", True, False), GraphInput("x", False, False)],
                     (stray, torch.zeros(2)), training=True)


# ---- Inductor's code on the CPU ---------------------------------------------------------------

def test_inductors_code_serves_training_and_three_shapes_through_the_regions():
    """Inductor itself (its C++ code on the CPU) behind the regions, Nimble's prepare stood in
    for: AOTAutograd's differentiable forward fills eager's gradients and batch-norm
    statistics, and inference at three batch sizes gives eager's outputs."""
    import copy
    import shutil

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("Inductor's CPU code needs a C++ compiler (g++ or c++ on PATH)")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    requests = Requests()
    backend = NimbleBackend(prepare=requests)
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):
        x = torch.randn(5, 8)
        compiled(x).square().sum().backward()
        reference(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model[1].running_var, reference[1].running_var)
    assert [r.training for r in requests.seen] == [True]

    model.eval(), reference.eval()
    with torch.no_grad():
        for batch in (1, 8, 32):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(compiled(x), reference(x), rtol=1e-4, atol=1e-5)
    assert [r.training for r in requests.seen] == [True, False, False, False]


def test_prepare_with_nimble_hands_the_calls_tensors_and_the_options_to_prepare(monkeypatch):
    from nimble.compile_backend import holder
    from nimble.compile_backend.region import PrepareRequest

    prepared = []

    class Recorder:
        def __init__(self, module) -> None:
            self.module = module

        def prepare(self, example_inputs=None, **kwargs):
            prepared.append((self.module, example_inputs, kwargs))
            return self

        def __call__(self, *inputs):
            return self.module(*inputs)

    monkeypatch.setattr(holder, "Nimble", Recorder)
    weight, x = torch.nn.Parameter(torch.ones(3)), torch.arange(3.0)
    inputs = [GraphInput("w", True, False), GraphInput("s0", False, True),
              GraphInput("x", False, False)]
    request = PrepareRequest("0/1", lambda w, n, x: (w * x + n,), (weight, 2, x), inputs,
                             False, parse_options({"relaunches": 7, "return_copies": False,
                                                  "max_streams": 2}))
    run = holder.prepare_with_nimble(request)
    (module, tensors, kwargs), = prepared
    assert tensors == (x,) and list(module.parameters()) == [weight]
    assert kwargs["options"] == PrepareOptions(relaunches=7)
    assert (kwargs["training"], kwargs["return_copies"], kwargs["max_streams"]) == \
        (False, False, 2)
    torch.testing.assert_close(run((weight, 2, x))[0], weight * x + 2)

    with pytest.raises(InputError, match="no tensor but the model's weights"):
        holder.prepare_with_nimble(PrepareRequest("0/2", lambda w: (w,), (weight,), inputs[:1],
                                                  False, parse_options(None)))


# ---- state no module owns: a static cache -----------------------------------------------------

def _step(x, cache):
    cache.add_(x)
    return cache * 2


def test_a_static_tensor_no_module_owns_is_state_and_a_new_one_prepares_again(caplog):
    backend, requests = _backend()
    step = torch.compile(_step, backend=backend)
    cache = torch.zeros(4)
    torch._dynamo.mark_static_address(cache)
    x = torch.ones(4)
    step(x, cache), step(x, cache)
    assert torch.equal(cache, 2 * x)
    (region,) = backend.regions
    assert sorted((g.static, g.state) for g in region.inputs) == [(False, False), (True, True)]
    run = region.runs[next(iter(region.runs))]
    assert not list(run.module.buffers()) and run.module.state[0][1] is cache

    other = torch.zeros(4)
    torch._dynamo.mark_static_address(other)
    with caplog.at_level(logging.INFO, logger="nimble"):
        torch.testing.assert_close(step(x, other), 2 * x)
    assert torch.equal(other, x) and torch.equal(cache, 2 * x)
    assert len(requests.seen) == 2 and len(backend.regions) == 1
    assert any("preparing it again" in r.message for r in caplog.records)


def test_module_buffers_stay_weights_not_state():
    model = torch.nn.BatchNorm1d(4).eval()
    backend, _ = _backend()
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(3, 4))
    (region,) = backend.regions
    assert [g.state for g in region.inputs if g.static] == [False] * 4


def test_preparing_leaves_the_state_and_the_buffers_as_the_call_found_them(monkeypatch):
    from nimble.compile_backend import holder
    from nimble.compile_backend.region import PrepareRequest

    class Writes:
        """A prepare that runs the module, as warm-up and proof do, then fails."""

        def __init__(self, module) -> None:
            self.module = module

        def prepare(self, example_inputs=None, **kwargs):
            self.module(*example_inputs)
            raise CaptureError("stand-in")

    def graph(state, running, x):
        state.add_(x)
        running.add_(x)
        return (state + running,)

    monkeypatch.setattr(holder, "Nimble", Writes)
    state, running, x = torch.zeros(2), torch.zeros(2), torch.ones(2)
    inputs = [GraphInput("l_cache_", True, False, state=True),
              GraphInput("l_self_modules_bn_buffers_running_", True, False),
              GraphInput("l_x_", False, False)]
    with pytest.raises(CaptureError):
        holder.prepare_with_nimble(PrepareRequest("0/0", graph, (state, running, x), inputs,
                                                  False, parse_options(None)))
    assert not state.any() and not running.any()


def test_transformers_decoding_through_compile_config_runs_one_graph_per_step_shape():
    """``generate(compile_config=CompileConfig(backend=...))``: the decoding forward is one
    graph, prepared once, its static cache taken as state; the tokens are the library's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=64)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 5))
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                  cache_implementation="static", pad_token_id=0, eos_token_id=None)
    want = model.generate(ids, disable_compile=True, **kwargs)
    backend, requests = _backend()
    config = transformers.CompileConfig(backend=backend, fullgraph=True)
    config._compile_all_devices = True  # the library compiles on GPUs only unless told
    got = model.generate(ids, compile_config=config, **kwargs)
    assert torch.equal(got, want)
    (request,) = requests.seen  # five decoding steps, one graph
    state = [g.name for g in request.inputs if g.state]
    # named after the cache's attribute or the argument it came in (transformers 5.17 names
    # them l_kwargs_past_key_values_layers_0_keys and so on)
    assert state and all("cache" in name or "past_key_values" in name for name in state)


def test_the_real_prepare_refuses_a_model_on_the_cpu_with_its_typed_error_not_an_eager_run():
    """The backend's own prepare function, up to Nimble's first check: a graph on the CPU is an
    InputError saying to move to the GPU, with the note on ``fallback``."""
    model = torch.nn.Linear(4, 4).eval()
    backend = NimbleBackend(compile=_fx_as_is)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), pytest.raises(InputError, match="GPU") as caught:
        compiled(torch.randn(2, 4))
    assert any("fallback" in note for note in getattr(caught.value, "__notes__", [""]))
    assert [r.prepared for r in backend.regions] == [0]
