"""Per-task GPU time: every task timed alone, by events recorded between tasks in one graph.

A chain graph runs the tasks in recorded order, each between two event record nodes; one launch
then yields every task's duration (the time between its events), with no other task running
beside it.  An event record node costs a few microseconds of its own, as much as a small kernel,
so the same graph starts with empty event pairs whose median gap is subtracted.  (Repeating a task
to spread that cost is not safe: library kernels can wait on semaphores that a memset node before
them resets, and a repeat would wait forever.)  These are the *isolated* kernel times the
critical-path limit and the timeline export use.
"""
from __future__ import annotations

import statistics
from typing import Sequence

from .. import driver
from .build import add_task_node
from ..ir.taskgraph import TaskGraph

_EMPTY_PAIRS = 16  # event pairs with nothing between them: the cost of the events themselves


def measure_task_durations(graph: TaskGraph, recorded_nodes: Sequence, bases: Sequence[int],
                           stream, repeats: int = 5) -> list[float]:
    """Median over ``repeats`` launches of each task's isolated duration, in microseconds.

    The gap that two back-to-back event records measure by themselves is subtracted.

    The tasks run where ``bases`` puts their buffers (the recorded addresses, for a live
    recording), so the memory they touch must be valid.  One warm-up launch is not counted.
    """
    n = len(graph.tasks)
    pairs = n + _EMPTY_PAIRS
    events = [driver.Event.create(timing=True) for _ in range(2 * pairs)]
    owned = driver.Graph.create()
    try:
        ctx = driver.current_context()
        g = owned.handle
        deps: list = []
        for k in range(pairs):
            prev = driver.add_event_record_node(g, deps, events[2 * k].handle)
            if k >= _EMPTY_PAIRS:
                task = graph.tasks[k - _EMPTY_PAIRS]
                prev = add_task_node(g, task, recorded_nodes[task.id], bases, [prev], ctx)
            deps = [driver.add_event_record_node(g, [prev], events[2 * k + 1].handle)]
        exec_ = driver.GraphExec.instantiate(owned)
        try:
            samples: list[list[float]] = [[] for _ in range(pairs)]
            for round_ in range(repeats + 1):
                driver.launch(exec_.handle, stream)
                driver.stream_synchronize(stream)
                if round_ == 0:
                    continue
                for k in range(pairs):
                    ms = driver.event_elapsed_ms(events[2 * k].handle, events[2 * k + 1].handle)
                    samples[k].append(ms * 1e3)
            gap = statistics.median(x for s in samples[:_EMPTY_PAIRS] for x in s)
            return [max(statistics.median(s) - gap, 0.0) for s in samples[_EMPTY_PAIRS:]]
        finally:
            exec_.close()
    finally:
        owned.close()
        for e in events:
            e.close()


def time_recording(rec, repeats: int = 5) -> list[float]:
    """Time every task of a live recording alone and store it as the task's ``duration_us``.

    Runs on torch's current stream, with the buffers where the recording left them; returns the
    durations (µs) in task order.
    """
    import torch

    g = rec.graph
    stream = driver.stream(torch.cuda.current_stream().cuda_stream)
    durations = measure_task_durations(g, rec.nodes, [b.address for b in g.buffers], stream,
                                       repeats)
    for task, us in zip(g.tasks, durations):
        task.duration_us = us
    return durations
