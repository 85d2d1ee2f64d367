"""tools/hunt.py: rounds of one command side by side until a run fails (no GPU)."""
from __future__ import annotations

import sys

from helpers import load_tool

tool = load_tool("hunt")

# The third run to write the marker file fails (each run appends a byte and reads where it ended),
# saving a recording into its own $NIMBLE_FAULT_DIR as a failed proof does.
FLAKY = r"""
import os, pathlib, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
os.write(fd, b"x")
started = os.lseek(fd, 0, os.SEEK_CUR)  # where this run's own byte ended: its place in line
os.close(fd)
if started == 3:
    folder = pathlib.Path(os.environ["NIMBLE_FAULT_DIR"])
    (folder / f"nimble-mismatch-model-{os.getpid()}.json.gz").write_bytes(b"recording")
    print("FAILED: output 3 differs")
    sys.exit(1)
print("passed")
"""


def test_the_hunt_stops_after_the_round_with_a_failure_and_keeps_its_log_and_recording(
        tmp_path, capsys):
    marker, out = tmp_path / "marker", tmp_path / "out"
    code = tool.main(["--parallel", "2", "--seconds", "600", "--out", str(out), "--",
                      sys.executable, "-c", FLAKY, str(marker)])
    assert code == 1
    assert len(marker.read_text()) == 4  # two rounds of two, none after the failure
    printed = capsys.readouterr().out
    assert printed.count("exit 1") == 1 and printed.count("exit 0") == 3
    assert "FAILED: output 3 differs" in printed and "4 runs, 1 failed" in printed
    assert "FAILED: output 3 differs" in (out / "hunt_failed.log").read_text()
    [recording] = out.glob("nimble-mismatch-model-*.json.gz")
    assert recording.read_bytes() == b"recording"


def test_runs_that_all_pass_stop_at_the_time_and_leave_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    code = tool.main(["--parallel", "3", "--seconds", "0.001", "--out", str(out), "--",
                      sys.executable, "-c", "print('passed')"])
    assert code == 0
    assert "3 runs, 0 failed" in capsys.readouterr().out
    assert not out.exists()
