"""tools/peer_bench.py: per-process lines and the medians of each system's ×graph (no GPU)."""
from __future__ import annotations

import pytest

from helpers import load_tool

tool = load_tool("peer_bench")


def _run(system: str, system_ms: float, graph_ms: float = 6.0) -> dict:
    return {"system": system, "ms": {"graph": graph_ms, "system": system_ms}, "spread": 0.002,
            "x_graph": graph_ms / system_ms, "max_diff": 0.0}


def test_the_ratio_is_of_each_systems_median_over_its_processes():
    runs = [_run("nimble", 3.0), _run("peer", 4.0), _run("nimble", 2.0), _run("peer", 3.0),
            _run("nimble", 2.4), {"system": "peer", "error": "died"}]
    s = tool.summarize(runs)
    assert s["nimble"] == pytest.approx(2.5)  # 2.0, 2.5, 3.0
    assert s["peer"] == pytest.approx(1.75)  # 1.5, 2.0; the failed process counts for nothing
    assert s["nimble_over_peer"] == pytest.approx(2.5 / 1.75)


def test_no_ratio_when_a_system_never_ran():
    s = tool.summarize([_run("nimble", 3.0), {"system": "peer", "error": "no Opara"}])
    assert s["peer"] is None and s["nimble_over_peer"] is None
    text = tool.format_case("googlenet", "float32",
                            [_run("nimble", 3.0), {"system": "peer", "error": "no Opara"}])
    lines = text.splitlines()
    assert lines[0] == "googlenet float32"
    assert lines[1].split()[0] == "nimble" and "x2.00" in lines[1]
    assert lines[2].endswith("failed: no Opara")
    assert lines[3].strip() == "median x graph: nimble 2.00, peer -; nimble / peer -"


def test_a_missing_peer_checkout_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(["googlenet", "--peer", str(tmp_path)])
    assert e.value.code == 2
    assert "no Opara/ folder" in capsys.readouterr().err
