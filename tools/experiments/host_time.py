"""Where the host time of a call goes: idle GPU against busy, whole call against bare driver calls.

    python3 tools/experiments/host_time.py resnet50,nasnetalarge,mobilenet_v2 [DTYPE]
        [--only-call [--fresh]]

For each model: a Nimble graph (multi-stream) and a ``torch.cuda.graph`` of it; for each step
(the whole ``nm(x)``, the launcher alone, a bare ``cuGraphLaunch`` of the same exec, the input-cell
write plus the launch, torch's replay) the host µs of one call with the GPU idle before it (median,
p10, p90 of 300) and of one call among 200 back-to-back ones, twice; then ``nm(x)`` idle with
Python's garbage collector off.  ``DTYPE`` (float32, float16, bfloat16; default float32)
converts model and input first; ``--only-call`` measures ``nm(x)`` idle only, three times, each
time in turn with a bare ``cuGraphLaunch`` of its exec (the machine's launch cost drifts between
rounds; sampled in turn, the difference is Nimble's own), once waiting for the stream before each
call (as a server waits for its previous call) and once for the whole device.  With ``--fresh``
those calls alternate between two input tensors, so every call writes the input cell (a server
handed a new tensor per request) instead of finding the address already there.
"""
import gc
import itertools
import sys
import time

import torch

import nimble
from nimble import driver
from nimble.cli import models
from nimble.cli.bench import bare_launch
from nimble.cli.harness import host_us_beside
from nimble.driver.gpu import use_cudnn_benchmark

use_cudnn_benchmark()

def idle(fn, n=300):
    t = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter(); fn(); t.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    t.sort()
    return f"med {t[n//2]*1e6:6.1f} p10 {t[n//10]*1e6:6.1f} p90 {t[9*n//10]*1e6:6.1f}"

def busy(fn, n=200):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    dt = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return f"{dt*1e6:6.1f}"

args = [a for a in sys.argv[1:] if not a.startswith("--")]
dtype = getattr(torch, args[1]) if len(args) > 1 else torch.float32
for name in args[0].split(","):
    model = models.create(name).cuda().to(dtype); x = models.example_input(name).to(dtype)
    nm = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(relaunches=2))
    if "--only-call" in sys.argv:
        next_input = itertools.cycle([x, x.clone()] if "--fresh" in sys.argv else [x]).__next__
        for rep in range(3):
            for device_sync in (False, True):
                call_us, bare_us = host_us_beside([lambda: nm(next_input()), bare_launch(nm)],
                                                  device_sync=device_sync)
                after = "device synchronize" if device_sync else "stream synchronize"
                print(f"{name} {dtype} r{rep} after a {after}: nm(x) idle median {call_us:.1f} "
                      f"µs, a bare cuGraphLaunch sampled beside it {bare_us:.1f} µs", flush=True)
        nm.close()
        continue
    st = nm.engine; L = st.launcher
    api = driver.CallPath(); stream = L.stream(); ex = st.built.exec.handle
    cell = L.slots[0].cell
    g = torch.cuda.CUDAGraph(); sx = x.clone()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        model(sx)
    torch.cuda.current_stream().wait_stream(s)
    with torch.no_grad(), torch.cuda.graph(g):
        model(sx)
    steps = {
        "nm(x)": lambda: nm(x),
        "launcher.run_flat": lambda: L.run_flat((x,)),
        "bare launch": lambda: api.launch(ex, stream),
        "write64+launch": lambda: (api.write64(stream, cell, x.data_ptr(), 0), api.launch(ex, stream)),
        "torch graph replay": g.replay,
    }
    for rep in range(2):
        for label, fn in steps.items():
            print(f"{name} r{rep} {label:20s} idle {idle(fn)}  busy {busy(fn)}", flush=True)
    gc.disable()
    print(f"{name} gc off  nm(x) idle {idle(lambda: nm(x))}", flush=True)
    gc.enable()
    nm.close()
