"""Which of a recording's "write" accesses its kernels' own signatures say are reads (no GPU).

    python3 tools/experiments/param_access.py [FIXTURE[,FIXTURE...]]      (default: every fixture)

The recorder marks a kernel's access to a buffer as a write whenever the kernel's op writes that
buffer (a TaskGraph write means read-write): the kernel's own reads and writes are not known.
So a kernel that only reads what an earlier kernel of its op wrote (a batch norm's transform
reading the inverse deviations another kernel computed) looks like a second writer, and a race
between the two looks like two writes, which the proof's fuzzer cannot tell from two writes of
bytes nothing reads (docs/findings.md, "The race fuzzer's misses at budget 1").

Many kernels declare what they only read: a parameter of type ``T const*``, or a packed tensor
accessor over ``T const``.  This tool demangles every kernel name of a fixture (``c++filt``),
lines the signature's parameters up with the task's parameter layout, and counts, per fixture:

- kernels whose parameters could be lined up, and the pointers they hold through a read-only
  parameter;
- accesses recorded as writes that come only through read-only parameters (reads in fact);
- the needed removals of ``tools/proof_power.py``'s first sync trials (the schedule
  ``prepare()`` makes, seed 0) that it marks *write-write only*, and how many of those the
  signatures turn into a write and a read.

Nothing here changes what Nimble records or schedules: it measures whether the signatures are
worth reading in the recorder.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from nimble.ir.taskgraph import Access, TaskGraph

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
TRIALS = 20

_OPEN, _CLOSE = "(<[{", ")>]}"
# a pointer to const (``__half const*``, ``float const* __restrict__``) or an accessor over a
# const element type (``TensorAccessor<c10::ArrayRef<long>, c10::Half const, 2ul, ...>``)
_CONST_POINTER = re.compile(r"\bconst\s*\*(\s*__restrict__)?\s*$")
_POINTER = re.compile(r"\*(\s*__restrict__)?\s*$")
_ACCESSOR = re.compile(r"TensorAccessor<[^,<>]+(<[^<>]*>)?, ([^,<>]+?)( const)?, ")


def demangle(names: Sequence[str]) -> dict[str, str]:
    """Each name demangled by ``c++filt`` (a name it cannot read comes back as it is)."""
    tool = shutil.which("c++filt")
    if tool is None:
        raise SystemExit("param_access: needs c++filt (binutils) on PATH")
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return dict(zip(names, out))


def parameters(signature: str) -> list[str] | None:
    """The top-level parameter types of a demangled function signature, or None if it has no
    parameter list (a plain ``extern "C"`` name)."""
    text = signature.rstrip()
    if not text.endswith(")"):
        return None
    depth, start = 0, None
    for i in range(len(text) - 1, -1, -1):
        c = text[i]
        if c == ")":
            depth += 1
        elif c == "(":
            depth -= 1
            if depth == 0:
                start = i
                break
    if start is None:
        return None
    inner = text[start + 1:-1]
    parts, depth, begin = [], 0, 0
    for i, c in enumerate(inner):
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(inner[begin:i].strip())
            begin = i + 1
    last = inner[begin:].strip()
    if last and last != "void":
        parts.append(last)
    return parts


def read_only(param: str) -> bool | None:
    """True for a pointer to const or an accessor over const elements, False for a pointer or
    accessor to mutable ones, None for anything else (structs whose members are not known)."""
    if _CONST_POINTER.search(param):
        return True
    if _POINTER.search(param):
        return False
    found = _ACCESSOR.search(param)
    if found:
        return bool(found.group(3))
    return None


def read_only_pointers(graph: TaskGraph, signatures: dict[str, str]) -> dict[int, set[int]]:
    """Per kernel task, the buffers it points to only through read-only parameters (tasks whose
    parameters do not line up with their layout are left out)."""
    found: dict[int, set[int]] = {}
    for task in graph.kernel_tasks():
        params = parameters(signatures.get(task.name, task.name))
        if params is None or len(params) != len(task.param_layout):
            continue
        kinds = [read_only(p) for p in params]
        through: dict[int, set] = {}
        for pointer in task.pointers:
            if not isinstance(pointer.location, int) or pointer.buffer < 0:
                continue
            k = next((i for i, (off, size) in enumerate(task.param_layout)
                      if off <= pointer.location < off + size), None)
            through.setdefault(pointer.buffer, set()).add(kinds[k] if k is not None else None)
        found[task.id] = {b for b, ks in through.items() if ks == {True}}
    return found


def with_reads(graph: TaskGraph, reads: dict[int, set[int]]) -> TaskGraph:
    """A copy of ``graph`` whose accesses through read-only parameters are reads."""
    tasks = []
    for task in graph.tasks:
        mine = reads.get(task.id, set())
        accesses = [Access(a.buffer, a.offset, a.size, a.write and a.buffer not in mine)
                    for a in task.accesses]
        tasks.append(dataclasses.replace(task, accesses=accesses))
    return dataclasses.replace(graph, tasks=tasks)


def _proof_power():
    """tools/proof_power.py, imported as the module it is when run (its dataclasses look their
    module up by name)."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    import proof_power
    return proof_power


def report(name: str) -> str:
    """One fixture's counts (see the module docstring)."""
    from nimble.engine.prepared import plan_graph

    graph = TaskGraph.load(FIXTURES / f"{name}.json.gz")
    kernels = graph.kernel_tasks()
    signatures = demangle(sorted({t.name for t in kernels}))
    reads = read_only_pointers(graph, signatures)
    through = sum(len(b) for b in reads.values())
    write_reads = sum(1 for t in kernels for a in t.accesses
                      if a.write and a.buffer in reads.get(t.id, ()))
    power = _proof_power()
    schedule, plan = plan_graph(graph, True, None, None)
    edges = schedule.edges()
    sync = list(schedule.sync_edges)
    random.Random(0).shuffle(sync)
    refined = with_reads(graph, reads)
    ww = turned = 0
    for edge in sync[:TRIALS]:
        change = power.Change("sync", removed_edges=frozenset({edge}))
        if not power.needed(graph, edges, plan, change)[0]:
            continue
        if power.write_write_only(graph, edges, plan, change):
            ww += 1
            turned += not power.write_write_only(refined, edges, plan, change)
    return (f"{name}: {len(reads)}/{len(kernels)} kernels lined up, {through} buffers read "
            f"through read-only parameters, {write_reads} accesses recorded as writes of those; "
            f"of the first {TRIALS} sync trials, {ww} needed removals are write-write only, "
            f"{turned} of them a write and a read by the signatures")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fixtures", nargs="?", default="",
                        help="fixture names, comma-separated (default: all)")
    args = parser.parse_args(argv)
    names = [n for n in args.fixtures.split(",") if n] or sorted(
        p.name.removesuffix(".json.gz") for p in FIXTURES.glob("*.json.gz"))
    for name in names:
        print(report(name), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
