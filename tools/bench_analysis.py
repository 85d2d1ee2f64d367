"""Time the analysis half of Nimble on recorded fixtures and large synthetic graphs.

    python3 tools/bench_analysis.py [fixture.json.gz ...]

Prints one row per graph: its size, the transitive reduction, the maximum logical concurrency
(width), the streams and synchronizations Nimble's assignment uses, the critical path in tasks,
and the wall time of each phase.  With no arguments it runs every ``tests/fixtures/*.json.gz``
and two synthetic graphs of about 5,000 tasks.  Needs no GPU.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from nimble.analysis.deps import build_dag, critical_path, transitive_reduction  # noqa: E402
from nimble.analysis.schedule import assign_streams, check_schedule  # noqa: E402
from nimble.ir.synthetic import branchy_graph, random_graph  # noqa: E402
from nimble.ir.taskgraph import TaskGraph  # noqa: E402

COLUMNS = [("graph", 20), ("tasks", 6), ("edges", 6), ("reduced", 7), ("width", 5),
           ("streams", 7), ("syncs", 6), ("crit", 5), ("deps ms", 8), ("reduce ms", 9),
           ("assign ms", 9), ("total ms", 8)]


def synthetic_graphs() -> list[tuple[str, TaskGraph]]:
    # 116 stages of 8 branches x 4 ops (a third with a scratch kernel) plus a concat: ~5,000 tasks
    return [("synthetic:branchy-5k", branchy_graph(stages=116, branches=8, depth=4, seed=1)),
            ("synthetic:random-5k", random_graph(5000, n_buffers=400, max_accesses=3, seed=1))]


def measure(name: str, graph: TaskGraph) -> list[str]:
    t0 = time.perf_counter()
    dag = build_dag(graph)
    t1 = time.perf_counter()
    reduced = transitive_reduction(dag)
    t2 = time.perf_counter()
    sched = assign_streams(dag, reduced=reduced)
    t3 = time.perf_counter()
    check_schedule(dag, sched)  # not timed: a bench that reported a wrong schedule would mislead
    crit = critical_path(dag)
    row = [name, dag.n, dag.num_edges, reduced.num_edges, sched.width, len(sched.streams),
           len(sched.sync_edges), int(crit.length)]
    row += [f"{(b - a) * 1e3:.1f}" for a, b in ((t0, t1), (t1, t2), (t2, t3), (t0, t3))]
    return [str(x) for x in row]


def main(argv: list[str]) -> int:
    if argv:
        graphs = [(Path(p).name.split(".")[0], Path(p)) for p in argv]
    else:
        fixtures = sorted((ROOT / "tests" / "fixtures").glob("*.json.gz"))
        graphs = [(p.name.split(".")[0], p) for p in fixtures]
        if not fixtures:
            print("no recorded fixtures in tests/fixtures; synthetic graphs only")
    print("  ".join(title.rjust(width) for title, width in COLUMNS))
    for name, source in graphs:
        graph = TaskGraph.load(source)
        print("  ".join(cell.rjust(w) for cell, (_, w) in zip(measure(name, graph), COLUMNS)))
    if not argv:
        for name, graph in synthetic_graphs():
            print("  ".join(cell.rjust(w) for cell, (_, w) in zip(measure(name, graph), COLUMNS)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
