"""tools/experiments/decode_levers.py: its variants, their order and its summary line (no GPU)."""
from __future__ import annotations

import pytest

from helpers import load_tool

tool = load_tool("experiments/decode_levers")


def test_variants_that_swap_the_models_layers_for_good_run_last():
    args = tool.parse(["--variants", "attention+gemv,base,coordinate+gemv,prefetch"])
    assert args.variants == ["base", "prefetch", "attention+gemv", "coordinate+gemv"]
    assert tool.parse([]).variants == ["base", "prefetch", "coordinate", "gemv"]
    with pytest.raises(SystemExit):
        tool.parse(["--variants", "base,warp-speed"])


def test_a_variants_name_joins_the_levers_it_sets():
    for name in ("base", "prefetch", "coordinate", "gemv", "attention", "attention+single",
                 "attention+coordinate+gemv", "plain-argmax+attention+gemv",
                 "split-attention+gemv", "branchless+gemv", "last-joins+gemv",
                 "wide-split+coordinate+gemv", "attention+coordinate+gemv-prologues",
                 "coordinate+joined-attention", "gap-prefetch+gemv", "window-prefetch",
                 "values-early+coordinate+gemv-prologues",
                 "rope-attention+coordinate+joined-attention", "rope-writes-after+gemv",
                 "programmatic+values-late+attention", "programmatic+gemv",
                 "programmatic+early-tiles+coordinate+gemv-prologues",
                 "whole-cache+rope-attention+coordinate+gemv-prologues",
                 "lead-timing+programmatic+coordinate+gemv-prologues",
                 "late-trigger+programmatic+rope-attention+coordinate+gemv-prologues",
                 "early-trigger+programmatic+rope-attention+coordinate+gemv-prologues",
                 "two-ahead+programmatic+rope-attention+coordinate+gemv-prologues"):
        variant = tool.variant(name)
        assert variant.inductor.get("combo_kernels") is True, name
        assert ("coordinate" in name) == bool(variant.inductor.get(
            "coordinate_descent_tuning")), name
        assert any(w in name for w in ("gemv", "joined", "early-tiles", "-trigger")) == \
            variant.fast_gemv, name
        assert ("early-tiles" in name) == variant.early_tiles, name
        assert variant.late_trigger == (True if "late-trigger" in name else
                                        False if "early-trigger" in name else None), name
        assert ("joined" in name) == variant.join_attention, name
        assert any(w in name for w in ("attention", "branchless", "last-joins",
                                       "wide-split", "values-", "rope", "whole")) == \
            variant.decode_attention, name
        assert ("prefetch" in name) == bool(variant.prefetch_l2), name
        assert variant.prefetch_l2 in (False, True, "gaps", "windows"), name
        assert ("gap-" in name) == (variant.prefetch_l2 == "gaps"), name
        assert ("single" in name) == variant.single_stream, name
        assert ("plain-argmax" in name) == variant.plain_argmax, name
        assert ("split-attention" in name) == variant.split_attention, name
        assert ("branchless" in name) == variant.branchless, name
        assert ("last-joins" in name) == variant.last_joins, name
        assert ("values-early" in name) == variant.values_early, name
        assert ("values-late" in name) == variant.values_late, name
        assert ("programmatic" in name) == variant.programmatic, name
        assert ("whole-cache" in name) == variant.whole_cache, name
        assert ("lead-timing" in name) == variant.lead_timing, name
        assert any(w in name for w in ("rope-attention", "rope-writes")) == \
            variant.rope_attention, name
        assert ("rope-writes-after" in name) == variant.rope_writes_after, name
        assert ("wide-split" in name) == variant.wide_split, name
        assert any(w in name for w in ("prologues", "joined")) == variant.gemv_prologues, name
        assert ("two-ahead" in name) == variant.two_ahead, name
    with pytest.raises(KeyError):
        tool.variant("attention+warp")


def test_a_variants_constants_hold_inside_its_block_and_are_restored_after():
    from nimble import decode_attention, decode_steps

    before = decode_steps.SPLIT_ARGMAX_FROM, decode_attention.UNSPLIT_BLOCKS
    split = tool.variant("split-attention")
    assert tool.whole_slots(split, decode_attention) == 0
    assert tool.whole_slots(tool.variant("whole-cache"), decode_attention) == 256
    assert tool.whole_slots(tool.variant("attention"), decode_attention) == \
        decode_attention.WHOLE_SLOTS
    with tool._patched({"SPLIT_ARGMAX_FROM": (decode_steps, 5),
                        "UNSPLIT_BLOCKS": (decode_attention, 0),
                        "WHOLE_SLOTS": (decode_attention, tool.whole_slots(split,
                                                                           decode_attention))}):
        assert (decode_steps.SPLIT_ARGMAX_FROM, decode_attention.UNSPLIT_BLOCKS) == (5, 0)
        assert decode_attention.split_for(1, 8, 128).splits == 2
    # the split's target read at the call, not fixed when split_for was defined
    assert decode_attention.split_for(8, 8, 4096).splits == 3
    with tool._patched({"TARGET_PROGRAMS": (decode_attention,
                                            2 * decode_attention.TARGET_PROGRAMS)}):
        assert decode_attention.split_for(8, 8, 4096).splits == 5
    assert decode_attention.split_for(8, 8, 4096).splits == 3
    assert (decode_steps.SPLIT_ARGMAX_FROM, decode_attention.UNSPLIT_BLOCKS) == before


def test_the_summary_line_holds_both_rows_and_their_ratio():
    def row(ms):
        return {"token_ms_median": ms, "token_ms_p90": ms + 0.01,
                "bandwidth": {"of_copy": 0.5}, "mismatch": {"sequences": 1, "near_ties": 1}}
    line = tool.line({"variant": "base", "compiled loop": row(1.2),
                      "nimble+inductor": row(1.0)})
    assert "loop 1.200 ms" in line and "nimble 1.000 ms" in line and "x loop 1.200" in line
    assert "differ 1/1 tie" in line and "prepare" not in line
    timed = tool.line({"variant": "base", "compiled loop": row(1.2),
                       "nimble+inductor": row(1.0), "prepare_s": 41.26})
    assert timed.endswith("x loop 1.200  prepare 41.3 s")
    assert tool.line({"variant": "base", "error": "RuntimeError: x"}) == \
        "base: RuntimeError: x"


def test_a_variants_gemv_margin_is_the_librarys_for_its_prologues_unless_it_names_one():
    from nimble.fast_gemv import MARGIN, PROLOGUE_MARGIN

    assert tool.gemv_margin(tool.variant("coordinate+gemv")) == MARGIN
    assert tool.gemv_margin(tool.variant("coordinate+gemv-prologues")) == PROLOGUE_MARGIN
    assert tool.gemv_margin(tool.variant("gemv-margin-3+gemv-prologues")) == 0.03
    assert tool.gemv_margin(tool.variant("gemv-within-10+gemv")) == -0.10


def test_the_tuners_picks_are_caught_by_kernel_and_the_slowest_listed():
    import logging

    logger = logging.getLogger(tool.TUNER_LOGGER)
    level, propagate = logger.level, logger.propagate
    with tool.tuner_picks() as picks:
        logger.debug("= Do coordinate descent tuning for %s =", "k1")
        for name, best, ms in (("k1", "XBLOCK: 4", 0.0276), ("k2", "XBLOCK: 1", 0.0091),
                               ("k1", "XBLOCK: 16", 0.0295)):
            logger.debug("%s: Improve from %s %f -> %s %f, %.3fx", name, "XBLOCK: 2", 0.046,
                         best, ms, 0.046 / ms)
    logger.debug("%s: Improve from %s %f -> %s %f, %.3fx", "k3", "a", 1.0, "b", 0.5, 2.0)
    assert picks == {"k1": ("XBLOCK: 16", 0.0295), "k2": ("XBLOCK: 1", 0.0091)}
    assert (logger.level, logger.propagate) == (level, propagate)
    assert tool.slowest_picks(picks, 1) == ["k1: XBLOCK: 16 (29.5 µs alone)"]


def test_a_variant_that_folds_the_rotary_embedding_alone_keeps_its_gemvs_by_the_fold_margin():
    from nimble.fast_gemv import PROLOGUE_MARGIN

    assert tool.folds(tool.variant("rope-attention+gemv"))
    assert tool.gemv_margin(tool.variant("rope-attention+gemv")) == PROLOGUE_MARGIN
