"""``torch.compile(model, backend="nimble")`` on the GPU: every graph Dynamo compiles prepared
by Nimble on Inductor's kernels, bit for bit what the same graphs give prepared by hand
(``Nimble(torch.compile(part)).prepare(x)``), across a graph break and three batch sizes, with
the model's weights followed."""
from __future__ import annotations

import pytest
import torch

import nimble
import nimble.compile_backend
from helpers import zoo_model

pytestmark = pytest.mark.gpu

#: Short proofs: these tests are about the backend's bookkeeping, the proof has its own.
OPTIONS = {"relaunches": 10}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _backend():
    return nimble.compile_backend.NimbleBackend()


def _by_hand(part, x, training: bool = False):
    """``part`` compiled by Inductor and prepared by Nimble by hand, as before the backend."""
    return nimble.Nimble(torch.compile(part)).prepare(
        x, return_copies=True, training=training, options=nimble.PrepareOptions(relaunches=10))


def _nimbles(backend) -> list:
    """Every prepared graph of the backend's live regions, in the order compiled."""
    return [run.launch for region in backend.regions for run in region.runs.values()
            if hasattr(run, "launch")]


def _equal(got, want) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _rounding_equal(got, want) -> None:
    """Equal to float32 rounding: two compilations and preparations of one model need not run
    the same kernels (Inductor's choices, cuBLAS's algorithm for other buffer offsets); on the
    GPU 23 of the branchy model's 1000 logits came out 7e-9 apart. Each preparation is proven
    bit for bit against its own single-stream replay by ``prepare()``."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_registered_backend_runs_a_branchy_model_on_several_streams_as_prepared_by_hand():
    model, x = zoo_model("branchy")
    model.eval()
    registered = nimble.compile_backend.backend
    registered.reset()
    fresh = torch.randn_like(x)
    with torch.no_grad():
        hand = _by_hand(model, x)
        want = [hand(x).clone(), hand(fresh).clone()]
        hand.close()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="nimble", options=OPTIONS)
        got = [compiled(x), compiled(fresh)]
    for g, w in zip(got, want):
        _rounding_equal(g, w)
    (nm,) = _nimbles(registered)
    assert nm.graph.meta["triton_launches"] > 0, "Inductor's kernels were not the ones recorded"
    assert len(nm.schedule.streams) > 1
    assert [r.prepared for r in registered.regions] == [1]
    assert registered.fallbacks == 0


class _Break(torch.nn.Module):
    """A convolution, a host read of a value that is the same every call (a graph break), then
    a head: two regions."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.b = torch.nn.Linear(16, 10)
        self.checked = False

    def head(self, x):
        return torch.relu(self.a(x))

    def tail(self, h):
        return self.b(h.mean((2, 3)))

    def forward(self, x):
        h = self.head(x)
        self.checked = bool((h.amin() >= 0).item())
        return self.tail(h)


def test_a_graph_break_gives_two_prepared_regions_equal_to_each_half_prepared_by_hand():
    model = _Break().cuda().eval()
    x = torch.randn(4, 3, 32, 32, device="cuda")
    fresh = torch.randn_like(x)

    class Head(torch.nn.Module):
        def forward(self, x):
            return model.head(x)

    class Tail(torch.nn.Module):
        def forward(self, h):
            return model.tail(h)

    with torch.no_grad():
        head = _by_hand(Head().eval(), x)
        h = head(x).clone()
        tail = _by_hand(Tail().eval(), h)
        want = [tail(h).clone(), tail(head(fresh).clone()).clone()]
        head.close(), tail.close()
        torch._dynamo.reset()
        backend = _backend()
        compiled = torch.compile(model, backend=backend, options=OPTIONS)
        got = [compiled(x), compiled(fresh)]
    for g, w in zip(got, want):
        _equal(g, w)
    assert [r.prepared for r in backend.regions] == [1, 1]
    assert len(_nimbles(backend)) == 2 and backend.fallbacks == 0


def test_three_batch_sizes_are_three_prepared_graphs_equal_to_those_prepared_by_hand():
    """Batches 1, 8 and 32: three prepared graphs, each with an arena of its own; with
    share_arena, the two of the graph Dynamo compiled for dynamic shapes are buckets of one."""
    model, _ = zoo_model("branchy")
    model.eval()
    batches = [torch.randn(b, 3, 64, 64, device="cuda") for b in (1, 8, 32)]
    with torch.no_grad():
        # By hand in the same order, so that Dynamo compiles alike: batch 1 static, then one
        # graph for dynamic shapes that serves 8 and 32.
        hand_compiled = torch.compile(model)
        want = []
        for x in batches:
            nm = nimble.Nimble(hand_compiled).prepare(
                x, return_copies=True, options=nimble.PrepareOptions(relaunches=10))
            want.append(nm(x))
            nm.close()
        for share in (False, True):
            torch._dynamo.reset()
            backend = _backend()
            compiled = torch.compile(model, backend=backend,
                                     options={**OPTIONS, "share_arena": share})
            got = [compiled(x) for x in batches]
            again = [compiled(x) for x in reversed(batches)][::-1]
            for g, a, w in zip(got, again, want):
                _equal(g, w)
                _equal(a, w)
            assert [(r.dynamic, r.prepared) for r in backend.regions] == [(False, 1), (True, 2)]
            dynamic = backend.regions[1]
            graphs = {id(run.launch): run.launch for run in dynamic.runs.values()}
            if share:  # batches 8 and 32 as two buckets of one arena
                (nm,) = graphs.values()
                assert len(nm.buckets) == 2 and dynamic.shares
            else:
                assert len(graphs) == 2


def test_weights_updated_in_place_or_reassigned_are_followed_without_preparing_again():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8)).cuda().eval()
    x = torch.randn(4, 64, device="cuda")
    backend = _backend()
    compiled = torch.compile(model, backend=backend, options=OPTIONS)
    inductor = torch.compile(model)
    with torch.no_grad():
        before = compiled(x)
        model[0].weight.mul_(0.5)  # an optimizer's way: in place
        torch.testing.assert_close(compiled(x), inductor(x))
        assert not torch.equal(compiled(x), before)
        model[2].weight = torch.nn.Parameter(torch.randn_like(model[2].weight))
        torch.testing.assert_close(compiled(x), inductor(x))
        model[0].bias.data = torch.randn_like(model[0].bias)  # around the module machinery
        nimble.compile_backend.weights_moved()
        torch.testing.assert_close(compiled(x), inductor(x))
    assert [r.prepared for r in backend.regions] == [1]


def test_a_host_number_that_changes_is_refused_with_what_to_do_or_falls_back_when_asked():
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            scale = x.abs().mean().item()
            return self.lin(x) * scale

    model = Scaled().cuda().eval()
    with torch.no_grad():
        compiled = torch.compile(model, backend=_backend(), options=OPTIONS)
        compiled(torch.randn(2, 16, device="cuda"))  # the first value is a constant
        # Another value: Dynamo recompiles with the number as a CPU tensor input.
        with pytest.raises(nimble.InputError, match=r"\.item\(\)"):
            compiled(torch.randn(2, 16, device="cuda"))
        torch._dynamo.reset()
        backend = _backend()
        compiled = torch.compile(model, backend=backend, options={**OPTIONS, "fallback": True})
        for _ in range(3):
            x = torch.randn(2, 16, device="cuda")
            torch.testing.assert_close(compiled(x), model(x))
    assert backend.fallbacks == 1


def test_a_training_step_through_the_backend_gives_eagers_gradients_and_steps():
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10)).cuda()
    reference = copy.deepcopy(model)
    backend = _backend()
    compiled = torch.compile(model, backend=backend, options={"relaunches": 5})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(8, 3, 32, 32, device="cuda")
        y = torch.randint(0, 10, (8,), device="cuda")
        for net, optimizer in ((compiled, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    (region,) = backend.regions
    (run,) = region.runs.values()
    assert run.launch.engine.step is not None, "the graph was not prepared as a training step"


def test_transformers_generate_decodes_through_compile_config_backend_nimble():
    """``generate(compile_config=CompileConfig(backend="nimble"))``: the library's compiled
    decoding forward on Nimble, one prepared graph for every step of both calls, the static
    cache taken as state; the tokens are those of the same call on Inductor without graphs."""
    transformers = pytest.importorskip("transformers")
    from nimble.cli.decoders import causal_lm

    model = causal_lm("llama_small", "float16")
    prompts = [torch.randint(0, model.config.vocab_size, (4, 16), device="cuda")
               for _ in range(2)]
    kwargs = dict(do_sample=False, max_new_tokens=24, cache_implementation="static",
                  pad_token_id=0, eos_token_id=None)

    def generate(config):
        return [model.generate(ids, attention_mask=torch.ones_like(ids), compile_config=config,
                               **kwargs) for ids in prompts]

    want = generate(transformers.CompileConfig(backend="inductor", mode="default"))
    torch._dynamo.reset()
    registered = nimble.compile_backend.backend
    registered.reset()
    got = generate(transformers.CompileConfig(backend="nimble", mode=None, options=OPTIONS))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    prepared = [r for r in registered.regions if r.prepared]
    assert [r.prepared for r in prepared] == [1], "every step of both calls: one graph"
    assert any(g.state for g in prepared[0].inputs), "the static cache was not taken as state"
    assert registered.fallbacks == 0


def test_a_training_step_across_a_graph_break_chains_two_prepared_steps():
    """Two regions, each a prepared training step: the second's input gradient flows into the
    first's backward, and the gradients are eager's."""
    import copy

    torch.manual_seed(0)
    model = _Break().cuda().train()
    reference = copy.deepcopy(model)
    backend = _backend()
    compiled = torch.compile(model, backend=backend, options={"relaunches": 5})
    for _ in range(2):
        x = torch.randn(4, 3, 32, 32, device="cuda")
        for net in (model, reference):
            net.zero_grad(set_to_none=True)
        compiled(x).square().mean().backward()
        reference(x).square().mean().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    steps = [run.launch.engine.step for r in backend.regions for run in r.runs.values()]
    assert len(steps) == 2 and all(s is not None for s in steps)
