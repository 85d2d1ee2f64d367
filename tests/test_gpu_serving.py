"""Serving on the GPU: shape buckets in one arena, model instances on several threads, padding,
the C host's reach to every graph, and a load test (googlenet in float16)."""
from __future__ import annotations

import gc

import pytest

from helpers import in_threads, zoo_model

pytestmark = pytest.mark.gpu

BATCHES = [1, 2, 4, 8]


def _googlenet_half():
    model, x = zoo_model("googlenet")
    return model.half(), x.half()


def _eager(model, x):
    import torch

    with torch.no_grad():
        return model(x)


def _close_to_eager(got, want) -> None:
    import torch

    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="module")
def served():
    """googlenet float16 in four buckets on four instances, proven as prepare() proves by
    default, with one input per bucket and its eager output."""
    import torch

    import nimble

    model, x = _googlenet_half()
    nm = nimble.Nimble(model).prepare(x, batch_sizes=BATCHES, instances=4, return_copies=True)
    inputs = {b: torch.randn(b, *x.shape[1:], device=x.device, dtype=x.dtype) for b in BATCHES}
    eager = {b: _eager(model, inputs[b]) for b in BATCHES}
    yield model, nm, inputs, eager
    nm.close()


class _Raw:
    """Device memory at an address, as torch reads it (``__cuda_array_interface__``)."""

    def __init__(self, address: int, shape: tuple, typestr: str = "<f2") -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (address, False), "version": 3,
                                         "strides": None}


def test_every_bucket_is_proven_and_answers_as_its_own_single_bucket_graph(served):
    import torch

    import nimble

    model, nm, inputs, eager = served
    assert [b.input_shapes for b in nm.buckets] == [((b, 3, 224, 224),) for b in BATCHES]
    assert nm.instances == 4
    for bucket in nm.buckets:
        [batch] = {shape[0] for shape in bucket.input_shapes}
        graph = nm._serving.buckets[BATCHES.index(batch)].instances[0].graph
        verified = graph.meta["verified"]
        assert verified["not_bitwise"] == {} and verified["fuzz"] and verified["launches"] == 100
        single = nimble.Nimble(model).prepare(
            inputs[batch], options=nimble.PrepareOptions(relaunches=4, fuzz=False))
        want = single(inputs[batch]).clone()
        single.close()
        got = nm(inputs[batch])
        assert got.shape == (batch, 1000) and torch.equal(got, want)
        _close_to_eager(got, eager[batch])
    # the primary graph is the bucket with the largest plan
    largest = max(nm.buckets, key=lambda b: b.arena_bytes)
    assert nm.exec_handle == largest.instances[0].exec_handle
    report = nm.prepare_report
    assert [c.input_shapes for c in report.buckets] == [b.input_shapes for b in nm.buckets]
    assert all({"capture", "schedule_and_memplan", "build", "verify_served"} <= set(c.seconds)
               for c in report.buckets)
    assert len(report.instances) == 3 * len(BATCHES)
    assert all(c.proof_launches > 0 and c.proof > 0 for c in report.instances)
    stages = report.stage_totals()
    assert report.total > stages["capture"] + stages["build"] + stages["instance_build"]


def test_the_buckets_of_an_instance_share_one_arena(served):
    _, nm, _, _ = served
    memory = nm.device_bytes
    plans = [b.arena_bytes for b in nm.buckets]
    assert memory.shared_bytes == max(plans)
    assert memory.instance_bytes == [memory.shared_bytes + memory.state_bytes] * 4
    assert memory.state_bytes < 1 << 20  # cells and alignment: no second plan
    assert memory.total_bytes - memory.outside_bytes < 4 * sum(plans)


def test_a_shape_not_prepared_is_refused_with_the_prepared_shapes(served):
    import torch

    from nimble.errors import InputError

    _, nm, inputs, _ = served
    x3 = torch.randn(3, 3, 224, 224, device="cuda", dtype=torch.float16)
    with pytest.raises(InputError, match=r"\(3, 3, 224, 224\).*\(1, 3, 224, 224\).*"
                                         r"\(8, 3, 224, 224\).*pad=True"):
        nm(x3)
    with pytest.raises(InputError, match="float32"):
        nm(inputs[2].float())  # a bucket's shape, another dtype: the message of one graph
    assert nm(inputs[2]).shape == (2, 1000)  # and the model keeps serving


def test_a_padded_batch_runs_in_the_next_bucket_and_returns_its_own_rows():
    import torch

    import nimble

    model, x = _googlenet_half()
    nm = nimble.Nimble(model).prepare(x, batch_sizes=[1, 4], pad=True,
                                      options=nimble.PrepareOptions(relaunches=4, fuzz=False))
    x4 = torch.randn(4, 3, 224, 224, device="cuda", dtype=torch.float16)
    full = nm(x4).clone()
    got = nm(x4[:3].clone())
    assert got.shape == (3, 1000) and torch.equal(got, full[:3])
    _close_to_eager(got, _eager(model, x4[:3]))
    assert nm(x4[:1]).shape == (1, 1000)  # a bucket of its own
    with pytest.raises(nimble.InputError, match=r"\(5, 3, 224, 224\)"):
        nm(torch.randn(5, 3, 224, 224, device="cuda", dtype=torch.float16))
    nm.close()


def test_four_threads_on_their_own_streams_run_on_four_instances(served):
    import torch

    _, nm, inputs, eager = served
    want = {b: nm(inputs[b]).clone() for b in BATCHES}
    for b in BATCHES:
        _close_to_eager(want[b], eager[b])

    def calls(k: int, failures: list[str]) -> None:
        for i in range(200):
            b = BATCHES[(i + k) % len(BATCHES)]
            if not torch.equal(nm(inputs[b]), want[b]):
                failures.append(f"thread {k} call {i} batch {b}")
    assert in_threads(calls, [torch.cuda.Stream() for _ in range(4)]) == []


def test_a_c_host_reaches_every_bucket_of_every_instance(served):
    import torch

    from nimble import driver

    _, nm, inputs, _ = served
    views = [(b, view) for b in nm.buckets for view in b.instances]
    assert len({view.exec_handle for _, view in views}) == len(BATCHES) * 4
    drv = driver.bindings()
    stream = drv.CUstream(torch.cuda.current_stream().cuda_stream)
    for bucket, view in views:
        batch = bucket.input_shapes[0][0]
        want = nm(inputs[batch]).clone()
        fresh = torch.randn_like(inputs[batch])
        [cell] = view.input_cells
        [out] = view.output_addresses
        driver.call("cuStreamWriteValue64", stream, cell, fresh.data_ptr(), 0)
        driver.call("cuGraphLaunch", drv.CUgraphExec(view.exec_handle), stream)
        torch.cuda.synchronize()
        got = torch.as_tensor(_Raw(out, (batch, 1000)), device="cuda").clone()
        assert not torch.equal(got, want)  # the fresh input's answer
        driver.call("cuStreamWriteValue64", stream, cell, inputs[batch].data_ptr(), 0)
        driver.call("cuGraphLaunch", drv.CUgraphExec(view.exec_handle), stream)
        torch.cuda.synchronize()
        got = torch.as_tensor(_Raw(out, (batch, 1000)), device="cuda").clone()
        assert torch.equal(got, want)
    nm.host_writes_cells()
    for b in BATCHES:  # Python calls write the cells again
        assert torch.equal(nm(inputs[b]), nm(inputs[b].clone()))


def _free_after_cleanup() -> int:
    """Free device memory with dead objects collected, torch's cuBLAS workspaces dropped and
    its cache released."""
    import torch

    from nimble.record.capture import clear_blas_workspaces

    gc.collect()
    torch.cuda.synchronize()
    clear_blas_workspaces()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def _serve_under_load(model, x, inputs, streams, calls_per_thread: int, bad=None):
    """Prepare buckets on three instances, run 8 threads x ``calls_per_thread`` calls over them
    (``bad`` tried once by thread 5 halfway), close; what went wrong, how many outputs each
    thread checked, the refusals."""
    import torch

    import nimble

    options = nimble.PrepareOptions(relaunches=4, fuzz=False)
    nm = nimble.Nimble(model).prepare(x, batch_sizes=BATCHES, instances=3, return_copies=True,
                                      options=options)
    want = {b: nm(inputs[b]) for b in BATCHES}
    refused: list[str] = []
    checked = [0] * len(streams)

    def calls(k: int, failures: list[str]) -> None:
        for i in range(calls_per_thread):
            if bad is not None and k == 5 and i == calls_per_thread // 2:
                try:
                    nm(bad)
                    failures.append("the bad shape was taken")
                except nimble.InputError as e:
                    refused.append(str(e))
            b = BATCHES[(i * 7 + k) % len(BATCHES)]
            out = nm(inputs[b])
            if i % 50 == 0:
                checked[k] += 1
                if not torch.equal(out, want[b]):
                    failures.append(f"thread {k} call {i} batch {b}")
    try:
        failures = in_threads(calls, streams)
        return failures, checked, refused, want
    finally:
        nm.close()


def test_under_load_nothing_is_wrong_nothing_is_lost_and_a_bad_call_fails_alone():
    """8 threads x 2,000 calls over four buckets on three instances, every 50th output checked;
    one call of a shape not prepared in the middle; the memory back after close.

    A first, shorter round of the same serving comes before the memory is read: after the
    first round the process holds 96 MiB more for good, outside torch's allocator and Nimble's
    allocations (measured on an H100 with no Nimble allocation left alive, and the same after
    three rounds; docs/findings.md).  A leak grows with every round: the second round is held
    to 1 MB."""
    import torch

    model, x = _googlenet_half()
    inputs = {b: torch.randn(b, *x.shape[1:], device="cuda", dtype=x.dtype) for b in BATCHES}
    eager = {b: _eager(model, inputs[b]) for b in BATCHES}
    streams = [torch.cuda.Stream() for _ in range(8)]
    bad = torch.randn(3, 3, 224, 224, device="cuda", dtype=torch.float16)
    failures, _, _, _ = _serve_under_load(model, x, inputs, streams, 200)
    assert failures == []
    free_before = _free_after_cleanup()

    failures, checked, refused, want = _serve_under_load(model, x, inputs, streams, 2000, bad)
    assert failures == []
    for b in BATCHES:
        _close_to_eager(want[b], eager[b])
    assert checked == [40] * 8
    assert len(refused) == 1 and "(3, 3, 224, 224)" in refused[0]
    want = None
    assert _free_after_cleanup() >= free_before - (1 << 20)
