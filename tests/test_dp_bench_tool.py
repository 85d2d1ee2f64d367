"""tools/dp_bench.py's arithmetic: what its medians say (no GPU)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers import load_tool

dp_bench = load_tool("dp_bench")
gpu_suite = load_tool("gpu_suite")


def _rows(**ms: float) -> dict:
    return {mode.replace("_", " "): {"median_ms": v, "min_ms": v, "max_ms": v}
            for mode, v in ms.items()}


def test_throughput_speed_up_efficiency_and_hidden_share():
    rows = _rows(ddp=40.0, nimble=25.0, nimble_local=20.0, **{"all-reduce": 10.0})
    got = dp_bench.derived(rows, world=4, batch=32)
    assert got["images_per_s"]["nimble"] == pytest.approx(4 * 32 * 1000 / 25.0)
    assert "all-reduce" not in got["images_per_s"]
    assert got["nimble_x_ddp"] == pytest.approx(1.6)
    assert got["scaling_efficiency"] == pytest.approx(0.8)
    assert got["all_reduce_hidden"] == pytest.approx(0.5)  # 5 of its 10 ms exposed


def test_the_hidden_share_stays_between_none_and_all():
    fully = dp_bench.derived(_rows(nimble=19.0, nimble_local=20.0, **{"all-reduce": 5.0}), 2, 8)
    assert fully["all_reduce_hidden"] == 1.0
    none = dp_bench.derived(_rows(nimble=40.0, nimble_local=20.0, **{"all-reduce": 5.0}), 2, 8)
    assert none["all_reduce_hidden"] == 0.0
    assert "nimble_x_ddp" not in none and "all_reduce_hidden" not in dp_bench.derived(
        _rows(nimble=1.0, nimble_local=1.0), 2, 8)


def test_the_ddp_wrapped_row_gets_its_own_speed_up_efficiency_and_hidden_share():
    rows = _rows(ddp=40.0, nimble=25.0, nimble_local=20.0, **{"nimble ddp": 32.0,
                                                              "all-reduce": 16.0})
    got = dp_bench.derived(rows, world=2, batch=32)
    assert got["nimble_ddp_x_ddp"] == pytest.approx(1.25)
    assert got["scaling_efficiency_ddp_wrapped"] == pytest.approx(20.0 / 32.0)
    assert got["all_reduce_hidden_ddp_wrapped"] == pytest.approx(0.25)  # 12 of 16 ms exposed
    assert got["all_reduce_hidden"] == pytest.approx(1 - 5.0 / 16.0)  # the averaged row's own
    assert "nimble ddp" in got["images_per_s"]
    assert "nimble ddp x ddp: 1.250" in dp_bench._report(
        {"model": "m", "world": 2, "gpu": "g", "batch_per_gpu": 32, "modes": rows, **got})


def test_each_nimble_row_says_how_its_graphs_are_launched_and_the_mixing_setting():
    nm = SimpleNamespace(engine=SimpleNamespace(builts=[SimpleNamespace(device_launch=True),
                                                        SimpleNamespace(device_launch=False)]))
    assert dp_bench.launch_modes(nm) == ["device", "host"]
    rows = _rows(nimble=4.0, nimble_local=3.5)
    report = dp_bench._report({"model": "m", "world": 2, "gpu": "G", "batch_per_gpu": 32,
                               "graph_mixing": False, "launch": {"nimble": ["device", "host"]},
                               "modes": rows, **dp_bench.derived(rows, 2, 32)})
    assert report.splitlines()[0] == "m, 2 x G, batch 32 per GPU, NCCL graph mixing off"
    assert report.splitlines()[1].endswith("launched device/host")
    assert "launched" not in report.splitlines()[2]  # nimble local: no launch modes given


def test_the_benches_turn_nccl_graph_mixing_off_unless_asked_to_keep_it():
    off = gpu_suite.collective_environment(keep_graph_mixing=False)
    assert off["NCCL_GRAPH_MIXING_SUPPORT"] == "0" and off["NCCL_NVLS_ENABLE"] == "0"
    assert "NCCL_GRAPH_MIXING_SUPPORT" not in gpu_suite.collective_environment(True)


def test_a_bench_rank_starts_with_its_environment_gpu_and_process_group(monkeypatch):
    import torch
    import torch.distributed as dist

    made = []
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    for key in {**gpu_suite.NO_MULTICAST, **gpu_suite.GRAPH_MIXING_OFF}:
        monkeypatch.setenv(key, "unset")  # put back as it was after the test
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: made.append(("device", i)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, device_id: made.append((backend, str(device_id))))
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    assert gpu_suite.start_rank(keep_graph_mixing=False) == (1, 2)
    assert made == [("device", 1), ("nccl", "cuda:1")]
    import os
    assert os.environ["NCCL_GRAPH_MIXING_SUPPORT"] == "0" and os.environ["NCCL_NVLS_ENABLE"] == "0"


def test_the_averaging_options_reach_the_nimble_row_and_its_report():
    from nimble.record.gradient_average import GradientAverage

    args = SimpleNamespace(average_in_all_reduce=False, last_bucket_mib=None)
    assert dp_bench.averaging(args) is True  # Nimble's defaults
    args = SimpleNamespace(average_in_all_reduce=True, last_bucket_mib=0.5)
    assert dp_bench.averaging(args) == GradientAverage(average_in_all_reduce=True,
                                                       last_bucket_bytes=1 << 19)
    args = SimpleNamespace(average_in_all_reduce=False, last_bucket_mib=0)  # DDP's buckets
    assert dp_bench.averaging(args) == GradientAverage(last_bucket_bytes=None)
    args = SimpleNamespace(average_in_all_reduce=True, last_bucket_mib=None)
    assert dp_bench.averaging(args).last_bucket_bytes == 4 << 20
    rows = _rows(nimble=4.0, nimble_local=3.5)
    first = dp_bench._report({"model": "m", "world": 2, "gpu": "G", "batch_per_gpu": 32,
                              "graph_mixing": False, "average_in_all_reduce": True,
                              "last_bucket_mib": 0.5, "modes": rows,
                              **dp_bench.derived(rows, 2, 32)}).splitlines()[0]
    assert first.endswith("mixing off, the nimble row averaging inside the all-reduce, its last "
                          "bucket at most 0.5 MiB")
