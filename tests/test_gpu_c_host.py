"""A C host drives a prepared graph: ``tests/c_host/nimble_host.c``, built here, on the driver API.

The C library is compiled with the system C compiler against the toolkit's ``cuda.h`` and a
``libcuda`` (the toolkit's stub, or the driver's own), loaded with ctypes, and run on handles a
prepared :class:`nimble.Nimble` hands out; its outputs must equal Python calls' bit for bit.
"""
from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from nimble import PrepareOptions

pytestmark = pytest.mark.gpu

SOURCE = Path(__file__).parent / "c_host" / "nimble_host.c"
def _tools() -> tuple[str, Path, list[str]]:
    """The C compiler, the driver API's include folder and libcuda's linker flags, as
    ``nimble c-runtime`` finds them; skips, saying what to install, where one is missing."""
    from nimble.cli import c_runtime
    from nimble.cli.common import Fail

    try:
        return c_runtime.compiler(), c_runtime.cuda_include(), c_runtime.libcuda()
    except Fail as e:
        pytest.skip(str(e))


def _build(tmp_path: Path) -> ctypes.CDLL:
    cc, include, link = _tools()
    out = tmp_path / "libnimble_host.so"
    cmd = [cc, "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", str(SOURCE), "-I", str(include),
           *link, "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"compiling {SOURCE.name} against {include}/cuda.h and {link} failed "
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
