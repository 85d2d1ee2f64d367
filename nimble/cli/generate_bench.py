"""``nimble bench --generate``: greedy decoding of a causal LM, Nimble against transformers.

Per model (:mod:`nimble.cli.decoders`), dtype and batch size, five modes generate the same
greedy tokens from the same random prompts:

- ``compiled loop``, the baseline: the strongest stock-PyTorch decoding, gpt-fast's tight loop
  over one ``torch.compile(step, mode="reduce-overhead", fullgraph=True)`` forward per token
  with a ``StaticCache`` and the argmax on the GPU (:mod:`nimble.cli.decode_loop`);
- ``eager generate``: ``model.generate(do_sample=False)`` with its default (dynamic) cache;
- ``static+compile``: ``generate(cache_implementation="static")``, for which transformers
  compiles the decoding forward (``torch.compile``, mode ``"reduce-overhead"``: CUDA graphs),
  with ``generate()``'s own host work per token;
- ``static+backend``: the same call with ``compile_config=CompileConfig(backend="nimble")``:
  the library's compiled decoding forward prepared by Nimble (:mod:`nimble.compile_backend`),
  its ``x comp`` column the speed against the same call's ``reduce-overhead``;
- ``nimble``: a :class:`nimble.generate.Generator` on the model's eager kernels;
- ``nimble+inductor``: the same on ``torch.compile(step)``'s kernels (default mode).

Each round times, per mode, a generation of one new token (the prefill, and the argmax), one of
:func:`timed_span`'s short count (16 tokens) and one of ``--new-tokens`` tokens (64), on
prompts of the first ``--prompt-lengths``; a token's decode latency is the long generation's
time less the short one's over the tokens between them ((T64 - T16) / 48, issue 53's method:
the prefill and the first steps' ramp cancel out), the median and p90 over ``--rounds``
rounds; tokens/s is the batch over it.  The prefill latency of every prompt length is the
one-token generation's time.  Every time includes the host's work, the point of the
comparison, between ``torch.cuda.synchronize()`` calls.

The bandwidth columns (:mod:`nimble.cli.decode_bandwidth`): the bytes a decode step must read
(every weight once, and the keys and values of the cache slots it attends to, averaged over
the timed tokens) over its time, and that over the device's bandwidth in a 1 GiB
device-to-device copy measured once per process.

Every generated sequence is checked against transformers' greedy tokens with a static cache and
eager kernels (:func:`nimble.generate.library_greedy`), and a sequence that departs from them is
judged at its first differing token by the reference's own logits: a departure to a token whose
logit the reference's choice beat by at most :data:`TIE_ULPS` units in the last place (of the
model's dtype, at that logit) is a near-tie flip, any other a wrong token.  Every mode's kernels
round differently from the reference somewhere: the others run other kernels (another cache,
Inductor's fusions), and even ``nimble``'s eager kernels are those transformers runs under graph
capture, where its mask code takes its capture branch (the same is true of
``static+compile``); random weights give near-flat logits, where such rounding flips ties.  A
wrong token in ``nimble`` ends the command with status 1; near-tie flips are counted and
shown.  Beside the table: the decode step's DAG width (the analysis stage's largest set of
mutually independent tasks), its streams, and its achieved concurrency (tasks in flight on
average, ``nm.trace()``).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

from . import decode_bandwidth
from .common import Fail, one_line, positive_int, require_gpu
from .decode_loop import compiled_loop
from .decoders import CAUSAL_LMS, causal_lm
from .generate_levers import (add_lever_arguments, attention_if_asked, cache_length,
                              check_lever_arguments, compiled_under, fuse_if_asked,
                              gemv_if_asked, nimble_generators)
from .harness import Case, Column, Outcome, format_table, run_cases, write_results
from .output import outputs
from ..progress import say

#: A departure from the reference at a token it chose by at most this many units in the last
#: place is a near-tie flip: the logits of a step run eagerly and of the same step captured
#: differ by about one unit (docs/inference.md), so a choice that close is rounding's, not the
#: graph's.
TIE_ULPS = 8
#: The baseline every mode's speed is held against (issue 53).
BASELINE = "compiled loop"
#: The modes, in table order.
MODES = (BASELINE, "eager generate", "static+compile", "static+backend", "nimble",
         "nimble+inductor")
#: The short generation whose time the long one's less is the decode time (issue 53: 16 of 64).
SHORT_TOKENS = 16
#: The mode whose kernels are the reference's own: its tokens must equal the reference's.
EXACT = "nimble"
DEFAULT_MODELS = ["gpt2", "llama_1b"]


def parse_lengths(text: str) -> list[int]:
    """``--prompt-lengths``: comma-separated positive integers."""
    return sorted({positive_int(part) for part in text.split(",") if part.strip()})


def add_arguments(p) -> None:
    """The options only ``--generate`` reads (``bench.py`` adds the flag itself)."""
    p.add_argument("--prompt-lengths", type=parse_lengths, default=[128, 512], metavar="N,N",
                   help="--generate: prompt lengths, one prefill bucket each (default 128,512)")
    p.add_argument("--new-tokens", type=positive_int, default=64,
                   help="--generate: tokens generated per sequence (default 64; a token's "
                        "time is (T(N) - T(16)) / (N - 16))")
    add_lever_arguments(p)
    p.add_argument("--breakdown", action="store_true",
                   help="--generate: print where each Nimble decode step's time goes (busy, "
                        "gaps between dependent kernels, each kernel's bandwidth, concurrency; "
                        "always in --json)")


def _seconds(fn: Callable[[], object]) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _library_generate(model, compiled: bool, max_cache_len: int,
                      backend: str | None = None) -> Callable:
    """``generate(ids, new_tokens)`` of transformers: eager with its default cache, or with a
    static cache of ``max_cache_len`` tokens (the Generators' length), compiled (through
    ``torch.compile(backend=backend)`` where given, by ``CompileConfig``)."""
    import torch

    from ..generate import library_greedy

    if compiled:
        cache = _static_cache(model, max_cache_len)
        config = None
        if backend is not None:
            import transformers

            config = transformers.CompileConfig(backend=backend, mode=None)
        return lambda ids, new: library_greedy(model, ids, new, compiled=True, cache=cache,
                                               compile_config=config)

    def eager(ids, new):
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    return eager


def _static_cache(model, max_cache_len: int):
    import transformers

    return transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)


def _decode_step_shape(generator, batch: int, needed=None,
                       copy_bytes_per_s: float | None = None, top: int = 10,
                       trace_file=None) -> dict:
    """The decode step's DAG width, streams and achieved concurrency, and where its time goes
    (:func:`nimble.debug.breakdown.step_breakdown`, held against ``copy_bytes_per_s``, the
    ``top`` kernel names by time), from one trace at the timed tokens' middle position
    (``needed``, the step's :class:`~nimble.cli.decode_bandwidth.StepBytes`; None and the
    trace's error where it failed); the trace also written to ``trace_file`` where given, as a
    Chrome trace that ``nimble inspect`` reads again."""
    import json

    import torch

    from ..debug.breakdown import format_breakdown, step_breakdown

    decode, _ = generator.steps(batch)
    shape = {"dag_width": decode.schedule.width, "streams": len(decode.schedule.streams),
             "tasks": len(decode.graph.tasks), "concurrency": None,
             "prefetch_l2": decode.graph.meta.get("prefetch_l2"),
             "programmatic_edges": len(decode.programmatic_edges),
             "programmatic": decode.graph.meta.get("programmatic")}
    try:
        device = next(generator.model.parameters()).device
        at = int(needed.slots_read) - 1 if needed else generator.decode_position
        timeline = decode.trace(torch.ones((batch, 1), dtype=torch.long, device=device),
                                torch.full((1,), at, dtype=torch.long, device=device))
        shape["concurrency"] = timeline.summary()["phases"][0]["concurrency"]
        if trace_file is not None:
            with open(trace_file, "w") as f:
                json.dump(timeline.to_chrome(), f)
            shape["trace_file"] = str(trace_file)
        l2 = torch.cuda.get_device_properties(device).L2_cache_size \
            if device.type == "cuda" else None
        broken = step_breakdown(timeline, decode.graph, copy_bytes_per_s=copy_bytes_per_s,
                                l2_bytes=l2)
        shape["breakdown"] = broken.summary(top=top)
        shape["breakdown_text"] = format_breakdown(broken, top=top)
    except Exception as e:  # noqa: BLE001 - the timings stand without it
        shape["trace_error"] = one_line(e)
    return shape


def _breakdown_text(info: dict) -> str:
    """Each Nimble mode's decode-step breakdown, where ``--breakdown`` asked for it."""
    if not info.get("show_breakdown"):
        return ""
    out = []
    for mode, shape in info.get("decode_step", {}).items():
        text = shape.get("breakdown_text") or f"(no trace: {shape.get('trace_error')})\n"
        out.append(f"where {mode}'s decode step spends its time:\n{text}")
        for r in shape.get("prefetch_l2") or ():
            out.append(f"  weight prefetch ({r.get('plan', 'windows')}): {r['plain_ms']:.3f} ms "
                       f"per launch without, {r['prefetch_ms']:.3f} with {r['windows']} "
                       "prefetches of "
                       f"{r['bytes'] / 1e6:.1f} MB in all; "
                       + ("kept\n" if r["kept"] else "not kept\n"))
        for r in shape.get("programmatic") or ():
            timed = (f"{r['plain_ms']:.3f} ms per launch without, {r['programmatic_ms']:.3f} "
                     "with " if r.get("measured") else "served unmeasured: ")
            out.append(f"  programmatic edges: {timed}{r['edges']} edge(s); "
                       + ("kept\n" if r["kept"] else "not kept\n"))
    return "".join(out).rstrip("\n")


def _mismatches(got, want, logits=None, dtype=None) -> dict:
    """How many sequences differ from the reference, the first differing token's column, and
    per differing sequence the reference's margin at its first differing token: its own
    token's logit over the departing token's, in units in the last place (None where there are
    no ``logits``, the reference's ``(new tokens, B, V)``) of ``dtype``, the model's (default:
    the logits'; transformers hands out float32 logits of a float16 model, whose rounding is
    float16's); margins up to :data:`TIE_ULPS` are counted as near-ties."""
    from ..generate import unit_in_last_place

    differ = got != want
    rows = differ.any(dim=1).nonzero().flatten().tolist()
    columns = differ.any(dim=0).nonzero().flatten().tolist()
    margins = []
    for row in rows:
        column = int(differ[row].nonzero()[0])
        step = column - (want.shape[1] - logits.shape[0]) if logits is not None else -1
        if step < 0:  # no logits, or the prompt itself differs
            margins.append(None)
            continue
        scores = logits[step, row].float()
        chosen = float(scores[int(want[row, column])])
        margin = chosen - float(scores[int(got[row, column])])
        margins.append(round(margin / unit_in_last_place(chosen, dtype or logits.dtype), 2))
    ties = sum(1 for m in margins if m is not None and m <= TIE_ULPS)
    return {"sequences": len(rows), "first_token": columns[0] if columns else None,
            "near_ties": ties, "margins_ulp": margins}


def wrong_sequences(mismatch: dict) -> int:
    """Differing sequences that are not near-tie flips."""
    return mismatch["sequences"] - mismatch.get("near_ties", 0)


def timed_span(new: int) -> tuple[int, int]:
    """``(short, long)``: the generations whose time difference over ``long - short`` tokens is
    the per-token decode time, ``(16, new)`` for ``new`` above 16 (the issue's (T64 - T16) /
    48), else ``(new // 2, new)``.  ``new`` is at least 2."""
    return (SHORT_TOKENS if new > SHORT_TOKENS else new // 2), new


def _time_mode(run: Callable, prompts: dict, new: int, rounds: int) -> dict:
    """Prefill seconds per prompt length and per-token decode seconds of ``run(ids, new)``
    (:func:`timed_span`)."""
    decode_ids = prompts[min(prompts)]
    short, long = timed_span(new)
    # warm-up: compilation, CUDA graph recording, the allocator
    for ids in [prompts[n] for n in sorted(prompts, reverse=True)] + [decode_ids]:
        run(ids, 1)
        run(ids, long)
    per_token, prefill = [], {n: [] for n in prompts}
    for _ in range(rounds):
        few = _seconds(lambda: run(decode_ids, short))
        many = _seconds(lambda: run(decode_ids, long))
        per_token.append((many - few) / (long - short))
        for n, ids in prompts.items():
            prefill[n].append(_seconds(lambda ids=ids: run(ids, 1)))
    ordered = sorted(per_token)
    return {"token_ms_median": 1e3 * statistics.median(ordered),
            "token_ms_p90": 1e3 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "timed_tokens": [short, long],
            "prefill_ms": {str(n): 1e3 * statistics.median(v) for n, v in prefill.items()}}


def step_bytes(model, cache, prompt: int, new: int) -> decode_bandwidth.StepBytes:
    """What a decode step of the timed tokens must read, from ``model``'s weights and an
    initialized static ``cache`` of the bench's batch."""
    return decode_bandwidth.StepBytes(decode_bandwidth.weight_bytes(model),
                                      decode_bandwidth.kv_bytes_per_slot(cache),
                                      decode_bandwidth.mean_slots_read(prompt, *timed_span(new)))


def _copy_bandwidth(args) -> float | None:
    """The device's copy bandwidth (bytes/s), measured once; None on a failure, said."""
    try:
        return decode_bandwidth.copy_bandwidth()
    except Exception as e:  # noqa: BLE001 - the timings stand without it
        say(f"bench --generate: no copy bandwidth ({one_line(e)})", args.quiet, "bench")
        return None


def bench_generate(name: str, args, dtype: str, batch: int) -> dict:
    """Every mode's numbers for ``name`` in ``dtype`` at ``batch``."""
    import torch

    from ..generate import library_greedy

    def step(what: str) -> None:
        say(f"{name} ({dtype}, batch {batch}): {what}", args.quiet, "bench")

    if args.new_tokens < 2:
        raise Fail("bench --generate: --new-tokens must be at least 2 (a decode step to time)")
    torch._dynamo.reset()  # each case compiles afresh, within Dynamo's recompile limit
    model = causal_lm(name, dtype)
    torch.manual_seed(1)
    device = next(model.parameters()).device
    prompts = {n: torch.randint(0, model.config.vocab_size, (batch, n), device=device)
               for n in args.prompt_lengths}
    decode_ids = prompts[min(prompts)]
    info: dict = {"model": name, "dtype": dtype, "batch": batch, "new_tokens": args.new_tokens,
                  "prompt_lengths": list(args.prompt_lengths), "rounds": args.rounds,
                  "baseline": BASELINE, "modes": {},
                  "show_breakdown": bool(getattr(args, "breakdown", False)),
                  "sdpa_backends": getattr(args, "sdpa_backends", None)}
    check_lever_arguments(args)
    fuse_if_asked(model, args, info)
    gemv_if_asked(model, args, info, batch)
    attention_if_asked(model, args, info)
    cache_len = cache_length(args)
    step("the reference: transformers' greedy tokens, static cache, eager kernels")
    reference_cache = _static_cache(model, cache_len)
    want, want_logits = library_greedy(model, decode_ids, args.new_tokens,
                                       cache=reference_cache, with_logits=True)
    needed = step_bytes(model, reference_cache, min(prompts), args.new_tokens)
    info["bytes"] = {"weights": needed.weights, "kv_per_slot": needed.kv_per_slot,
                     "slots_read": needed.slots_read, "per_step": needed.total}
    info["copy_bytes_per_s"] = _copy_bandwidth(args)
    step("preparing the Nimble generators (eager kernels, Inductor's)")
    generators = nimble_generators(model, args, batch)
    try:
        runs = {BASELINE: compiled_under(compiled_loop(model, cache_len), args),
                "eager generate": _library_generate(model, False, cache_len),
                "static+compile": compiled_under(_library_generate(model, True, cache_len),
                                                 args),
                "static+backend": compiled_under(
                    _library_generate(model, True, cache_len, "nimble"), args),
                **{mode: g if isinstance(g, str) else g.generate
                   for mode, g in generators.items()}}
        for mode in MODES:
            step(f"timing {mode}")
            row = info["modes"][mode] = _mode_row(runs[mode], prompts, args, batch, want,
                                                  want_logits, model.dtype)
            if "error" not in row:
                row["bandwidth"] = decode_bandwidth.used(needed, row["token_ms_median"],
                                                         info["copy_bytes_per_s"])
        step("tracing the decode steps")
        info["decode_step"] = {mode: _decode_step_shape(g, batch, needed,
                                                        info["copy_bytes_per_s"])
                               for mode, g in generators.items() if not isinstance(g, str)}
    finally:
        for generator in generators.values():
            if not isinstance(generator, str):
                generator.close()
    _add_speedups(info["modes"])
    return info


def _mode_row(run: Callable | str, prompts: dict, args, batch: int, want,
              want_logits=None, dtype=None) -> dict:
    """One mode's timings and mismatches, or ``{"error": ...}`` (``run`` may be the error that
    stopped its preparation)."""
    if isinstance(run, str):
        return {"error": run}
    try:
        row = _time_mode(run, prompts, args.new_tokens, args.rounds)
        row["tokens_per_s"] = batch / (row["token_ms_median"] / 1e3)
        row["mismatch"] = _mismatches(run(prompts[min(prompts)], args.new_tokens), want,
                                      want_logits, dtype)
    except Exception as e:  # noqa: BLE001 - the other modes still run
        return {"error": one_line(e)}
    return row


#: Each speedup key and the mode it holds a row's tokens/s against.
SPEEDUPS = {"x_loop": BASELINE, "x_compiled": "static+compile", "x_eager": "eager generate"}


def _add_speedups(modes: dict) -> None:
    """Each timed mode's tokens/s over the compiled loop's, static+compile's and eager
    generate's (None where that mode has no time)."""
    def rate(mode: str):
        return modes.get(mode, {}).get("tokens_per_s")
    for row in modes.values():
        if "tokens_per_s" in row:
            for key, mode in SPEEDUPS.items():
                base = rate(mode)
                row[key] = row["tokens_per_s"] / base if base else None


def _columns(lengths: list[int]) -> list[Column]:
    return [Column("mode", 17, left=True), Column("ms/token", 10), Column("p90", 8),
            Column("tokens/s", 10), Column("x loop", 8), Column("x comp", 8),
            Column("x eager", 8), *(Column(f"prefill {n}", 12) for n in lengths),
            Column("TB/s", 6), Column("% copy", 7), Column("differ", 11),
            Column("width", 7), Column("streams", 8), Column("conc", 6)]


def _row(mode: str, r: dict, lengths: list[int], shape: dict | None) -> list[str]:
    used = r.get("bandwidth") or {}
    rate, share = used.get("bytes_per_s"), used.get("of_copy")
    return [mode, f"{r['token_ms_median']:.3f}", f"{r['token_ms_p90']:.3f}",
            f"{r['tokens_per_s']:.0f}", _ratio(r.get("x_loop")), _ratio(r.get("x_compiled")),
            _ratio(r.get("x_eager")), *(f"{r['prefill_ms'][str(n)]:.2f}" for n in lengths),
            "" if rate is None else f"{rate / 1e12:.2f}",
            "" if share is None else f"{100 * share:.0f}%", _differ(r["mismatch"]),
            *((str(shape["dag_width"]), str(shape["streams"]), _ratio(shape["concurrency"]))
              if shape else ("", "", ""))]


def _header(info: dict) -> list[str]:
    """The case's title, and what its bandwidth columns are measured against."""
    short, long = timed_span(info["new_tokens"])
    lines = [f"{info['model']} ({info['dtype']}, batch {info['batch']}): "
             f"{info['new_tokens']} new tokens, (T{long} - T{short}) / {long - short} per "
             f"token, median of {info['rounds']} rounds; baseline: {BASELINE}"]
    needed, copy = info.get("bytes"), info.get("copy_bytes_per_s")
    if needed:
        lines.append(f"a decode step reads {needed['per_step'] / 1e9:.3f} GB: weights "
                     f"{needed['weights'] / 1e9:.3f} GB, keys and values "
                     f"{needed['kv_per_slot'] * needed['slots_read'] / 1e9:.4f} GB "
                     f"({needed['slots_read']:.1f} slots); device copy bandwidth "
                     + ("not measured" if not copy else f"{copy / 1e12:.2f} TB/s "
                        "(1 GiB device-to-device, read + write)"))
    if info.get("sdpa_backends"):
        lines.append("the Nimble rows' attention kernels: "
                     f"{', '.join(info['sdpa_backends'])} (--sdpa-backends)")
    if info.get("fused_projections") is not None:
        lines.append(f"every row's model: {info['fused_projections']} group(s) of sibling "
                     "projections fused into one GEMM each (--fuse-projections)")
    if info.get("decode_attention"):
        lines.append("every row's model: single-query attention on nimble::decode_attention "
                     "(--decode-attention)")
    for choice in info.get("fast_gemv") or ():
        lines.append(f"every row's model, --fast-gemv: {choice}")
    return lines


def format_result(info: dict) -> str:
    """One model, dtype and batch: a row per mode."""
    lengths = sorted(int(n) for n in info["prompt_lengths"])
    rows, failed = [], []
    for mode, r in info["modes"].items():
        if "error" in r:
            failed.append(f"{mode}: FAILED: {r['error']}")
            continue
        rows.append(_row(mode, r, lengths, info.get("decode_step", {}).get(mode)))
    legend = ("ms/token, p90: decode latency per token (a generation of N tokens less one of "
              "S tokens, over N-S); tokens/s: batch / ms per token; x loop, x comp, x eager: "
              f"tokens/s over {BASELINE}'s (the baseline), static+compile's, eager generate's; "
              "prefill N: ms of a one-token generation from N prompt tokens; TB/s: the bytes "
              "a decode step must read (weights once, the keys and values it attends to) per "
              "second of ms/token; % copy: that over the device's copy bandwidth; "
              "differ: sequences whose tokens differ from transformers' greedy "
              "tokens (static cache, eager kernels), (k tie): k of them first depart where "
              f"the reference's margin is at most {TIE_ULPS} units in the last place; width: "
              "the decode step's DAG width; streams: its streams; conc: its achieved "
              "concurrency (nm.trace())")
    out = [*_header(info), format_table(_columns(lengths), rows, legend), *failed]
    breakdown = _breakdown_text(info)
    if breakdown:
        out.append(breakdown)
    return "\n".join(out)


def _differ(mismatch: dict) -> str:
    """Differing sequences, with how many of them are near-tie flips."""
    n, ties = mismatch["sequences"], mismatch.get("near_ties", 0)
    return f"{n} ({ties} tie)" if ties else str(n)


def _ratio(value) -> str:
    return "" if value is None else f"{value:.2f}"


def run(args) -> int:
    """``nimble bench --generate [MODEL ...]``."""
    if args.training or args.profiler:
        raise Fail("bench: --generate times decoding; leave out --training and --profiler")
    names = args.models or DEFAULT_MODELS
    unknown = [n for n in names if n not in CAUSAL_LMS]
    if unknown:
        raise Fail(f"bench --generate: no causal LM {', '.join(unknown)}; there are "
                   f"{', '.join(CAUSAL_LMS)}")
    out = outputs(args, "json")
    require_gpu("bench --generate")
    batches = args.batches or [1, 8]
    cases = [Case(f"{name} ({dtype}, batch {batch})", {"model": name, "dtype": dtype,
                                                        "batch": batch},
                  lambda name=name, dtype=dtype, batch=batch:
                  bench_generate(name, args, dtype, batch))
             for name in names for dtype in args.dtypes for batch in batches]
    outcome = run_cases(cases, format_result, out.report)
    write_results(args, out, outcome, "bench --generate results", generate=True)
    return _status(outcome)


def _status(outcome: Outcome) -> int:
    """1 if a case or a mode failed, or Nimble on eager kernels departed from the reference
    other than at a near-tie."""
    for result in outcome.results:
        modes = result["modes"]
        if any("error" in row for row in modes.values()) or \
                wrong_sequences(modes[EXACT]["mismatch"]):
            return 1
    return 1 if outcome.failed else 0
