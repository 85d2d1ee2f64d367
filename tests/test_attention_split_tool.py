"""tools/experiments/attention_split.py: its variants and the rule it reads off (no GPU)."""
from __future__ import annotations

from helpers import load_tool

tool = load_tool("experiments/attention_split")


def _row(batch, slots, unsplit, split, live=None):
    return {"batch": batch, "slots": slots, "live": slots if live is None else live,
            "us": {"unsplit": unsplit, "split": split}}


def test_the_rule_is_the_longest_cache_from_the_shortest_where_unsplit_never_lost():
    rows = [_row(1, 128, 3.0, 5.0), _row(8, 128, 3.5, 5.0),
            _row(1, 256, 4.0, 5.0), _row(8, 256, 4.9, 5.0),
            _row(1, 512, 6.0, 5.0), _row(8, 512, 4.0, 5.0),
            _row(1, 1024, 4.0, 5.0), _row(8, 1024, 4.0, 5.0),  # past a loss: not counted
            _row(1, 2048, 1.0, 9.0, live=129)]  # a short live stretch says nothing
    assert tool.best_unsplit_blocks(rows, 64) == 4
    assert tool.best_unsplit_blocks([_row(1, 128, 6.0, 5.0)], 64) == 0


def test_every_shape_times_unsplit_the_full_split_and_the_fixed_counts():
    Form = tool.Form
    plan = tool.variants(1, 8, 192, [2, 4])
    assert plan == {"unsplit": Form(1), "split": Form(3), "splits=2": Form(2),
                    "splits=4": Form(4)}
    both = tool.variants(1, 8, 192, [], branchless=True, last_joins=True)
    assert both == {"unsplit": Form(1), "split": Form(3),
                    "unsplit bl": Form(1, branchless=True), "split bl": Form(3, branchless=True),
                    "split lj": Form(3, last_joins=True)}
    assert tool.parse(["--splits", "", "--batches", "8"]).splits == []


def test_the_whole_cache_as_one_tile_is_timed_only_up_to_its_slots():
    assert tool.variants(1, 8, 192, [], whole=256)["whole"] == tool.Form(None, whole=True)
    assert "whole" not in tool.variants(1, 8, 384, [], whole=256)
    assert "whole" not in tool.variants(1, 8, 192, [])
    assert tool.parse(["--whole", "256"]).whole == 256
