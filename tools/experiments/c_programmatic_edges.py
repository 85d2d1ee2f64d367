"""Which of a saved decode step's programmatic edges the C runtime builds wrong: the step of
``tests/workers/programmatic_load_worker.py`` (the swapped tiny Llama, its edges into Nimble's
waiting kernels), its C plan's edges against those Python's load builds (read back from the
driver's graph), then the C runtime loaded with NIMBLE_LOAD_PROGRAMMATIC and each programmatic
edge alone built so, the proof at load saying whether it reproduces the saving process.

    python3 tools/experiments/c_programmatic_edges.py [--work DIR] [--repeats N]

Where the runtime's own rule leaves an edge full (an edge out of a root), the edge-by-edge run
builds it anyway: the patched copy of the runtime it compiles lifts that rule, so that the
measurement that made the rule can be made again.  One JSON line per edge, then a summary.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

#: The patch of nimble.c's add_edges that builds the k-th marked edge alone (PROG_ONLY=k) and
#: lifts the root rule.
PATCH = (("if (!b->programmatic[e] || !entered[b->edges[2 * e]]) continue;",
          "if (!b->programmatic[e]) continue;\n            seen++;\n"
          "            if (only && atoi(only) != seen) continue;"),
         ("for (uint64_t e = 0; e < b->nedges; e++) entered[",
          "int seen = -1; const char *only = getenv(\"PROG_ONLY\");\n"
          "        for (uint64_t e = 0; e < b->nedges; e++) entered["))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/c_programmatic_edges"))
    p.add_argument("--repeats", type=int, default=2, help="loads per edge")
    return p.parse_args(argv)


def build_patched(work: Path) -> Path:
    """run_saved against a copy of the C runtime patched by :data:`PATCH`."""
    from nimble.cli import c_runtime

    folder = work / "runtime"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(c_runtime.FOLDER, folder)
    source = (folder / "nimble.c").read_text()
    for old, new in PATCH:
        if old not in source:
            raise SystemExit(f"the runtime's add_edges changed: cannot patch {old!r}")
        source = source.replace(old, new)
    (folder / "nimble.c").write_text(source)
    exe = work / "run_saved_edge_by_edge"
    subprocess.run([c_runtime.compiler(), "-O2", "-std=c11", "-pthread", "-I", str(folder),
                    "-I", str(c_runtime.cuda_include()),
                    str(ROOT / "tests" / "c_host" / "run_saved.c"),
                    *[str(folder / s) for s in c_runtime.SOURCES], "-o", str(exe),
                    *c_runtime.libcuda()], check=True)
    return exe


def python_edges(saved: Path) -> tuple[dict, list]:
    """Python's loaded graph's edges between tasks, ``(u, v) -> programmatic``, and the tasks
    that edges from Nimble's own nodes (its input gathers) end in."""
    import nimble
    from nimble import driver

    loaded = nimble.load(saved)
    built = loaded.engine.built
    edges = driver.graph_edges(built.graph.handle, built.nodes)
    start = built.span.start
    between = {(start + e.source, start + e.target): e.programmatic for e in edges
               if e.source is not None and e.target is not None}
    own = [start + e.target for e in edges if e.source is None and e.target is not None]
    loaded.close()
    return between, own


def main(argv=None) -> None:
    args = parse(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    saved = args.work / "decode.nimble"
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "workers" /
                                               "programmatic_load_worker.py"),
                           str(args.work / "g.nimble"), "24", str(saved)],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    from c_plan_reader import read_plan
    from nimble.ir.saved_format import C_PLAN, SavedFile

    plan = read_plan(bytes(SavedFile.read(saved).extra[C_PLAN]))
    bucket = plan["buckets"][0]

    def name(t: int) -> str:
        node = bucket["nodes"][t]
        return plan["kernels"][node["kernel"]]["name"] if node["kind"] == "kernel" \
            else node["kind"]

    edges = [tuple(e) for e in bucket["edges"]]
    marked = [e for e in edges if e in set(map(tuple, bucket["programmatic"]))]
    between, own = python_edges(saved)
    entered = {v for _, v in edges}
    print(json.dumps({"plan_edges": len(edges), "plan_programmatic": len(marked),
                      "python_edges_between_tasks": len(between),
                      "same_edges": set(between) == set(edges),
                      "same_programmatic": sorted(e for e, t in between.items() if t)
                      == sorted(marked),
                      "python_own_node_edges_into": sorted(set(own))}))
    exe = build_patched(args.work)
    failing = []
    for k, (u, v) in enumerate(marked):
        failed = 0
        for _ in range(args.repeats):
            run = subprocess.run([str(exe), str(saved), "--info"], capture_output=True,
                                 text=True, env={**os.environ, "RUN_SAVED_PROGRAMMATIC": "1",
                                                 "PROG_ONLY": str(k)})
            failed += run.returncode != 0
        if failed:
            failing.append((u, v))
        print(json.dumps({"edge": [u, v], "from": name(u), "to": name(v),
                          "from_a_root": u not in entered, "proof_failed": failed,
                          "of": args.repeats}), flush=True)
    print(json.dumps({"failing": failing,
                      "failing_from_roots": sum(u not in entered for u, _ in failing)}))


if __name__ == "__main__":
    main()
