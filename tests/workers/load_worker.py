"""Loads a saved graph in a fresh process and runs it: what a serving worker does at start.

``python load_worker.py SAVED INPUTS OUT [--model NAME --dtype DTYPE --state STATE]``: loads
``SAVED`` (reading the weights of the zoo model NAME, with the ``torch.save``d state dict STATE,
by name when given, else the file's), runs it on each input of ``INPUTS`` (a ``torch.save``d
list of tensors; ``-``: three random ones of the graph's shapes), and writes the outputs to
``OUT`` with the seconds from the start of the load to the end of the first call and the
load's stages.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import nimble


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("saved")
    parser.add_argument("inputs")
    parser.add_argument("out")
    parser.add_argument("--model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--state")
    args = parser.parse_args()
    inputs = None if args.inputs == "-" else [x.cuda() for x in torch.load(args.inputs)]
    model = None
    if args.model:
        from nimble.cli import models

        model = models.create(args.model).cuda().to(getattr(torch, args.dtype)).eval()
        model.load_state_dict(torch.load(args.state))
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the context, which the load-time figure leaves out
    torch.cuda.synchronize()
    began = time.perf_counter()
    nm = nimble.load(args.saved, model=model)
    if inputs is None:
        slot = nm.engine.launcher.slots[0]
        inputs = [torch.randn(slot.shape, device="cuda").to(slot.dtype) for _ in range(3)]
    first = nm(inputs[0])
    torch.cuda.synchronize()
    load_to_first_call = time.perf_counter() - began
    outputs = [first.clone()] + [nm(x).clone() for x in inputs[1:]]
    torch.save({"outputs": [o.cpu() for o in outputs],
                "seconds": load_to_first_call,
                "report": nm.prepare_report.buckets[0].seconds}, args.out)
    print(json.dumps({"load_to_first_call_s": round(load_to_first_call, 4),
                      "stages": {k: round(v, 4) for k, v in
                                 nm.prepare_report.buckets[0].seconds.items()},
                      "launch_mode": nm.launch_mode}))


if __name__ == "__main__":
    main()
