"""What the source distribution carries, read from ``MANIFEST.in`` as setuptools reads it (no
build, no GPU): every file the tests and the maintainers' tools need, and no pattern that
matches nothing (setuptools warns about each on every build)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "MANIFEST.in"
#: The folders whose files an unpacked sdist needs to run its tests and tools, and the
#: suffixes of the files there that are source (not caches or outputs).
NEEDED = {"tests": (".py", ".c", ".json.gz", ".nimble.gz", ".fatbin"),
          "tools": (".py", ".sh", ".cpp"), "docs": (".md",), "kernels": (".ptx",)}

pytestmark = pytest.mark.skipif(not MANIFEST.exists(), reason="no MANIFEST.in (not a checkout)")


def _template_lines() -> list[str]:
    lines = [line.strip() for line in MANIFEST.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _file_list(lines: list[str]):
    """setuptools' own reading of ``lines`` (MANIFEST.in commands) over the checkout."""
    from setuptools.command.egg_info import FileList

    here = os.getcwd()
    os.chdir(ROOT)
    try:
        files = FileList()
        files.findall(".")
        for line in lines:
            files.process_template_line(line)
        return files
    finally:
        os.chdir(here)


def _needed_files() -> list[str]:
    found = []
    for folder, suffixes in NEEDED.items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.name.endswith(suffixes) \
                    and "__pycache__" not in path.parts:
                found.append(path.relative_to(ROOT).as_posix())
    return sorted(found)


def test_the_sdist_carries_every_file_of_the_tests_and_tools():
    shipped = set(_file_list(_template_lines()).files)
    needed = _needed_files()
    assert "tests/workers/allreduce_worker.py" in needed  # the walk reaches subfolders
    missing = [f for f in needed if f not in shipped]
    assert not missing, f"MANIFEST.in leaves out {missing}"


def test_every_install_hint_names_the_distribution_nimble_gpu():
    """``pip install nimble`` installs an unrelated project (README): no hint may say so."""
    wrong = re.compile(r"(?<![\w-])nimble\[|pip install (-U )?['\"]?nimble(?![-\w])")
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "nimble").rglob("*.py"),
             *(ROOT / "tools").rglob("*.py")]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in texts
             for m in wrong.finditer(p.read_text(encoding="utf-8"))]
    assert not found


def test_every_pattern_of_the_manifest_matches_a_file():
    """A pattern that matches nothing is a warning on every build, and a sign of a file moved
    or gone."""
    dead = []
    for line in _template_lines():
        command, *words = line.split()
        # recursive-include and graft name a folder first; each pattern counts on its own
        folder = [words.pop(0)] if command in ("recursive-include", "recursive-exclude") else []
        for pattern in words or [""]:
            alone = " ".join([command, *folder, pattern])
            if command.endswith("exclude"):
                # an exclusion must take away something the inclusions before it took
                lines = _template_lines()
                kept = _file_list(lines[:lines.index(line)]).files
                taken = _file_list(lines[:lines.index(line)] + [alone]).files
                matched = len(taken) < len(kept)
            else:
                matched = bool(_file_list([alone]).files)
            if not matched:
                dead.append(alone)
    assert not dead, f"MANIFEST.in patterns that match nothing: {dead}"


def _optional_imports(path: Path) -> set[str]:
    """The top-level modules ``path`` skips without (``pytest.importorskip("x.y")``)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" \
                and node.args and isinstance(node.args[0], ast.Constant):
            found.add(node.args[0].value.split(".")[0])
    return found


def test_the_test_extra_installs_every_package_a_cpu_test_skips_without():
    """CI installs ``.[test]``: a CPU test that skips without a package CI lacks checks nothing
    there (test_generate.py and part of test_kv_cache.py without transformers)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("reading pyproject.toml needs Python 3.11's tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda requirement: re.split(r"[\s<>=!~;\[]", requirement, 1)[0].lower()  # noqa: E731
    installed = {name(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]}
    skipped = {m for path in (ROOT / "tests").glob("test_*.py")
               if not path.name.startswith("test_gpu_") for m in _optional_imports(path)}
    assert "transformers" in skipped  # the scan finds them
    assert skipped <= installed, f"CPU tests skip without {sorted(skipped - installed)}"


def test_the_kernels_folder_does_not_shadow_an_installed_kernels_package():
    """transformers (5.25 and newer) imports Hugging Face's ``kernels`` distribution; from the
    checkout's root (pytest's rootdir, a script run there) a ``kernels/__init__.py`` of ours
    was found first and transformers' import of it failed."""
    import subprocess
    import sys

    found = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; s = u.find_spec('kernels'); "
         "print(s.origin if s and s.origin else '')"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert not found.startswith(str(ROOT / "kernels")), found
