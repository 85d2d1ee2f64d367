"""How soon the race fuzzer's targeted draws hold back the writer of each needed sync (no GPU).

    python3 tools/experiments/fuzz_cover.py FIXTURE[,FIXTURE...] [--trials 50] [--launches 300]
        [--seed 0]

Per recorded fixture (``tests/fixtures/NAME.json.gz``): the schedule ``prepare()`` makes and
the draws a fuzz copy of it would run (:func:`nimble.analysis.delays.plan_draws`, seeded, the
tasks' recorded durations setting the delays), with the targets of the *direct* hazards
(:func:`nimble.analysis.hazards.direct_hazards`) first.  For the first ``--trials`` shuffled sync edges
whose removal the plan check says opens a race (as ``tools/proof_power.py`` draws them), the
launch at which a targeted or chained draw first holds back the earlier task of that race: a
race shows only when its earlier task runs late, so a writer never held back within the proof's
launches is a removal the fuzzer can catch only by chance.  Prints the median and largest such
launch, and how many writers no targeted draw held back within ``--launches``.
"""
from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from nimble.analysis.hazards import CHAINED, HELD
from nimble.analysis import delays as fuzz_delays
from nimble.engine.prepared import plan_graph
from nimble.ir.taskgraph import TaskGraph

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"


def _proof_power():
    """tools/proof_power.py, imported as the module it is when run (its dataclasses look their
    module up by name)."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    import proof_power
    return proof_power


def first_held(graph: TaskGraph, schedule, plan, launches: int, seed: int) -> tuple[dict, dict]:
    """``(first, facts)``: per task, the first launch whose targeted or chained draw holds it
    back; and the target counts and the launch at which every direct target was held."""
    draws = fuzz_delays.plan_draws(graph, [range(len(graph.tasks))], schedule.edges(),
                                  schedule.stream_of, plan.offsets, seed)
    picks = draws.picks
    first: dict[int, int] = {}
    direct_cover = None
    for launch in range(launches):
        kind, delays = draws.next()
        if kind in (HELD, CHAINED):
            for t in np.flatnonzero(delays):
                first.setdefault(int(t), launch)
        if direct_cover is None and picks.direct_done:
            direct_cover = launch + 1
    return first, {"direct_targets": len(picks.tiers[0].targets), "targets": len(picks.targets),
                   "direct_cover": direct_cover}


def report(name: str, trials: int, launches: int, seed: int) -> str:
    power = _proof_power()
    graph = TaskGraph.load(FIXTURES / f"{name}.json.gz")
    schedule, plan = plan_graph(graph, True, None, None)
    first, facts = first_held(graph, schedule, plan, launches, seed)
    edges = schedule.edges()
    sync = list(schedule.sync_edges)
    random.Random(seed).shuffle(sync)
    at, never = [], 0
    for edge in sync:
        if len(at) + never == trials:
            break
        is_needed, reason = power.needed(graph, edges, plan,
                                         power.Change("sync", removed_edges=frozenset({edge})))
        found = re.search(r"tasks (\d+) and (\d+)", reason) if is_needed else None
        if found is None:
            continue
        writer = int(found.group(1))
        if writer in first:
            at.append(first[writer])
        else:
            never += 1
    cover = facts["direct_cover"]
    spread = (f"median launch {statistics.median(at):.0f}, largest {max(at)}" if at else "none")
    return (f"{name}: {facts['direct_targets']} direct targets of {facts['targets']}, every "
            "direct target "
            f"held by launch {cover if cover is not None else f'> {launches}'}; "
            f"{len(at) + never} needed sync removals, their writer first held back by a "
            f"targeted draw at {spread}; never within {launches} launches: {never}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fixtures", help="fixture names, comma-separated")
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--launches", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in filter(None, args.fixtures.split(",")):
        print(report(name, args.trials, args.launches, args.seed), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
