"""Where a call's host time goes: the driver's graph launch against graph shape, and each Python step.

    python3 tools/experiments/launch_cost.py [MODEL ...] [--json FILE]

For every model: one recording, then Nimble graphs at several stream caps, each instantiated with
several flag sets, and variants with a single root / single sink added.  For each: median host µs
of a bare ``cuGraphLaunch`` on an idle GPU, host µs per launch when launches queue back to back,
and GPU ms per launch.  Then the host cost of each step of ``Nimble.__call__``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nimble import driver  # noqa: E402
from nimble.cli import models  # noqa: E402
from nimble.cli.harness import host_us  # noqa: E402
from nimble.driver.gpu import use_cudnn_benchmark  # noqa: E402


def idle_host_us(fn) -> float:
    """Median host µs of one call of ``fn`` with the GPU idle before it (the bench's measure)."""
    return host_us(fn, calls=200)


def busy_host_us(fn, calls: int = 50, rounds: int = 7) -> float:
    import torch

    per = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls)
    torch.cuda.synchronize()
    return statistics.median(per) * 1e6


def gpu_ms(fn, calls: int = 100, rounds: int = 5) -> float:
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        fn()
    per = []
    for _ in range(rounds):
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b) / calls)
    return statistics.median(per)


def roots_and_leaves(graph) -> tuple[list, list]:
    drv = driver.bindings()
    _, count = driver.call("cuGraphGetNodes", graph, 0)
    nodes, _ = driver.call("cuGraphGetNodes", graph, count)
    _, _, _, n_edges = driver.call("cuGraphGetEdges", graph, 0)
    src, dst, _, _ = driver.call("cuGraphGetEdges", graph, n_edges)
    has_in = {int(d) for d in dst}
    has_out = {int(s) for s in src}
    del drv
    return ([n for n in nodes if int(n) not in has_in], [n for n in nodes if int(n) not in has_out])


def funnel_clone(graph, root: bool, sink: bool):
    """A clone of ``graph`` with one empty node before all roots and/or after all leaves."""
    clone = driver.Graph(driver.call("cuGraphClone", graph))
    roots, leaves = roots_and_leaves(clone.handle)
    if root:
        first = driver.call("cuGraphAddEmptyNode", clone.handle, [], 0)
        driver.call("cuGraphAddDependencies", clone.handle, [first] * len(roots), roots, None,
                    len(roots))
    if sink:
        driver.call("cuGraphAddEmptyNode", clone.handle, leaves, len(leaves))
    return clone


def measure(label: str, fn, extra: dict | None = None) -> dict:
    """GPU ms, idle host µs and back-to-back host µs of ``fn``, printed and returned as a row."""
    row = {"variant": label, **(extra or {}),
           "gpu_ms": gpu_ms(fn), "idle_host_us": idle_host_us(fn), "busy_host_us": busy_host_us(fn)}
    print(f"  {label:44s} gpu {row['gpu_ms']:.3f} ms  idle host {row['idle_host_us']:6.1f} µs  "
          f"busy host {row['busy_host_us']:6.1f} µs", flush=True)
    return row


def measure_exec(label: str, exec_handle, stream, extra: dict) -> dict:
    launch = driver.bindings().cuGraphLaunch
    return measure(label, lambda: launch(exec_handle, stream), extra)


def model_rows(name: str) -> list[dict]:
    import torch

    import nimble

    use_cudnn_benchmark()
    model = models.create(name).cuda()
    x = models.example_input(name)
    drv = driver.bindings()
    stream_obj = torch.cuda.Stream()
    stream = drv.CUstream(stream_obj.cuda_stream)
    rows = []
    print(f"{name}", flush=True)
    with torch.cuda.stream(stream_obj):
        static_x = x.clone()
        with torch.no_grad():
            for _ in range(3):
                model(static_x)
        tg = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(tg):
            model(static_x)
        rows.append(measure("torch.cuda.graph replay()", tg.replay))
        raw_exec = getattr(tg, "raw_cuda_graph_exec", None)
        if raw_exec is not None:
            rows.append(measure_exec("torch graph exec, bare cuGraphLaunch",
                                     drv.CUgraphExec(raw_exec()), stream, {}))

        multi = nimble.Nimble(model).prepare(
            x, options=nimble.PrepareOptions(keep_recording=True, arena_limit=None))
        rec = multi.recording
        full = len(multi.schedule.streams)
        caps = sorted({1, 2, 4, 8, full} - {k for k in (8, 4) if k >= full})
        flag_sets = {
            "0": 0,
            "UPLOAD": int(drv.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD),
            "DEVICE_LAUNCH":
                int(drv.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH),
            "NODE_PRIORITY":
                int(drv.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY),
        }
        for k in caps:
            nm = multi if k == full else nimble.Nimble(model).prepare(
                x, max_streams=k,
                options=nimble.PrepareOptions(arena_limit=None, recording=rec, relaunches=10))
            built = nm.engine.built
            roots, leaves = roots_and_leaves(built.graph.handle)
            info = {"streams": len(nm.schedule.streams), "syncs": len(nm.schedule.sync_edges),
                    "roots": len(roots), "leaves": len(leaves), "flags": "0"}
            rows.append(measure_exec(
                f"k={k}: {info['streams']} streams {info['syncs']} syncs {len(roots)} roots "
                f"{len(leaves)} leaves", built.exec.handle, stream, info))
            for flag_name, flags in flag_sets.items():
                if flag_name == "0":
                    continue
                try:
                    params = drv.CUDA_GRAPH_INSTANTIATE_PARAMS()
                    params.flags = flags
                    params.hUploadStream = stream
                    ex = driver.GraphExec(driver.call(
                        "cuGraphInstantiateWithParams", built.graph.handle, params))
                    if flag_name == "DEVICE_LAUNCH":
                        driver.call("cuGraphUpload", ex.handle, stream)
                except Exception as e:  # noqa: BLE001 - a variant the driver refuses is a finding
                    print(f"  k={k} flags {flag_name}: {e}", flush=True)
                    rows.append({"variant": f"k={k} {flag_name}", "error": str(e)})
                    continue
                rows.append(measure_exec(f"k={k} flags {flag_name}", ex.handle, stream,
                                         {**info, "flags": flag_name}))
                ex.close()
            for root, sink in ((True, False), (False, True), (True, True)):
                g = funnel_clone(built.graph.handle, root, sink)
                ex = driver.GraphExec(driver.call("cuGraphInstantiate", g.handle, 0))
                tag = ("one root " if root else "") + ("one sink" if sink else "")
                rows.append(measure_exec(f"k={k} {tag}", ex.handle, stream,
                                         {**info, "funnel": tag}))
                ex.close()
                g.close()
            if nm is not multi:
                nm.close()

        # The steps of one call, each alone.
        launcher = multi.engine.launcher
        slot = launcher.slots[0]
        device = slot.tensor.device
        dtod = drv.cuMemcpyDtoDAsync
        cell = driver.DeviceMemory.allocate(8)
        write64 = drv.cuStreamWriteValue64
        steps = {
            "bare cuStreamWriteValue64(cell, ptr)": lambda: write64(stream, cell.address,
                                                                     x.data_ptr(), 0),
            "Nimble.__call__ (whole)": lambda: multi(x),
            "Launcher.run_flat": lambda: launcher.run_flat((x,)),
            "Launcher.stream()": launcher.stream,
            "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
            "CUstream(int)": lambda: drv.CUstream(stream_obj.cuda_stream),
            "slot.copy_(x)": lambda: slot.tensor.copy_(x),
            "bare cuMemcpyDtoDAsync(slot, x)": lambda: dtod(slot.address, x.data_ptr(),
                                                            slot.nbytes, stream),
            "shape/dtype/device check": lambda: (x.shape == slot.shape, x.dtype == slot.dtype,
                                                 x.device == device),
            "x.data_ptr() + is_contiguous()": lambda: (x.data_ptr(), x.is_contiguous()),
            "bare cuGraphLaunch (multi)": lambda: drv.cuGraphLaunch(
                multi.engine.built.exec.handle, stream),
        }
        for label, fn in steps.items():
            us = idle_host_us(fn)
            print(f"  step {label:40s} {us:6.1f} µs", flush=True)
            rows.append({"variant": "step: " + label, "idle_host_us": us})
        cell.close()
        multi.close()
    return rows


def stream_rows(name: str) -> list[dict]:
    """Launch cost of one prepared graph on each kind of stream, and through an event join."""
    import torch

    import nimble

    use_cudnn_benchmark()
    model = models.create(name).cuda()
    x = models.example_input(name)
    drv = driver.bindings()
    print(f"{name}: streams", flush=True)
    rows = []
    on_device = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(keep_recording=True))
    on_host = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(
        device_launch=False, recording=on_device.recording))
    side = torch.cuda.Stream()
    own = driver.call("cuStreamCreate", int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING))
    streams = {
        "legacy default (0)": drv.CUstream(0),
        "per-thread default": drv.CUstream(int(drv.CU_STREAM_PER_THREAD)),
        "torch side stream": drv.CUstream(side.cuda_stream),
        "cuStreamCreate NON_BLOCKING": own,
    }
    for label, nm in (("device-launchable", on_device), ("host", on_host)):
        exec_ = nm.engine.built.exec.handle
        for s_label, stream in streams.items():
            rows.append(measure_exec(f"{label} on {s_label}", exec_, stream,
                                     {"launch_mode": label, "stream": s_label}))
    ev_in = driver.Event.create(timing=False)
    ev_out = driver.Event.create(timing=False)
    record, wait = drv.cuEventRecord, drv.cuStreamWaitEvent
    caller = drv.CUstream(0)
    for label, nm in (("device-launchable", on_device), ("host", on_host)):
        exec_ = nm.engine.built.exec.handle
        launch = drv.cuGraphLaunch

        def joined():
            record(ev_in.handle, caller)
            wait(own, ev_in.handle, 0)
            launch(exec_, own)
            record(ev_out.handle, own)
            wait(caller, ev_out.handle, 0)
        rows.append(measure(f"{label} via event join from legacy stream", joined))
        for s_label, ctx in (("legacy", torch.cuda.stream(torch.cuda.default_stream())),
                             ("side", torch.cuda.stream(side))):
            with ctx:
                us = idle_host_us(lambda nm=nm: nm(x))
            print(f"  whole call, {label}, {s_label} stream: {us:6.1f} µs", flush=True)
            rows.append({"variant": f"whole call {label} {s_label}", "idle_host_us": us})
    # Segments of one call, timed inside the same call.
    launcher = on_device.engine.launcher
    slot = launcher.slots[0]
    exec_ = on_device.engine.built.exec.handle
    cell = driver.DeviceMemory.allocate(8)
    pairs = {
        "memcpy then launch": (
            lambda: drv.cuMemcpyDtoDAsync(slot.address, x.data_ptr(), slot.nbytes, caller),
            lambda: drv.cuGraphLaunch(exec_, caller)),
        "writeValue64 then launch": (
            lambda: drv.cuStreamWriteValue64(caller, cell.address, x.data_ptr(), 0),
            lambda: drv.cuGraphLaunch(exec_, caller)),
        "launch then launch": (lambda: drv.cuGraphLaunch(exec_, caller),
                               lambda: drv.cuGraphLaunch(exec_, caller)),
        "torch copy_ then launch": (lambda: slot.tensor.copy_(x),
                                    lambda: drv.cuGraphLaunch(exec_, caller)),
    }
    for label, (first, second) in pairs.items():
        a, b = [], []
        for _ in range(200):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            first()
            t1 = time.perf_counter()
            second()
            t2 = time.perf_counter()
            a.append(t1 - t0)
            b.append(t2 - t1)
        torch.cuda.synchronize()
        print(f"  {label:32s} first {statistics.median(a) * 1e6:6.1f} µs  second "
              f"{statistics.median(b) * 1e6:6.1f} µs", flush=True)
        rows.append({"variant": "pair: " + label, "first_us": statistics.median(a) * 1e6,
                     "second_us": statistics.median(b) * 1e6})
    cell.close()
    ev_in.close()
    ev_out.close()
    driver.call("cuStreamDestroy", own)
    on_device.close()
    on_host.close()
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", default=["branchy", "inception_v3"])
    p.add_argument("--json", type=Path)
    p.add_argument("--streams", action="store_true",
                   help="only compare launch streams (legacy, per-thread, side, event join)")
    args = p.parse_args(argv)
    rows = stream_rows if args.streams else model_rows
    result = {name: rows(name) for name in args.models}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
