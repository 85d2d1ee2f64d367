"""Recording on the GPU: attribution, pointer resolution, buffers by allocation, replay, errors."""
from __future__ import annotations

import pytest

from nimble.record.twin import TWIN_EVIDENCE

pytestmark = pytest.mark.gpu

ZOO_RECORDED = ["resnet50", "inception_v3", "googlenet", "mobilenet_v2", "nasnetalarge"]


def _record(name: str):
    import torch

    from nimble.cli import models
    from nimble.driver.gpu import use_cudnn_benchmark
    from nimble.record.recorder import record

    use_cudnn_benchmark()
    try:
        model = models.create(name).cuda()
    except ImportError as e:
        pytest.skip(str(e))
    with torch.no_grad():
        return record(model, models.example_input(name), name=name)


@pytest.mark.parametrize("name", ZOO_RECORDED)
def test_every_kernel_attributed_and_every_pointer_resolved(name):
    g = _record(name).graph
    kernels = g.kernel_tasks()
    assert len(kernels) > 50
    assert [t.id for t in kernels if t.op < 0] == []
    assert g.unresolved_pointers() == []
    assert all(g.ops[t.op].module or g.ops[t.op].name for t in kernels)
    assert not [t for t in g.tasks if t.kind.startswith("other:")]
    # the twin capture reproduced every node, so every pool word was checked by it
    assert g.meta["pointer_evidence"] == TWIN_EVIDENCE


def test_gemm_chains_are_eight_independent_chains():
    from nimble.analysis.deps import build_dag, reachability

    g = _record("gemm_chains").graph
    dag = build_dag(g)
    reach = reachability(dag)
    chain_of = {}
    for t in g.tasks:
        module = g.ops[t.op].module if t.op >= 0 else ""
        if module.startswith("chains."):
            chain_of[t.id] = int(module.split(".")[1])
    assert set(chain_of.values()) == set(range(8))
    ordered_across = [(u, v) for u in chain_of for v in chain_of
                      if u < v and chain_of[u] != chain_of[v] and reach[u] >> v & 1]
    assert ordered_across == [], f"{len(ordered_across)} cross-chain orderings"
    # within a chain the layers stay ordered
    c0 = sorted(t for t, c in chain_of.items() if c == 0)
    assert all(reach[a] >> b & 1 for a, b in zip(c0, c0[1:]))
    # every chain writes its own intermediates: no buffer is written by two chains
    writers = {}
    for t, c in chain_of.items():
        for a in g.tasks[t].accesses:
            if a.write and g.buffers[a.buffer].kind == "intermediate":
                writers.setdefault(a.buffer, set()).add(c)
    assert writers and all(len(cs) == 1 for cs in writers.values())


@pytest.mark.parametrize("name", ["inception_v3", "googlenet", "resnet50"])
def test_replay_as_recorded_equals_torch_graph_bitwise(name):
    """tools/replay_check.py: rebuilt in recorded order, the graph equals torch's replay."""
    from helpers import load_tool

    r = load_tool("replay_check").check(name)
    assert r["backward_edges"] == 0 and r["torch_repeatable"] and r["input_dependent"]
    assert r["rebuilt_equals_torch"] and r["max_diff"] == 0.0
    assert r["nan_filled_output_rewritten"] and r["torch_after_rebuilt_equals_torch"]


def test_cpu_model_and_inputs_are_rejected_with_advice():
    import torch

    from nimble.cli import models
    from nimble.errors import InputError
    from nimble.record.recorder import record

    model = models.create("branchy")
    with pytest.raises(InputError, match="model.cuda"):
        record(model, torch.randn(1, 3, 64, 64, device="cuda"))
    model = model.cuda()
    with pytest.raises(InputError, match="move it to the GPU"):
        record(model, torch.randn(1, 3, 64, 64))
    with pytest.raises(InputError, match="tensors"):
        record(model, [torch.randn(1, 3, 64, 64, device="cuda"), 3])


def test_forward_that_syncs_with_the_host_is_a_capture_error():
    import torch

    from nimble.errors import CaptureError
    from nimble.record.recorder import record

    class Syncs(torch.nn.Module):
        def forward(self, x):
            return x * float(x.sum().item())

    with pytest.raises(CaptureError, match="synchronise with the host"):
        record(Syncs().cuda(), torch.randn(4, device="cuda"))
    # the failed capture leaves the device usable
    assert float((torch.ones(2, device="cuda") * 2).sum()) == 4.0


def test_a_capture_holds_while_another_thread_queries_an_event():
    """Another thread's unsafe call during a capture (NCCL's watchdog querying a collective's
    end event, a server's thread polling its own work) neither breaks the capture nor fails
    there: Nimble captures in thread-local mode, where torch's default ("global") breaks both."""
    import threading

    import torch

    import nimble
    from nimble.cli import models

    model = models.create("branchy").cuda().eval()
    x = models.example_input("branchy").cuda()
    event = torch.cuda.Event()
    event.record()
    torch.cuda.synchronize()
    stop, errors, queries = threading.Event(), [], [0]

    def poll() -> None:
        while not stop.is_set():
            try:
                event.query()
                queries[0] += 1
            except Exception as e:  # noqa: BLE001 - the test reports what the thread met
                errors.append(repr(e))
                return
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with torch.no_grad():
            nm = nimble.Nimble(model).prepare(x)
    finally:
        stop.set()
        poller.join()
    assert errors == [] and queries[0] > 0
    with torch.no_grad():
        assert torch.equal(nm(x), nm(x))
