"""``nimble record``: record a built-in or zoo model's GPU work into a TaskGraph file."""
from __future__ import annotations

import argparse

from . import models
from .common import (add_batch_argument, add_quiet_argument, check_models, model_help,
                     positive_int)
from .output import outputs
from ..driver.gpu import use_cudnn_benchmark
from ..errors import InputError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help=model_help("the model to record"))
    p.add_argument("-o", "--output", metavar="FILE", default=None,
                   help="where to write the TaskGraph (default MODEL.json.gz; '-': stdout, "
                        "as plain JSON)")
    add_batch_argument(p, several=False, default="1")
    p.add_argument("--time-tasks", action="store_true",
                   help="also time every task alone and store duration_us")
    p.add_argument("--training", action="store_true",
                   help="record a training step (forward and backward, two phases) of the model "
                        "in train() mode")
    p.add_argument("--side", type=positive_int, default=None,
                   help="image side of the input (default: the model's usual one; 32 for CIFAR)")
    p.add_argument("--classes", type=positive_int, default=None,
                   help="classifier size of a zoo model (default: its own; 10 for CIFAR-10)")
    add_quiet_argument(p)


def run(args) -> int:
    args.output = args.output or f"{args.model}.json.gz"
    out = outputs(args, "output")
    if args.training and args.time_tasks:
        raise InputError("--time-tasks times inference recordings only; drop it with --training")
    check_models([args.model], "record")
    import torch

    from ..record.recorder import record, record_step
    from ..engine.task_timing import time_recording

    use_cudnn_benchmark()
    model = models.create(args.model, num_classes=args.classes).cuda()
    x = models.example_input(args.model, args.batch, side=args.side)
    if args.training:
        rec = record_step(model.train(), x, name=args.model, quiet=args.quiet)
    else:
        with torch.no_grad():
            rec = record(model, x, name=args.model, quiet=args.quiet)
    g = rec.graph
    if args.time_tasks:
        time_recording(rec)
    out.write_taskgraph("--output", g)
    return 0
