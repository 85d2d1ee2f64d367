"""The peer sum's protocol on one GPU (:mod:`nimble.peer_sum`): its ranks as streams of one
process, each rank's buffer a plain allocation of the same device, so the kernel's flags,
counters and slots meet the GPU's own memory order (the ``.sys`` releases and acquires, the
``.cv`` reads) where no second GPU is lent.  The ranks' kernels run side by side (each spins
until every other has written its flag), in no fixed order between streams, over hundreds of
calls of each slot parity: a missing wait or a slot reused too early shows as a wrong sum or
as digests that differ between the ranks.  The sums across GPUs are
``tests/test_gpu_collectives.py``'s."""
from __future__ import annotations

import hashlib

import pytest

pytestmark = pytest.mark.gpu

#: Elements of each call in turn: one block, several programs, ragged, the most, one.
SIZES = (64, 4096, 1000, 32768, 1, 300, 20000, 8192)
CALLS = 240
GATHER_EVERY = 5


def _rank_inputs(ranks: int, n: int, call: int, dtype):
    import torch

    generator = torch.Generator(device="cuda").manual_seed(call)
    return [torch.randn(n, generator=generator, device="cuda").to(dtype) for _ in range(ranks)]


def _digest(t) -> str:
    import torch

    return hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_ranks_as_streams_sum_and_gather_every_call_in_rank_order(ranks, dtype_name):
    import torch

    from nimble.peer_sum import PeerSumLayout, launch_peer_sum

    dtype = getattr(torch, dtype_name)
    layout = PeerSumLayout.for_elements(max(SIZES), ranks, dtype)
    buffers = [torch.zeros(layout.nbytes, dtype=torch.uint8, device="cuda")
               for _ in range(ranks)]
    table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device="cuda")
    streams = [torch.cuda.Stream() for _ in range(ranks)]
    calls = []
    for call in range(CALLS):
        n = SIZES[call % len(SIZES)]
        inputs = _rank_inputs(ranks, n, call, dtype)
        gather = call % GATHER_EVERY == GATHER_EVERY - 1
        torch.cuda.synchronize()  # the inputs drawn before any rank reads them
        # the ranks launched in a changing order, so no stream always arrives first
        order = list(range(ranks))
        order = order[call % ranks:] + order[:call % ranks]
        results = [None] * ranks
        for rank in order:
            with torch.cuda.stream(streams[rank]):
                results[rank] = launch_peer_sum(inputs[rank], table, rank, layout, gather)
        calls.append((n, gather, inputs, results))
        if call % 16 == 15:
            torch.cuda.synchronize()  # let calls queue up in between: both slots in flight
    torch.cuda.synchronize()
    for call, (n, gather, inputs, results) in enumerate(calls):
        if gather:
            want = torch.stack(inputs)
        else:
            total = inputs[0].float()
            for x in inputs[1:]:
                total = total + x.float()
            want = total.to(dtype)
        for rank, got in enumerate(results):
            assert torch.equal(got, want), (call, n, gather, rank)
        assert len({_digest(r) for r in results}) == 1, (call, n)


def test_the_peer_sums_captured_by_each_rank_replay_in_step():
    """Each rank's calls captured in a CUDA graph of its own stream, the graphs replayed side
    by side many times: the call counters carry on across replays as across eager calls."""
    import torch

    from nimble.peer_sum import PeerSumLayout, launch_peer_sum

    ranks, n, dtype = 2, 8192, torch.bfloat16
    layout = PeerSumLayout.for_elements(n, ranks, dtype)
    buffers = [torch.zeros(layout.nbytes, dtype=torch.uint8, device="cuda")
               for _ in range(ranks)]
    table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device="cuda")
    inputs = [torch.randn(n, device="cuda").to(dtype) for _ in range(ranks)]
    streams = [torch.cuda.Stream() for _ in range(ranks)]
    warm = [None] * ranks
    for rank in range(ranks):  # compiled and loaded before capture
        with torch.cuda.stream(streams[rank]):
            warm[rank] = launch_peer_sum(inputs[rank], table, rank, layout)
    torch.cuda.synchronize()
    graphs, outs = [], []
    for rank in range(ranks):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=streams[rank]):
            # three sums in a row: both slots, the second reading the first's result
            first = launch_peer_sum(inputs[rank], table, rank, layout)
            second = launch_peer_sum(first, table, rank, layout)
            third = launch_peer_sum(inputs[rank] * 2, table, rank, layout)
        graphs.append(graph)
        outs.append((first, second, third))
    want_first = (inputs[0].float() + inputs[1].float()).to(dtype)
    want_second = (want_first.float() * 2).to(dtype)
    want_third = ((inputs[0] * 2).float() + (inputs[1] * 2).float()).to(dtype)
    for replay in range(50):
        for rank in (range(ranks) if replay % 2 else reversed(range(ranks))):
            with torch.cuda.stream(streams[rank]):
                graphs[rank].replay()
        torch.cuda.synchronize()
        for rank in range(ranks):
            first, second, third = outs[rank]
            assert torch.equal(first, want_first), (replay, rank)
            assert torch.equal(second, want_second), (replay, rank)
            assert torch.equal(third, want_third), (replay, rank)
