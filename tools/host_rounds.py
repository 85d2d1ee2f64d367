"""What slows a call in the GPU machine's slow rounds (GPU).

    python3 tools/host_rounds.py MODEL:DTYPE SECONDS

Rounds of 150 idle calls (stream waited before each) for SECONDS, each kind sampled in turn in
a shuffled order: a bare cuGraphLaunch of the model's exec, a bare launch of an empty one-node
graph, the fast call's checks without the launch, nm(x), and a 100-step pure-Python loop; with
the CPU's user / system / idle / steal shares from /proc/stat over the round.  One line per round.
"""
import sys, time, random, statistics
import torch, nimble
from nimble import driver
from nimble.cli import models
torch.backends.cudnn.benchmark = True
name, dt = sys.argv[1].split(":"); dtype = getattr(torch, dt); seconds = float(sys.argv[2])
m = models.create(name).cuda().eval().to(dtype); x = models.example_input(name).to(dtype)
nm = nimble.Nimble(m).prepare(x, relaunches=3)
st = nm._state(); L = st.launcher; api = driver.CallPath(); stream = L.stream(); big = st.built.exec.handle
g = driver.Graph.create(); driver.add_empty_node(g.handle, [])
tiny = driver.GraphExec.instantiate(g, upload_stream=stream)
slots = L.slots; T = torch.Tensor; index = x.get_device(); order = L._order
def checks_only():  # what Launcher.fast_call reads before its launch
    for xx, slot in zip((x,), slots):
        if xx.__class__ is not T or xx.dtype is not slot.dtype or xx.shape != slot.shape \
                or xx.get_device() != index or not xx.is_contiguous():
            raise RuntimeError
    with order.lock:
        L._raw_stream() != order.last_raw
        x.data_ptr()
def yardstick():
    s = 0
    for i in range(100):
        s += i
    return s
fns = {"bare model": lambda: api.launch(big, stream), "bare 1-node": lambda: api.launch(tiny.handle, stream),
       "checks": checks_only, "nm(x)": lambda: nm(x), "py100": yardstick}
def cpu_stat():
    f = open("/proc/stat").readline().split()[1:]
    return [int(v) for v in f]
wait = torch.cuda.current_stream().synchronize
nm(x); torch.cuda.synchronize()
end = time.time() + seconds; rnd = 0
while time.time() < end:
    t = {k: [] for k in fns}; keys = list(fns); c0 = cpu_stat(); w0 = time.time()
    for _ in range(150):
        random.shuffle(keys)
        for k in keys:
            wait(); t0 = time.perf_counter(); fns[k](); t[k].append(time.perf_counter() - t0)
    torch.cuda.synchronize(); c1 = cpu_stat(); w = time.time() - w0
    d = [b - a for a, b in zip(c0, c1)]; tot = sum(d) or 1
    # user nice system idle iowait irq softirq steal guest
    print(f"{name} {dt} r{rnd} {w:.1f}s", " | ".join(f"{k} {statistics.median(v)*1e6:.1f}" for k, v in t.items()),
          f"| cpu user {100*d[0]/tot:.1f}% sys {100*d[2]/tot:.1f}% idle {100*d[3]/tot:.1f}% steal {100*(d[7] if len(d)>7 else 0)/tot:.1f}%", flush=True)
    rnd += 1
print(open("/proc/cpuinfo").read().count("processor"), "cpus;", [l for l in open("/proc/cpuinfo") if "MHz" in l][:3])
