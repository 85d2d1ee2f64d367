"""Decode-step levers side by side in one process (issue 53): per variant, the compiled tight
loop (gpt-fast's baseline, compiled under the same Inductor settings) and a Generator on
Inductor's kernels, ms per token, the share of the copy bandwidth, the tokens against
transformers' greedy ones, where the Generator's decode step spends its time, and what
Inductor's coordinate-descent tuning picked for the kernels slowest alone (``--top-picks``: two
compilations of one variant differ by those picks).

    python3 tools/experiments/decode_levers.py --variants base,prefetch,coordinate,gemv

A variant is ``base`` or levers joined with "+" (``attention+coordinate+gemv``): ``prefetch`` (the
weight prefetch into the L2, Nimble's own, every plan timed; ``window-prefetch`` and
``gap-prefetch`` one plan each: :data:`nimble.analysis.prefetch.PLANS`), ``coordinate``
(Inductor's coordinate-descent tuning), ``gemv`` (:func:`nimble.fast_gemv`), ``attention``
(:func:`nimble.decode_attention`), ``single`` (Nimble's steps on one stream), ``plain-argmax``
(the argmax as one reduction, not :func:`nimble.decode_steps.split_argmax`), ``split-attention``
(the attention kernel with every cache split over programs, not read unsplit where it is short),
``branchless`` (the attention kernel's hidden stretches skipped by masked loads, not a branch),
``last-joins`` (a split's parts joined by its last program, not a second kernel), ``values-early``
(the attention kernel asks for a block's values beside its keys:
:data:`nimble.decode_attention.VALUES_EARLY`, on by default; ``values-late`` takes it back),
``wide-split`` (the attention's split aiming for twice
:data:`nimble.decode_attention.TARGET_PROGRAMS`: at batch 8 the kernel alone is faster with 4
programs a head than the rule's 3), ``gemv-within-10`` (``gemv``, a shape's GEMV kept where it is
at most 10% slower than torch's GEMM), ``gemv-margin-3`` (``gemv``, kept only where 3% faster:
:data:`nimble.fast_gemv.MARGIN`, the default without prologues), ``rows-within-25`` /
``rows-always`` (``gemv``, a shape's GEMM of rows kept where it is at most 25% slower than
torch's / wherever it runs: what a step's programmatic edges into it pay, which its timing
alone does not see), ``rows-second-kernel`` (``gemv``, a split GEMM of rows' parts added by a
second kernel, not by the last program of each block: :data:`nimble.gemm_rows.LAST_JOINS`),
``fold-rows`` (``gemv-prologues``, the norms and gated products folded into the GEMMs of rows
too: :data:`nimble.gemv_prologue_pass.FOLD_ROWS`; with ``rows-always`` every projection),
``layer-norms`` (``gemv-prologues``, layer norms and GELUs folded too:
:data:`nimble.gemv_prologue_pass.FOLD_LAYER_NORMS`), ``gemv-prologues`` (``gemv``,
and each GEMV fed by an RMS norm or a gated activation computing that vector itself:
:mod:`nimble.gemv_prologue_pass`; its GEMVs kept within
:data:`nimble.fast_gemv.PROLOGUE_MARGIN`),
``joined-attention`` (``gemv-prologues`` and ``attention``, the attention's split joined by the
output projection's GEMV as it reads it), ``rope-attention`` (``attention``, its rotary embedding
and cache read in the attention kernel: :mod:`nimble.attention_rope_pass`; ``rope-writes-after``
with the cache writes right after each attention, not together at the graph's end),
``programmatic`` (the edges into Nimble's own kernels programmatic where the step measures faster
at prepare: :func:`nimble.analysis.programmatic.waiting_edges`), ``early-tiles`` (``gemv``, the
plain GEMV asking for two weight tiles before its wait: :data:`nimble.fast_gemv.EARLY_TILES`),
``whole-cache`` (``attention``, a cache of at most 256 slots read as one tile a program, no join:
:data:`nimble.decode_attention.WHOLE_SLOTS`), ``lead-timing`` (the prepare times each launch of a
step behind an untimed one, as a loop of calls runs it:
:data:`nimble.engine.phase_timing.LEAD_LAUNCH`), ``late-trigger`` / ``early-trigger`` (``gemv``,
each GEMV letting the kernel behind it launch only once its weight is read / at its start:
:data:`nimble.kernel_waits.LAUNCH_DEPENDENTS_LATE`, late by default), ``two-ahead``
(``gemv-prologues``, each prologue GEMV's program asking for two weight tiles ahead of the one
it sums: :data:`nimble.gemv_prologues.TILES_AHEAD`), ``tuned-prologues`` (``gemv-prologues``,
each folded GEMV launched as :mod:`nimble.gemv_prologue_tuning` times fastest on its own kernel;
the launches chosen are printed), ``cache-late`` (``rope-attention``, the whole cache's keys and
values asked for after the attention kernel's wait, not before it:
:data:`nimble.decode_attention.CACHE_BEFORE_WAIT`).
Every variant runs on one model (built once, its sibling projections fused unless ``--no-fuse``);
a ``gemv`` variant changes the model's modules for good and runs after the others. The Inductor
settings of a variant (``combo_kernels`` always) and the module constants it sets are set around
both rows' compilations, so the baseline gets every lever that is not Nimble's own.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of preparing the decode step."""

    inductor: dict  # torch._inductor.config settings around both rows' compilations
    prefetch_l2: bool | str = False  # PrepareOptions(prefetch_l2=...): Nimble's own
    fast_gemv: bool = False  # nimble.fast_gemv on the model, before both rows
    # fast_gemv's margin; None: nimble.fast_gemv.PROLOGUE_MARGIN with gemv_prologues, else MARGIN
    gemv_margin: float | None = None
    row_margin: float | None = None  # fast_gemv's row_margin (a GEMM of rows); None: its own
    rows_second_kernel: bool = False  # a split GEMM of rows' parts added by a second kernel
    fold_rows: bool = False  # the fold pass also folds into the GEMMs of rows (FOLD_ROWS)
    layer_norms: bool = False  # the fold pass folds layer norms and GELUs (FOLD_LAYER_NORMS)
    decode_attention: bool = False  # nimble.decode_attention on the model, before both rows
    single_stream: bool = False  # the Generator's steps prepared with use_multi_stream=False
    plain_argmax: bool = False  # both rows' argmax one reduction (no decode_steps.split_argmax)
    split_attention: bool = False  # the attention kernel splits every cache (UNSPLIT_BLOCKS 0,
    #                                WHOLE_SLOTS 0)
    branchless: bool = False  # the attention kernel's hidden stretches by masked loads
    last_joins: bool = False  # the attention's split joined by its last program
    values_early: bool = False  # the attention kernel asks for a block's values beside its keys
    values_late: bool = False  # ... after its scores (VALUES_EARLY off: it is on by default)
    wide_split: bool = False  # the attention's split aims for twice TARGET_PROGRAMS
    gemv_prologues: bool = False  # nimble.gemv_prologue_pass around both rows' compilations
    join_attention: bool = False  # ... with the attention's join folded into its GEMV
    rope_attention: bool = False  # the rotary embedding and cache read folded into the attention
    rope_writes_after: bool = False  # ... its cache writes right after it, not at the graph's end
    programmatic: bool = False  # PrepareOptions(programmatic_launch=True): into Nimble's kernels
    early_tiles: bool = False  # the plain GEMV asks for two weight tiles before its wait
    whole_cache: bool = False  # the attention reads a cache of <= 256 slots as one tile
    two_ahead: bool = False  # the prologue GEMVs ask for two weight tiles ahead, not one
    tuned_prologues: bool = False  # each folded GEMV launched as timed fastest on its kernel
    cache_late: bool = False  # the rotary attention asks for its cache after its wait
    lead_timing: bool = False  # prepare times each launch behind an untimed one (LEAD_LAUNCH)
    late_trigger: bool | None = None  # the GEMVs let the next kernel launch once their weight
    #                                   is read (True), at their start (False); None: the default


COMBO = {"combo_kernels": True}
#: The longest cache the ``whole-cache`` lever reads as one tile.
WHOLE_CACHE_SLOTS = 256
#: The levers a variant's name joins with "+" ("base": none), and what each sets.
LEVERS = {
    "prefetch": {"prefetch_l2": True},
    "window-prefetch": {"prefetch_l2": "windows"},
    "gap-prefetch": {"prefetch_l2": "gaps"},
    "coordinate": {"inductor": {**COMBO, "coordinate_descent_tuning": True}},
    "gemv": {"fast_gemv": True},
    "attention": {"decode_attention": True},
    "single": {"single_stream": True},
    "plain-argmax": {"plain_argmax": True},
    "split-attention": {"decode_attention": True, "split_attention": True},
    "branchless": {"decode_attention": True, "branchless": True},
    "last-joins": {"decode_attention": True, "last_joins": True},
    "values-early": {"decode_attention": True, "values_early": True},
    "values-late": {"decode_attention": True, "values_late": True},
    "wide-split": {"decode_attention": True, "wide_split": True},
    "gemv-prologues": {"fast_gemv": True, "gemv_prologues": True},
    "gemv-within-10": {"fast_gemv": True, "gemv_margin": -0.10},
    "gemv-margin-3": {"fast_gemv": True, "gemv_margin": 0.03},
    "rows-within-25": {"fast_gemv": True, "row_margin": -0.25},
    "rows-always": {"fast_gemv": True, "row_margin": -10.0},
    "rows-second-kernel": {"fast_gemv": True, "rows_second_kernel": True},
    "fold-rows": {"fast_gemv": True, "gemv_prologues": True, "fold_rows": True},
    "layer-norms": {"fast_gemv": True, "gemv_prologues": True, "layer_norms": True},
    "joined-attention": {"fast_gemv": True, "gemv_prologues": True, "decode_attention": True,
                         "join_attention": True},
    "rope-attention": {"decode_attention": True, "rope_attention": True},
    "programmatic": {"programmatic": True},
    "early-tiles": {"fast_gemv": True, "early_tiles": True},
    "whole-cache": {"decode_attention": True, "whole_cache": True},
    "lead-timing": {"lead_timing": True},
    "late-trigger": {"fast_gemv": True, "late_trigger": True},
    "early-trigger": {"fast_gemv": True, "late_trigger": False},
    "two-ahead": {"fast_gemv": True, "gemv_prologues": True, "two_ahead": True},
    "tuned-prologues": {"fast_gemv": True, "gemv_prologues": True, "tuned_prologues": True},
    "cache-late": {"decode_attention": True, "rope_attention": True, "cache_late": True},
    "rope-writes-after": {"decode_attention": True, "rope_attention": True,
                          "rope_writes_after": True},
}


def variant(name: str) -> Variant:
    """The variant a name describes: ``base``, or levers of :data:`LEVERS` joined with "+"."""
    fields: dict = {"inductor": COMBO}
    for lever in ([] if name == "base" else name.split("+")):
        if lever not in LEVERS:
            raise KeyError(lever)
        fields.update(LEVERS[lever])
    return Variant(**fields)


def gemv_margin(lever: Variant) -> float:
    """The margin ``fast_gemv`` keeps a GEMV by under ``lever``: its own, else the library's
    for a compilation with the fold pass (:func:`folding`) or without."""
    from nimble.fast_gemv import margin_for

    if lever.gemv_margin is not None:
        return lever.gemv_margin
    return margin_for(folds(lever))


def folds(lever: Variant) -> bool:
    """Whether ``lever``'s compilations run the fold pass."""
    return lever.gemv_prologues or lever.rope_attention


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3_1b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", default="base,prefetch,coordinate,gemv")
    p.add_argument("--no-fuse", action="store_true")
    p.add_argument("--top", type=int, default=14, help="kernel names shown per breakdown")
    p.add_argument("--top-picks", type=int, default=4,
                   help="Inductor's coordinate-descent picks shown per variant (the kernels "
                        "slowest alone)")
    p.add_argument("--json", default=None)
    p.add_argument("--traces", type=Path, default=None,
                   help="a folder for each variant's traced decode step (a Chrome trace "
                        "`nimble inspect` reads)")
    args = p.parse_args(argv)
    if args.traces:
        args.traces.mkdir(parents=True, exist_ok=True)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = []
    for v in args.variants:
        try:
            variant(v)
        except KeyError:
            unknown.append(v)
    if unknown:
        p.error(f"unknown variants {unknown}: base, or levers joined with '+' of "
                f"{', '.join(LEVERS)}")
    # a variant that swaps modules for good goes after every variant that does not
    args.variants.sort(key=lambda v: variant(v).fast_gemv)
    return args


@dataclasses.dataclass
class Reference:
    """transformers' greedy tokens on the plain model (static cache, eager kernels), and what a
    decode step must read."""

    tokens: object
    logits: object
    needed: object


def reference(model, args, ids) -> Reference:
    import transformers

    from nimble.cli.generate_bench import step_bytes
    from nimble.generate import library_greedy

    cache = transformers.StaticCache(config=model.config,
                                     max_cache_len=args.prompt + args.new_tokens)
    tokens, logits = library_greedy(model, ids, args.new_tokens, cache=cache, with_logits=True)
    return Reference(tokens, logits, step_bytes(model, cache, args.prompt, args.new_tokens))


def run_variant(name: str, model, args, copy: float, prompts: dict, ref: Reference,
                swapped: set) -> dict:
    import torch
    import torch._inductor.config as inductor_config

    from nimble.cli import decode_bandwidth
    from nimble.cli.decode_loop import compiled_loop
    from nimble.cli.generate_bench import _decode_step_shape, _mismatches, _time_mode
    from nimble.generate import Generator, prepare_with_nimble

    from nimble import attention_rope_pass as rope_pass
    from nimble import decode_attention as attention_module
    from nimble import decode_steps
    from nimble import fast_gemv as gemv_module
    from nimble import gemv_prologues
    from nimble import kernel_waits
    from nimble.engine import phase_timing

    lever = variant(name)
    out: dict = {"variant": name, "settings": dataclasses.asdict(lever)}
    margin = gemv_margin(lever)
    chosen_as = ("fast_gemv", margin, lever.row_margin, lever.rows_second_kernel)
    if lever.fast_gemv and chosen_as not in swapped:
        from nimble.fast_gemv import fast_gemv

        out["fast_gemv"] = [c.describe() for c in fast_gemv(
            model, margin=margin, rows=gemv_module.decode_rows([args.batch]),
            row_margin=lever.row_margin)]
        # for good: the variants after it run on the swapped layers (chosen again where a
        # variant asks for another margin)
        swapped.clear()
        swapped.add(chosen_as)
    undo = []
    if lever.decode_attention:
        from nimble.decode_attention import decode_attention

        undo.append(decode_attention(model).undo)
    cache_len = args.prompt + args.new_tokens
    ids = prompts[args.prompt]
    options = prepare_options(lever)
    try:
        torch._dynamo.reset()
        # read where the step is traced (the argmax) and where its kernels are recorded (the
        # attention's split): both inside the block
        patches = {"SPLIT_ARGMAX_FROM": (decode_steps, sys.maxsize if lever.plain_argmax
                                         else decode_steps.SPLIT_ARGMAX_FROM),
                   "UNSPLIT_BLOCKS": (attention_module, 0 if lever.split_attention
                                      else attention_module.UNSPLIT_BLOCKS),
                   "BRANCHLESS": (attention_module, lever.branchless
                                  or attention_module.BRANCHLESS),
                   "LAST_JOINS": (attention_module, lever.last_joins
                                  or attention_module.LAST_JOINS),
                   "VALUES_EARLY": (attention_module, (lever.values_early
                                                       or attention_module.VALUES_EARLY)
                                    and not lever.values_late),
                   "CACHE_BEFORE_WAIT": (attention_module, attention_module.CACHE_BEFORE_WAIT
                                         and not lever.cache_late),
                   "WRITES_LAST": (rope_pass, rope_pass.WRITES_LAST
                                   and not lever.rope_writes_after),
                   "TARGET_PROGRAMS": (attention_module, attention_module.TARGET_PROGRAMS
                                       * (2 if lever.wide_split else 1)),
                   "EARLY_TILES": (gemv_module, 2 if lever.early_tiles
                                   else gemv_module.EARLY_TILES),
                   "WHOLE_SLOTS": (attention_module, whole_slots(lever, attention_module)),
                   "LEAD_LAUNCH": (phase_timing, lever.lead_timing or phase_timing.LEAD_LAUNCH),
                   "TILES_AHEAD": (gemv_prologues, 2 if lever.two_ahead
                                   else gemv_prologues.TILES_AHEAD),
                   "LAUNCH_DEPENDENTS_LATE": (kernel_waits, kernel_waits.LAUNCH_DEPENDENTS_LATE
                                              if lever.late_trigger is None
                                              else lever.late_trigger)}
        with inductor_config.patch(**lever.inductor), _patched(patches), \
                folding(lever) as folded:
            rows = {"compiled loop": compiled_loop(model, cache_len)}
            started = time.perf_counter()
            generator = Generator(model, cache_len, [args.prompt], [args.batch],
                                  prepare_step=single_stream(options) if lever.single_stream
                                  else prepare_with_nimble(options, True))
            # the steps' compilations (with any launch timing of the pass) and Nimble's prepare
            out["prepare_s"] = time.perf_counter() - started
            undo.append(generator.close)
            rows["nimble+inductor"] = generator.generate
            for mode, run in rows.items():
                row = out[mode] = _time_mode(run, prompts, args.new_tokens, args.rounds)
                row["bandwidth"] = decode_bandwidth.used(ref.needed, row["token_ms_median"],
                                                         copy)
                row["mismatch"] = _mismatches(run(ids, args.new_tokens), ref.tokens,
                                              ref.logits, model.dtype)
        if folded is not None:
            out["gemv_prologues"] = [dataclasses.asdict(r) for r in folded.runs if r.gemvs]
        if lever.tuned_prologues:
            from nimble import gemv_prologue_tuning

            out["prologue_launches"] = [c.describe() for c in gemv_prologue_tuning.chosen()]
            gemv_prologue_tuning.forget()  # the next variant times its own
        # "+" kept out of the file name: copying tools refuse it
        trace = args.traces / f"{name.replace('+', '_')}.trace.json" if args.traces else None
        out["decode_step"] = _decode_step_shape(generator, args.batch, ref.needed, copy,
                                                top=args.top, trace_file=trace)
    finally:
        for step in reversed(undo):
            step()
    return out


def prepare_options(lever: Variant):
    """The ``PrepareOptions`` of ``lever``'s Generator: programmatic edges only where the
    variant names them (on by default in ``PrepareOptions``)."""
    from nimble.engine.options import PrepareOptions

    return PrepareOptions(prefetch_l2=lever.prefetch_l2, programmatic_launch=lever.programmatic)


def folding(lever: Variant):
    """The Inductor pass folding ``lever``'s prologues, rotary embedding and join into Nimble's
    kernels around a compilation (:func:`nimble.gemv_prologue_pass.fusing`), or no pass."""
    from nimble.gemv_prologue_pass import fusing

    if folds(lever):
        return fusing(lever.join_attention, lever.rope_attention, lever.tuned_prologues)
    return contextlib.nullcontext()


def whole_slots(lever: Variant, attention_module) -> int:
    """The longest cache the attention reads as one tile under ``lever``: none where every
    cache is split (``split-attention``)."""
    if lever.whole_cache:
        return WHOLE_CACHE_SLOTS
    return 0 if lever.split_attention else attention_module.WHOLE_SLOTS


@contextlib.contextmanager
def _patched(patches: dict):
    """Module constants set (``{name: (module, value)}``) for the block, restored after it."""
    from unittest import mock

    with contextlib.ExitStack() as stack:
        for name, (module, value) in patches.items():
            stack.enter_context(mock.patch.object(module, name, value))
        yield


def single_stream(options):
    """``prepare_step`` of a Generator on Inductor's kernels whose graphs run on one stream."""
    def prepare(module, examples):
        import torch

        from nimble import Nimble

        return Nimble(torch.compile(module, dynamic=False)).prepare(
            buckets=list(examples), options=options, use_multi_stream=False)
    return prepare


def line(r: dict) -> str:
    def cell(mode):
        row = r.get(mode)
        if not row:
            return "-"
        share = row["bandwidth"]["of_copy"]
        differ = row["mismatch"]
        return (f"{row['token_ms_median']:.3f} ms (p90 {row['token_ms_p90']:.3f}, "
                f"{100 * share:.0f}%, differ {differ['sequences']}/{differ['near_ties']} tie)")
    loop, ours = r.get("compiled loop"), r.get("nimble+inductor")
    ratio = loop["token_ms_median"] / ours["token_ms_median"] if loop and ours else None
    prepared = f"  prepare {r['prepare_s']:.1f} s" if r.get("prepare_s") is not None else ""
    return (f"{r['variant']:<22} loop {cell('compiled loop')}  nimble {cell('nimble+inductor')}"
            f"  x loop {ratio:.3f}{prepared}" if ratio else f"{r['variant']}: {r.get('error')}")


#: The logger of Inductor's coordinate-descent tuner, and the start of its message for a
#: kernel's final pick (``name, baseline, its µs, the pick, its µs, the ratio``).
TUNER_LOGGER = "torch._inductor.runtime.coordinate_descent_tuner"
PICK_MESSAGE = "%s: Improve from"


@contextlib.contextmanager
def tuner_picks():
    """The configuration each kernel's coordinate-descent tuning picked inside the block, and
    its ms timed alone, by kernel name (the last pick where a name is tuned twice): what moves
    a variant's step between compilations.  The tuner's other messages are dropped while it
    runs, unless asked for with ``TORCH_LOGS``."""
    import logging

    picks: dict = {}

    class Picks(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if str(record.msg).startswith(PICK_MESSAGE) and len(record.args or ()) >= 5:
                name, _, _, best, best_ms = record.args[:5]
                picks[str(name)] = (str(best), float(best_ms))

    logger = logging.getLogger(TUNER_LOGGER)
    handler, level, propagate = Picks(logging.DEBUG), logger.level, logger.propagate
    logger.addHandler(handler)
    if not logger.isEnabledFor(logging.DEBUG):  # not asked for: to this handler alone
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
    try:
        yield picks
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def slowest_picks(picks: dict, count: int) -> list[str]:
    """The ``count`` kernels whose picks took longest alone, a line each."""
    ranked = sorted(picks.items(), key=lambda kv: -kv[1][1])[:count]
    return [f"{name}: {config} ({ms * 1e3:.1f} µs alone)" for name, (config, ms) in ranked]


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    from nimble.cli.decode_bandwidth import copy_bandwidth
    from nimble.cli.decoders import causal_lm
    from nimble.cli.common import one_line
    from nimble.fused_projections import fuse_projections

    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy / 1e12:.2f} TB/s", flush=True)
    model = causal_lm(args.model, args.dtype)
    fused = 0 if args.no_fuse else fuse_projections(model)
    torch.manual_seed(1)
    prompts = {args.prompt: torch.randint(0, model.config.vocab_size, (args.batch, args.prompt),
                                          device="cuda")}
    ref = reference(model, args, prompts[args.prompt])
    results, swapped = [], set()
    for name in args.variants:
        print(f"--- {name} ({args.model} {args.dtype}, batch {args.batch}, {fused} fused "
              "groups)", flush=True)
        try:
            from nimble import gemm_rows

            from nimble import gemv_prologue_pass

            asked = variant(name)
            joins = gemm_rows.LAST_JOINS and not asked.rows_second_kernel
            # around the choice's timing and the step's recording alike
            with tuner_picks() as picks, _patched({
                    "LAST_JOINS": (gemm_rows, joins),
                    "FOLD_ROWS": (gemv_prologue_pass,
                                  asked.fold_rows or gemv_prologue_pass.FOLD_ROWS),
                    "FOLD_LAYER_NORMS": (gemv_prologue_pass, asked.layer_norms
                                         or gemv_prologue_pass.FOLD_LAYER_NORMS)}):
                r = run_variant(name, model, args, copy, prompts, ref, swapped)
            r["tuner_picks"] = picks
        except Exception as e:  # noqa: BLE001 - the other variants still run
            r = {"variant": name, "error": one_line(e)}
        results.append(r)
        print(line(r), flush=True)
        if r.get("decode_step"):
            step = r["decode_step"]
            print(step.get("breakdown_text") or f"(no trace: {step.get('trace_error')})",
                  flush=True)
        for p in (r.get("decode_step") or {}).get("prefetch_l2") or ():
            print(f"  prefetch: {p}", flush=True)
        for p in (r.get("decode_step") or {}).get("programmatic") or ():
            print(f"  programmatic: {p}", flush=True)
        for folded in r.get("gemv_prologues") or ():
            print(f"  gemv prologues: {folded}", flush=True)
        for launch in r.get("prologue_launches") or ():
            print(f"  prologue launch: {launch}", flush=True)
        for pick in slowest_picks(r.get("tuner_picks") or {}, args.top_picks):
            print(f"  tuned: {pick}", flush=True)
    print("=== summary")
    for r in results:
        print(line(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
