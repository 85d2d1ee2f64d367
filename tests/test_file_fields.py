"""Every field of a TaskGraph file is checked for its type when it is read: ``nimble inspect``
(with ``--memplan``, which reads the most) ends with one line naming the field of the wrong
type, never a traceback; a value of the right type but out of range ends in a report or one
line too.  In process, on the recorded ``branchy`` fixture (no GPU)."""
from __future__ import annotations

import copy
import gzip
import json

import pytest

import nimble.cli.main as cli
from helpers import FIXTURE_DIR

with gzip.open(FIXTURE_DIR / "branchy.json.gz", "rt", encoding="utf-8") as _f:
    GRAPH = json.load(_f)


def _leaves(value, path: str):
    """``(path, value)`` of ``value`` and of everything inside it, the first item of each array
    standing for the rest."""
    yield path, value
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _leaves(inner, f"{path}.{key}")
    elif isinstance(value, list) and value:
        yield from _leaves(value[0], f"{path}[0]")
        if not isinstance(value[0], (dict, list)):  # a row: every column has its own type
            for i, inner in enumerate(value[1:], 1):
                yield from _leaves(inner, f"{path}[{i}]")


def _mistyped(path: str, value):
    """A value of another JSON type than the field at ``path`` takes (a pointer's location is
    a byte offset or a field's name)."""
    if path.endswith("pointers[0][0]"):
        return 1.5
    return -5 if isinstance(value, str) else "zz"


#: Every field of the first buffer, op, task, input and output, with the fields of ``meta``
#: that Nimble reads back (the issue's cases among them: ``tasks[0].duration_us``,
#: ``tasks[0].op`` and ``tasks[0].name``).
FIELDS = [path for key in ("buffers", "ops", "tasks", "inputs", "outputs")
          for path, _ in _leaves(GRAPH[key][0], f"{key}[0]")
          if path not in ("tasks[0].short_name",)] + ["tasks[0].short_name", "meta.model"]
META = {"phases": [100, 47], "pool_segments": [[4096, 8192]], "low_word_buffers": [3],
        "pool_bytes": 1 << 20, "rng": {"increment": 4, "cells": 2}}


def _set(data: dict, path: str, value) -> None:
    """Set the field at ``path`` (``tasks[0].grid[1]``) of ``data`` to ``value``."""
    keys = path.replace("[", ".[").split(".")
    *parents, last = keys
    target = data
    for key in parents:
        target = target[int(key[1:-1])] if key.startswith("[") else target[key]
    if last.startswith("["):
        target[int(last[1:-1])] = value
    else:
        target[last] = value


def _get(data: dict, path: str):
    target = data
    for key in path.replace("[", ".[").split("."):
        target = target[int(key[1:-1])] if key.startswith("[") else target[key]
    return target


def _inspect(tmp_path, data: dict, capsys) -> tuple[int, str]:
    path = tmp_path / "mutated.json"
    path.write_text(json.dumps(data))
    status = cli.main(["inspect", str(path), "--memplan", "-q", "--json", str(tmp_path / "o")])
    _, err = capsys.readouterr()
    return status, err


def test_the_fixture_itself_inspects(tmp_path, capsys):
    assert _inspect(tmp_path, GRAPH, capsys) == (0, "")
    with_meta = copy.deepcopy(GRAPH)
    with_meta["meta"].update(META, phases=[100, len(GRAPH["tasks"]) - 100])
    status, err = _inspect(tmp_path, with_meta, capsys)
    assert status == 0, err


@pytest.mark.parametrize("path", FIELDS + [f"meta.{key}" for key in META])
def test_a_field_of_the_wrong_type_is_one_line_naming_it(path, tmp_path, capsys):
    data = copy.deepcopy(GRAPH)
    if path.startswith("meta."):
        data["meta"].update(META)
    _set(data, path, _mistyped(path, _get(data, path)))
    status, err = _inspect(tmp_path, data, capsys)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    assert f"({path} is " in lines[0] and "record the model again" in lines[0], lines[0]


@pytest.mark.parametrize("path, value", [
    ("tasks[0].accesses[0][3]", 1), ("tasks[0].accesses[0][0]", True),
    ("tasks[0].grid[0]", True), ("buffers[0][2]", False), ("tasks[0].pointers[0][1]", True),
    ("buffers[0][0]", 1.0), ("inputs[0].shape[0]", True),
])
def test_a_boolean_for_a_number_or_a_number_for_a_boolean_is_named(path, value, tmp_path,
                                                                    capsys):
    """JSON's true is no integer and 1 no flag: the whole-array readers that take the exact
    types json.loads makes leave such a row to the field-by-field reader, which names it."""
    data = copy.deepcopy(GRAPH)
    _set(data, path, value)
    status, err = _inspect(tmp_path, data, capsys)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and f"({path} is " in lines[0], err


@pytest.mark.parametrize("path, value", [
    ("tasks[0].op", 10**9), ("tasks[0].op", -7), ("tasks[0].grid", [0, -1, 2**40]),
    ("tasks[0].duration_us", -3.5), ("tasks[0].duration_us", None), ("tasks[0].pointers", []),
    ("tasks[0].accesses[0][0]", 10**9), ("tasks[0].accesses[0][2]", -1),
    ("tasks[0].param_layout", [[0]]), ("tasks[0].grid", [1, 2]), ("buffers[0]", [0, "param"]),
    ("tasks[0].params", "xyz"), ("tasks[0].fields", {"width": [1]}), ("buffers[0][1]", "zz"),
    ("meta.phases", [1, 2]), ("meta.phases", [-1, 148]), ("meta.phase_inputs", [1, 1]),
    ("meta.low_word_buffers", [10**6]), ("tasks[0].id", 5),
    ("inputs[0].shape", [1, "a"]), ("ops[0].accesses[0]", [0, 0]),
])
def test_a_value_out_of_place_ends_in_a_report_or_one_line(path, value, tmp_path, capsys):
    data = copy.deepcopy(GRAPH)
    _set(data, path, value)
    status, err = _inspect(tmp_path, data, capsys)
    assert status in (0, 2) and len(err.strip().splitlines()) == (status == 2), err


# ---- the other files inspect reads: a plan export, a simulated and a measured trace --------

def _measured_trace() -> dict:
    from nimble.analysis.schedule import Schedule
    from nimble.debug.timeline import Timeline
    from nimble.ir.taskgraph import Task, TaskGraph

    g = TaskGraph(meta={"model": "diamond"})
    g.tasks = [Task(i, "kernel", short_name=f"k{i}") for i in range(4)]
    s = Schedule([0, 0, 1, 0], [[0, 1, 3], [2]], [(0, 2), (2, 3)], 4, 2)
    times = [(0.0, 10.0), (10.0, 30.0), (15.0, 25.0), (30.0, 40.0)]
    return json.loads(json.dumps(Timeline(g, s, times, 40.0, 44.0).to_chrome()))


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, dict]:
    """The files Nimble writes besides TaskGraphs, as JSON objects."""
    folder = tmp_path_factory.mktemp("written")
    assert cli.main(["inspect", "-q", str(FIXTURE_DIR / "branchy.json.gz"), "--export",
                     str(folder / "plan.json"), "--simulated-trace", str(folder / "sim.json")]) == 0
    return {"plan": json.loads((folder / "plan.json").read_text()),
            "simulated": json.loads((folder / "sim.json").read_text()),
            "measured": _measured_trace()}


#: The fields of each file that ``nimble inspect`` reads: one of the wrong type is named.
READ = {"plan": ["model", "tasks", "num_streams", "sync_edges", "edges", "phases",
                 "arena_bytes", "offsets"],
        "simulated": ["traceEvents[0]", "traceEvents[0].ph", "traceEvents[9].ts",
                      "traceEvents[9].dur", "otherData.model"],
        "measured": [f"otherData.nimble_timeline.{key}" for key in
                     ("times", "times[0]", "times[0][1]", "stream_of", "stream_of[2]",
                      "sync_edges", "sync_edges[0]", "sync_edges[0][1]", "plain_us",
                      "instrumented_us", "late_edges", "phases", "barrier_edges")]
        + ["otherData.model", "traceEvents[3].args.task"]}
OTHER_FIELDS = [(kind, path) for kind in READ for path in READ[kind]]


def _inspect_data(tmp_path, data: dict, capsys) -> tuple[int, str]:
    path = tmp_path / "mutated.json"
    path.write_text(json.dumps(data))
    status = cli.main(["inspect", str(path), "-q", "--json", str(tmp_path / "o")])
    return status, capsys.readouterr().err


@pytest.mark.parametrize("kind, path", OTHER_FIELDS)
def test_a_read_field_of_the_wrong_type_is_named_in_every_file(kind, path, written, tmp_path,
                                                                capsys):
    data = copy.deepcopy(written[kind])
    assert _inspect_data(tmp_path, data, capsys)[0] == 0
    value = _get(data, path)
    _set(data, path, "zz" if not isinstance(value, str) else -5)
    status, err = _inspect_data(tmp_path, data, capsys)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    assert f"({path} is " in lines[0] or f"({path} holds " in lines[0], lines[0]


@pytest.mark.parametrize("kind", sorted(READ))
def test_no_field_of_any_other_file_gives_a_traceback(kind, written, tmp_path, capsys):
    for path, value in list(_leaves(written[kind], "root"))[1:]:
        path = path.removeprefix("root.")
        for bad in ("zz" if not isinstance(value, str) else -5, None, -1, []):
            data = copy.deepcopy(written[kind])
            _set(data, path, bad)
            status, err = _inspect_data(tmp_path, data, capsys)
            assert status in (0, 2) and len(err.strip().splitlines()) == (status == 2), \
                (path, bad, err)
