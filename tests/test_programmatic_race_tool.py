"""tools/experiments/programmatic_race.py: its switches, and that undoing the withdrawal (for the
experiment's process only) builds the edges each rule says (no GPU)."""
from __future__ import annotations

import pytest

from helpers import load_tool
from nimble.analysis import programmatic
from nimble.engine import programmatic_pick
from nimble.ir.taskgraph import Task, TaskGraph

tool = load_tool("experiments/programmatic_race")


def test_the_switches_and_their_defaults():
    args = tool.parse([])
    assert (args.variant, args.rule, args.tries, args.no_load) == ("programmatic", "allowed", 12,
                                                                    False)
    args = tool.parse(["--variant", "capture-replay", "--tries", "3000", "--no-load"])
    assert (args.variant, args.tries, args.no_load) == ("capture-replay", 3000, True)
    with pytest.raises(SystemExit):
        tool.parse(["--rule", "sometimes"])


def _graph() -> TaskGraph:
    """Three kernels in a chain, captured behind two programmatic edges; the first a
    library's."""
    names = ["nvjet_sm90_tst_64x8", "triton_poi_fused_add_0", "triton_poi_fused_mul_1"]
    tasks = [Task(id=i, kind="kernel", op=i, name=n, short_name=n) for i, n in enumerate(names)]
    return TaskGraph(tasks=tasks, buffers=[], ops=[], inputs=[], outputs=[],
                     meta={programmatic.META_KEY: [[0, 1], [1, 2]]})


@pytest.mark.parametrize("rule, edges", [("allowed", [(0, 1), (1, 2)]),
                                         ("library-sources", [(1, 2)]), ("none", [])])
def test_undoing_the_withdrawal_builds_the_edges_of_each_rule(monkeypatch, rule, edges):
    # the tool patches these modules in place: the test puts them back
    monkeypatch.setattr(programmatic, "candidate_edges", programmatic.candidate_edges)
    monkeypatch.setattr(programmatic_pick, "RULE", programmatic_pick.RULE)
    assert programmatic_pick.RULE == "waiting"
    tool.undo_withdrawal(rule)
    assert programmatic_pick.RULE == "recorded"
    assert programmatic.candidate_edges(_graph(), [(0, 1), (1, 2)]) == edges
