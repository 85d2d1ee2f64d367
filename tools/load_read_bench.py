"""Time a load's read stage on the CPU (no GPU): the file mapped, its manifest and every
bucket's graph checked (``nimble.engine.saved_reading.read_checked``) and its checksum waited
for, on saved files made from the recorded fixtures (``tests/saved_fixture.py``), in a process
that imported torch (as a loading process has), with Python's cyclic garbage collector on and
paused (``nimble.engine.loading.collector_paused``, as ``nimble.load`` runs).

    python3 tools/load_read_bench.py [FIXTURE ...] [--rounds N]

Prints a row per fixture and collector setting: tasks, min, median and max ms over the rounds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402,F401 - a loading process has imported it: its objects are what a collection walks

from nimble.engine.loading import collector_paused  # noqa: E402
from nimble.engine.saved_reading import read_checked  # noqa: E402
from nimble.ir.taskgraph import TaskGraph  # noqa: E402
from saved_fixture import FIXTURE_DIR, saved_file_of  # noqa: E402

DEFAULT = ["resnet50", "inception_v3", "nasnetalarge", "pnasnet5large"]


def _read_ms(path: Path, paused: bool) -> float:
    began = time.perf_counter()
    if paused:
        with collector_paused():
            _, _, checksum = read_checked(path)
            checksum.verify()
    else:
        _, _, checksum = read_checked(path)
        checksum.verify()
    return (time.perf_counter() - began) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("fixtures", nargs="*", default=DEFAULT)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args(argv)
    print(f"{'fixture':16} {'tasks':>6} {'collector':>9} {'min ms':>8} {'median':>8} {'max':>8}")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.fixtures:
            graph = TaskGraph.load(FIXTURE_DIR / f"{name}.json.gz")
            path = saved_file_of(graph).write(Path(folder) / f"{name}.nimble")
            _read_ms(path, True)  # the page cache and the imports, once
            for paused in (False, True):
                ms = [_read_ms(path, paused) for _ in range(args.rounds)]
                print(f"{name:16} {len(graph.tasks):6d} {'paused' if paused else 'on':>9} "
                      f"{min(ms):8.1f} {statistics.median(ms):8.1f} {max(ms):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
