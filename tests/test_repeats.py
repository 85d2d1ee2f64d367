"""The block of tasks a step repeats (nimble.debug.repeats): found from the task names alone,
each place's median time, wait and bytes over the repeats; on hand-made sequences, a recorded
decoder's graph and a decode step's trace measured on an H200 (issue 53)."""
from __future__ import annotations

import gzip
import json
import statistics

import pytest

from helpers import FIXTURE_DIR
import nimble.cli.main as cli
from nimble.analysis.report import analyze
from nimble.debug.breakdown import format_breakdown, step_breakdown, touched_bytes
from nimble.debug.repeats import BlockSpan, find_repeated_block, repeated_block
from nimble.debug.timeline import Timeline, format_timeline
from nimble.ir.taskgraph import TaskGraph

#: `decode_levers.py --variants programmatic+rope-attention+coordinate+gemv-prologues --traces`
#: on one H200: the 1B Llama shape's decode step in bf16, batch 1 (docs/results.md).
DECODE_TRACE = FIXTURE_DIR / "traces" / "llama3_1b_decode_step.trace.json.gz"


@pytest.mark.parametrize("names, want", [
    (["embed", *"abc" * 5, "head"], BlockSpan(1, 3, 5)),
    (list("aaaaaa"), BlockSpan(0, 1, 6)),  # the shortest block of the most tasks
    (["x", *"abab" * 2, "a", "y"], BlockSpan(1, 2, 4)),  # a block's last partial copy left out
    (list("abcabd"), None),  # twice only
    (list("abcdefgh"), None),
    (list("xy" * 3) + [f"k{i}" for i in range(30)], None),  # repeats over a sixth of the step
    ([], None),
])
def test_the_block_repeated_over_the_most_tasks_is_found_from_the_names(names, want):
    assert find_repeated_block(names) == want


def test_a_longer_block_wins_where_it_covers_more_tasks_than_a_short_run():
    """A run of five equal kernels (a block of one) inside layers of six tasks repeated four
    times: the layers cover more."""
    layer = ["norm", "gemm", "gemm", "gemm", "gemm", "attend"]
    span = find_repeated_block(["embed", *layer * 4, "head"])
    assert span == BlockSpan(1, 6, 4)


def test_each_place_gets_its_median_time_wait_and_bytes_over_the_repeats():
    names = ["embed"] + ["norm", "gemm"] * 3
    # embed 0-2; then per block: norm waits 1, 2, 3 µs and runs 1, 2, 6 µs; gemm waits 0.5 µs
    # and runs 10, 11, 12 µs
    times, end = [(0.0, 2.0)], 2.0
    for wait, norm, gemm in ((1, 1, 10), (2, 2, 11), (3, 6, 12)):
        times.append((end + wait, end + wait + norm))
        end = times[-1][1]
        times.append((end + 0.5, end + 0.5 + gemm))
        end = times[-1][1]
    last = {t: t - 1 for t in range(1, len(names))}
    block = repeated_block(names, times, last, bytes_of=lambda t: 1000 * t)
    assert block.span == BlockSpan(1, 2, 3)
    norm, gemm = block.places
    assert (norm.name, norm.median_us, norm.median_wait_us, norm.max_wait_us) == \
        ("norm", 2.0, 2.0, 3.0)
    assert (gemm.name, gemm.median_us, gemm.median_wait_us) == ("gemm", 11.0, 0.5)
    assert norm.bytes == 1000 and gemm.bytes_per_s == pytest.approx(2000 / 11e-6)
    firsts = [times[t][0] for t in (1, 3, 5)]
    assert block.block_us == statistics.median([firsts[1] - firsts[0], firsts[2] - firsts[1]])
    assert block.waits_us == pytest.approx(2.5)
    assert block.summary()["places"][1]["median_us"] == 11.0


def _decode_trace() -> dict:
    return json.loads(gzip.decompress(DECODE_TRACE.read_bytes()))


def test_a_measured_decode_steps_layers_are_its_repeated_block():
    """The 1B Llama shape's 16 layers: a block whose places hold the norm, the GEMVs and the
    attention, repeated over most layers, each block's time within the step's."""
    timeline = Timeline.from_chrome(_decode_trace())
    (phase,) = timeline.summary()["phases"]
    block = phase["repeated_block"]
    assert block is not None and block["count"] >= 12 and block["length"] <= 12
    names = [p["name"] for p in block["places"]]
    assert "attend" in names and sum("gemv" in n for n in names) >= 2
    assert block["count"] * block["block_us"] <= phase["makespan_us"]
    for p in block["places"]:
        tasks = [block["first_task"] + b * block["length"] + p["place"]
                 for b in range(block["count"])]
        assert {timeline.graph.tasks[t].short_name for t in tasks} == {p["name"]}
        assert p["median_us"] == statistics.median(
            timeline.times[t][1] - timeline.times[t][0] for t in tasks)
    text = format_timeline(timeline.summary())
    assert f"a block of {block['length']} tasks repeats {block['count']} times" in text


def test_nimble_inspect_shows_a_traced_steps_repeated_block(tmp_path, capsys):
    assert cli.main(["inspect", str(DECODE_TRACE)]) == 0
    out = capsys.readouterr().out
    assert "measured trace" in out and "tasks repeats" in out and "attend" in out
    report = tmp_path / "r.json"
    assert cli.main(["inspect", str(DECODE_TRACE), "--json", str(report), "-q"]) == 0
    (phase,) = json.loads(report.read_text())["phases"]
    assert phase["repeated_block"]["length"] == len(phase["repeated_block"]["places"])


def test_a_breakdowns_repeated_block_carries_each_places_bytes():
    """The small Llama's recording on simulated times: each place's bytes are the first
    repeat's accesses, and the text shows the block."""
    g = TaskGraph.load(FIXTURE_DIR / "llama_small_float16.json.gz")
    s = analyze(g).schedule
    from nimble.analysis.report import simulate

    b = step_breakdown(Timeline(g, s, simulate(g, s)), copy_bytes_per_s=4e12)
    block = b.repeated
    assert block is not None and block.span.count >= 2
    for p in block.places:
        t = block.span.task(0, p.place)
        assert p.bytes == (touched_bytes(g, [t]) if g.tasks[t].accesses else None)
    assert "tasks repeats" in format_breakdown(b)
    assert b.summary()["repeated_block"]["count"] == block.span.count


def test_a_trace_carries_each_tasks_bytes_so_its_block_reads_the_same_offline():
    """to_chrome writes each task's bytes beside its times: the timeline read back gives the
    same repeated block, bytes and all, with no recording at hand; a trace written before the
    field reads as bytes unknown, and one whose list does not fit its tasks is refused."""
    from nimble.analysis.report import simulate
    from nimble.ir.json_fields import FieldError

    g = TaskGraph.load(FIXTURE_DIR / "llama_small_float16.json.gz")
    s = analyze(g).schedule
    timeline = Timeline(g, s, simulate(g, s))
    trace = json.loads(json.dumps(timeline.to_chrome()))
    back = Timeline.from_chrome(trace)
    (here,), (there,) = timeline.summary()["phases"], back.summary()["phases"]
    assert here["repeated_block"] is not None
    assert there["repeated_block"] == here["repeated_block"]
    assert any(p["bytes"] for p in there["repeated_block"]["places"])
    del trace["otherData"]["nimble_timeline"]["task_bytes"]
    (old,) = Timeline.from_chrome(trace).summary()["phases"]
    assert all(p["bytes"] is None for p in old["repeated_block"]["places"])
    trace["otherData"]["nimble_timeline"]["task_bytes"] = [1, 2]
    with pytest.raises(FieldError, match="task_bytes"):
        Timeline.from_chrome(trace)
