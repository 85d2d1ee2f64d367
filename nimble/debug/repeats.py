"""The block of tasks a step repeats (a decoder's layers, a network's stages): one row per place
in the block, with what each place costs across the repeats.

A step recorded from a model with repeated layers launches the same sequence of kernels once per
layer.  :func:`find_repeated_block` finds that sequence from the task names alone (no knowledge
of any model): the period under which the longest stretch of tasks repeats, at least
:data:`MIN_REPEATS` times.  :func:`repeated_block` then reads a measured timeline over it: per
place, the kernel's median time, the median wait before it (its start less the end of the
predecessor it waited for last), and the bytes it names where the recording says; and the
median time one block takes.  A layer's anatomy is then a dozen rows, where the whole step is
hundreds: which kernel of the layer runs below the memory's rate, and which wait recurs.
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

#: The fewest repeats a block needs to be reported.
MIN_REPEATS = 3
#: The least share of the step's tasks the repeats must cover: a short run of repeats in a
#: step without layers is chance, not structure.
MIN_SHARE = 0.2
#: The longest block looked for: past it the search's time grows with the step's square.
MAX_LENGTH = 1024


@dataclass(frozen=True)
class BlockSpan:
    """Where a block repeats: ``count`` blocks of ``length`` tasks from task ``first``."""

    first: int
    length: int
    count: int

    def task(self, block: int, place: int) -> int:
        return self.first + block * self.length + place

    @property
    def tasks(self) -> int:
        return self.length * self.count


@dataclass(frozen=True)
class BlockPlace:
    """One place of the repeated block, over every repeat."""

    place: int
    name: str
    median_us: float
    median_wait_us: float | None  # None: no repeat of this place waited on a predecessor
    max_wait_us: float | None
    bytes: int | None  # the bytes its accesses name (the first repeat's); None: not recorded

    @property
    def bytes_per_s(self) -> float | None:
        if self.bytes is None or self.median_us <= 0:
            return None
        return self.bytes / (self.median_us / 1e6)


@dataclass(frozen=True)
class RepeatedBlock:
    """A step's repeated block and what each of its places costs."""

    span: BlockSpan
    block_us: float  # median of a block's first start to the next block's first start
    places: list[BlockPlace]

    @property
    def waits_us(self) -> float:
        """The median waits of a block's places, summed: what one block spends waiting."""
        return sum(p.median_wait_us for p in self.places if p.median_wait_us is not None)

    def summary(self) -> dict:
        s = self.span
        return {"first_task": s.first, "length": s.length, "count": s.count,
                "block_us": self.block_us, "waits_us": self.waits_us,
                "places": [{"place": p.place, "name": p.name, "median_us": p.median_us,
                            "median_wait_us": p.median_wait_us, "max_wait_us": p.max_wait_us,
                            "bytes": p.bytes, "bytes_per_s": p.bytes_per_s}
                           for p in self.places]}


def task_label(task) -> str:
    """What a block's place is called: a kernel's short name (or name), else the task's kind
    (a memset, a copy), as a trace names it."""
    return task.short_name or task.name or task.kind


def find_repeated_block(names: Sequence[str], min_repeats: int = MIN_REPEATS
                        ) -> BlockSpan | None:
    """The block of consecutive names that repeats back to back over the most tasks (whole
    blocks counted; the shortest such block where several cover as many), repeated at least
    ``min_repeats`` times over at least :data:`MIN_SHARE` of the names; None where no block
    is."""
    n = len(names)
    if n < 2 * min_repeats:
        return None
    _, codes = np.unique(np.asarray(list(names), dtype=object).astype(str), return_inverse=True)
    best: BlockSpan | None = None
    for length in range(1, min(n // min_repeats, MAX_LENGTH) + 1):
        same = np.concatenate(([False], codes[:-length] == codes[length:], [False]))
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        if not len(edges):
            continue
        starts, ends = edges[0::2], edges[1::2]
        runs = ends - starts  # i with names[i] == names[i + length], run by run
        k = int(np.argmax(runs))
        count = (int(runs[k]) + length) // length
        if count >= min_repeats and (best is None or count * length > best.tasks):
            best = BlockSpan(int(starts[k]), length, count)
    return best if best is not None and best.tasks >= MIN_SHARE * n else None


def repeated_block(names: Sequence[str], times: Sequence[tuple[float, float]],
                   last: dict[int, int], bytes_of: Callable[[int], int] | None = None,
                   span: BlockSpan | None = None) -> RepeatedBlock | None:
    """The repeated block of a measured run: ``names`` and ``times`` (start, end µs) per task,
    ``last`` the predecessor each task waited for last (task to task), ``bytes_of`` a task's
    bytes where the recording names them; ``span`` found from the names when not given.  None
    where no block repeats."""
    span = span or find_repeated_block(names)
    if span is None:
        return None
    places = []
    for j in range(span.length):
        tasks = [span.task(b, j) for b in range(span.count)]
        waits = [times[t][0] - times[last[t]][1] for t in tasks if t in last]
        places.append(BlockPlace(
            j, names[tasks[0]], statistics.median(times[t][1] - times[t][0] for t in tasks),
            statistics.median(waits) if waits else None, max(waits) if waits else None,
            bytes_of(tasks[0]) if bytes_of is not None else None))
    firsts = [min(times[span.task(b, j)][0] for j in range(span.length))
              for b in range(span.count)]
    block_us = statistics.median(b - a for a, b in zip(firsts, firsts[1:]))
    return RepeatedBlock(span, block_us, places)


def phase_block(span: range, labels: Sequence[str], times: Sequence[tuple[float, float]],
                last: dict[int, int], bytes_of: Callable[[int], int | None] | None = None
                ) -> RepeatedBlock | None:
    """:func:`repeated_block` over the tasks of ``span`` (a phase), every id absolute: the
    phase's ``labels``, the whole step's ``times`` and ``last`` (task to the predecessor it
    waited for last), ``bytes_of`` a task's bytes; the block's first task an id of the step."""
    start = span.start
    block = repeated_block(labels, [times[t] for t in span],
                           {v - start: u - start for v, u in last.items()},
                           None if bytes_of is None else lambda k: bytes_of(start + k))
    if block is None:
        return None
    return dataclasses.replace(block, span=dataclasses.replace(block.span,
                                                               first=block.span.first + start))


def format_repeated_block(block: dict, copy_bytes_per_s: float | None = None,
                          indent: str = "  ") -> str:
    """The text of a :meth:`RepeatedBlock.summary`: a line for the block, a row per place."""
    lines = [f"{indent}a block of {block['length']} tasks repeats {block['count']} times from "
             f"task {block['first_task']}: {block['block_us']:.1f} µs a block (median), "
             f"{block['waits_us']:.1f} µs of it waits",
             f"{indent}  place  median µs  wait µs (max)   MB    rate        kernel"]
    for p in block["places"]:
        wait = "-" if p["median_wait_us"] is None else \
            f"{p['median_wait_us']:.2f} ({p['max_wait_us']:.2f})"
        mb = "-" if p["bytes"] is None else f"{p['bytes'] / 1e6:.2f}"
        rate = "-"
        if p["bytes_per_s"] is not None:
            rate = f"{p['bytes_per_s'] / 1e9:.0f} GB/s"
            if copy_bytes_per_s:
                rate += f" {100 * p['bytes_per_s'] / copy_bytes_per_s:.0f}%"
        lines.append(f"{indent}  {p['place']:5d}  {p['median_us']:9.2f}  {wait:>13}  {mb:>6}  "
                     f"{rate:<11} {p['name'][:60]}")
    return "\n".join(lines) + "\n"
