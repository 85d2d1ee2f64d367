"""The files ``nimble inspect`` reads: every kind Nimble writes, recognised by its content.

:func:`read_nimble_file` opens a path (gzip or plain, any name) and says which of
:class:`FileKind` it holds; anything else fails with one line that names the file, what it is
and what to do, never the parser's own exception.
"""
from __future__ import annotations

import enum
import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..analysis.report import PLAN_FORMAT, PLAN_VERSION
from ..ir import json_fields as jf
from ..ir.taskgraph import FORMAT_NAME, FORMAT_VERSION, TaskGraph
from .common import Fail

#: What a user may hand ``nimble inspect``, for the messages about other files.
EXPECTED = ("give a file Nimble wrote: a TaskGraph (nimble record), a saved graph (nimble save), "
            "a plan (nimble inspect --export) or a trace (nimble inspect --simulated-trace, "
            "nimble debug --trace)")


class FileKind(enum.Enum):
    TASKGRAPH = "TaskGraph"
    PLAN = "plan export"
    SIMULATED_TRACE = "simulated trace"
    MEASURED_TRACE = "measured trace"
    SAVED = "saved graph"


@dataclass(frozen=True)
class NimbleFile:
    """A file Nimble wrote: its path as given, its kind and its JSON object."""
    path: str
    kind: FileKind
    data: dict


def _fail(path: str, what: str) -> Fail:
    return Fail(f"{path}: {what}")


def _read_text(path: str) -> str:
    p = Path(path)
    if not p.exists():
        raise _fail(path, "no such file")
    if p.is_dir():
        raise _fail(path, f"a directory; {EXPECTED}")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise _fail(path, f"cannot read it ({e.strerror or e})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error):
            raise _fail(path, "a gzip file that is truncated or damaged; write it again "
                              "(a copy cut short, or a recording that did not finish?)") from None
    if not raw.strip():
        raise _fail(path, f"empty; {EXPECTED}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(path, f"binary data, not JSON text; {EXPECTED}") from None


def _read_object(path: str) -> dict:
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise _fail(path, f"not JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                          f"{EXPECTED}") from None
    except RecursionError:
        raise _fail(path, f"JSON nested too deeply; {EXPECTED}") from None
    if not isinstance(data, dict):
        raise _fail(path, f"JSON {_json_type(data)}, not an object; {EXPECTED}")
    return data


def _json_type(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
             float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _check_version(path: str, data: dict, what: str, supported: int, remedy: str) -> None:
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise _fail(path, f"a {what} whose version is {version!r}, a JSON {_json_type(version)} "
                          f"instead of a number; the file is damaged, {remedy}")
    if version != supported:
        raise _fail(path, f"a {what} in format version {version}; this Nimble reads version "
                          f"{supported}: {remedy}")


def read_nimble_file(path: str) -> NimbleFile:
    """The kind and content of the file at ``path``; :class:`Fail` for anything else.  A saved
    graph is recognised by its magic and read by :mod:`nimble.cli.inspect_saved` (``data``
    empty here)."""
    from .inspect_saved import is_saved_graph

    if Path(path).is_file() and is_saved_graph(path):
        return NimbleFile(path, FileKind.SAVED, {})
    data = _read_object(path)
    fmt = data.get("format")
    if fmt == FORMAT_NAME:
        _check_version(path, data, "TaskGraph", FORMAT_VERSION,
                       "record the model again with this Nimble (nimble record MODEL)")
        return NimbleFile(path, FileKind.TASKGRAPH, data)
    if fmt == PLAN_FORMAT:
        _check_version(path, data, "plan", PLAN_VERSION,
                       "export it again with this Nimble (nimble inspect GRAPH --export FILE)")
        return NimbleFile(path, FileKind.PLAN, data)
    if fmt is None and isinstance(data.get("traceEvents"), list):
        other = data.get("otherData")
        other = other if isinstance(other, dict) else {}
        if other.get("nimble_timeline"):
            return NimbleFile(path, FileKind.MEASURED_TRACE, data)
        if other.get("simulated") is True:
            return NimbleFile(path, FileKind.SIMULATED_TRACE, data)
        raise _fail(path, "a Chrome trace, but not a measured Nimble timeline nor a simulated "
                          f"one (Nimble did not write it); {EXPECTED}")
    if fmt is None:
        raise _fail(path, f"a JSON object without a 'format' key, not a file Nimble writes; "
                          f"{EXPECTED}")
    raise _fail(path, f"format {fmt!r} is not one Nimble writes; {EXPECTED}")


def _describe(e: Exception) -> str:
    """What went wrong decoding a part, without the exception's internal name."""
    if isinstance(e, KeyError):
        return f"a required key {e.args[0]!r} is missing"
    return " ".join(str(e).split()) or "a part has the wrong shape"


def taskgraph_of(file: NimbleFile) -> TaskGraph:
    """The TaskGraph in ``file`` (:class:`Fail` if a part is missing or has the wrong shape)."""
    for key in ("buffers", "ops", "tasks"):
        value = file.data.get(key)
        if not isinstance(value, list):
            have = "missing" if value is None else f"a JSON {_json_type(value)}, not an array"
            raise _fail(file.path, f"a TaskGraph whose {key!r} is {have}; the file is damaged, "
                                   "record the model again")
    try:
        return TaskGraph.from_json(file.data)
    # The row decoders index, unpack and construct without checking shapes first: any of
    # these means a damaged or hand-edited file.
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise _fail(file.path, f"a TaskGraph that does not decode ({_describe(e)}); the file is "
                               "damaged, record the model again") from None


def _ints(value, where: str) -> list[int]:
    return jf.items(value, where, jf.integer)


def plan_summary(file: NimbleFile) -> dict:
    """A plan export's numbers: model, tasks, streams, syncs, phases, arena size (:class:`Fail`
    naming the first field of the wrong type)."""
    d = file.data
    try:
        get = lambda key, read, default=...: jf.member(d, key, "", read, default)  # noqa: E731
        return {"kind": file.kind.value, "model": get("model", jf.optional(jf.text), None),
                "tasks": get("tasks", jf.integer), "streams": get("num_streams", jf.integer),
                "sync_edges": len(get("sync_edges", jf.array)),
                "edges": len(get("edges", jf.array)), "phases": get("phases", _ints, []),
                "arena_bytes": get("arena_bytes", jf.integer),
                "buffers_placed": len(get("offsets", jf.obj))}
    except jf.FieldError as e:
        raise _fail(file.path, f"a plan that does not decode ({e}); export it again") from None


def _task_event(event, where: str) -> tuple[float, float, object]:
    """A simulated trace's task (a complete event): its start and end, µs, and its row."""
    e = jf.obj(event, where)
    ts, dur = jf.member(e, "ts", where, jf.number), jf.member(e, "dur", where, jf.number)
    return ts, ts + dur, jf.member(e, "tid", where, jf.scalar)


def simulated_trace_summary(file: NimbleFile) -> dict:
    """A simulated trace's numbers: tasks, streams, sync arrows and the simulated makespan
    (:class:`Fail` naming the first field of the wrong type)."""
    try:
        events = jf.items(file.data["traceEvents"], "traceEvents", jf.obj)
        phases = [jf.member(e, "ph", f"traceEvents[{i}]", jf.text, "")
                  for i, e in enumerate(events)]
        tasks = [_task_event(e, f"traceEvents[{i}]") for i, (e, ph) in
                 enumerate(zip(events, phases)) if ph == "X"]
        other = jf.obj(file.data["otherData"], "otherData")
        return {"kind": file.kind.value,
                "model": jf.member(other, "model", "otherData", jf.optional(jf.text), None),
                "tasks": len(tasks), "streams": len({tid for _, _, tid in tasks}),
                "sync_edges": phases.count("s"),
                "simulated_us": (max(end for _, end, _ in tasks) - min(b for b, _, _ in tasks))
                if tasks else 0.0}
    except jf.FieldError as e:
        raise _fail(file.path, f"a simulated trace that does not decode ({e}); write it "
                               "again") from None
