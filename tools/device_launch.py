"""Host cost of launching a prepared graph from the GPU (GPU; needs nvcc and libcudadevrt.a).

    python3 tools/device_launch.py MODEL:DTYPE[,MODEL:DTYPE ...] HOGS

Builds a one-node graph whose kernel (tools/launch_graph.cu) launches the prepared,
device-launchable exec with cudaGraphLaunch (tail launch, and fire-and-forget), checks that work
queued after it on the stream sees the graph's outputs, then samples in turn the host µs of a
bare launch of the exec, a launch of the one-node graph and nm(x): in quiet rounds, with HOGS
processes copying memory beside them, and quiet again.
"""
import sys, os, time, random, statistics, subprocess, ctypes, glob
from pathlib import Path
import torch, nimble
from nimble import driver
from nimble.cli import models
torch.backends.cudnn.benchmark = True
out = os.environ.get("OUT", "/tmp")
subprocess.run(["nvcc", "-arch=sm_90", "-rdc=true", "-ptx", str(Path(__file__).with_name("launch_graph.cu")), "-o", f"{out}/launch_graph.ptx"], check=True)
ptx = open(f"{out}/launch_graph.ptx", "rb").read()
print(ptx.decode()[-1500:])
drv = driver.bindings()
driver.ensure_context()
libs = glob.glob("/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudadevrt.a") + ["/usr/local/cuda/lib64/libcudadevrt.a"]
print("devrt", libs[0])
state = driver.call("cuLinkCreate", 0, [], [])
driver.call("cuLinkAddData", state, drv.CUjitInputType.CU_JIT_INPUT_PTX, ptx + b"\0", len(ptx) + 1, b"launch_graph", 0, [], [])
driver.call("cuLinkAddFile", state, drv.CUjitInputType.CU_JIT_INPUT_LIBRARY, libs[0].encode(), 0, [], [])
cubin, size = driver.call("cuLinkComplete", state)
image = ctypes.string_at(int(cubin), size)
driver.call("cuLinkDestroy", state)
mod = driver.Module.load_data(image, detail="launch_graph")
fn = mod.function("nimble_launch_graph")
print("linked cubin", size, "bytes", flush=True)
status = driver.DeviceMemory.allocate(8)

def launcher_exec(big_exec, mode):
    g = driver.Graph.create()
    params = drv.CUDA_KERNEL_NODE_PARAMS()
    params.func = fn
    params.gridDimX = params.gridDimY = params.gridDimZ = 1
    params.blockDimX = params.blockDimY = params.blockDimZ = 1
    params.sharedMemBytes = 0
    vals = (ctypes.c_uint64 * 3)(int(big_exec), status.address, mode)
    slots = (ctypes.c_void_p * 3)(*[ctypes.addressof(vals) + 8 * i for i in range(3)])
    params.kernelParams = ctypes.addressof(slots)
    params.extra = 0
    driver.add_kernel_node(g.handle, [], params, detail="launcher")
    s = torch.cuda.current_stream().cuda_stream
    ex = driver.GraphExec.instantiate(g, upload_stream=drv.CUstream(s))
    return g, ex

def read_status():
    torch.cuda.synchronize()
    return int.from_bytes(driver.copy_to_host(status.address, 4), "little", signed=True)

api = driver.CallPath()
for spec in sys.argv[1].split(","):
    name, dt = spec.split(":"); dtype = getattr(torch, dt)
    m = models.create(name).cuda().eval().to(dtype)
    x1 = models.example_input(name).to(dtype); x2 = torch.randn_like(x1)
    nm = nimble.Nimble(m).prepare(x1, relaunches=3)
    st = nm._state(); big = st.built.exec.handle; stream = st.launcher.stream()
    print(name, dt, "launch mode", nm.launch_mode, flush=True)
    ref2 = nm(x2).clone(); ref1 = nm(x1).clone()   # cell now holds x1
    torch.cuda.synchronize()
    execs = {}
    for mode in (0, 1):
        g, ex = launcher_exec(big, mode)
        execs[mode] = (g, ex)
        o = nm(x2); torch.cuda.synchronize()   # cell -> x2
        o.fill_(float("nan")); torch.cuda.synchronize()
        api.launch(ex.handle, stream)
        got = o.clone()  # same torch stream, right after the launcher
        torch.cuda.synchronize()
        print(f"  mode {mode}: status {read_status()}  equal-after-stream-order {torch.equal(got, ref2)}  nan {torch.isnan(got).any().item()}", flush=True)
    tail = execs[0][1].handle
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for label, f in [("big", lambda: api.launch(big, stream)), ("tail", lambda: api.launch(tail, stream))]:
        for _ in range(10): f()
        per = []
        for _ in range(5):
            a.record()
            for _ in range(50): f()
            b.record(); b.synchronize(); per.append(a.elapsed_time(b) / 50)
        print(f"  gpu ms back to back {label} {statistics.median(per):.3f}", flush=True)
    print("  status after loops", read_status())
    fns = {"bare big": lambda: api.launch(big, stream), "bare tail": lambda: api.launch(tail, stream),
           "nm(x)": lambda: nm(x2)}
    wait = torch.cuda.current_stream().synchronize
    def rounds(tag, n=3):
        for rnd in range(n):
            t = {k: [] for k in fns}; keys = list(fns)
            for _ in range(200):
                random.shuffle(keys)
                for k in keys:
                    wait(); t0 = time.perf_counter(); fns[k](); t[k].append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            print(f"  {tag} r{rnd}", " | ".join(f"{k} {statistics.median(v)*1e6:.1f} (p90 {sorted(v)[180]*1e6:.1f})" for k, v in t.items()), flush=True)
    rounds("quiet")
    hogs = [subprocess.Popen([sys.executable, "-c", "import numpy as np\na=np.ones(2**25)\nb=np.empty_like(a)\nwhile True: np.copyto(b,a)"]) for _ in range(int(sys.argv[2]))]
    time.sleep(2)
    rounds(f"{len(hogs)} memory hogs")
    for h in hogs: h.kill()
    time.sleep(1)
    rounds("quiet again", 1)
    nm.close()
