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
from ..ir.taskgraph import FORMAT_NAME, FORMAT_VERSION, TaskGraph
from .common import Fail

#: What a user may hand ``nimble inspect``, for the messages about other files.
EXPECTED = ("give a file Nimble wrote: a TaskGraph (nimble record), a plan (nimble inspect "
            "--export) or a trace (nimble inspect --simulated-trace, nimble debug --trace)")


class FileKind(enum.Enum):
    TASKGRAPH = "TaskGraph"
    PLAN = "plan export"
    SIMULATED_TRACE = "simulated trace"
    MEASURED_TRACE = "measured trace"


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
    """The kind and content of the file at ``path``; :class:`Fail` for anything else."""
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


def plan_summary(file: NimbleFile) -> dict:
    """A plan export's numbers: model, tasks, streams, syncs, phases, arena size."""
    d = file.data
    try:
        return {"kind": file.kind.value, "model": d.get("model"), "tasks": int(d["tasks"]),
                "streams": int(d["num_streams"]), "sync_edges": len(d["sync_edges"]),
                "edges": len(d["edges"]), "phases": [int(c) for c in d.get("phases", [])],
                "arena_bytes": int(d["arena_bytes"]), "buffers_placed": len(d["offsets"])}
    except (KeyError, TypeError, ValueError) as e:
        raise _fail(file.path, f"a plan that does not decode ({_describe(e)}); export it "
                               "again") from None


def simulated_trace_summary(file: NimbleFile) -> dict:
    """A simulated trace's numbers: tasks, streams, sync arrows and the simulated makespan."""
    events = file.data["traceEvents"]
    try:
        tasks = [e for e in events if e.get("ph") == "X"]
        begin = min((float(e["ts"]) for e in tasks), default=0.0)
        end = max((float(e["ts"]) + float(e["dur"]) for e in tasks), default=0.0)
        return {"kind": file.kind.value, "model": file.data["otherData"].get("model"),
                "tasks": len(tasks), "streams": len({e["tid"] for e in tasks}),
                "sync_edges": sum(1 for e in events if e.get("ph") == "s"),
                "simulated_us": end - begin}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise _fail(file.path, f"a simulated trace that does not decode ({_describe(e)}); "
                               "write it again") from None
