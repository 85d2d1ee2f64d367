"""The sum over the ranks through their peers' memory (nimble.peer_sum) on the CPU: its layout,
its typed errors, its protocol between processes under Triton's interpreter (each rank a
process, the buffers files they all map), and its kernel compiled for a Hopper GPU."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nimble.errors import InputError
from nimble.ir.kernel_names import collective_kernel
from nimble.peer_sum import (ALIGN, MAX_BLOCK, MAX_PROGRAMS, MIN_BLOCK, PeerSum,
                              PeerSumLayout, check_call)

WORKER = Path(__file__).parent / "workers" / "peer_sum_interpreted.py"


def test_the_layout_keeps_the_flags_apart_from_two_aligned_slots_of_the_largest_call():
    layout = PeerSumLayout.for_elements(3000, 4, torch.bfloat16)
    assert (layout.programs, layout.capacity) == (12, 3000)
    assert layout.data_at >= 4 * (4 + 1) * 12 and layout.data_at % ALIGN == 0
    assert layout.slot_elements >= 3000 and layout.slot_elements * 2 % ALIGN == 0
    assert layout.nbytes == layout.data_at + 2 * layout.slot_elements * 2
    odd = PeerSumLayout.for_elements(5, 3, torch.float32)
    assert (odd.programs, odd.capacity, odd.slot_elements) == (1, 5, 32)
    assert PeerSumLayout.for_elements(2 << 20, 2, torch.bfloat16).programs == MAX_PROGRAMS


def test_a_call_shares_its_blocks_out_over_every_program():
    layout = PeerSumLayout.for_elements(2 << 20, 2, torch.bfloat16)
    assert layout.block(2048) == MIN_BLOCK  # a batch-1 step's hidden state: a few programs
    assert layout.block(16384) == 512  # batch 8: one block each
    assert layout.block(2 << 20) == MAX_BLOCK  # a prefill: several blocks each in turn
    for n in (1, 100, 16384, 50000, 2 << 20):
        block = layout.block(n)
        assert block & (block - 1) == 0 and MIN_BLOCK <= block <= MAX_BLOCK


def test_a_layout_refuses_what_the_kernel_cannot_sum():
    with pytest.raises(InputError, match="adds"):
        PeerSumLayout.for_elements(10, 2, torch.int32)
    with pytest.raises(InputError, match="at least 1"):
        PeerSumLayout.for_elements(0, 2, torch.float16)


def test_a_call_the_kernel_cannot_make_is_refused_saying_what_to_pass(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layout = PeerSumLayout.for_elements(100, 2, torch.float16)
    table = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(InputError, match=r"runs on a GPU: move the tensor there \(\.cuda\(\)\)"):
        check_call(torch.zeros(4, dtype=torch.float16), layout, table)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(InputError, match="make one per dtype"):
        check_call(torch.zeros(4, dtype=torch.float32), layout, table)
    with pytest.raises(InputError, match="its buffers take 100"):
        check_call(torch.zeros(101, dtype=torch.float16), layout, table)
    with pytest.raises(InputError, match="adds a tensor"):
        check_call([1.0], layout, table)


def test_a_peer_sum_is_made_by_the_ranks_of_a_process_group():
    with pytest.raises(InputError, match="init_process_group first"):
        PeerSum(1024, torch.bfloat16)


def test_the_kernel_is_a_collective_a_graph_keeps_in_order():
    pytest.importorskip("triton", reason="the kernel is Triton's")
    from nimble.peer_sum_kernels import nimble_peer_sum_kernel

    assert collective_kernel(nimble_peer_sum_kernel.fn.__name__)


def _buffers(folder: Path, world: int) -> None:
    """Each rank's zeroed buffer of each dtype the worker sums, and one whose counters and
    flags stand three calls before the int32 wrap (as after 2^31 calls)."""
    spec = importlib.util.spec_from_file_location("peer_sum_interpreted", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    for name, dtype in worker.DTYPES.items():
        layout = worker.layout(world, dtype)
        for rank in range(world):
            data = np.zeros(layout.nbytes, dtype=np.uint8)
            if name == "wrapping":
                words = data[:layout.data_at].view(np.int32)
                words[:(world + 1) * layout.programs] = 2**31 - 3
            (folder / f"{name}-{rank}").write_bytes(data.tobytes())


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_sums_its_peers_buffers_to_the_same_bits_over_many_calls(tmp_path, world):
    """Two, three (not a power of two) and four ranks, each a process under Triton's
    interpreter: calls of one and several programs, ragged, both slot parities twice, across
    the counters' wrap; every sum equal to the float32 sum in rank order, on every rank."""
    pytest.importorskip("triton", reason="the kernel's CPU test runs Triton's interpreter")
    _buffers(tmp_path, world)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    ranks = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    try:
        outputs = [rank.communicate(timeout=600) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    for rank, (_, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err[-3000:]
    lines = [[json.loads(line) for line in out.splitlines()] for out, _ in outputs]
    assert len({len(ls) for ls in lines}) == 1 and len(lines[0]) == 4 * 8
    for calls in zip(*lines):
        assert all(c["equal"] for c in calls), calls
        assert len({c["digest"] for c in calls}) == 1, calls


@pytest.mark.parametrize("gather", [False, True])
def test_the_kernel_compiles_for_a_hopper_gpu_with_its_flags_at_system_scope(gather):
    """PTX for sm_90: the flag written to each peer with a release at system scope after a
    barrier of the program's threads, the wait an acquire at system scope, the peers' data read
    past the L1 in 16-byte vectors (summed, or stored each in its place: the gather)."""
    triton = pytest.importorskip("triton", reason="compiles with Triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nimble.peer_sum_kernels import nimble_peer_sum_kernel

    signature = {"x_ptr": "*bf16", "out_ptr": "*bf16", "table_ptr": "*i64", "n": "i32",
                 "rank": "i32", "slot_elements": "i32", "RANKS": "constexpr",
                 "PROGRAMS": "constexpr", "DATA_AT": "constexpr",
                 "BLOCK": "constexpr", "WAITS": "constexpr", "GATHER": "constexpr"}
    constexprs = {"RANKS": 2, "PROGRAMS": 16, "DATA_AT": 256, "BLOCK": 1024,
                  "WAITS": True, "GATHER": gather}
    # as a launch specializes them: the pointers and sizes divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 5)}
    ptx = triton.compile(ASTSource(fn=nimble_peer_sum_kernel, signature=signature,
                                   constexprs=constexprs, attrs=attrs),
                         target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    lines = [line.strip() for line in ptx.splitlines()]
    release = next(k for k, line in enumerate(lines) if "atom.global.sys.release.exch" in line)
    assert any(line.startswith("bar.sync") for line in lines[:release])
    # the wait: an acquire at system scope (Triton lowers an atomic add of 0 to an acquiring
    # load)
    assert any("global.sys.acquire" in line and ("atom." in line or "ld." in line)
               for line in lines[release:])
    acquired = max(k for k, line in enumerate(lines) if "global.sys.acquire" in line)
    peer_reads = [line for line in lines[acquired:] if "ld.global" in line and ".v4.b32" in line]
    assert len(peer_reads) == 2
    # past the L1 where this Triton keeps the modifier (Triton 3.6, the GPU machine's, drops
    # it: then the acquire at system scope, and the barrier after it, order the reads after
    # the peers' writes by PTX's memory model all the same)
    assert all(".cv" in line for line in peer_reads) or not any(".cv" in line for line in lines)
    assert any(line.startswith("bar.sync") for line in lines[acquired:acquired + 40])
    stores = [line for line in lines[release:] if "st.global.v4.b32" in line]
    assert len(stores) == (2 if gather else 1)


def _made_elsewhere(table: torch.Tensor) -> PeerSum:
    """A peer sum as ``__init__`` leaves it, without a process group (none on the CPU)."""
    summed = PeerSum.__new__(PeerSum)
    torch.nn.Module.__init__(summed)
    summed.register_buffer("table", table, persistent=False)
    summed.gathers = False
    return summed


def test_a_copied_model_sums_through_the_buffers_its_peers_map():
    import copy

    summed = _made_elsewhere(torch.zeros(2, dtype=torch.int64))
    holder = torch.nn.Module()
    holder.summed = summed
    assert copy.deepcopy(holder).summed is summed


def test_the_table_is_a_weight_of_the_model_by_name_and_no_state_of_it():
    """A graph reads the table as one of the model's weights, by name, while a state_dict
    (the addresses are this process's) leaves it out."""
    from nimble.record.module_weights import module_weights

    summed = _made_elsewhere(torch.arange(2, dtype=torch.int64))
    layer = torch.nn.Module()
    layer.proj, layer.reduce = torch.nn.Linear(4, 4), summed
    assert module_weights(layer)["reduce.table"] is summed.table
    assert "reduce.table" not in layer.state_dict()
    assert layer.half().reduce.table.dtype == torch.int64  # .half() leaves the addresses


def test_a_traced_model_holds_the_sum_and_the_gather_as_one_operator_each():
    """Traced with fake tensors (as torch.compile traces): one ``nimble::peer_sum`` and one
    ``nimble::peer_gather``, their results shaped as the kernel writes them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    summed = _made_elsewhere(torch.zeros(2, dtype=torch.int64))
    summed.rank, summed.layout = 0, PeerSumLayout.for_elements(64, 2, torch.float16)

    def step(x):
        total = summed(x)
        return summed.gather(total.t())

    traced = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(
        torch.zeros(4, 8, dtype=torch.float16))
    ops = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    assert ops.count("nimble.peer_sum.default") == 1
    assert ops.count("nimble.peer_gather.default") == 1
    out = [n for n in traced.graph.nodes if n.op == "output"][0].args[0]
    assert tuple(out.meta["val"].shape) == (2, 8, 4)
