"""The README and docs as a reader takes them, top to bottom (no GPU)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _line_of(text: str, needle: str) -> int:
    lines = [i for i, line in enumerate(text.splitlines()) if needle in line]
    assert lines, f"the README no longer says {needle!r}"
    return lines[0]


def test_the_cpu_torch_hint_comes_before_the_test_command():
    """Read top to bottom, the test command run first would pull torch's CUDA build."""
    text = README.read_text(encoding="utf-8")
    assert _line_of(text, "download.pytorch.org/whl/cpu") < \
        _line_of(text, "pip install -e '.[test]'")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (``-`` and ``_`` kept),
    each space a hyphen; inline code and links read as their text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            slug = _slug(line.lstrip("#"))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if not count else f"{slug}-{count}")
    return found


def _links(path: Path):
    """``(target file, anchor)`` of every relative Markdown link in ``path``."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        yield (path.parent / file).resolve() if file else path, anchor


DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_every_link_in_the_docs_reaches_its_file_and_heading():
    broken = []
    for doc in DOCS:
        for target, anchor in _links(doc):
            if not target.exists():
                broken.append(f"{doc.name}: {target.name} does not exist")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{doc.name}: no heading #{anchor} in {target.name}")
    assert not broken


def _prose(text: str) -> str:
    """``text`` without its code blocks and tables."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return "\n".join(line for line in text.splitlines() if not line.startswith("|"))


def test_every_ratio_the_readme_gives_says_where_it_was_measured():
    """A number like 2.04× in the README's prose comes with its command or a link to the table
    that holds it, in the same sentence."""
    prose = " ".join(_prose(README.read_text(encoding="utf-8")).split())
    sentences = re.split(r"(?<=[.;])\s+(?=[A-Z*(])", prose)
    bare = [s for s in sentences if re.search(r"\d×", s)
            and not re.search(r"\]\([^)]*\)|`(nimble|python3? tools/)[^`]*`", s)]
    assert not bare


def _commands(path: Path) -> list[str]:
    """The ``nimble ...`` commands ``path`` quotes: the lines of its code blocks and its inline
    code, placeholders (``MODEL``, ``[--batch N]``, ``...``) left out."""
    text = path.read_text(encoding="utf-8")
    found = [line.split("#")[0].strip() for block in re.findall(r"```[a-z]*\n(.*?)```", text,
                                                                  flags=re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    found += re.findall(r"`([^`]+)`", " ".join(_prose(text).split()))
    return [c for c in found if c.startswith("nimble ") and "[" not in c and "..." not in c
            and not re.search(r"\b[A-Z][A-Z_]+\b", c)]


#: The pages whose commands are given to be run as written: the README and the measurements.
RUN_AS_WRITTEN = [README, ROOT / "docs" / "results.md", ROOT / "docs" / "findings.md"]


@pytest.mark.parametrize("page", RUN_AS_WRITTEN, ids=lambda p: p.name)
def test_every_command_quoted_to_run_parses_as_written(page):
    import shlex

    from nimble.cli.main import build_parser

    commands = _commands(page)
    assert commands or page.name == "findings.md"
    wrong = []
    for command in commands:
        words = shlex.split(command)[1:]
        try:
            build_parser(load=words[0]).parse_args(words)
        except SystemExit:
            wrong.append(command)
    assert not wrong, f"{page.name}: commands that fail as quoted: {wrong}"


TOOLS = ROOT / "tools"


def _table_names(text: str, header: str) -> list[str]:
    """The first column's code of the Markdown table under the header row ``header``."""
    lines = text.splitlines()
    start = lines.index(header) + 2
    names = []
    for line in lines[start:]:
        if not line.startswith("| `"):
            break
        name, purpose = line.split("`")[1], line.split("|")[2].strip()
        assert purpose, f"{name} has no purpose in docs/tools.md"
        names.append(name)
    return names


def test_the_maintainers_tools_and_the_finished_experiments_are_apart_and_each_listed():
    """tools/ holds what maintainers run; the finished experiments are in tools/experiments/;
    docs/tools.md gives each its line in the table of its folder."""
    text = (ROOT / "docs" / "tools.md").read_text(encoding="utf-8")
    top = sorted(p.name for p in TOOLS.iterdir() if p.suffix in (".py", ".sh", ".cpp"))
    experiments = sorted(f"experiments/{p.name}" for p in (TOOLS / "experiments").glob("*.py"))
    assert sorted(_table_names(text, "| tool | what it does |")) == top
    assert sorted(_table_names(text, "| experiment | what it measured |")) == experiments
    for runs in ("gpu_suite.py", "record_fixture.py", "hunt.py", "sanitize.py", "peer_bench.py"):
        assert runs in top
    for finished in ("green_split", "resource_ab", "autotune_spread", "param_access",
                     "gap_analysis"):
        assert f"experiments/{finished}.py" in experiments


#: Tools docs/findings.md (a dated journal) quotes that have left the tree, as it says.
LEFT = {"tools/host_rounds.py", "tools/device_launch.py", "tools/train_sequence.py"}


def test_every_tool_a_page_or_module_names_is_where_it_says():
    texts = [README, *(ROOT / "docs").glob("*.md"), *(ROOT / "nimble").rglob("*.py"),
             *(ROOT / "tests").rglob("*.py"), *TOOLS.rglob("*.py"), *TOOLS.rglob("*.sh")]
    gone = []
    for path in texts:
        for named in re.findall(r"(?<![\w/.-])tools/[\w/]+\.(?:py|sh)\b",
                                path.read_text(encoding="utf-8")):
            placeholder = Path(named).stem.isupper()  # tools/sanitize/S.py, .../NAME.py
            if not placeholder and not (ROOT / named).exists() and named not in LEFT:
                gone.append(f"{path.relative_to(ROOT)}: {named}")
    assert not gone
