"""``nimble inspect`` on every kind of file a user may hand it: one line and status 2 for each
malformed one, a report for each kind Nimble writes, never a traceback."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import FIXTURE_DIR

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = FIXTURE_DIR / "branchy.json.gz"
INTERNAL_NAMES = ("Traceback", "JSONDecodeError", "UnicodeDecodeError", "KeyError",
                  "AttributeError", "TypeError", "EOFError", "IndexError", "BadGzipFile")


def _nimble(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nimble", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


def _taskgraph_json() -> dict:
    with gzip.open(FIXTURE, "rt", encoding="utf-8") as f:
        return json.load(f)


def _write(tmp: Path, name: str, content) -> Path:
    path = tmp / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


MALFORMED = {
    "empty.json": "",
    "random.bin": bytes(range(7, 250, 3)) * 5,
    "list.json": "[1, 2, 3]",
    "null.json": "null",
    "number.json": "42",
    "string.json": '"a string"',
    "foreign.json": '{"hello": "world"}',
    "no_tasks.json": '{"format": "nimble.taskgraph", "version": 1}',
    "string_version.json": None,  # filled below from the fixture
    "mistyped_tasks.json": None,
    "mistyped_rows.json": None,
    "truncated.json.gz": None,
}


def _malformed(tmp: Path, name: str) -> Path:
    if name == "truncated.json.gz":
        return _write(tmp, name, FIXTURE.read_bytes()[:1500])
    if MALFORMED[name] is not None:
        return _write(tmp, name, MALFORMED[name])
    data = _taskgraph_json()
    if name == "string_version.json":
        data["version"] = "1"
    elif name == "mistyped_tasks.json":
        data["tasks"] = "tasks"
    else:
        data["buffers"] = [["not", "a", "buffer"]]
    return _write(tmp, name, json.dumps(data))


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_file_is_one_line_and_status_2(tmp_path, name):
    path = _malformed(tmp_path, name)
    r = _nimble("inspect", path.name, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"nimble: {path.name}: "), r.stderr
    assert not any(word in r.stderr for word in INTERNAL_NAMES), r.stderr
    assert r.stdout == ""


def test_a_directory_and_a_missing_file_are_one_line(tmp_path):
    (tmp_path / "a_dir").mkdir()
    for name in ("a_dir", "missing.json"):
        r = _nimble("inspect", name, cwd=tmp_path)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith(f"nimble: {name}: ")


def test_a_string_version_is_named_as_a_string(tmp_path):
    r = _nimble("inspect", _malformed(tmp_path, "string_version.json").name, cwd=tmp_path)
    assert "'1'" in r.stderr and "version 1 is not supported" not in r.stderr, r.stderr


def test_inspect_reads_back_every_file_nimble_writes(tmp_path):
    r = _nimble("inspect", "-q", str(FIXTURE), "--export", "plan.json", "--simulated-trace",
                "sim.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    plan = _nimble("inspect", "plan.json", cwd=tmp_path)
    assert plan.returncode == 0 and "plan" in plan.stdout.lower(), plan.stderr
    simulated = _nimble("inspect", "sim.json", cwd=tmp_path)
    assert simulated.returncode == 0 and "simulated" in simulated.stdout.lower(), \
        simulated.stderr


def test_options_that_do_not_apply_to_a_file_are_an_error(tmp_path):
    _nimble("inspect", "-q", str(FIXTURE), "--simulated-trace", "sim.json", cwd=tmp_path)
    r = _nimble("inspect", "sim.json", "--schedule", "--export", "p.json", cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "p.json").exists()


def test_dash_means_stdout(tmp_path):
    r = _nimble("inspect", "-q", str(FIXTURE), "--export", "-", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "-").exists()
    assert json.loads(r.stdout)["format"] == "nimble.plan"


@pytest.mark.parametrize("command", ["inspect", "record", "bench", "debug"])
def test_every_command_takes_quiet_and_lists_the_zoo(tmp_path, command):
    r = _nimble(command, "--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "-q" in r.stdout
    if command != "inspect":
        assert "resnet50" in r.stdout and "branchy" in r.stdout
        # The distribution is nimble-gpu; `nimble` on the package index is another project.
        assert "pipinstall'nimble-gpu[zoo]'" in "".join(r.stdout.split())  # wrapped anywhere
