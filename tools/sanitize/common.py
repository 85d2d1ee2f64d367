"""What the sanitizer's driver scripts share: the checkout on the path, their one option, and
the prepare options that keep a run under the sanitizer short.

Under ``compute-sanitizer`` every kernel runs 10-100x slower, so the proof runs 2 launches
instead of 100 and the race fuzzer is off (``PrepareOptions(relaunches=2, fuzz=False)``); every
other step of ``prepare`` (recording, twin capture, per-task timing, build, the proof's poisoned
launches) runs as it does by default.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse(description: str) -> argparse.Namespace:
    """The scripts' one option: ``--host-launch`` prepares plain host-launch graphs
    (``device_launch=False``), to tell a report of device-launchable graphs from the rest."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--host-launch", action="store_true",
                   help="prepare with PrepareOptions(device_launch=False)")
    return p.parse_args()


def short_options(args: argparse.Namespace, **extra):
    """The prepare options of a run under the sanitizer (see the module's docstring)."""
    import nimble

    return nimble.PrepareOptions(relaunches=2, fuzz=False,
                                 device_launch=not args.host_launch, **extra)


def finish(what: str) -> None:
    """Wait for the GPU, so that a fault is reported inside the run, and say it ended."""
    import torch

    torch.cuda.synchronize()
    print(f"{what}: done", flush=True)


def prepare_and_call(model, x, args: argparse.Namespace, what: str, calls: int = 5) -> None:
    """Prepare ``model`` on ``x`` with :func:`short_options`, call it ``calls`` times on fresh
    inputs, wait for the GPU and close it."""
    import torch

    import nimble

    nm = nimble.Nimble(model).prepare(x, options=short_options(args))
    for _ in range(calls):
        nm(torch.randn_like(x))
    finish(f"{what}, {nm.launch_mode}: prepare and {calls} calls")
    nm.close()
