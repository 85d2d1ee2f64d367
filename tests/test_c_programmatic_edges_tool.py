"""tools/experiments/c_programmatic_edges.py on the CPU: its patch of the C runtime (each
programmatic edge alone, the root rule lifted) still applies to nimble.c and compiles."""
from __future__ import annotations

import subprocess

import pytest

from helpers import load_tool

tool = load_tool("experiments/c_programmatic_edges")


def test_the_patch_applies_to_the_runtime_and_the_patched_runtime_compiles(tmp_path):
    from nimble.cli import c_runtime
    from nimble.cli.common import Fail

    source = (c_runtime.FOLDER / "nimble.c").read_text()
    for old, new in tool.PATCH:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    assert "!entered[b->edges[2 * e]]" not in source and 'getenv("PROG_ONLY")' in source
    try:
        cc, include = c_runtime.compiler(), c_runtime.cuda_include()
    except Fail as e:
        pytest.skip(str(e))
    patched = tmp_path / "nimble.c"
    patched.write_text(source)
    done = subprocess.run([cc, "-std=c11", "-Wall", "-Wextra", "-Werror", "-I",
                           str(c_runtime.FOLDER), "-I", str(include), "-c", str(patched), "-o",
                           str(tmp_path / "nimble.o")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
