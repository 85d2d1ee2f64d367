"""NCCL collectives inside prepared graphs, across two GPUs (two ranks under ``torchrun``).

``tests/workers/allreduce_worker.py``: each rank prepares a model whose forward all-reduces an
activation, on one stream and on several (NCCL's kernel and its event nodes rebuilt in the
explicit graph, the proof replaying both ranks' graphs in step), then calls it on fresh inputs
against eager.  ``tests/workers/training_worker.py``: a network prepared with
``average_gradients=True`` (its gradients averaged inside the backward graph) steps as eager DDP
does.  ``tests/workers/ddp_worker.py``: an unchanged DDP script whose DDP is called through
``Nimble(ddp)`` ends its steps where eager DDP does, at the floor a second eager DDP sets, on
every rank, with DDP's defaults (buffers broadcast inside the forward graph), with its other
settings, and with ``SyncBatchNorm``, on two ranks and on four where the machine has four
GPUs.  ``tests/workers/peer_sum_worker.py``: Nimble's sum over the peers' memory
(:mod:`nimble.peer_sum`) eager, captured and prepared, equal to the rank-order sum on every
rank; ``peer_sum_saved_worker.py``: its graph saved on every rank and loaded in fresh
processes, and ``tp_saved_worker.py`` a split Generator's.  ``tp_decode_worker.py``: a
Generator on a Llama split over the ranks decodes the whole model's tokens, its partial sums
summed by NCCL or by the peer sum.  A rank that hangs (a collective launched on one rank only)
fails by timeout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).parent / "workers" / "allreduce_worker.py"
TRAINING_WORKER = Path(__file__).parent / "workers" / "training_worker.py"
DDP_WORKER = Path(__file__).parent / "workers" / "ddp_worker.py"


def _gpus_or_skip(ranks: int = 2) -> None:
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs; this machine has {torch.cuda.device_count()}")
    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch has no NCCL")


def _two_ranks(worker: Path, lines: int, *args: str, ranks: int = 2) -> list[dict]:
    """Run ``worker`` (with ``args``) as ``ranks`` ranks (two unless told); the JSON lines they
    print (``lines``)."""
    _gpus_or_skip(ranks)
    env = {**os.environ, "NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "1",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}  # torch's advice for capturing DDP
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
         str(worker), *args],
        capture_output=True, text=True, timeout=240, env=env)
    seen = _json_lines(done.stdout)
    assert done.returncode == 0 and len(seen) == lines, \
        f"rc {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return seen


def _json_lines(text: str) -> list[dict]:
    """The JSON objects the ranks printed: an unbuffered ``print`` writes its text and its
    newline apart, so two ranks' objects can share a line of the common pipe."""
    decoder, seen = json.JSONDecoder(), []
    for line in text.splitlines():
        at = line.find("{")
        while line.startswith("{") and 0 <= at < len(line):
            obj, end = decoder.raw_decode(line, at)
            seen.append(obj)
            at = line.find("{", end)
    return seen


def test_an_all_reduce_in_the_forward_is_prepared_and_proven_on_both_ranks():
    lines = _two_ranks(WORKER, 4)
    for seen in lines:
        assert "error" not in seen, f"rank {seen['rank']}: {seen['error']}\n{seen['trace']}"
        # eager's all-reduce runs the same NCCL algorithm on the same bytes
        assert seen["max_diff"] <= 1e-6 * max(seen["scale"], 1.0), seen
    multi = [s for s in lines if s["multi"]]
    assert all(s["streams"] >= 2 for s in multi), multi  # the second conv runs beside the reduce


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("variant", ["defaults", "settings", "syncbn"])
def test_an_unchanged_ddp_script_ends_where_eager_ddp_does_on_every_rank(variant, ranks):
    steps = 5  # ddp_worker.STEPS
    for seen in _two_ranks(DDP_WORKER, ranks, variant, ranks=ranks):
        assert "error" not in seen, f"rank {seen['rank']}: {seen['error']}\n{seen['trace']}"
        # a gradient not averaged, or a buffer not broadcast, is off by far more than 1e-5
        assert seen["param_err"] <= max(4 * seen["param_floor"], 1e-5), seen
        assert seen["buffer_err"] <= max(4 * seen["buffer_floor"], 1e-5), seen
        assert seen["ranks_equal"] and seen["eager_ranks_equal"], seen
        assert seen["tracked"] == [steps, steps], seen  # prepare left the buffers as found
        forward, backward = seen["collectives"]
        if variant == "settings":
            assert forward == 0 and backward == seen["planned_buckets"] >= 2, seen
        elif variant == "defaults":  # one broadcast per buffer dtype, one bucket
            assert forward == 2 and backward == seen["planned_buckets"] == 1, seen
        else:  # SyncBatchNorm's gathers and all-reduces beside the broadcasts and the bucket
            assert forward > 2 and backward > seen["planned_buckets"], seen


def test_average_gradients_trains_as_ddp_with_the_all_reduce_in_the_backward_graph():
    for seen in _two_ranks(TRAINING_WORKER, 2, "average"):
        assert "error" not in seen, f"rank {seen['rank']}: {seen['error']}\n{seen['trace']}"
        assert seen["collectives"] >= 1, seen
        for diff, scale in zip(seen["grad_diffs"], seen["grad_scales"]):
            # cuDNN's weight gradients add with atomics, and DDP may divide in another order
            assert diff <= 1e-5 * max(scale, 1.0), seen



TP_WORKER = Path(__file__).parent / "workers" / "tp_decode_worker.py"


@pytest.mark.parametrize("ranks,all_reduce", [(2, "nccl"), (4, "nccl"), (2, "peer"),
                                               (4, "peer")])
def test_a_generator_on_a_model_split_over_gpus_decodes_the_whole_models_tokens(ranks,
                                                                               all_reduce):
    """A small Llama split over the ranks as Megatron splits it (heads, MLP columns and the LM
    head's vocabulary shared out, the partial sums all-reduced by NCCL or by Nimble's peer sum,
    the logits gathered; over four ranks its two key-value heads replicated): a Generator on
    it decodes transformers' greedy tokens of the whole model (near-ties aside), its decode
    step holding every layer's two all-reduces."""
    pytest.importorskip("transformers")
    for seen in _two_ranks(TP_WORKER, ranks, all_reduce, ranks=ranks):
        assert "error" not in seen, f"rank {seen['rank']}: {seen['error']}\n{seen['trace']}"
        assert seen["wrong"] == 0, seen
        assert seen["all_reduces"] >= 2 * seen["layers"], seen


PEER_SUM_WORKER = Path(__file__).parent / "workers" / "peer_sum_worker.py"


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_peer_sum_gives_every_rank_the_rank_order_sum_eager_captured_and_prepared(ranks):
    """Nimble's sum over the peers' memory: eager calls in three dtypes and five sizes equal the
    float32 sum in rank order bit for bit and alike on every rank; eight calls captured in a
    CUDA graph stay equal over 50 replays; a model summing one branch beside another, prepared
    on one stream, on several and with the gap prefetch served unmeasured, equals eager bit for
    bit on fresh inputs."""
    results = _two_ranks(PEER_SUM_WORKER, ranks, ranks=ranks)
    for seen in results:
        assert "error" not in seen, f"rank {seen['rank']}: {seen['error']}\n{seen['trace']}"
        assert all(seen["eager_equal"]) and seen["graph_equal"], seen
        assert all(seen[f"prepared_equal_{k}"] for k in ("single", "multi", "gaps")), seen
        assert all(seen[f"collectives_{k}"] == 1 for k in ("single", "multi", "gaps")), seen
        assert seen["streams_multi"] > 1, seen
        # the second branch's weight, after the sum and the activation, served unmeasured
        served = seen["prefetch_gaps"]
        assert served and all(not r["measured"] and r["windows"] >= 1 for r in served), seen
        assert not seen["prefetch_multi"], seen
    digests = {tuple(seen["eager_digests"]) for seen in results}
    assert len(digests) == 1


SAVED_PEER_SUM_WORKER = Path(__file__).parent / "workers" / "peer_sum_saved_worker.py"


def test_a_graph_of_peer_sums_saved_on_every_rank_loads_in_fresh_processes(tmp_path):
    """Each rank saves its prepared graph (the peer sum's table a weight of the model); fresh
    processes make the model again, each loads its own file with it and gives the outputs
    saved, bit for bit, and eager's; a rank is refused another rank's file."""
    for seen in _two_ranks(SAVED_PEER_SUM_WORKER, 2, "save", str(tmp_path)):
        assert "error" not in seen, f"rank {seen['rank']}: {seen['error']}\n{seen['trace']}"
    for seen in _two_ranks(SAVED_PEER_SUM_WORKER, 2, "load", str(tmp_path)):
        assert "error" not in seen, f"rank {seen['rank']}: {seen['error']}\n{seen['trace']}"
        assert seen["equal_saved"] and seen["equal_eager"] and seen["collectives"] == 1, seen
        assert "load each rank's file on that rank" in seen["other_rank_refused"], seen


TP_SAVED_WORKER = Path(__file__).parent / "workers" / "tp_saved_worker.py"


def test_a_generator_split_over_gpus_with_peer_sums_is_saved_and_loaded_on_every_rank(tmp_path):
    """A Generator on a Llama split over two ranks (its sums and logits through peer sums),
    saved by each rank; in fresh processes each rank splits the model again and loads its file
    with it: the tokens are the saved ones."""
    pytest.importorskip("transformers")
    for seen in _two_ranks(TP_SAVED_WORKER, 2, "save", str(tmp_path)):
        assert "error" not in seen, f"rank {seen['rank']}: {seen['error']}\n{seen['trace']}"
    for seen in _two_ranks(TP_SAVED_WORKER, 2, "load", str(tmp_path)):
        assert "error" not in seen, f"rank {seen['rank']}: {seen['error']}\n{seen['trace']}"
        assert seen["equal_saved"], seen


TP_PLAN_WORKER = Path(__file__).parent / "workers" / "tp_plan_worker.py"


def test_a_generator_on_transformers_own_tensor_parallel_model_decodes_the_whole_models_tokens(
        tmp_path):
    """A model that transformers itself splits over two ranks (``tp_plan="auto"``: DTensor
    weights, its own all-reduces): a Generator prepared on it decodes the whole model's greedy
    tokens, as the split model's eager decode does, its decode step holding the all-reduces."""
    pytest.importorskip("transformers")
    for seen in _two_ranks(TP_PLAN_WORKER, 2, str(tmp_path / "llama")):
        assert "error" not in seen, f"rank {seen['rank']}: {seen['error']}\n{seen['trace']}"
        assert "DTensor" in seen["weight_types"], seen
        assert seen["eager_equal"] and seen["nimble_equal"] and seen["nimble_equal_eager"], seen
        assert seen["all_reduces"] >= seen["layers"], seen
