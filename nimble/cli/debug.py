"""``nimble debug``: prepare a model step by step and say which step breaks, with the evidence.

Records the model once, then prepares it in recorded order on one stream and with Nimble's
multi-stream schedule, each verified bit for bit against the recording with its old buffers
poisoned.  A failure in the single-stream build points at relocation (a pointer the recorder did
not find); a failure only with several streams points at a missing dependency.  With ``--trace``
the multi-stream graph is run once more with every task's start and end measured inside the run
(:mod:`nimble.debug.timeline`): the summary is printed and a Chrome/Perfetto trace written.
``--compare`` walks the ops for the first whose output differs from eager's, ``--nan`` for the
first that writes NaN or Inf (:mod:`nimble.debug.divergence`).

The report goes to stdout, or to stderr when ``--trace -`` or ``--save -`` takes stdout.
"""
from __future__ import annotations

import argparse
import json
from typing import TextIO

from .common import (add_batch_argument, add_quiet_argument, add_stream_cap_argument,
                     check_models, model_help, positive_int)
from . import models
from .output import Outputs, outputs
from ..driver.gpu import use_cudnn_benchmark


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help=model_help("the model to debug"))
    add_batch_argument(p, several=False, default="1")
    add_stream_cap_argument(p)
    p.add_argument("--relaunches", type=positive_int, default=100,
                   help="verified launches (default 100)")
    p.add_argument("--trace", metavar="FILE",
                   help="measure every task in a real multi-stream run; write the measured "
                        "Chrome trace to FILE ('-': stdout)")
    p.add_argument("--trace-groups", type=positive_int, default=1, metavar="K",
                   help="with --trace: spread the timestamps over K runs, each measuring a K-th "
                        "of the tasks (less disturbed runs; default 1)")
    p.add_argument("--save", metavar="FILE",
                   help="write the recorded TaskGraph ('-': stdout, as plain JSON)")
    p.add_argument("--compare", action="store_true",
                   help="find the first op whose output differs from eager's")
    p.add_argument("--nan", action="store_true",
                   help="find the first op that writes NaN or Inf (an infinity a padding or "
                   "mask op writes on purpose does not count)")
    add_quiet_argument(p)


def _divergences(nm, x, args, report: TextIO) -> int:
    """``--compare`` and ``--nan``: 1 if an op goes wrong."""
    status = 0
    for flag, nonfinite in (("compare", False), ("nan", True)):
        if getattr(args, flag):
            found = nm.first_divergence(x, nonfinite=nonfinite, quiet=args.quiet)
            print(f"--{flag}: " + (found.detail + f" (tasks {found.tasks[:8]})"
                                   if found else "no op goes wrong"), file=report)
            status |= found is not None
    return status


def _measured_trace(nm, args, out: Outputs) -> int:
    """``--trace``: the measured run's summary and trace; 1 if it broke a dependency."""
    from ..analysis.deps import build_dag
    from ..debug.timeline import format_timeline

    timeline = nm.trace(groups=args.trace_groups)
    print(format_timeline(timeline.summary()), end="", file=out.report)
    status = 0
    if args.trace_groups == 1:
        broken = timeline.overlapped(build_dag(nm.graph).edges())
        print(f"dependencies the run broke (a task started before one it depends on "
              f"ended): {len(broken)}" + (f", e.g. {broken[:4]}" if broken else ""),
              file=out.report)
        status = int(bool(broken))
    else:  # a task and its predecessor may come from different runs
        print("dependencies the run broke: not checked (--trace-groups joins several "
              "runs; use 1)", file=out.report)
    out.write("--trace", json.dumps(timeline.to_chrome()) + "\n", "measured Chrome trace")
    return status


def run(args) -> int:
    out = outputs(args, "trace", "save")
    check_models([args.model], "debug")
    import torch

    from ..analysis import report
    from ..errors import NimbleError
    from ..record.recorder import record
    from ..api import Nimble
    from ..engine.options import PrepareOptions

    use_cudnn_benchmark()
    model = models.create(args.model).cuda()
    x = models.example_input(args.model, args.batch)
    with torch.no_grad():
        rec = record(model, x, name=args.model, quiet=args.quiet)
    g = rec.graph
    print(report.format_summary(report.summarize(g)), end="", file=out.report)
    status = 0
    for label, multi in (("single stream (recorded order)", False), ("multi-stream", True)):
        nm = Nimble(model)
        try:
            nm.prepare(x, use_multi_stream=multi, max_streams=args.max_streams,
                       options=PrepareOptions(relaunches=args.relaunches, recording=rec,
                                              keep_recording=True))
        except NimbleError as e:
            status = 1
            print(f"{label}: FAILED: {type(e).__name__}: {e}", file=out.report)
            continue
        s = nm.schedule
        print(f"{label}: verified over {args.relaunches} launches; {len(s.streams)} streams, "
              f"{len(s.sync_edges)} syncs, arena {nm.memplan.arena_bytes / 2**20:.1f} MiB",
              file=out.report)
        if multi:
            status |= _divergences(nm, x, args, out.report)
            if args.trace:
                status |= _measured_trace(nm, args, out)
        nm.close()
    if args.save:
        out.write_taskgraph("--save", g)
    return status
