"""``nimble debug``: prepare a model step by step and say which step breaks, with the evidence.

Records the model once, then prepares it in recorded order on one stream and with Nimble's
multi-stream schedule, each verified bit for bit against the recording with its old buffers
poisoned.  A failure in the single-stream build points at relocation (a pointer the recorder did
not find); a failure only with several streams points at a missing dependency.  With ``--trace``
the multi-stream graph is run once more with every task's start and end measured inside the run
(:mod:`nimble.debug.timeline`): the summary is printed and a Chrome/Perfetto trace written.
``--compare`` walks the ops for the first whose output differs from eager's, ``--nan`` for the
first that writes NaN or Inf (:mod:`nimble.debug.divergence`).
"""
from __future__ import annotations

import argparse
import json
import sys

from . import models
from .common import check_models, positive_int, require_gpu
from ..driver.gpu import use_cudnn_benchmark


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help=f"{models.BUILTIN}, {models.CHAINS} or a zoo model")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--max-streams", type=int, default=None, metavar="K", help="stream cap")
    p.add_argument("--relaunches", type=int, default=100, help="verified launches (default 100)")
    p.add_argument("--trace", metavar="FILE",
                   help="measure every task in a real multi-stream run; write a Chrome trace")
    p.add_argument("--trace-groups", type=positive_int, default=1, metavar="K",
                   help="with --trace: spread the timestamps over K runs, each measuring a K-th "
                        "of the tasks (less disturbed runs; default 1)")
    p.add_argument("--save", metavar="FILE", help="write the recorded TaskGraph")
    p.add_argument("--compare", action="store_true",
                   help="find the first op whose output differs from eager's")
    p.add_argument("--nan", action="store_true",
                   help="find the first op that writes NaN or Inf (an infinity a padding or "
                   "mask op writes on purpose does not count)")


def run(args) -> int:
    check_models([args.model])
    require_gpu("debug")
    import torch

    from ..analysis import report
    from ..analysis.deps import build_dag
    from ..errors import NimbleError
    from ..record.recorder import record
    from ..api import Nimble
    from ..debug.timeline import format_timeline

    use_cudnn_benchmark()
    model = models.create(args.model).cuda()
    x = models.example_input(args.model, args.batch)
    with torch.no_grad():
        rec = record(model, x, name=args.model, quiet=False)
    g = rec.graph
    print(report.format_summary(report.summarize(g)), end="")
    status = 0
    for label, multi in (("single stream (recorded order)", False), ("multi-stream", True)):
        nm = Nimble(model)
        try:
            nm.prepare(x, use_multi_stream=multi, max_streams=args.max_streams,
                       relaunches=args.relaunches, recording=rec, keep_recording=True)
        except NimbleError as e:
            status = 1
            print(f"{label}: FAILED: {type(e).__name__}: {e}")
            continue
        s = nm.schedule
        print(f"{label}: verified over {args.relaunches} launches; {len(s.streams)} streams, "
              f"{len(s.sync_edges)} syncs, arena {nm.memplan.arena_bytes / 2**20:.1f} MiB")
        if multi and (args.compare or args.nan):
            for flag, nonfinite in (("compare", False), ("nan", True)):
                if getattr(args, flag):
                    found = nm.first_divergence(x, nonfinite=nonfinite)
                    print(f"--{flag}: " + (found.detail + f" (tasks {found.tasks[:8]})"
                                           if found else "no op goes wrong"))
                    status |= found is not None
        if multi and args.trace:
            timeline = nm.trace(groups=args.trace_groups)
            print(format_timeline(timeline.summary()), end="")
            if args.trace_groups == 1:
                broken = timeline.overlapped(build_dag(nm.graph).edges())
                print(f"dependencies the run broke (a task started before one it depends on "
                      f"ended): {len(broken)}" + (f", e.g. {broken[:4]}" if broken else ""))
                status |= bool(broken)
            else:  # a task and its predecessor may come from different runs
                print("dependencies the run broke: not checked (--trace-groups joins several "
                      "runs; use 1)")
            with open(args.trace, "w", encoding="utf-8") as f:
                json.dump(timeline.to_chrome(), f)
            print(f"wrote {args.trace}", file=sys.stderr)
        nm.close()
    if args.save:
        g.save(args.save)
    return status
