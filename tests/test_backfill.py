"""Tail backfill (nimble.analysis.backfill): which tasks move behind which anchor, and the measured pick."""
import pytest

from helpers import FIXTURE_DIR
from nimble.analysis import backfill
from nimble.analysis.deps import build_dag, dag_from_edges, reachability, task_durations
from nimble.analysis.schedule import phase_spans
from nimble.ir.taskgraph import TaskGraph

SMS = 132
#   0 m0 -> 2 m1 -> 4 m2 -> 5 n1 -> 6 n2     (the critical path; n1, n2 narrow and long)
#   0 -> 1 s0,  2 -> 3 s1                     (side tasks with slack, ready before m2 ends)
EDGES = [(0, 1), (0, 2), (2, 3), (2, 4), (4, 5), (5, 6)]
DURATIONS = [100, 50, 100, 50, 100, 400, 400]
BLOCKS = [SMS, SMS, SMS, SMS, SMS, SMS // 4, SMS // 4]


def plan(edges=EDGES, durations=DURATIONS, blocks=BLOCKS, fill=0.5, tail_idle=0.7,
         spans=None, n=None):
    n = len(durations) if n is None else n
    return backfill.plan_backfill(n, edges, spans or [range(n)], durations, blocks, SMS, fill,
                                  tail_idle)


def acyclic(n, edges):
    preds = {v: set() for v in range(n)}
    for u, v in edges:
        preds[v].add(u)
    done: set = set()
    while len(done) < n:
        ready = [v for v in range(n) if v not in done and preds[v] <= done]
        if not ready:
            return False
        done |= set(ready)
    return True


def test_the_side_tasks_move_behind_the_last_task_before_the_narrow_tail():
    (b,) = plan()
    assert b.anchor == 4
    assert b.deferred == (1, 3)  # most slack first
    assert b.idle_us == pytest.approx(800 * 0.75)
    assert b.work_us == pytest.approx(100)
    assert b.edges() == [(4, 1), (4, 3)]
    assert acyclic(7, EDGES + b.edges())


def test_moving_stops_once_the_work_moved_reaches_fill_times_the_idle_time():
    (b,) = plan(fill=0.05)  # 30 µs: the first side task's 50 µs is enough
    assert b.deferred == (1,)


def test_a_critical_path_without_narrow_kernels_gets_no_backfill():
    assert plan(blocks=[SMS] * 7) == []


def test_a_tail_idle_below_the_minimum_share_of_the_path_gets_no_backfill():
    short = [100, 50, 100, 50, 100, 20, 20]  # idle 30 µs of a 340 µs path: under 5%
    assert plan(durations=short) == []


def test_a_task_whose_path_to_the_end_outlasts_the_tail_stays_where_it_is():
    long_side = [100, 900, 100, 50, 100, 400, 400]
    (b,) = plan(durations=long_side)
    assert 1 not in b.deferred and b.deferred == (3,)


def test_a_successor_moved_along_with_its_predecessor_counts_once():
    edges = EDGES + [(1, 3)]  # s1 now also follows s0
    (b,) = plan(edges=edges)
    assert b.deferred == (1,) and b.moved == 2
    assert b.work_us == pytest.approx(100)


def test_phases_are_planned_separately_and_ids_are_the_graph_s():
    shift = 10
    head = [(u, u + 1) for u in range(shift - 1)]
    edges = head + [(u + shift, v + shift) for u, v in EDGES]
    durations = [5] * shift + DURATIONS
    blocks = [SMS] * shift + BLOCKS
    got = backfill.plan_backfill(len(durations), edges, [range(shift), range(shift, 17)],
                                 durations, blocks, SMS, 0.5, 0.7)
    assert [(b.phase, b.anchor, b.deferred) for b in got] == [(1, 14, (11, 13))]
    only_first = backfill.plan_backfill(len(durations), edges, [range(shift), range(shift, 17)],
                                        durations, blocks, SMS, 0.5, 0.7, phases=[0])
    assert only_first == []


def test_trials_that_give_the_same_edges_are_timed_once():
    trials = backfill.plan_trials(7, EDGES, [range(7)], DURATIONS, BLOCKS, SMS)
    assert list(trials) == [0]
    edge_sets = [b.edges() for b in trials[0]]
    assert len(edge_sets) == len({tuple(e) for e in edge_sets}) >= 1


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="durations"):
        backfill.plan_backfill(7, EDGES, [range(7)], DURATIONS[:-1], BLOCKS, SMS, 0.5, 0.5)
    with pytest.raises(ValueError, match="sm_count"):
        backfill.widths([1], 0)


def test_on_a_recorded_training_step_the_edges_keep_the_schedule_a_dag():
    g = TaskGraph.load(FIXTURE_DIR / "googlenet_train.json.gz")
    durations = task_durations(g)
    n = len(g.tasks)
    edges = build_dag(g).edges()
    blocks = [t.grid[0] * t.grid[1] * t.grid[2] for t in g.tasks]
    spans = phase_spans(g.meta["phases"], n)
    trials = backfill.plan_trials(n, edges, spans, durations, blocks, SMS)
    assert trials, "googlenet's backward ends in its stem's narrow batch norms"
    for phase, candidates in trials.items():
        span = spans[phase]
        reach = reachability(dag_from_edges(n, edges))
        for b in candidates:
            assert b.anchor in span and all(t in span for t in b.deferred)
            assert b.work_us <= 1.0 * b.idle_us + max(durations[t] for t in span)
            # No deferred task is already ordered against the anchor, either way.
            for t in b.deferred:
                assert not (reach[b.anchor] >> t) & 1 and not (reach[t] >> b.anchor) & 1
            assert acyclic(n, edges + b.edges())


class FakeBuilt:
    def __init__(self, name):
        self.name, self.closed = name, False

    def close(self):
        self.closed = True


def fake_candidates(k):
    return [backfill.Backfill(1, 4, (i,), 1, 100.0, 50.0) for i in range(k)]


def test_pick_keeps_the_fastest_and_closes_the_others():
    plain = FakeBuilt("plain")
    made = []
    ms = {"plain": 10.0, "(4, 0)": 9.0, "(4, 1)": 9.5}

    def build(edges):
        made.append(FakeBuilt(str(edges[0])))
        return made[-1]

    got, report = backfill.pick(plain, fake_candidates(2), build,
                                lambda b, count: ms[b.name] * count)
    assert got is made[0] and not got.closed
    assert plain.closed and made[1].closed
    assert report.kept.deferred == (0,) and report.plain_ms == 10.0
    assert report.trial_ms == (9.0, 9.5)


def test_pick_keeps_the_plain_graph_when_no_candidate_gains_enough():
    plain = FakeBuilt("plain")
    made = []

    def build(edges):
        made.append(FakeBuilt("x"))
        return made[-1]

    ms = {"plain": 10.0, "x": 10.0 * (1 - backfill.MIN_GAIN / 2)}
    got, report = backfill.pick(plain, fake_candidates(1), build,
                                lambda b, count: ms[b.name] * count)
    assert got is plain and not plain.closed and made[0].closed
    assert report.kept is None


def test_a_failed_build_frees_what_pick_built_and_leaves_the_plain_graph_to_its_owner():
    plain = FakeBuilt("plain")
    made = []

    def build(edges):
        if made:
            raise RuntimeError("instantiate failed")
        made.append(FakeBuilt("x"))
        return made[-1]

    with pytest.raises(RuntimeError, match="instantiate failed"):
        backfill.pick(plain, fake_candidates(2), build, lambda b, count: 1.0)
    assert made[0].closed and not plain.closed


def test_a_gain_below_zero_keeps_a_candidate_slower_than_the_plain_graph_by_less_than_it(
        monkeypatch):
    """What a GPU test that must see a candidate built asks (MIN_GAIN = -1: up to twice as
    slow): a plain graph measured fastest, as on a busy GPU, does not stop it."""
    monkeypatch.setattr(backfill, "MIN_GAIN", -1.0)
    plain = FakeBuilt("plain")
    made = []

    def build(edges):
        made.append(FakeBuilt(str(edges[0])))
        return made[-1]

    ms = {"plain": 10.0, "(4, 0)": 14.0, "(4, 1)": 12.0}
    got, report = backfill.pick(plain, fake_candidates(2), build,
                                lambda b, count: ms[b.name] * count)
    assert got is made[1] and plain.closed and made[0].closed
    assert report.kept.deferred == (1,)
    ms["(4, 0)"] = ms["(4, 1)"] = 25.0  # more than twice as slow: the plain graph stays
    got, report = backfill.pick(plain := FakeBuilt("plain"), fake_candidates(2), build,
                                lambda b, count: ms[b.name] * count)
    assert got is plain and report.kept is None
