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
    cmd = [cc, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-I", str(c_runtime.FOLDER),
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
    assert capsys.readouterr().out.split() == [str(folder / "nimble.c")]


def test_the_package_data_carries_the_runtime():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '"c_runtime/*.c", "c_runtime/*.h"' in text


def test_a_build_without_a_toolchain_ends_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(c_runtime.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    assert main(["c-runtime", "--build", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nimble: no C compiler") and "\n" not in err
