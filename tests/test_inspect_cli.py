"""``nimble.analysis.report`` and the ``nimble inspect`` command, on synthetic graphs and the fixtures."""
from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from nimble import Pointer, TaskGraph

import nimble.cli.main as cli
from nimble.analysis import report as ins
from nimble.analysis.deps import build_dag
from nimble.analysis.memplan import MemPlan
from nimble.analysis.plan_check import check_plan
from nimble.analysis.schedule import Schedule, check_schedule
from nimble.ir.synthetic import branchy_graph, random_graph
from nimble.ir.taskgraph import BufferKind, FORMAT_VERSION

from helpers import FIXTURE_PATHS, fixture_ids

ROOT = Path(__file__).resolve().parents[1]


def _edges_of_accesses(graph):
    """Reference dependencies: any two tasks touching common bytes of a buffer, one writing."""
    out = []
    for j, tj in enumerate(graph.tasks):
        for i in range(j):
            if any(a.buffer == b.buffer and (a.write or b.write) and a.offset < b.end
                   and b.offset < a.end for a in graph.tasks[i].accesses for b in tj.accesses):
                out.append((i, j))
    return out


SUMMARY_KEYS = {"tasks", "kernel_tasks", "buffers", "bytes_by_kind", "unresolved_pointers",
                "tasks_by_kind", "ops", "buffers_by_kind", "top_kernels", "unattributed_tasks",
                "model"}
SCHEDULE_KEYS = {"width", "streams", "sync_edges", "reduced_edges", "critical_path_tasks",
                 "critical_path_us", "dag_edges", "analysis_seconds"}
MEMPLAN_KEYS = {"arena_bytes", "buffer_bytes", "lower_bound_bytes"}


def _run_json(capsys, *argv) -> dict:
    assert cli.main(["inspect", *map(str, argv), "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def _graphs():
    return [("branchy", branchy_graph()), ("random", random_graph(60, seed=5))]


@pytest.fixture(params=_graphs(), ids=lambda p: p[0])
def saved(request, tmp_path):
    name, graph = request.param
    return graph, graph.save(tmp_path / f"{name}.json.gz")


# ---- summaries ------------------------------------------------------------------------------

def _check_summary(graph: TaskGraph, s: dict) -> None:
    assert SUMMARY_KEYS <= s.keys()
    assert s["tasks"] == len(graph.tasks) == sum(s["tasks_by_kind"].values())
    assert s["kernel_tasks"] == len(graph.kernel_tasks())
    assert s["buffers"] == len(graph.buffers) == sum(s["buffers_by_kind"].values())
    assert sum(s["bytes_by_kind"].values()) == sum(b.size for b in graph.buffers)
    assert s["unresolved_pointers"] == len(graph.unresolved_pointers())
    counts = [k["count"] for k in s["top_kernels"]]
    assert counts == sorted(counts, reverse=True) and len(counts) <= 10
    assert sum(counts) <= s["kernel_tasks"]
    assert s["model"] == graph.meta.get("model")


def test_json_summary(saved, capsys):
    graph, path = saved
    s = _run_json(capsys, path)
    _check_summary(graph, s)
    assert not SCHEDULE_KEYS & s.keys() and not MEMPLAN_KEYS & s.keys()


def test_summary_counts_unresolved_and_unattributed():
    g = branchy_graph(stages=1)
    g.tasks[0].op = -1
    g.tasks[1].pointers.append(Pointer(8, 0xDEAD0000, -1, 0))
    s = ins.summarize(g)
    assert s["unattributed_tasks"] == 1 and s["unresolved_pointers"] == 1
    assert s["unresolved_examples"] == [{"task": 1, "location": 8, "value": "0xdead0000"}]
    text = ins.format_summary(s, None, None)
    assert "unresolved pointers: 1" in text and "0xdead0000" in text


def test_schedule_and_memplan_json(saved, capsys):
    graph, path = saved
    s = _run_json(capsys, path, "--schedule")
    assert SCHEDULE_KEYS <= s.keys() and not MEMPLAN_KEYS & s.keys()
    m = _run_json(capsys, path, "--memplan")  # implies the schedule
    assert (SUMMARY_KEYS | SCHEDULE_KEYS | MEMPLAN_KEYS) <= m.keys()
    assert 1 <= m["streams"] and m["critical_path_tasks"] <= m["tasks"]
    assert m["sync_edges"] <= m["reduced_edges"] <= m["dag_edges"]
    # Every synthetic task has a duration: the simulated makespan lies between the bounds.
    assert m["critical_path_us"] <= m["simulated_us"] + 1e-6
    assert m["simulated_us"] <= m["serial_us"] + 1e-6
    assert m["lower_bound_bytes"] <= m["arena_bytes"] <= m["buffer_bytes"]
    assert m["buffer_bytes"] >= sum(b.size for b in graph.buffers if b.relocatable)


def test_max_streams_limits_streams(saved, capsys):
    _, path = saved
    assert _run_json(capsys, path, "--schedule", "--max-streams", 2)["streams"] <= 2
    assert cli.main(["inspect", str(path), "--max-streams", "0"]) == 2
    capsys.readouterr()


def test_text_report(saved, capsys):
    _, path = saved
    assert cli.main(["inspect", str(path), "--memplan"]) == 0
    out, err = capsys.readouterr()
    for heading in ("tasks:", "top kernels:", "buffers:", "unresolved pointers: 0",
                    "schedule (max streams: unlimited):", "critical path:", "memory plan:"):
        assert heading in out
    assert "MiB" in out and "loaded" in err  # progress on stderr, report on stdout


# ---- exports --------------------------------------------------------------------------------

def _closure(n: int, edges) -> list[int]:
    succs = [[] for _ in range(n)]
    for u, v in edges:
        succs[u].append(v)
    reach = [0] * n
    for u in range(n - 1, -1, -1):
        for v in succs[u]:
            reach[u] |= reach[v] | 1 << v
    return reach


def _check_export(graph: TaskGraph, plan: dict) -> None:
    n = len(graph.tasks)
    assert plan["format"] == "nimble.plan" and plan["version"] == 1
    streams, edges = plan["streams"], [tuple(e) for e in plan["edges"]]
    assert len(streams) == n and set(streams) == set(range(plan["num_streams"]))
    assert all(0 <= u < v < n for u, v in edges)
    assert {tuple(e) for e in plan["sync_edges"]} <= set(edges)
    assert all(streams[u] != streams[v] for u, v in plan["sync_edges"])
    # Tasks of one stream run in order, so the edges must chain each stream's tasks.
    reach = _closure(n, edges)
    for s in set(streams):
        members = [t for t in range(n) if streams[t] == s]
        assert all(reach[a] >> b & 1 for a, b in zip(members, members[1:]))
    relocatable = {b.id for b in graph.buffers if b.relocatable}
    offsets = {int(k): v for k, v in plan["offsets"].items()}
    assert offsets.keys() == relocatable
    check_plan(graph, edges, MemPlan(offsets, plan["arena_bytes"], 0, 0, plan["alignment"]))
    members = [[t for t in range(n) if streams[t] == s] for s in range(plan["num_streams"])]
    check_schedule(build_dag(graph), Schedule(
        streams, members, [tuple(e) for e in plan["sync_edges"]], 0, 0, phases=plan["phases"],
        barrier_edges=[tuple(e) for e in plan["barrier_edges"]]))
    assert sum(plan["phases"]) in (0, n)


def test_export_is_consistent(saved, tmp_path, capsys):
    graph, path = saved
    out = tmp_path / "plan.json"
    assert cli.main(["inspect", str(path), "--export", str(out), "-q"]) == 0
    assert capsys.readouterr().err == ""
    plan = json.loads(out.read_text())
    _check_export(graph, plan)
    # The final edges keep every dependency between tasks that touch common bytes.
    reach = _closure(len(graph.tasks), plan["edges"])
    assert all(reach[u] >> v & 1 for u, v in _edges_of_accesses(graph))


def test_dot_output(saved, tmp_path, capsys):
    graph, path = saved
    out = tmp_path / "g.dot"
    assert cli.main(["inspect", str(path), "--dot", str(out), "--export", str(tmp_path / "p")]) == 0
    capsys.readouterr()
    text = out.read_text()
    plan = json.loads((tmp_path / "p").read_text())
    assert text.startswith("digraph taskgraph {") and text.rstrip().endswith("}")
    lines = text.splitlines()
    assert sum(1 for l in lines if l.lstrip().startswith("t") and "label=" in l) == len(graph.tasks)
    arrows = [l for l in lines if " -> " in l]
    assert len(arrows) == len(plan["edges"])
    assert sum("dashed" in l for l in arrows) == len(plan["sync_edges"])
    plain = ins.to_dot(graph)  # no schedule: reduced dependency DAG, no stream colours
    assert "xlabel" not in plain and plain.count("{") == plain.count("}")
    if shutil.which("dot"):
        subprocess.run(["dot", "-Tsvg", str(out), "-o", str(tmp_path / "g.svg")], check=True)


def test_chrome_trace(saved, tmp_path, capsys):
    graph, path = saved
    trace_path, plan_path = tmp_path / "t.json", tmp_path / "p.json"
    assert cli.main(["inspect", str(path), "--simulated-trace", str(trace_path),
                     "--export", str(plan_path)]) == 0
    capsys.readouterr()
    trace, plan = json.loads(trace_path.read_text()), json.loads(plan_path.read_text())
    slices = sorted((e for e in trace["traceEvents"] if e["ph"] == "X"),
                    key=lambda e: e["args"]["task"])
    assert [e["args"]["task"] for e in slices] == list(range(len(graph.tasks)))
    for e, t in zip(slices, graph.tasks):
        assert e["tid"] == plan["streams"][t.id] and e["dur"] == pytest.approx(t.duration_us)
    for u, v in plan["edges"]:
        assert slices[u]["ts"] + slices[u]["dur"] <= slices[v]["ts"] + 1e-9
    by_row = {}
    for e in slices:
        by_row.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_row.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))
    flows = [e for e in trace["traceEvents"] if e["ph"] in "sf"]
    assert len(flows) == 2 * len(plan["sync_edges"])


def test_trace_unknown_durations_last_one_microsecond():
    g = branchy_graph(stages=1)
    for t in g.tasks:
        t.duration_us = None
    a = ins.analyze(g)
    assert ins.schedule_summary(g, analysis=a)["critical_path_us"] is None
    times = ins.simulate(g, a.schedule)
    assert all(end - start == 1.0 for start, end in times)


# ---- errors ---------------------------------------------------------------------------------

def _bad_files(tmp_path):
    data = branchy_graph(stages=1).to_json()
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({**data, "version": FORMAT_VERSION + 1}))
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"hello": 1}))
    garbage = tmp_path / "garbage.json.gz"
    garbage.write_bytes(b"\x1f\x8b" + b"not really gzip")
    broken = tmp_path / "broken.json.gz"
    with gzip.open(broken, "wt") as f:
        f.write(json.dumps({**data, "buffers": [[0, "param"]]}))
    return {"missing": tmp_path / "nope.json.gz", "directory": tmp_path, "newer": newer,
            "foreign": foreign, "garbage": garbage, "broken": broken}


@pytest.mark.parametrize("case", ["missing", "directory", "newer", "foreign", "garbage", "broken"])
def test_bad_input_exits_2_with_one_line(case, tmp_path, capsys):
    path = _bad_files(tmp_path)[case]
    assert cli.main(["inspect", str(path), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and str(path) in err
    if case == "newer":
        assert "version" in err


def test_help_runs_as_module():
    r = subprocess.run([sys.executable, "-m", "nimble", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for name in ("inspect", "bench", "record", "debug"):
        assert name in r.stdout


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "inspect" in capsys.readouterr().err


def test_lazy_subcommand_missing_or_broken(monkeypatch, capsys):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(cli.importlib, "import_module", missing)
    assert cli.main(["bench", "--model", "resnet50"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "nimble.cli.bench" in err

    def broken(name):
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(cli.importlib, "import_module", broken)
    assert cli.main(["record", "--help"]) == 2
    assert "libcuda" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0  # the lazy modules are not needed for the overview
    assert "debug" in capsys.readouterr().out


def test_lazy_subcommand_runs(monkeypatch, capsys):
    seen = {}
    fake = types.SimpleNamespace(
        add_arguments=lambda p: p.add_argument("--model"),
        run=lambda args: seen.setdefault("model", args.model) and 3)
    monkeypatch.setattr(cli.importlib, "import_module",
                        lambda name: fake if name == "nimble.cli.debug" else None)
    assert cli.main(["debug", "--model", "vgg"]) == 3 and seen == {"model": "vgg"}


# ---- fixtures -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", FIXTURE_PATHS, ids=fixture_ids())
def test_fixture_inspects(path, tmp_path, capsys):
    graph = TaskGraph.load(path)
    out = tmp_path / "plan.json"
    s = _run_json(capsys, path, "--memplan", "--export", out, "--simulated-trace",
                  tmp_path / "t.json")
    _check_summary(graph, s)
    assert (SCHEDULE_KEYS | MEMPLAN_KEYS) <= s.keys()
    assert s["lower_bound_bytes"] <= s["arena_bytes"] <= s["buffer_bytes"]
    assert s["buffers_by_kind"][BufferKind.PARAM] > 0
    _check_export(graph, json.loads(out.read_text()))
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_inspect_names_the_memory_a_graph_keeps_beside_its_plan(capsys):
    """The faulting inception_v3 training fixture: its six private copies of library memory,
    and the one of them a word that may be an integer points into, named in the text and the
    JSON (the report that would have named the fault's memory at once)."""
    from helpers import FIXTURE_DIR

    path = FIXTURE_DIR / "inception_v3_train_averaged_fault.json.gz"
    outside = _run_json(capsys, path)["outside_arena"]
    assert len(outside["private_copies"]) == 6
    [kept] = outside["low_bits"]
    assert (kept["buffer"], kept["kind"], kept["bytes"], kept["address"]) == \
        (1067, "external", 64 << 20, "0x7fdd00000000")
    assert cli.main(["inspect", str(path), "-q"]) == 0
    text = capsys.readouterr().out
    assert "private copies of library memory: 6, 74.05 MiB" in text
    assert "buffer 1067 (external, device allocation@0x7fdd00000000): 64.00 MiB" in text
    assert cli.main(["inspect", str(FIXTURE_DIR / "resnet50.json.gz"), "-q"]) == 0
    assert "private copies" not in capsys.readouterr().out  # an inference graph keeps none
