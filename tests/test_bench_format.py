"""The benchmark's report, from a result dict shaped like one ``bench_model`` returns (no GPU);
its ``--dtype`` / ``--quick`` arguments and the dtype conversion."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from nimble.cli import bench as bench_cli

import nimble.cli.main as cli

from nimble.cli import models
from nimble.cli.bench import format_model, parse_dtypes, summary_table, to_dtype


def _info(model: str, multi_ms: float, dtype: str = "float32", quick: bool = False) -> dict:
    """A result as ``bench_model`` makes it; ``quick`` ones lack the variants and the limit."""
    labels = [("eager", 5.0), ("torch.cuda.graph", 1.0), ("nimble multi", multi_ms),
              ("nimble single", 1.0)]
    if not quick:
        labels.append(("nimble multi, host launch", multi_ms + 0.01))
    modes = {}
    for label, ms in labels:
        modes[label] = {"median_ms": ms, "min_ms": ms * 0.99, "max_ms": ms * 1.01,
                        "x_graph": 1.0 / ms, "x_eager": 5.0 / ms}
    info = {"model": model, "dtype": dtype, "batch": 1, "quick": quick, "tasks": 10, "width": 2,
            "streams": 2, "sync_edges": 1, "modes": modes,
            "arena_mb": {"nimble multi": 1.5, "nimble single": 1.0},
            "pool_mb": 2.0, "prepare_seconds": 0.5, "host_us_per_call": 12.3,
            "launch_mode": "device-launchable"}
    if not quick:
        info["arena_mb"]["nimble multi, host launch"] = 1.5
        info.update(host_us_per_call_host_launch=25.0, host_us_bare_launch=7.5,
                    limits={"tasks": 10, "isolated_sum_us": 900.0, "critical_path_us": 400.0,
                            "launch_us": 0.5, "launch_aware_path_us": 402.0,
                            "capacity_us": 350.0, "tightest_us": 402.0,
                            "tightest": "launch-aware path"},
                    over_critical_path=1.25, over_tightest_limit=1.24,
                    trace={"concurrency": 1.76, "makespan_us": 336.0, "idle_us": {0: 3.0, 1: 40.0},
                           "overhead": 0.207, "overhead_ends_only": 0.08, "overhead_grouped": 0.03,
                           "concurrency_ends_only": 1.8})
    return info


def test_per_model_report_names_every_mode_and_the_launch_mode():
    text = format_model(_info("toy", 0.5))
    for label in ("eager", "torch.cuda.graph", "nimble multi, host launch", "nimble single"):
        assert label in text
    assert "device-launchable" in text and "12.3 µs/call" in text and "nimble multi at 1.25× the critical path, 1.24× the tightest (launch-aware path)" in text
    assert "critical path 400 µs; with 0.50 µs launch cost a task 402 µs; GPU capacity 350 µs (serial 900 µs)" in text
    assert "a bare cuGraphLaunch of it beside: 7.5 µs" in text
    assert "achieved concurrency 1.76 (DAG width 2, 2 streams)" in text
    assert "instrumentation +21% (+8% with end stamps only, +3% with them in 8 groups)" in text


def test_summary_table_has_a_row_per_model_with_its_ratios():
    lines = summary_table([_info("a", 0.5), _info("b", 0.25)]).splitlines()
    rows = {line.split()[0]: line.split() for line in lines[2:4]}
    assert set(rows) == {"a", "b"}
    # x graph and x eager of Nimble multi, then arena, pool, limit, host µs, concurrency, and
    # no nimble+inductor or torch.compile rows
    assert rows["a"][-10:] == ["2.00", "10.0", "1.5", "2.0", "0.402", "12.3", "1.76", "–", "–",
                               "–"]
    assert rows["b"][-10:-8] == ["4.00", "20.0"]


def test_summary_compares_nimble_multi_even_where_a_variant_is_faster():
    """No best-of: a faster stream cap or an uncapped arena above the pool does not take the
    summary's ratios, which would favour Nimble by the choice alone."""
    info = _info("a", 0.5)
    for label, ms in (("nimble k=2", 0.25), ("nimble uncapped", 0.2)):
        info["modes"][label] = {"median_ms": ms, "min_ms": ms, "max_ms": ms,
                                "x_graph": 1.0 / ms, "x_eager": 5.0 / ms}
    info["arena_mb"].update({"nimble k=2": 1.0, "nimble uncapped": 9.0})
    lines = summary_table([info]).splitlines()
    assert "best" not in lines[0]
    assert lines[2].split()[-10:-6] == ["2.00", "10.0", "1.5", "2.0"]  # multi's, pool
    text = format_model(info)
    assert "nimble multi at 1.25× the critical path" in text
    assert "k=2 1.0" in text and "uncapped 9.0" in text  # every variant's arena


def test_summary_table_without_dtype_column_names_the_dtype_in_the_legend():
    text = summary_table([_info("a", 0.5)])
    assert "dtype" not in text.splitlines()[0] and "median ms per call in float32" in text


def _with_inductor(info: dict, compile_ms: float, single_ms: float, multi_ms: float) -> dict:
    for label, ms in (("torch.compile", compile_ms), ("nimble+inductor single", single_ms),
                      ("nimble+inductor multi", multi_ms)):
        info["modes"][label] = {"median_ms": ms, "min_ms": ms, "max_ms": ms, "x_graph": 1.0 / ms,
                                "x_eager": 5.0 / ms}
    for r in info["modes"].values():
        r["x_compile"] = compile_ms / r["median_ms"]
    info.update(inductor={"tasks": 7, "triton_launches": 5, "width": 3, "streams": 3,
                          "sync_edges": 2, "arena_mb": 0.5},
                inductor_compile_seconds=12.5, inductor_prepare_seconds=0.75)
    return info


def test_inductor_rows_and_the_ratio_to_torch_compile():
    """x comp is torch.compile over the faster of Nimble multi and nimble+inductor multi."""
    info = _with_inductor(_info("a", 0.5), compile_ms=0.4, single_ms=0.3, multi_ms=0.2)
    row = summary_table([info]).splitlines()[2].split()
    assert row[-3:] == ["0.300", "0.200", "2.00"]
    text = format_model(info)
    assert "x compile" in text.splitlines()[1]
    assert "nimble+inductor: 7 tasks (5 Triton launches), width 3, 3 streams, 2 syncs" in text
    assert "compile 12.5 s, then prepare 0.75 s" in text
    assert "programmatic edges" not in text
    # A record with the prepare's kept choices says them (older records have none).
    info["inductor"].update(priorities=False, backfilled=0, programmatic=12)
    assert ("then prepare 0.75 s; priorities off, 0 phases backfilled, 12 programmatic edges"
            in format_model(info))
    # Eager-kernel Nimble faster than the Inductor rows: the ratio takes it.
    slow = _with_inductor(_info("b", 0.1), compile_ms=0.4, single_ms=0.5, multi_ms=0.45)
    assert summary_table([slow]).splitlines()[2].split()[-1] == "4.00"


# ---- --dtype and --quick --------------------------------------------------------------------

def test_quick_report_has_no_variant_or_limit_lines():
    text = format_model(_info("toy", 0.5, dtype="bfloat16", quick=True))
    assert text.splitlines()[0].startswith("toy (bfloat16, batch 1): 10 tasks")
    assert "host launch" not in text and "limit" not in text
    assert "12.3 µs/call (device-launchable)" in text and "prepare 0.50 s" in text
    assert "torch graph pool 2.0 MB" in text and "multi 1.5, single 1.0" in text


def test_summary_table_dtype_column_and_quick_rows():
    results = [_info("a", 0.5, "float16", quick=True), _info("a", 0.25, "bfloat16", quick=True),
               _info("b", 0.5, "float16")]
    lines = summary_table(results).splitlines()
    assert lines[0].split()[:3] == ["model", "dtype", "eager"]
    rows = [line.split() for line in lines[2:5]]
    assert [r[:2] for r in rows] == [["a", "float16"], ["a", "bfloat16"], ["b", "float16"]]
    # x graph, x eager, arena, pool, limit (– without the per-task timing), host µs, concurrency
    assert rows[0][-10:-3] == ["2.00", "10.0", "1.5", "2.0", "–", "12.3", "–"]
    assert rows[1][-10:-8] == ["4.00", "20.0"]
    assert rows[2][-6:-3] == ["0.402", "12.3", "1.76"]  # the tightest limit
    assert len({len(line) for line in lines[:5]}) == 1  # the columns line up
    # Several dtypes asked for but one left (the others failed): the column stays; by default
    # one dtype gets none.
    assert summary_table(results[:1], dtype_column=True).splitlines()[2].split()[1] == "float16"
    assert "dtype" not in summary_table(results[:1]).splitlines()[0]


def test_parse_dtypes():
    assert parse_dtypes("float16,bfloat16") == ["float16", "bfloat16"]
    assert parse_dtypes(" float32, float16,float32 ") == ["float32", "float16"]
    for bad in ("float64", "float16,half", "", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_dtypes(bad)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_to_dtype_converts_model_and_input(dtype):
    model = models.create(models.BUILTIN)
    x = models.example_input(models.BUILTIN, 2, device="cpu")
    model, x = to_dtype(model, x, dtype)
    want = getattr(torch, dtype)
    assert x.dtype == want and x.shape == (2, 3, 64, 64)
    floats = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    assert floats and all(t.dtype == want for t in floats)
    with torch.no_grad():
        assert model(x).dtype == want


def test_bench_runs_every_model_in_every_dtype(monkeypatch, tmp_path, capsys):
    """``run`` with the GPU work replaced: the loop, the table's dtype column and the JSON."""
    seen = []

    def fake_bench_model(name, args, dtype):
        seen.append((name, dtype, args.quick, args.rounds))
        if dtype == "bfloat16" and name == models.CHAINS:
            raise RuntimeError("no kernel")
        return _info(name, 0.5, dtype, quick=args.quick)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(bench_cli, "bench_model", fake_bench_model)
    out_json = tmp_path / "bench.json"
    argv = ["bench", models.BUILTIN, models.CHAINS, "--dtype", "float16,bfloat16", "--quick",
            "--rounds", "3", "--json", str(out_json)]
    assert cli.main(argv) == 1  # one run failed, the others are reported
    assert seen == [(m, d, True, 3) for m in (models.BUILTIN, models.CHAINS)
                    for d in ("float16", "bfloat16")]
    out = capsys.readouterr().out
    assert f"{models.CHAINS} (bfloat16): FAILED: RuntimeError: no kernel" in out
    table = out[out.index("model "):].splitlines()
    assert [line.split()[:2] for line in table[2:5]] == [
        [models.BUILTIN, "float16"], [models.BUILTIN, "bfloat16"], [models.CHAINS, "float16"]]
    data = json.loads(out_json.read_text())
    assert [(r["model"], r["dtype"]) for r in data["results"]] == [
        (models.BUILTIN, "float16"), (models.BUILTIN, "bfloat16"), (models.CHAINS, "float16")]
    assert data["failed"] == [{"model": models.CHAINS, "dtype": "bfloat16",
                               "error": "RuntimeError: no kernel"}]
    assert data["dtypes"] == ["float16", "bfloat16"] and data["quick"] is True


def test_bench_defaults_to_float32_and_the_full_mode():
    args = cli.build_parser("bench").parse_args(["bench"])
    assert args.dtypes == ["float32"] and not args.quick and args.models == []  # built-in
    assert args.batches is None and not args.training


# ---- tools/gpu_suite.py ---------------------------------------------------------------------

def _gpu_suite():
    from helpers import load_tool

    return load_tool("gpu_suite")


def test_gpu_suite_runs_the_quick_bench_in_three_dtypes_and_the_full_one_on_demand(
        monkeypatch, tmp_path, capsys):
    suite = _gpu_suite()
    commands = []

    def fake_run(cmd, stdout, **kwargs):
        args = cmd[cmd.index("bench") + 1:]
        commands.append(args)
        if "--training" in cmd:
            stdout.write("training table\n")
            return suite.subprocess.CompletedProcess(cmd, 0)
        quick = "--quick" in cmd
        dtypes = args[args.index("--dtype") + 1].split(",") if quick else ["float32"]
        results = [_info(m, 0.5, d, quick) for m in args[:2] for d in dtypes]
        stdout.write("\n".join(map(format_model, results)) + "\n"
                     + summary_table(results, dtype_column=quick) + "\n")
        return suite.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(suite.subprocess, "run", fake_run)
    assert suite.main(["--skip-tests", "--gpus", "0", "--out", str(tmp_path)]) == 0
    quick, training = commands
    assert training[:4] == ["resnet50", "mobilenet_v2", "efficientnet_b0", "googlenet"]
    assert " ".join(training).endswith("--training --batch 32 --rounds 3 --iters 10 --no-compile")
    assert quick[:8] == suite.ALL_MODELS.split(",")
    assert " ".join(quick).endswith("--dtype float32,float16,bfloat16 --quick --rounds 5 "
                                    "--iters 50 --no-compile")
    assert quick[quick.index("--json") + 1] == str(tmp_path / "bench.json")
    assert (tmp_path / "bench.log").exists()
    out = capsys.readouterr().out
    summary = out[out.rindex("bench float32,float16,bfloat16 (--quick) ("):]
    assert "resnet50        float16" in summary and "times: median ms per call" in summary

    commands.clear()
    assert suite.main(["--skip-tests", "--skip-bench", "--skip-training", "--full", "--gpus",
                       "0", "--out", str(tmp_path)]) == 0
    [full] = commands
    assert "--quick" not in full and "--dtype" not in full and "--no-compile" in full
    assert full[full.index("--json") + 1] == str(tmp_path / "bench_full.json")


def test_gpu_suite_spreads_the_test_files_and_runs_the_memory_tests_alone(monkeypatch, tmp_path,
                                                                          capsys):
    from pathlib import Path

    suite = _gpu_suite()
    files = [Path(f"tests/test_gpu_{n}.py") for n in
             ("proof", "debug_tools", "runtime", "training", "c_host", "deploy", "new")]
    groups = suite.test_groups(files, 3)
    assert sorted(f for g in groups for f in g) == sorted(files)  # each file once
    loads = [sum(suite.WEIGHTS.get(f.name, 1) for f in g) for g in groups]
    assert max(loads) - min(loads) <= max(suite.WEIGHTS.get(f.name, 1) for f in files)
    two = suite.test_groups(files[:2], 5)  # no empty group, the heavier file first
    assert sorted(two) == sorted([[files[0]], [files[1]]])
    assert suite.WEIGHTS.get(two[0][0].name, 1) >= suite.WEIGHTS.get(two[1][0].name, 1)

    started = []

    class Proc:
        """A pytest process; the first one started ends last (it is polled twice first)."""
        returncode = 0

        def __init__(self, cmd, stdout, **kwargs):
            started.append([Path(c).name for c in cmd if c.endswith(".py")])
            stdout.write(f"{len(started)} passed in 1.0s\n")
            self.polls_left = 2 if len(started) == 1 else 0

        def poll(self):
            self.polls_left -= 1
            return 0 if self.polls_left < 0 else None
    monkeypatch.setattr(suite.subprocess, "Popen", Proc)
    monkeypatch.setattr(suite, "EXCLUSIVE", ("test_gpu_deploy.py",))
    assert suite.main(["--skip-bench", "--skip-training", "--jobs", "2", "--gpus", "0", "--out",
                       str(tmp_path)]) == 0
    *parallel, alone = started
    assert len(parallel) == 2 and alone == list(suite.EXCLUSIVE)
    assert not set(suite.EXCLUSIVE) & {name for g in parallel for name in g}
    out = capsys.readouterr().out
    # each process's line as it ends (the second before the first), then the summary again
    ended = [line.rsplit(": ", 1)[1] for line in out.splitlines()
             if line.startswith("gpu tests on GPU 0 [")]
    assert ended == ["2 passed in 1.0s", "1 passed in 1.0s", "3 passed in 1.0s"] * 2
    assert (tmp_path / "gpu_tests_deploy.log").exists()  # the exclusive group's, by its file
    assert len(list(tmp_path.glob("gpu_tests_*.log"))) == 3


def test_gpu_suite_stops_processes_at_its_deadline_and_says_what_each_did_so_far(monkeypatch,
                                                                                  tmp_path,
                                                                                  capsys):
    """``--deadline``: a process still running is stopped (its session signalled, so torchrun's
    ranks go with it), and its line says what its tests did, from the times file each pytest
    process writes as tests end; the slowest tests follow; the status is a failure."""
    from pathlib import Path

    suite = _gpu_suite()
    stale = tmp_path / "gpu_tests_all.times.tsv"
    stale.write_text("failed\t99.0\tan::earlier_run\n")
    signalled = []

    class Proc:
        """A pytest process that never ends by itself, having ended two tests."""
        returncode = None

        def __init__(self, cmd, stdout, **kwargs):
            env = kwargs["env"]
            self.pid = 4242 + len(signalled)
            assert kwargs.get("start_new_session")
            with open(env[suite.TIMES_ENV], "a") as f:
                f.write("passed\t3.50\ttests/test_gpu_runtime.py::fast\n"
                        "failed\t12.25\ttests/test_gpu_runtime.py::slow\npass")  # cut off

        def poll(self):
            return None

        def wait(self, timeout=None):
            return 0
    monkeypatch.setattr(suite.subprocess, "Popen", Proc)
    monkeypatch.setattr(suite.os, "killpg", lambda pid, sig: signalled.append((pid, sig)))
    monkeypatch.setattr(suite, "_stages", lambda args: [
        [suite.Run((Path("tests"),), ("0",))],
        [suite.Run((Path("tests/test_gpu_serving.py"),), ("0",))]])
    assert suite.main(["--skip-bench", "--skip-training", "--deadline", "0", "--gpus", "0", "--out",
                       str(tmp_path)]) == 1
    assert signalled == [(4242, suite.signal.SIGTERM)]
    out = capsys.readouterr().out
    assert "FAILED tests/test_gpu_runtime.py::slow" in out
    assert "gpu tests on GPU 0 [tests] (0 s): cut off at the deadline; 1 failed, 1 passed" in out
    slowest = out[out.index("slowest tests"):].splitlines()
    assert slowest[1].split() == ["12.2", "failed", "tests/test_gpu_runtime.py::slow"]
    assert slowest[2].split() == ["3.5", "passed", "tests/test_gpu_runtime.py::fast"]
    assert "earlier_run" not in out  # the folder's times file of a former run was removed
    assert "not started at the deadline: test_gpu_serving.py" in out


def test_each_test_writes_its_outcome_and_seconds_where_the_suite_asks(tmp_path):
    """tests/conftest.py's hook, in a pytest process of its own: a line per test as it ends."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    (tmp_path / "none.ini").write_text("[pytest]\n")
    (tmp_path / "test_three.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert False\n"
        "@pytest.mark.skip(reason='no')\ndef test_skipped():\n    pass\n")
    times = tmp_path / "times.tsv"
    env = {**__import__("os").environ, "NIMBLE_TEST_TIMES": str(times),
           "PYTHONPATH": str(tests)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                        "conftest", "-c", str(tmp_path / "none.ini"), "--rootdir",
                        str(tmp_path), str(tmp_path / "test_three.py")],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert "1 failed, 1 passed, 1 skipped" in r.stdout, r.stdout + r.stderr
    rows = [line.split("\t") for line in times.read_text().splitlines()]
    assert [(outcome, test.rsplit("::", 1)[1]) for outcome, _, test in rows] == \
        [("passed", "test_ok"), ("failed", "test_bad"), ("skipped", "test_skipped")]
    assert all(float(seconds) >= 0 for _, seconds, _ in rows)


NVIDIA_SMI = ["GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-a)", "GPU 1: NVIDIA H100 (UUID: GPU-b)",
              "  MIG 1g.10gb     Device  0: (UUID: MIG-c)", "GPU 2: NVIDIA H100 (UUID: GPU-d)",
              "GPU 3: NVIDIA H100 (UUID: GPU-e)"]


def test_gpu_suite_finds_the_gpus_without_torch():
    suite = _gpu_suite()
    assert suite.visible_gpus({}, lambda: NVIDIA_SMI) == ["0", "1", "2", "3"]  # MIG lines aside
    assert suite.visible_gpus({}, lambda: []) == []  # no nvidia-smi: the environment as it is
    assert suite.visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}, lambda: NVIDIA_SMI) == ["2", "3"]
    assert suite.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, lambda: NVIDIA_SMI) == []
    assert suite.parse_gpus("1,3", {}, lambda: NVIDIA_SMI) == ["1", "3"]
    assert suite.parse_gpus("auto", {}, lambda: NVIDIA_SMI[:2]) == ["0", "1"]


def _gpu_files(suite):
    from pathlib import Path

    names = ["proof", "debug_tools", "runtime", "training", "c_host", "deploy", "compiled",
             "generate", "record", "serving", "serve_bench", "collectives", "new"]
    files = [Path(f"tests/test_gpu_{n}.py") for n in names]
    assert set(suite.EXCLUSIVE) | set(suite.MULTI_GPU) <= {f.name for f in files}
    return files


def test_gpu_suite_gives_each_gpu_a_lane_and_the_multi_gpu_files_all_then_the_memory_files():
    suite = _gpu_suite()
    files = _gpu_files(suite)
    first, alone = suite.plan_runs(files, ["0", "1", "2", "3"], jobs=1)
    shared, multi = first[:-1], first[-1:]
    planned = [f for stage in (shared, alone, multi) for run in stage for f in run.files]
    whole = [f for f in planned if not isinstance(f, suite.Share)]
    parts = [f for f in planned if isinstance(f, suite.Share)]
    assert sorted(map(str, whole)) == sorted(str(f) for f in files if f.name not in suite.SPLIT)
    # a split file runs as its shares, each once
    assert sorted((f.name, f.index) for f in parts) == sorted(
        (f.name, i) for f in files if f.name in suite.SPLIT for i in range(suite.SPLIT[f.name]))
    assert sorted(run.gpus for run in shared) == [("0",), ("1",), ("2",), ("3",)]  # a lane each
    loads = [sum(suite.weight(f) for f in run.files) for run in shared]
    assert max(loads) - min(loads) <= max(suite.weight(f) for f in suite.shares(files))
    assert not {f.name for run in shared for f in run.files} & \
        (set(suite.EXCLUSIVE) | set(suite.MULTI_GPU))
    assert sorted(f.name for run in alone for f in run.files) == sorted(suite.EXCLUSIVE)
    assert len({run.gpus for run in alone}) == len(alone) and all(len(r.gpus) == 1 for r in alone)
    assert multi == [suite.Run(tuple(f for f in files if f.name in suite.MULTI_GPU),
                               ("0", "1", "2", "3"))]
    two_jobs = suite.plan_runs(files, ["0", "1"], jobs=2)[0]
    assert sorted(run.gpus for run in two_jobs) == [("0",), ("0",), ("0", "1"), ("1",), ("1",)]


def test_gpu_suite_on_one_gpu_runs_the_memory_files_in_one_process_and_no_multi_gpu_stage():
    suite = _gpu_suite()
    files = _gpu_files(suite)
    for gpus in (["0"], []):
        stages = suite.plan_runs(files, gpus, jobs=3)
        assert len(stages) == 2 and len(stages[0]) == 3
        [alone] = stages[1]
        assert sorted(f.name for f in alone.files) == sorted(suite.EXCLUSIVE)
        assert "test_gpu_collectives.py" in {f.name for run in stages[0] for f in run.files}


def test_gpu_suite_runs_every_process_on_its_gpus_with_multicast_off(monkeypatch, tmp_path,
                                                                    capsys):
    """Four GPUs seen by nvidia-smi: the suite in one call, four lanes at once, each process
    seeing its own GPU (the multi-GPU files' process every GPU, beside them), and every process (the benches too) with NVLink multicast off."""
    from pathlib import Path

    suite = _gpu_suite()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # the suite's own setting wins
    monkeypatch.setattr(suite, "_nvidia_smi", lambda: NVIDIA_SMI)
    started, running, most = [], set(), [0]

    class Proc:
        returncode = 0

        def __init__(self, cmd, stdout, env, **kwargs):
            started.append(([Path(c).name for c in cmd if c.endswith(".py")], env))
            running.add(id(self))
            most[0] = max(most[0], len(running))
            stdout.write("1 passed in 1.0s\n")

        def poll(self):
            running.discard(id(self))
            return 0

    def bench(cmd, stdout, env, **kwargs):
        started.append((["bench"], env))
        return suite.subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(suite.subprocess, "Popen", Proc)
    monkeypatch.setattr(suite.subprocess, "run", bench)
    assert suite.main(["--skip-bench", "--out", str(tmp_path)]) == 0
    assert most[0] == 5  # the four lanes at once, the multi-GPU files' process beside them
    lanes = [env["CUDA_VISIBLE_DEVICES"] for names, env in started[:5]]
    assert sorted(lanes) == ["0", "0,1,2,3", "1", "2", "3"]
    collectives = next(env for names, env in started if "test_gpu_collectives.py" in names)
    assert collectives["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    for _, env in started:
        assert {k: env[k] for k in suite.NO_MULTICAST} == suite.NO_MULTICAST
    assert started[-1][0] == ["bench"]
    ran = [n for names, _ in started[:-1] for n in names]
    gpu_files = sorted(p.name for p in (suite.ROOT / "tests").glob("test_gpu_*.py"))
    assert sorted(set(ran)) == gpu_files  # every GPU test file
    assert all(ran.count(n) == 1 for n in gpu_files if n not in suite.SPLIT)  # once
    for name, count in suite.SPLIT.items():  # a split file: every share once, no more
        picked = [int(i) for names, env in started[:-1] if name in names
                  for part in env["NIMBLE_TEST_SHARD"].split(";") if part.startswith(name)
                  for i in part.split(":")[1].split("/")[0].split(",")]
        assert sorted(picked) == list(range(count)), (name, picked)
    assert all("NIMBLE_TEST_SHARD" not in env for names, env in started[:-1]
               if not set(names) & set(suite.SPLIT))
    assert "gpu tests on GPU 3 [" in capsys.readouterr().out


def test_gpu_suite_parts_hold_every_file_and_share_once_in_groups_of_about_equal_length():
    suite = _gpu_suite()
    files = _gpu_files(suite)
    every = sorted(map(str, suite.shares(files)))
    for parts in (1, 2, 3):
        groups = [suite.part_of(files, k, parts) for k in range(1, parts + 1)]
        assert sorted(str(f) for g in groups for f in g) == every
        loads = [sum(suite.weight(f) for f in g) for g in groups]
        assert max(loads) - min(loads) <= max(suite.weight(f) for f in suite.shares(files))
        for g in groups:  # a part plans like the whole: shares stay shares, stages apart
            planned = [f for stage in suite.plan_runs(g, ["0", "1", "2", "3"], 2)
                       for run in stage for f in run.files]
            assert sorted(map(str, planned)) == sorted(map(str, g))
    assert suite.parse_part("2/3") == (2, 3)
    for bad in ("0/2", "3/2", "x", "1/0"):
        with pytest.raises(SystemExit, match="--part"):
            suite.parse_part(bad)


def test_every_gpu_test_is_in_a_file_the_suite_spreads():
    """The suite spreads the test_gpu_*.py files: a test marked gpu elsewhere would not run."""
    import ast
    from pathlib import Path

    marked = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        if path.name.startswith("test_gpu_"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "gpu" \
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "mark":
                marked.append(path.name)
    assert not marked


def test_training_bench_parses_batches_and_formats_its_table():
    import argparse

    from nimble.cli.common import parse_batches
    from nimble.cli.train_bench import table

    assert parse_batches("32,64,32") == [32, 64]
    for bad in ("", "0", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_batches(bad)
    modes = {k: {"median_ms": ms, "min_ms": ms, "max_ms": ms, "x_eager": 10.0 / ms,
                 "x_graphed": 8.0 / ms}
             for k, ms in (("eager", 10.0), ("graphed", 8.0), ("nimble single", 6.0),
                           ("nimble multi", 5.0))}
    text = table([{"model": "resnet50", "batch": 32, "modes": modes, "paper_x_eager": 1.9,
                   "arena_mb": 222.6, "pool_mb": 226.0, "graphed_pool_mb": 230.0,
                   "prepare_seconds": {"nimble single": 20.5, "nimble multi": 2.0}}])
    row = text.splitlines()[2].split()
    assert row[:2] == ["resnet50", "32"] and row[4] == "–"  # no compile row
    assert row[7:10] == ["2.00", "1.60", "1.90"]
    assert row[10:] == ["223", "230", "20.5"]


def test_the_training_lines_set_the_backend_against_nimble_on_inductors_kernels():
    """The per-model line of ``bench --training`` gives the backend's step over Nimble's step
    of the same compiled model (issue 52's 3%), and says why that row is missing where its
    prepare failed, instead of leaving it out unsaid."""
    from nimble.cli.train_bench import BACKEND_ROW, INDUCTOR_ROW, _report

    modes = {"graphed": {"median_ms": 4.0}, BACKEND_ROW: {"median_ms": 3.09},
             INDUCTOR_ROW: {"median_ms": 3.0}}
    line = _report({"model": "resnet50", "batch": 32, "modes": modes})
    assert line.endswith(f"{BACKEND_ROW} against {INDUCTOR_ROW}: 1.030")
    del modes[INDUCTOR_ROW]
    line = _report({"model": "resnet50", "batch": 32, "modes": modes,
                    "nimble_inductor_error": "CaptureError: no"})
    assert "against" not in line and line.endswith(f"{INDUCTOR_ROW} not timed (CaptureError: no)")
    host = {"graphed": 812.4, BACKEND_ROW: 1430.2, INDUCTOR_ROW: 951.0}
    line = _report({"model": "resnet50", "batch": 32, "modes": modes, "host_us_per_step": host})
    assert line.endswith(f"; host µs/step sampled in turn: graphed 812, {BACKEND_ROW} 1430, "
                         f"{INDUCTOR_ROW} 951")


def test_the_compile_backend_row_and_the_host_times_of_torch_compiles_two_ways():
    from nimble.cli.bench import BACKEND_ROW

    info = _with_inductor(_info("a", 0.5), compile_ms=0.4, single_ms=0.3, multi_ms=0.2)
    info["modes"][BACKEND_ROW] = {"median_ms": 0.21, "min_ms": 0.2, "max_ms": 0.22,
                                  "x_graph": 1 / 0.21, "x_eager": 5 / 0.21, "x_compile": 0.4 / 0.21}
    info.update(host_us_compiled={"torch.compile": 40.5, BACKEND_ROW: 31.25,
                                  "nimble+inductor multi": 18.0}, backend_seconds=20.0)
    text = format_model(info)
    assert f"  {BACKEND_ROW:<26}     0.210" in text
    assert ("host µs/call sampled in turn: torch.compile(mode='reduce-overhead') 40.5, "
            "torch.compile(backend='nimble') 31.2, nimble+inductor multi 18.0; backend=nimble "
            "compiled and prepared in 20.0 s") in text
    # The summary keeps its columns: the backend's row is in the model's lines.
    assert summary_table([info]).splitlines()[2].split()[-3:] == ["0.300", "0.200", "2.00"]


def test_a_split_files_shares_run_each_of_its_tests_once():
    """NIMBLE_TEST_SHARD (tests/conftest.py), as the suite sets it for a split file: the
    shares of a file together run each of its tests once, other files whole; a malformed
    setting is a usage error."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from conftest import parse_shards

    assert parse_shards("a.py:0,2/3;b.py:1/2") == {"a.py": (3, frozenset({0, 2})),
                                                  "b.py": (2, frozenset({1}))}
    assert parse_shards("") == {}
    files = ["tests/test_tp_decode_bench_tool.py", "tests/test_c_plan.py"]

    def ran(shard: str) -> list[str]:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "--collect-only", *files],
                              capture_output=True, text=True, cwd=Path(__file__).parent.parent,
                              env={**os.environ, "NIMBLE_TEST_SHARD": shard})
        assert done.returncode in (0, 5), done.stdout + done.stderr
        return re.findall(r"^tests/\S+::\S+", done.stdout, flags=re.M)
    every = ran("")
    mine = [t for t in every if "tp_decode_bench_tool" in t]
    others = [t for t in every if t not in mine]
    shares = [ran(f"test_tp_decode_bench_tool.py:{i}/2") for i in range(2)]
    for share in shares:
        assert sorted(t for t in share if t not in mine) == sorted(others)  # other files whole
    assert sorted(t for share in shares for t in share if t in mine) == sorted(mine)
    assert all(share != [t for t in every] for share in shares)
    bad = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", files[0]],
                         capture_output=True, text=True, cwd=Path(__file__).parent.parent,
                         env={**os.environ, "NIMBLE_TEST_SHARD": "x.py:2/2"})
    assert bad.returncode == 4 and "NIMBLE_TEST_SHARD" in bad.stdout + bad.stderr


def test_the_backend_has_a_row_with_its_outputs_copied_and_one_without(monkeypatch):
    """``nimble bench``'s backend rows: the default (each call copies its outputs) and
    ``options={"return_copies": False}``, as ``nimble+inductor`` returns the arena's outputs;
    each row calls its own compiled model under no_grad."""
    import torch

    from nimble.cli import bench
    from nimble.cli.harness import BACKEND_ROW, BACKEND_VIEWS_ROW

    compiled_with = []

    def warm_compile(model, x, **options):
        compiled_with.append(options)
        return lambda arg: (options.get("options"), torch.is_grad_enabled(), arg)

    monkeypatch.setattr(bench, "_warm_compile", warm_compile)
    info: dict = {}
    rows = bench._on_backend(object(), "x", info, lambda what: None)
    assert set(rows) == {BACKEND_ROW, BACKEND_VIEWS_ROW} and "backend_seconds" in info
    assert info["backend_graphs"] == []  # the stand-in compiled no region
    assert [o["backend"] for o in compiled_with] == ["nimble", "nimble"]
    assert rows[BACKEND_ROW]() == (None, False, "x")
    assert rows[BACKEND_VIEWS_ROW]() == ({"return_copies": False}, False, "x")


def test_the_backends_graphs_are_counted_and_said_beside_its_host_time():
    """Each Nimble graph a region prepared (an Inductor fallback has none) is given by its
    tasks, streams and syncs on the host line, to set beside nimble+inductor's."""
    from types import SimpleNamespace as NS

    from nimble.cli import bench
    from nimble.cli.harness import BACKEND_ROW

    engine = NS(priorities=[0, -1], backfill=[NS(kept=None), NS(kept="late")],
                programmatic=frozenset())
    nm = NS(graph=NS(tasks=[0] * 188), schedule=NS(streams=[0, 1], sync_edges=[(0, 1)]),
            engine=engine)
    regions = [NS(runs={"a": NS(launch=nm), "b": object()}), NS(runs={})]
    shapes = bench._graph_shapes(regions)
    assert shapes == [{"tasks": 188, "streams": 2, "sync_edges": 1, "priorities": True,
                       "backfilled": 1, "programmatic": 0}]
    info = {"host_us_compiled": {"torch.compile": 1.0, BACKEND_ROW: 2.0,
                                 "nimble+inductor multi": 3.0},
            "backend_seconds": 2.5, "backend_graphs": shapes}
    assert bench._compiled_host_line(info).endswith(
        "compiled and prepared in 2.5 s; its graph: 188 tasks, 2 streams, 1 syncs, priorities "
        "on, 1 phases backfilled, 0 programmatic edges")
