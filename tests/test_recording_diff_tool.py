"""tools/recording_diff.py: two recordings of one model compared, kernels and pointer words
(no GPU)."""
from __future__ import annotations

import dataclasses

from helpers import FIXTURE_DIR, load_tool

from nimble.ir.taskgraph import TaskGraph

tool = load_tool("recording_diff")


def test_identical_recordings_differ_in_nothing():
    a = TaskGraph.load(FIXTURE_DIR / "googlenet_train.json.gz")
    result = tool.compare(a, TaskGraph.load(FIXTURE_DIR / "googlenet_train.json.gz"))
    assert result["only"] == {"a": {}, "b": {}} and result["words_differ"] == {}
    assert result["a"] == result["b"]


def test_a_word_taken_otherwise_and_a_kernel_run_by_one_are_named():
    a = TaskGraph.load(FIXTURE_DIR / "googlenet_train.json.gz")
    b = TaskGraph.load(FIXTURE_DIR / "googlenet_train.json.gz")
    dgrad = next(t for t in b.tasks if "sm90_xmma_dgrad" in t.name)
    moved = dgrad.pointers[0]
    # b keeps the first pointer word of every such task as an integer, ruled out by a rule
    for t in b.tasks:
        if t.name == dgrad.name:
            t.pointers = [p for p in t.pointers if p.location != moved.location]
            b.meta.setdefault("not_pointer_words", []).append([t.id, moved.location, moved.value])
    # and runs another kernel where a ran a transpose
    transpose = next(t for t in b.tasks if t.short_name.endswith("nchwToNhwcKernel"))
    renamed = [t for t in b.tasks if t.name == transpose.name]
    for t in renamed:
        b.tasks[t.id] = dataclasses.replace(t, name="other_kernel", short_name="other_kernel")
    result = tool.compare(a, b)
    assert result["only"]["b"] == {"other_kernel": len(renamed)}
    assert result["only"]["a"] == {transpose.short_name: len(renamed)}
    [(name, offsets)] = result["words_differ"].items()
    assert name.startswith(dgrad.short_name)
    how = offsets[str(moved.location)]
    assert how["a"] == f"pointer {moved.value:#x}"
    assert how["b"] == f"ruled no pointer {moved.value:#x}"
    assert result["b"]["words_not_pointers"] == result["a"]["words_not_pointers"] + sum(
        1 for t in b.tasks if t.name == dgrad.name)
    text = tool.report(result, "a.json.gz", "b.json.gz")
    assert f"byte {moved.location}: a pointer {moved.value:#x}; b ruled no pointer" in text
    assert "kernels only b runs: 1" in text
