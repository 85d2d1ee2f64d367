"""The benchmark's report, from a result dict shaped like one ``bench_model`` returns (no GPU)."""
from __future__ import annotations

from nimble.bench_cli import format_model, summary_table


def _info(model: str, multi_ms: float) -> dict:
    modes = {}
    for label, ms in (("eager", 5.0), ("torch.cuda.graph", 1.0), ("nimble multi", multi_ms),
                      ("nimble single", 1.0), ("nimble multi, host launch", multi_ms + 0.01)):
        modes[label] = {"median_ms": ms, "min_ms": ms * 0.99, "max_ms": ms * 1.01,
                        "x_graph": 1.0 / ms, "x_eager": 5.0 / ms}
    return {"model": model, "batch": 1, "tasks": 10, "width": 2, "streams": 2, "sync_edges": 1,
            "modes": modes, "best_nimble": "nimble multi",
            "arena_mb": {"nimble multi": 1.5, "nimble single": 1.0,
                         "nimble multi, host launch": 1.5},
            "pool_mb": 2.0, "prepare_seconds": 0.5, "host_us_per_call": 12.3,
            "launch_mode": "device-launchable", "host_us_per_call_host_launch": 25.0,
            "critical_path_us": 400.0, "serial_kernel_us": 900.0, "achieved_over_limit": 1.25}


def test_per_model_report_names_every_mode_and_the_launch_mode():
    text = format_model(_info("toy", 0.5))
    for label in ("eager", "torch.cuda.graph", "nimble multi, host launch", "nimble single"):
        assert label in text
    assert "device-launchable" in text and "12.3 µs/call" in text and "1.25× the limit" in text


def test_summary_table_has_a_row_per_model_with_its_ratios():
    lines = summary_table([_info("a", 0.5), _info("b", 0.25)]).splitlines()
    rows = {line.split()[0]: line.split() for line in lines[2:4]}
    assert set(rows) == {"a", "b"}
    # x graph and x eager of the best mode, then arena, pool, limit, host µs
    assert rows["a"][-6:] == ["2.00", "10.0", "1.5", "2.0", "0.400", "12.3"]
    assert rows["b"][-6:-4] == ["4.00", "20.0"]
