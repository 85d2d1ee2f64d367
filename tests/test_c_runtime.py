"""The C runtime's sources compile, on the CPU, wherever a C compiler and the driver API's cuda.h
are found (the ``test`` extra installs NVIDIA's nvidia-cuda-runtime wheel, which carries
cuda.h); no GPU and no libcuda are needed to compile.  ``nimble c-runtime`` tells a build
where they are."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from nimble.cli import c_runtime
from nimble.cli.common import Fail
from nimble.cli.main import main

HOST = Path(__file__).parent / "c_host" / "run_saved.c"


def _toolchain() -> tuple[str, Path]:
    try:
        return c_runtime.compiler(), c_runtime.cuda_include()
    except Fail as e:
        pytest.skip(str(e))


def _compile(cc: str, include: Path, source: Path, out: Path) -> None:
    cmd = [cc, "-O2", "-std=c11", "-pthread", "-Wall", "-Wextra", "-Werror", "-I",
           str(c_runtime.FOLDER),
           "-I", str(include), "-c", str(source), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, " ".join(cmd) + "\n" + done.stderr


def test_the_c_runtime_and_its_host_program_compile_without_a_warning(tmp_path):
    cc, include = _toolchain()
    for source in [c_runtime.FOLDER / s for s in c_runtime.SOURCES] + [HOST]:
        _compile(cc, include, source, tmp_path / (source.stem + ".o"))


def test_the_header_compiles_as_cpp_too(tmp_path):
    import shutil

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    _, include = _toolchain()
    source = tmp_path / "use.cpp"
    source.write_text('#include "nimble.h"\nint main() { return nimble_buckets(nullptr); }\n')
    done = subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", "-I", str(c_runtime.FOLDER),
                           "-I", str(include), "-c", str(source), "-o", str(tmp_path / "u.o")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_command_prints_where_the_runtime_is(capsys):
    assert main(["c-runtime", "--print-include"]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert (folder / "nimble.h").is_file() and (folder / "nimble.c").is_file()
    assert main(["c-runtime", "--print-sources"]) == 0
    assert capsys.readouterr().out.split() == [str(folder / s) for s in c_runtime.SOURCES]


def test_the_package_data_carries_the_runtime():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '"c_runtime/*.c", "c_runtime/*.h"' in text


def test_a_build_without_a_toolchain_ends_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(c_runtime.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    assert main(["c-runtime", "--build", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nimble: no C compiler") and "\n" not in err


def test_the_c_checksum_is_the_python_readers(tmp_path):
    """The C runtime's SHA-256 and the file's hash-list checksum, compiled alone (no CUDA) and
    called through ctypes, against hashlib and nimble.ir.saved_format.checksum on sizes around
    the 64-byte block and the 8 MiB chunk."""
    import ctypes
    import hashlib
    import random

    from nimble.ir.saved_format import checksum

    try:
        cc = c_runtime.compiler()
    except Fail as e:
        pytest.skip(str(e))
    lib_path = tmp_path / "libsha.so"
    done = subprocess.run([cc, "-O2", "-std=c11", "-pthread", "-shared", "-fPIC", "-Werror",
                           str(c_runtime.FOLDER / "nimble_sha256.c"), "-o", str(lib_path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lib = ctypes.CDLL(str(lib_path))
    data = random.Random(0).randbytes((8 << 20) * 2 + 1000)
    for n in (0, 1, 55, 56, 63, 64, 65, 1000, 8 << 20, (8 << 20) + 1, len(data)):
        out = ctypes.create_string_buffer(32)
        lib.nimble_sha256(data, ctypes.c_size_t(n), out)
        assert out.raw == hashlib.sha256(data[:n]).digest(), n
        lib.nimble_checksum(data, ctypes.c_size_t(n), out)
        assert out.raw == checksum(data[:n]), n
    pieces = [data[i * 1000:i * 1000 + 37 * i] for i in range(20)]  # one per binary, in threads
    starts = (ctypes.c_char_p * 20)(*pieces)
    sizes = (ctypes.c_size_t * 20)(*[len(p) for p in pieces])
    sums = ctypes.create_string_buffer(32 * 20)
    lib.nimble_sha256_many(starts, sizes, sums, ctypes.c_size_t(20))
    assert [sums.raw[32 * i:32 * i + 32] for i in range(20)] == \
        [hashlib.sha256(p).digest() for p in pieces]
