"""Synthetic TaskGraphs for tests and analysis benchmarks (no GPU, no PyTorch).

``branchy_graph`` imitates the shape of inception-style networks: stages that fork into parallel
branches of dependent ops and join again, each op a kernel that reads its inputs and writes one new
intermediate, some with an op-private scratch buffer.  ``random_graph`` draws arbitrary accesses to
a small pool of buffers, which gives every kind of hazard (RAW, WAR, WAW, partial overlaps).
"""
from __future__ import annotations

import random

from .alignment import align_up
from .taskgraph import Access, Buffer, BufferKind, Op, Task, TaskGraph, TaskKind, TensorRef


class _Builder:
    def __init__(self) -> None:
        self.g = TaskGraph(meta={"model": "synthetic"})
        self._next_address = 1 << 32

    def buffer(self, kind: str, size: int, op: int = -1, name: str = "") -> int:
        bid = len(self.g.buffers)
        self.g.buffers.append(Buffer(bid, kind, size, self._next_address, name or f"{kind}{bid}", op))
        self._next_address += align_up(size)
        return bid

    def task(self, op: int, accesses: list[Access], duration_us: float | None = None) -> int:
        tid = len(self.g.tasks)
        self.g.tasks.append(Task(tid, TaskKind.KERNEL, op=op, name=f"kernel_{tid}",
                                 short_name=f"kernel_{tid}", accesses=accesses,
                                 duration_us=duration_us))
        return tid

    def op(self, name: str, accesses: list[Access]) -> int:
        index = len(self.g.ops)
        self.g.ops.append(Op(index, name, f"m{index}", accesses))
        return index


def branchy_graph(stages: int = 4, branches: int = 4, depth: int = 3, scratch_every: int = 3,
                  size: int = 4096, seed: int = 0) -> TaskGraph:
    """A fork/join network: ``stages`` × (``branches`` chains of ``depth`` ops, then a concat)."""
    rng = random.Random(seed)
    b = _Builder()
    params = b.buffer(BufferKind.PARAM, size, name="weight")
    x = b.buffer(BufferKind.INPUT, size, name="input0")
    b.g.inputs.append(TensorRef(x, 0, [size // 4], [1], "float32"))
    current = x
    count = 0
    for s in range(stages):
        ends = []
        for _ in range(branches):
            src = current
            for _ in range(depth):
                op_reads = [Access(src, 0, size, False), Access(params, 0, size, False)]
                op = b.op("aten::conv", [])
                out = b.buffer(BufferKind.INTERMEDIATE, size, op=op)
                accesses = op_reads + [Access(out, 0, size, True)]
                b.g.ops[op].accesses = list(accesses)
                count += 1
                if scratch_every and count % scratch_every == 0:
                    ws = b.buffer(BufferKind.SCRATCH, size // 2, op=op, name=f"scratch:op{op}")
                    b.task(op, [Access(src, 0, size, False), Access(ws, 0, size // 2, True)],
                           rng.uniform(1, 20))
                    b.task(op, [Access(ws, 0, size // 2, True), Access(params, 0, size, False),
                                Access(out, 0, size, True)], rng.uniform(1, 20))
                else:
                    b.task(op, accesses, rng.uniform(1, 20))
                src = out
            ends.append(src)
        op = b.op("aten::cat", [])
        kind = BufferKind.OUTPUT if s == stages - 1 else BufferKind.INTERMEDIATE
        joined = b.buffer(kind, size * branches, op=op)
        accesses = [Access(e, 0, size, False) for e in ends]
        accesses += [Access(joined, i * size, size, True) for i in range(branches)]
        b.g.ops[op].accesses = list(accesses)
        b.task(op, accesses, rng.uniform(1, 20))
        current = joined
    b.g.outputs.append(TensorRef(current, 0, [size * branches // 4], [1], "float32"))
    b.g.validate()
    return b.g


def random_graph(n_tasks: int, n_buffers: int = 12, size: int = 1024, max_accesses: int = 3,
                 write_prob: float = 0.4, seed: int = 0) -> TaskGraph:
    """Tasks with random (possibly partial, overlapping) accesses to a pool of buffers."""
    rng = random.Random(seed)
    b = _Builder()
    kinds = [BufferKind.INTERMEDIATE, BufferKind.SCRATCH, BufferKind.PARAM]
    pool = [b.buffer(rng.choice(kinds), size) for _ in range(n_buffers)]
    for _ in range(n_tasks):
        accesses = []
        for _ in range(rng.randint(1, max_accesses)):
            buf = rng.choice(pool)
            start = rng.randrange(0, size, 64)
            length = rng.randrange(64, size - start + 1, 64) if size - start >= 64 else size - start
            write = b.g.buffers[buf].kind != BufferKind.PARAM and rng.random() < write_prob
            accesses.append(Access(buf, start, length, write))
        op = b.op("aten::random", list(accesses))
        b.task(op, accesses, rng.uniform(1, 10))
    b.g.validate()
    return b.g
