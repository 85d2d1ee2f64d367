"""A C host drives a prepared graph: ``tests/c_host/nimble_host.c``, built here, on the driver API.

The C library is compiled with the system C compiler against the toolkit's ``cuda.h`` and a
``libcuda`` (the toolkit's stub, or the driver's own), loaded with ctypes, and run on handles a
prepared :class:`nimble.Nimble` hands out; its outputs must equal Python calls' bit for bit.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from nimble import PrepareOptions

pytestmark = pytest.mark.gpu

SOURCE = Path(__file__).parent / "c_host" / "nimble_host.c"
_TARGET = {"x86_64": "x86_64-linux", "aarch64": "sbsa-linux"}.get(platform.machine(), "")
_LDCONFIG_ARCH = {"x86_64": "x86-64", "aarch64": "AArch64"}.get(platform.machine(), "")
_LIBCUDA = ("libcuda.so", "libcuda.so.1")


def _compiler() -> str:
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no C compiler on PATH (looked for cc, gcc, clang): install one, e.g. "
                "`apt-get install gcc`")


def _toolkit_roots() -> list[Path]:
    """Where a CUDA toolkit may live, in order: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, nvcc's."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots += [str(Path(nvcc).parent.parent), str(Path(nvcc).resolve().parent.parent)]
    seen, out = set(), []
    for r in roots:
        if r and r not in seen:
            seen.add(r)
            out.append(Path(r))
    return out


def _is_driver_header(path: Path) -> bool:
    # /usr/include/linux/cuda.h (the Coda file system) shares the name: look for the driver API.
    try:
        text = path.read_bytes()
    except OSError:
        return False
    return b"cuGraphLaunch" in text and b"cuStreamWriteValue64" in text


def _cuda_include() -> Path:
    dirs = []
    for root in _toolkit_roots():
        dirs.append(root / "include")
        if _TARGET:
            dirs.append(root / "targets" / _TARGET / "include")
    for d in dirs:
        if _is_driver_header(d / "cuda.h"):
            return d
    pytest.skip("no CUDA driver API header cuda.h (looked in " + ", ".join(map(str, dirs)) +
                "): install the CUDA toolkit (or just NVIDIA's cuda-driver-dev-<version> package) "
                "or point CUDA_HOME at it")


def _ldconfig_libcuda() -> list[Path]:
    exe = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None)
    if exe is None:
        return []
    try:
        listing = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in listing.splitlines():
        m = re.match(r"\s*(libcuda\.so(?:\.1)?) \(([^)]*)\) => (\S+)", line)
        if m and (not _LDCONFIG_ARCH or _LDCONFIG_ARCH in m.group(2)):
            found.append(Path(m.group(3)))
    return found


def _libcuda_link() -> tuple[list[str], str]:
    """Linker flags for a libcuda, and where it is; skips where there is none.

    In order: the toolkit's stub, the libcuda this process has loaded, ldconfig's, then
    ``ctypes.util.find_library("cuda")`` looked up in the usual driver directories.
    """
    candidates: list[Path] = []
    for root in _toolkit_roots():
        candidates += [root / "lib64" / "stubs", root / "lib" / "stubs"]
        if _TARGET:
            candidates.append(root / "targets" / _TARGET / "lib" / "stubs")
    try:
        with open("/proc/self/maps") as maps:
            candidates += [Path(line.split()[-1]).parent for line in maps
                           if "/libcuda.so" in line and line.split()[-1].startswith("/")]
    except OSError:
        pass
    candidates += [p.parent for p in _ldconfig_libcuda()]
    name = ctypes.util.find_library("cuda")
    if name:
        if os.path.isabs(name):
            candidates.append(Path(name).parent)
        candidates += [Path(d) for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
                                         "/usr/lib64", "/usr/lib", "/usr/local/nvidia/lib64",
                                         "/usr/lib/wsl/lib")]
    for d in candidates:
        if (d / "libcuda.so").exists():
            return ["-L", str(d), "-lcuda"], str(d / "libcuda.so")
        if (d / "libcuda.so.1").exists():
            return ["-L", str(d), "-l:libcuda.so.1"], str(d / "libcuda.so.1")
    pytest.skip("no libcuda to link against (no lib64/stubs/libcuda.so under "
                + ", ".join(map(str, _toolkit_roots())) + "; no libcuda.so or libcuda.so.1 "
                "loaded in this process, in `ldconfig -p` or the usual directories): install the "
                "CUDA toolkit or NVIDIA's cuda-driver-dev-<version> package (they ship the stub), "
                "or point CUDA_HOME at a toolkit")


def _build(tmp_path: Path) -> ctypes.CDLL:
    cc = _compiler()
    include = _cuda_include()
    link, libcuda = _libcuda_link()
    out = tmp_path / "libnimble_host.so"
    cmd = [cc, "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", str(SOURCE), "-I", str(include),
           *link, "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"compiling {SOURCE.name} against {include}/cuda.h and {libcuda} failed "
                    f"(exit {done.returncode}):\n{' '.join(cmd)}\n{done.stderr}{done.stdout}",
                    pytrace=False)
    lib = ctypes.CDLL(str(out))
    u64, u64p = ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_ulonglong)
    lib.nimble_host_run.argtypes = [u64, u64, ctypes.c_int, u64p, u64p, u64, ctypes.c_size_t,
                                    ctypes.c_void_p, ctypes.c_int]
    lib.nimble_host_run.restype = ctypes.c_int
    return lib


def _raw_bytes(t):
    """A tensor's bytes, on the CPU, as a flat uint8 tensor (NaN-safe bitwise comparison)."""
    import torch

    return t.detach().contiguous().view(-1).view(torch.uint8).cpu()


def _result_name(rc: int) -> str:
    try:
        from nimble import driver

        return driver.bindings().CUresult(rc).name
    except Exception:  # noqa: BLE001 - only for the failure message
        return f"CUresult {rc}"


def test_a_c_library_on_the_driver_api_drives_the_prepared_graph(tmp_path):
    import torch

    import nimble
    from nimble.cli import models
    from nimble.driver.gpu import use_cudnn_benchmark

    torch.cuda.init()  # libcuda loaded and the primary context current on this thread
    lib = _build(tmp_path)

    use_cudnn_benchmark()
    model, x = models.create("branchy").cuda(), models.example_input("branchy")
    nm = nimble.Nimble(model).prepare(x, options=PrepareOptions(relaunches=4))
    cells = nm.input_cells
    if not all(cells):
        pytest.skip("this GPU takes no 64-bit stream memory writes, so the graph copies its "
                    f"inputs into their slots instead of reading cells (input_cells={cells})")
    inputs = [(torch.randn_like(x),) for _ in range(6)]

    # Expected outputs from Python calls; the returned view tells where the output lives.
    want = []
    for args in inputs:
        out = nm(*args)
        with torch.no_grad():
            torch.testing.assert_close(out, model(*args), rtol=1e-4, atol=1e-4)
        want.append(_raw_bytes(out))
    assert isinstance(out, torch.Tensor) and out.is_contiguous()
    output, nbytes = out.data_ptr(), out.numel() * out.element_size()
    for i in range(len(want)):
        for j in range(i):
            assert not torch.equal(want[i], want[j]), f"inputs {j} and {i} gave the same output"
    # A last call on another input, so that the arena holds none of the expected outputs: a C
    # loop that launched nothing (or too late) would read these bytes back.
    stale = _raw_bytes(nm(torch.randn_like(x)))
    assert not any(torch.equal(stale, w) for w in want)

    n = len(cells)
    c_cells = (ctypes.c_ulonglong * n)(*cells)
    c_sources = (ctypes.c_ulonglong * (n * len(inputs)))(
        *[t.data_ptr() for args in inputs for t in args])
    host = torch.full((len(inputs), nbytes), 0xA5, dtype=torch.uint8)
    stream = torch.cuda.current_stream().cuda_stream
    torch.cuda.synchronize()
    rc = lib.nimble_host_run(nm.exec_handle, stream, n, c_cells, c_sources, output, nbytes,
                             host.data_ptr(), len(inputs))
    assert rc == 0, f"nimble_host_run failed: {_result_name(rc)}"
    for i, w in enumerate(want):
        assert torch.equal(host[i], w), f"the C host's output {i} differs from the Python call's"

    # Python calls go on working after the C host used the same exec and cells.
    nm.host_writes_cells()
    assert torch.equal(_raw_bytes(nm(*inputs[0])), want[0])
    nm.close()
