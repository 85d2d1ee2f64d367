"""tools/cold_start.py's arithmetic and its parent's flow, on the CPU with stand-in children."""
from __future__ import annotations

import json

import pytest

from helpers import load_tool

cold = load_tool("cold_start")


def _run(mode: str, first: float, ms: float) -> dict:
    return {"mode": mode, "first_call_s": first, "ms_per_call": ms}


def test_each_mode_is_summarized_against_prepare():
    runs = {"prepare": [_run("prepare", s, 0.8) for s in (4.0, 5.0, 6.0)],
            "nimble load": [_run("nimble load", s, m) for s, m in ((0.3, 0.81), (0.5, 0.79),
                                                                  (0.4, 0.80))]}
    rows = cold.summarize(runs)
    assert [r["mode"] for r in rows] == ["prepare", "nimble load"]
    load = rows[1]
    assert (load["first_call_s"], load["min_s"], load["max_s"]) == (0.4, 0.3, 0.5)
    assert load["ms_per_call"] == 0.80 and load["of_prepare"] == pytest.approx(0.08)
    assert rows[0]["of_prepare"] == 1.0 and load["processes"] == 3
    text = cold.table("resnet50", rows, {"nimble save": "3.5, 3.7, 54.6 MB"})
    assert "| nimble load | 0.400 (0.300-0.500) | 0.8000 | 8.0% | 3 |" in text
    assert text.endswith("Once: nimble save 3.5, 3.7, 54.6 MB.")


def test_without_prepare_no_share_is_given():
    rows = cold.summarize({"aoti load": [_run("aoti load", 1.0, 1.2)]})
    assert rows[0]["of_prepare"] is None
    assert "| aoti load | 1.000 (1.000-1.000) | 1.2000 | - | 1 |" in cold.table("m", rows, {})


def test_the_parent_runs_every_mode_in_fresh_processes_round_after_round(monkeypatch, tmp_path,
                                                                         capsys):
    spawned = []

    def spawn(argv, timeout=1200):
        spawned.append(argv)
        if argv[0] == "--write":
            return {"what": argv[1], "seconds": 12.0, "bytes": 2 ** 20}
        mode = argv[1]
        return _run(mode, {"prepare": 5.0}.get(mode, 0.5), 0.8)
    monkeypatch.setattr(cold, "_spawn", spawn)
    monkeypatch.setattr(cold, "_saved_file",
                        lambda model, args, folder: ("f.nimble", {"nimble save": "x"}))
    out = tmp_path / "r.json"
    assert cold.main(["resnet50", "--rounds", "2", "--json", str(out)]) == 0
    children = [a[1] for a in spawned if a[0] == "--child"]
    assert children == list(cold.MODES) * 2  # interleaved, round after round
    assert [a[1] for a in spawned if a[0] == "--write"] == ["compile cache", "aoti package"]
    rows = json.loads(out.read_text())["resnet50"]["rows"]
    assert [r["mode"] for r in rows] == list(cold.MODES)
    assert "| prepare | 5.000" in capsys.readouterr().out


def test_skipped_modes_are_not_run(monkeypatch):
    spawned = []
    monkeypatch.setattr(cold, "_spawn", lambda argv, timeout=1200: spawned.append(argv) or
                        _run(argv[1], 1.0, 1.0))
    monkeypatch.setattr(cold, "_saved_file", lambda m, a, f: ("f", {}))
    cold.main(["resnet50", "--rounds", "1", "--skip", "compile,aoti"])
    assert [a[1] for a in spawned] == ["prepare", "nimble load"]
    with pytest.raises(SystemExit):
        cold.main(["resnet50", "--skip", "tensorrt"])


def test_a_generator_is_built_and_loaded_in_fresh_processes(monkeypatch, capsys):
    spawned = []

    class Done:
        returncode, stderr = 0, ""
        stdout = "g.nimble\t52428800 bytes\tprepare 40.00 s\tsave 5.00 s\n"
    monkeypatch.setattr(cold.subprocess, "run", lambda *a, **k: Done())

    def spawn(argv, timeout=1200):
        spawned.append(argv[1])
        return _run(argv[1], 40.0 if argv[1] == "generator prepare" else 1.5, 1.3)
    monkeypatch.setattr(cold, "_spawn", spawn)
    assert cold.main(["--generate", "llama_1b", "--rounds", "2"]) == 0
    assert spawned == list(cold.GENERATOR_MODES) * 2
    out = capsys.readouterr().out
    assert "### llama_1b Generator" in out
    assert "| generator load | 1.500 (1.500-1.500) | 1.3000 | 3.8% | 2 |" in out
    assert "nimble save --generate prepare 40.00 s, save 5.00 s, 50.0 MB" in out


def test_a_crashing_way_of_loading_is_a_row_that_says_so_and_the_rest_stand(monkeypatch,
                                                                            capsys):
    """AOTInductor's package load died of a signal on the GPU machine: the other modes' rows
    are still measured and printed, and the failed mode's row says how it died."""
    def spawn(argv, timeout=1200):
        if argv[0] == "--write":
            return {"what": argv[1], "seconds": 3.0, "bytes": 2 ** 20}
        if argv[1] == "aoti load":
            return {"failed": "signal 11: no output"}
        return _run(argv[1], 2.0 if argv[1] == "prepare" else 0.2, 0.8)
    monkeypatch.setattr(cold, "_spawn", spawn)
    monkeypatch.setattr(cold, "_saved_file", lambda m, a, f: ("f", {}))
    assert cold.main(["resnet50", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "| aoti load | failed in 2 of 2: signal 11: no output |" in out
    assert "| nimble load | 0.200 (0.200-0.200) | 0.8000 | 10.0% | 2 |" in out


def test_a_package_that_cannot_be_written_skips_its_mode(monkeypatch, capsys):
    spawned = []

    def spawn(argv, timeout=1200):
        spawned.append(argv)
        if argv[0] == "--write":
            return {"failed": "exit status 1: export failed"} if argv[1] == "aoti package" \
                else {"what": argv[1], "seconds": 3.0, "bytes": 2 ** 20}
        return _run(argv[1], 1.0, 1.0)
    monkeypatch.setattr(cold, "_spawn", spawn)
    monkeypatch.setattr(cold, "_saved_file", lambda m, a, f: ("f", {}))
    cold.main(["resnet50", "--rounds", "1"])
    assert "aoti load" not in [a[1] for a in spawned if a[0] == "--child"]
    assert "aoti package failed (exit status 1: export failed)" in capsys.readouterr().out


def test_a_loads_stages_are_summarized_by_their_medians():
    runs = {"nimble load": [dict(_run("nimble load", 0.3, 0.8),
                                 stages={"read": r, "kernels": k})
                            for r, k in ((0.05, 0.10), (0.07, 0.30), (0.06, 0.20))]}
    rows = cold.summarize(runs)
    assert rows[0]["stages"] == {"read": 0.06, "kernels": 0.20}
    text = cold.table("m", rows, {})
    assert text.endswith("Load stages (medians): nimble load: read 60 ms, kernels 200 ms.")
