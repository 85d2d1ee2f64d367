"""The package's folders are its pipeline, and imports run one way (docs/design.md, "Layout").

Every import in every module of ``nimble`` (those inside functions too) is read with ``ast`` and
resolved to the module it loads; each must stay in its own stage or go to an earlier one, and no
two modules may import each other, directly or round a longer loop.  The analysis stage must
import with torch and the driver unimportable, and ``import nimble`` must load neither.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nimble"

# Each stage's place in the pipeline: a module may import from its own stage or an earlier one.
RANK = {"_version": 0, "errors": 0, "progress": 0, "driver": 1, "ir": 1, "analysis": 2, "record": 3,
        "engine": 4, "debug": 5, "api": 6, "inspection": 6, "generate": 7, "decode_steps": 7,
        "fused_projections": 7, "fast_gemv": 7, "gemm_rows": 7, "gemm_rows_kernels": 7, "gemv_prologues": 7,
        "gemv_prologue_pass": 7, "gemv_prologue_patterns": 7, "prologue_kinds": 7, "gemv_prologue_kernels": 7, "gemv_prologue_tuning": 7,
        "kernel_waits": 7, "peer_sum": 7, "peer_sum_kernels": 7,
        "decode_attention": 7, "decode_attention_kernels": 7, "attention_rope": 7,
        "attention_rope_pass": 7, "fx_patterns": 7, "compile_backend": 7, "fast_decoding": 7,
        "__init__": 7, "__main__": 8, "cli": 8}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, level: int, target: str | None) -> str:
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of other ``nimble`` modules (a name imported from a package counts
    as the submodule where one of that name exists)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.split(".")[0] == "nimble")
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = _resolve(name, is_package, node.level, node.module)
                elif node.module and node.module.split(".")[0] == "nimble":
                    base = node.module
                else:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in modules else base)
        graph[name] = {m for m in found if m != name}
    return graph


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_import_names_a_module_that_exists():
    modules = _modules()
    missing = {(m, t) for m, targets in _imports(modules).items() for t in targets
               if t not in modules}
    assert not missing


def test_imports_run_one_way_through_the_stages():
    modules = _modules()
    assert {_stage(m) for m in modules} <= set(RANK), "a new stage needs a place in RANK"
    backwards = sorted((m, t) for m, targets in _imports(modules).items() for t in targets
                       if RANK[_stage(t)] > RANK[_stage(m)]
                       and not (t == "nimble" and _stage(m) == "__main__"))
    assert not backwards, "imports against the pipeline: " + ", ".join(
        f"{m} -> {t}" for m, t in backwards)


def test_no_import_cycle_among_nimbles_modules():
    graph = _imports(_modules())
    # A package's __init__ is loaded before any of its submodules: an import of ``nimble.x.y``
    # also loads ``nimble.x`` (unless the importer is inside ``nimble.x``, which is loaded then).
    for m in list(graph):
        for t in list(graph[m]):
            parent = t.rsplit(".", 1)[0]
            while "." in parent and not (m + ".").startswith(parent + "."):
                graph[m].add(parent)
                parent = parent.rsplit(".", 1)[0]
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                cycle = visit(t)
                if cycle:
                    return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _run_isolated(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=PACKAGE.parent, timeout=120)


BLOCK_TORCH_AND_DRIVER = """
    import sys
    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "cuda"):
                raise ImportError(f"{name} is made unimportable by this test")
    sys.meta_path.insert(0, Refuse())
"""


@pytest.mark.parametrize("stage", ["ir", "analysis"])
def test_the_analysis_stages_import_without_torch_or_the_driver(stage):
    r = _run_isolated(BLOCK_TORCH_AND_DRIVER + f"""
    import importlib, pkgutil
    import nimble.{stage} as stage
    for info in pkgutil.walk_packages(stage.__path__, stage.__name__ + "."):
        importlib.import_module(info.name)
    from nimble.ir.synthetic import branchy_graph
    from nimble.analysis.report import analyze
    analyze(branchy_graph(seed=1))
    """)
    assert r.returncode == 0, r.stderr


def test_importing_nimble_loads_neither_torch_nor_the_driver():
    r = _run_isolated("""
    import sys
    import nimble
    nimble.Nimble, nimble.TaskGraph
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "cuda"))
    print(" ".join(loaded))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""


def test_no_module_names_a_variable_it_never_defines():
    """A name used but never bound (an import lost in a move) fails only when its line runs,
    which for a debugging path may be on the GPU alone: pyflakes finds it statically."""
    pyflakes = pytest.importorskip("pyflakes.api", reason="pyflakes is in the test extra")
    from pyflakes.messages import UndefinedName

    class Collect:
        def __init__(self) -> None:
            self.found: list[str] = []

        def flake(self, message) -> None:
            if isinstance(message, UndefinedName):
                self.found.append(str(message))

        def unexpectedError(self, filename, message) -> None:
            self.found.append(f"{filename}: {message}")

        def syntaxError(self, filename, message, lineno, offset, text) -> None:
            self.found.append(f"{filename}:{lineno}: {message}")

    report = Collect()
    for path in sorted(PACKAGE.rglob("*.py")):
        pyflakes.checkPath(str(path), report)
    assert not report.found, "\n".join(report.found)
