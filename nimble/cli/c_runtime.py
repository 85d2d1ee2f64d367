"""``nimble c-runtime``: where Nimble's C runtime is, and building it.

The runtime is a few files inside the package (``nimble/c_runtime/``: the API ``nimble.h``;
``nimble.c``, ``nimble_load.c``, ``nimble_plan.c`` and ``nimble_sha256.c``; C11 on the CUDA
driver API and POSIX threads alone), so a wheel or sdist carries them.  ``--print-include``
prints their folder for a build system (``cc -I$(python -m nimble c-runtime --print-include)``);
``--build DIR`` compiles ``libnimble.so`` with the system C compiler against a ``cuda.h`` and a
``libcuda`` it finds (a CUDA toolkit, ``$CUDA_HOME``, the headers of the ``nvidia-cuda-runtime``
wheel, the driver's own library).  Plain Python: no torch, no GPU needed to print or build.
"""
from __future__ import annotations

import argparse
import ctypes.util
import glob
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .common import Fail

HELP = "where Nimble's C runtime is, and building it (libnimble.so)"
FOLDER = Path(__file__).resolve().parent.parent / "c_runtime"
SOURCES = ("nimble.c", "nimble_load.c", "nimble_plan.c", "nimble_sha256.c")
HEADER = "nimble.h"
_TARGET = {"x86_64": "x86_64-linux", "aarch64": "sbsa-linux"}.get(platform.machine(), "")
_LDCONFIG_ARCH = {"x86_64": "x86-64", "aarch64": "AArch64"}.get(platform.machine(), "")


def compiler() -> str:
    """The C compiler on PATH (cc, gcc or clang); Fail naming what to install."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise Fail("no C compiler on PATH (looked for $CC, cc, gcc, clang): install one, e.g. "
               "apt-get install gcc")


def toolkit_roots() -> list[Path]:
    """Where a CUDA toolkit may live: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, nvcc's."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots += [str(Path(nvcc).parent.parent), str(Path(nvcc).resolve().parent.parent)]
    return [Path(r) for i, r in enumerate(roots) if r and r not in roots[:i]]


def _driver_header(path: Path) -> bool:
    # /usr/include/linux/cuda.h (the Coda file system) has the name too.
    try:
        return b"cuGraphLaunch" in path.read_bytes()
    except OSError:
        return False


def cuda_include() -> Path:
    """A folder whose ``cuda.h`` is the driver API's; Fail naming where it looked."""
    dirs = []
    for root in toolkit_roots():
        dirs.append(root / "include")
        if _TARGET:
            dirs.append(root / "targets" / _TARGET / "include")
    for entry in sys.path:  # the headers NVIDIA's nvidia-cuda-runtime wheel installs
        dirs += sorted(Path(p) for p in glob.glob(os.path.join(entry, "nvidia", "*", "include")))
    for d in dirs:
        if _driver_header(d / "cuda.h"):
            return d
    raise Fail("no CUDA driver API header cuda.h (looked in a CUDA toolkit, $CUDA_HOME and the "
               "nvidia-cuda-runtime wheel's include folders): pip install nvidia-cuda-runtime, "
               "or install the CUDA toolkit, or point CUDA_HOME at one")


def _ldconfig_libcuda() -> list[Path]:
    """The libcuda libraries ``ldconfig -p`` lists for this machine's architecture."""
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


def _loaded_libcuda() -> list[Path]:
    """The folders of a libcuda this process has loaded (a GPU process: the driver's own)."""
    try:
        with open("/proc/self/maps") as maps:
            return [Path(line.split()[-1]).parent for line in maps
                    if "/libcuda.so" in line and line.split()[-1].startswith("/")]
    except OSError:
        return []


def libcuda() -> list[str]:
    """Linker arguments for a libcuda, looked for in order: the toolkit's stub, the libcuda this
    process has loaded, ``ldconfig``'s, then the driver's usual folders."""
    dirs = []
    for root in toolkit_roots():
        dirs += [root / "lib64" / "stubs", root / "lib" / "stubs"]
        if _TARGET:
            dirs.append(root / "targets" / _TARGET / "lib" / "stubs")
    dirs += _loaded_libcuda() + [p.parent for p in _ldconfig_libcuda()]
    found = ctypes.util.find_library("cuda")
    if found and os.path.isabs(found):
        dirs.append(Path(found).parent)
    dirs += [Path(d) for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
                               "/usr/lib64", "/usr/lib", "/usr/local/nvidia/lib64",
                               "/usr/lib/wsl/lib")]
    for d in dirs:
        if (d / "libcuda.so").exists():
            return ["-L", str(d), "-lcuda"]
        if (d / "libcuda.so.1").exists():
            return ["-L", str(d), "-l:libcuda.so.1"]
    raise Fail("no libcuda to link against (no CUDA toolkit stub, none loaded, none in "
               "`ldconfig -p` or the usual folders): install the NVIDIA driver or the CUDA "
               "toolkit, or point CUDA_HOME at a toolkit")


def compile_command(output: Path, shared: bool = True) -> list[str]:
    """The command that builds the runtime (``libnimble.so``; or, with ``shared`` False, an
    object file without linking, which needs no libcuda)."""
    sources = [str(FOLDER / s) for s in SOURCES]
    base = [compiler(), "-O2", "-std=c11", "-pthread", "-Wall", "-Wextra", "-I", str(FOLDER),
            "-I", str(cuda_include())]
    if not shared:  # one object per source, in the output's folder
        return base + ["-c", *sources]
    return base + ["-fPIC", "-shared", *sources, "-o", str(output), *libcuda()]


def build(folder: Path) -> Path:
    """``libnimble.so`` built in ``folder``; Fail with the compiler's output where it fails."""
    folder.mkdir(parents=True, exist_ok=True)
    output = folder / "libnimble.so"
    cmd = compile_command(output)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise Fail(f"building the C runtime failed: {' '.join(cmd)}: "
                   + (done.stderr or done.stdout).strip().replace("\n", " | "))
    return output


def add_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--print-include", action="store_true",
                      help="print the folder of nimble.h and the sources")
    what.add_argument("--print-sources", action="store_true",
                      help="print the C sources to compile, one a line")
    what.add_argument("--print-command", metavar="OUT",
                      help="print the command that builds OUT (libnimble.so)")
    what.add_argument("--build", metavar="DIR", help="build DIR/libnimble.so and print its path")


def run(args) -> int:
    if args.print_include:
        print(FOLDER)
    elif args.print_sources:
        for s in SOURCES:
            print(FOLDER / s)
    elif args.print_command:
        print(" ".join(compile_command(Path(args.print_command))))
    else:
        print(build(Path(args.build)))
    return 0
