"""Two recordings of one model side by side: the kernels only one of them runs, and the kernel
words each took for pointers differently (no GPU).

    python3 tools/recording_diff.py A.json.gz B.json.gz [--json F]

For a recording whose rebuilt graph faulted (``nimble.GraphFaultError`` saves it to
``$NIMBLE_FAULT_DIR``) against one of the same model that proved: cuDNN's autotuning picks
kernels anew in each process, so a kernel only the faulting recording runs is a suspect; so is a
kernel both run whose parameter words were resolved differently (a word relocated as a pointer in
one recording and kept as an integer in the other, at the same byte offset). Also compared: the
recording's pointer evidence (the twin capture, or the value rules alone), the words it ruled no
pointers, the buffers placed to keep their low 32 bits, and the pool's lowest address (where
integers can look like pointers).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from dataclasses import dataclass, field

from nimble.ir.taskgraph import TaskGraph, TaskKind


@dataclass
class KernelWords:
    """One kernel's parameter words in one recording, over all its tasks."""

    short: str = ""  # the name shown
    tasks: int = 0
    pointers: set[int] = field(default_factory=set)  # byte offsets relocated as pointers
    not_pointers: set[int] = field(default_factory=set)  # offsets ruled no pointers
    params: bytes = b""  # the first task's parameter block, to show a word's value


def kernel_words(graph: TaskGraph) -> dict[str, KernelWords]:
    """Per kernel name, its tasks and which parameter offsets were taken for what."""
    ruled_out = collections.defaultdict(set)
    for task, offset, _ in graph.meta.get("not_pointer_words", []):
        ruled_out[task].add(offset)
    out: dict[str, KernelWords] = collections.defaultdict(KernelWords)
    for t in graph.tasks:
        if t.kind != TaskKind.KERNEL:
            continue
        words = out[t.name]
        words.short = t.short_name or t.name
        words.params = words.params or bytes(t.params or b"")
        words.tasks += 1
        words.pointers.update(p.location for p in t.pointers if isinstance(p.location, int))
        words.not_pointers.update(ruled_out.get(t.id, ()))
    return dict(out)


def word(params: bytes, offset: int) -> str:
    """The 8-byte word at ``offset`` in hex ("-" past the block)."""
    chunk = params[offset:offset + 8]
    return hex(int.from_bytes(chunk, "little")) if len(chunk) == 8 else "-"


def evidence(graph: TaskGraph) -> dict:
    """What the recording's pointer resolution rested on."""
    meta = graph.meta
    pool = [a for a, _ in meta.get("pool_segments", [])]
    return {"tasks": len(graph.tasks), "pointer_evidence": meta.get("pointer_evidence"),
            "words_not_pointers": len(meta.get("not_pointer_words", [])),
            "low_word_buffers": len(meta.get("low_word_buffers", [])),
            "stale_pool_words": meta.get("stale_pool_words"),
            "twin_unmoved_words": meta.get("twin_unmoved_words"),
            "padded_words_in_external": meta.get("padded_words_in_external"),
            "unaligned_words_in_external": meta.get("unaligned_words_in_external"),
            "lowest_pool_address": hex(min(pool)) if pool else None}


def _taken(words: KernelWords, offset: int) -> str:
    """How one recording took the word at ``offset``, with its first task's value."""
    how = ("pointer" if offset in words.pointers else
           "ruled no pointer" if offset in words.not_pointers else "integer")
    return f"{how} {word(words.params, offset)}"


def compare(a: TaskGraph, b: TaskGraph) -> dict:
    """The kernels each recording alone runs (with task counts), and for kernels both run the
    byte offsets taken for pointers (or ruled no pointers) in one and not the other, each with
    how either recording took it and its value there."""
    wa, wb = kernel_words(a), kernel_words(b)
    only = {}
    for side, mine, other in (("a", wa, wb), ("b", wb, wa)):
        counts: collections.Counter = collections.Counter()
        for name, words in mine.items():
            if name not in other:
                counts[words.short] += words.tasks  # template instances may share a short name
        only[side] = dict(counts)
    differ = {}
    for name in sorted(set(wa) & set(wb)):
        x, y = wa[name], wb[name]
        offsets = sorted((x.pointers ^ y.pointers) | (x.not_pointers ^ y.not_pointers))
        if offsets:
            differ[f"{x.short} [{name[-40:]}]"] = {
                str(off): {"a": _taken(x, off), "b": _taken(y, off)} for off in offsets}
    return {"a": evidence(a), "b": evidence(b), "only": only, "words_differ": differ}


def report(result: dict, a_name: str, b_name: str) -> str:
    lines = [f"a: {a_name}", f"   {json.dumps(result['a'])}",
             f"b: {b_name}", f"   {json.dumps(result['b'])}"]
    for side in ("a", "b"):
        kernels = result["only"][side]
        lines.append(f"kernels only {side} runs: {len(kernels)}")
        lines += [f"  {count:4d} x {name[:110]}" for name, count in
                  sorted(kernels.items(), key=lambda kv: (-kv[1], kv[0]))]
    lines.append(f"kernels both run whose words were resolved differently: "
                 f"{len(result['words_differ'])}")
    for name, offsets in result["words_differ"].items():
        lines.append(f"  {name}")
        lines += [f"    byte {off}: a {how['a']}; b {how['b']}" for off, how in offsets.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--json")
    args = p.parse_args(argv)
    result = compare(TaskGraph.load(args.a), TaskGraph.load(args.b))
    print(report(result, args.a, args.b))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
