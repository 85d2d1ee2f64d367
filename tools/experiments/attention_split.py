"""The decode attention kernel read unsplit against split over programs, per cache length and
batch: what ``nimble.decode_attention.UNSPLIT_BLOCKS`` was chosen from (issue 53).

    python3 tools/experiments/attention_split.py --batches 1,8 --slots 128,192,256,384,576,1024,2048,4096

Per (batch, cache slots, live slots) the tool captures one CUDA graph of ``--layers`` calls of
the kernel, each over a cache of its own and, between two calls, a GEMV over a weight of its
own (``--between``: the MLP's down projection of a 1B Llama, 33.5 MB, so each call finds its
cache out of the L2 as a decode step does), and subtracts the same graph without the attention:
µs per call, median of ``--replays``.  A call's variants: ``unsplit`` (one program per sequence
and key-value head), ``split`` (the slots split until the call has about 132 programs, with the
second kernel that joins them), and ``splits=N`` for each ``--splits``; with ``--branchless``,
each again with the stretches the mask hides skipped by masked loads, not a branch (``bl``);
with ``--last-joins``, each split variant again with its parts joined by its last program
(``lj``); with ``--whole``, the cache read as one tile a program (``whole``:
``nimble.decode_attention.WHOLE_SLOTS``) where it has at most ``--whole`` slots.  "live" is the slots
the mask lets through (a static cache's slots past the position are skipped): the whole cache,
and ``--short`` slots of it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=_counts("batch sizes like 1,8"), default=[1, 8])
    p.add_argument("--slots", type=_counts("cache lengths like 128,576"),
                   default=[128, 192, 256, 384, 576, 768, 1024, 2048, 4096])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--short", type=int, default=129, help="live slots of the short case")
    p.add_argument("--splits", type=_counts("split counts like 2,4 ('' for none)", True),
                   default=[2, 4], help="fixed split counts also timed")
    p.add_argument("--between", default="2048x8192",
                   help="the weight read between two calls (OUTxIN), or 'none'")
    p.add_argument("--branchless", action="store_true",
                   help="also each variant with the hidden stretches skipped by masked loads "
                        "rather than a branch (nimble.decode_attention.BRANCHLESS)")
    p.add_argument("--last-joins", action="store_true",
                   help="also each split variant with its parts joined by its last program, "
                        "not a second kernel (nimble.decode_attention.LAST_JOINS)")
    p.add_argument("--whole", type=int, default=0, metavar="SLOTS",
                   help="also the cache read as one tile a program (the kernel's WHOLE form) "
                        "for caches of at most SLOTS slots")
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _counts(example: str, allow_none: bool = False):
    """An argument type: comma-separated positive ints (``example`` shows them in the error)."""
    from nimble.cli.common import positive_ints

    return lambda text: positive_ints(text, example, allow_none)


@dataclasses.dataclass(frozen=True)
class Form:
    """How one variant launches the kernel."""

    splits: int | None  # programs per (sequence, key-value head); None: the whole cache a tile
    branchless: bool = False  # hidden stretches skipped by masked loads, not a branch
    last_joins: bool = False  # a split's parts joined by its last program
    whole: bool = False  # the cache read as one tile a program (WHOLE_SLOTS)


def variants(batch: int, kv_heads: int, slots: int, fixed: list[int],
             branchless: bool = False, last_joins: bool = False, whole: int = 0) -> dict:
    """``{name: Form}`` of the variants timed for one shape: unsplit, the split rule's (every
    cache split), each fixed count; with ``branchless``, each again with masked loads for the
    hidden stretches (``... bl``); with ``last_joins``, each split one again joined by its
    last program (``... lj``); ``whole`` slots or fewer: the cache as one tile (``whole``)."""
    from nimble.decode_attention import split_for

    counts = {"unsplit": 1, "split": split_for(batch, kv_heads, slots, unsplit_blocks=0).splits}
    for n in fixed:
        counts[f"splits={n}"] = n
    out = {name: Form(n) for name, n in counts.items()}
    if branchless:
        out.update({f"{name} bl": Form(n, branchless=True) for name, n in counts.items()})
    if last_joins:
        out.update({f"{name} lj": Form(n, last_joins=True) for name, n in counts.items()
                    if n > 1})
    if 0 < slots <= whole:
        out["whole"] = Form(None, whole=True)
    return out


def best_unsplit_blocks(rows: list[dict], block: int) -> int:
    """The most blocks of slots at which the unsplit kernel, over the whole cache live, was no
    slower than the split one for every batch measured, counting up from the shortest cache (0:
    split wins at the shortest)."""
    by_slots: dict = {}
    for r in rows:
        if r["live"] == r["slots"]:
            by_slots.setdefault(r["slots"], []).append(r["us"]["unsplit"] <= r["us"]["split"])
    best = 0
    for slots in sorted(by_slots):
        if not all(by_slots[slots]):
            break
        best = -(-slots // block)
    return best


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    from unittest import mock

    import nimble.decode_attention as da
    from nimble.decode_attention import BLOCK_SLOTS, launch
    from nimble.fast_gemv import GemvConfig, launch_gemv

    dtype = getattr(torch, args.dtype)
    dev = "cuda"
    weight = None
    if args.between != "none":
        n, k = (int(v) for v in args.between.lower().split("x"))
        weight = [torch.randn(n, k, device=dev, dtype=dtype) for _ in range(args.layers)]
        x = torch.randn(k, device=dev, dtype=dtype)
    gemv = GemvConfig(4, 1024, 8, 1)

    def timed(calls) -> float:
        """µs of one replay of a graph of ``calls``, median of the replays."""
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            calls()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            calls()
        graph.replay()
        times = []
        for _ in range(args.replays):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    def between(i):
        if weight is not None:
            launch_gemv(x, weight[i], gemv)

    floor = timed(lambda: [between(i) for i in range(args.layers)])
    print(f"{torch.cuda.get_device_name()}: {args.layers} calls, between them "
          f"{args.between} ({floor / args.layers:.2f} µs each, subtracted)", flush=True)
    rows = []
    scale = args.head_dim ** -0.5
    for batch in args.batches:
        for slots in args.slots:
            torch.manual_seed(slots)
            q = [torch.randn(batch, args.heads, 1, args.head_dim, device=dev, dtype=dtype)
                 for _ in range(args.layers)]
            kv = [[torch.randn(batch, args.kv_heads, slots, args.head_dim, device=dev,
                               dtype=dtype) for _ in range(2)] for _ in range(args.layers)]
            for live in sorted({slots, min(slots, args.short)}, reverse=True):
                keep = (torch.arange(slots, device=dev) < live).view(1, 1, 1, slots).expand(
                    batch, 1, 1, slots).contiguous()
                plan = variants(batch, args.kv_heads, slots, args.splits, args.branchless,
                                args.last_joins, args.whole)
                outs, us = {}, {}
                for name, form in plan.items():
                    def calls(form=form, name=name):
                        with mock.patch.object(da, "WHOLE_SLOTS",
                                               slots if form.whole else 0):
                            for i in range(args.layers):
                                outs[name] = launch(q[i], kv[i][0], kv[i][1], keep, scale,
                                                    form.splits, form.branchless,
                                                    form.last_joins)
                                between(i)
                    us[name] = round((timed(calls) - floor) / args.layers, 2)
                ref = outs["unsplit"].float()
                worst = max(float((o.float() - ref).abs().max()) for o in outs.values())
                row = {"batch": batch, "slots": slots, "live": live, "us": us,
                       "splits": {n: v.splits for n, v in plan.items()},
                       "max_difference": worst}
                rows.append(row)
                cells = "  ".join(f"{n} {v:6.2f}" for n, v in us.items())
                print(f"batch {batch:3d} slots {slots:5d} live {live:5d}  {cells}  "
                      f"(split {plan['split'].splits}, max |diff| {worst:.1e})", flush=True)
    pick = best_unsplit_blocks(rows, BLOCK_SLOTS)
    print(f"unsplit no slower up to {pick} blocks of {BLOCK_SLOTS} slots "
          f"({pick * BLOCK_SLOTS} slots), every batch, the whole cache live")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "unsplit_blocks": pick}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
