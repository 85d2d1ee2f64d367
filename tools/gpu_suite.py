"""The whole GPU check in one call: the GPU tests, then the benchmark, a short table last.

    python3 tools/gpu_suite.py [--models M,M,...] [--compile] [--skip-tests] [--out DIR]

Runs ``pytest -m gpu`` (every test that needs the GPU), then ``nimble bench`` on the models, and
prints the pytest summary line and the benchmark table at the end.  Logs and the benchmark JSON
go to ``--out`` (default ``$OUT`` on the device machine, else ``./out``).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALL_MODELS = "branchy,resnet50,inception_v3,googlenet,mobilenet_v2,efficientnet_b0," \
             "nasnetalarge,pnasnet5large"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=ALL_MODELS)
    p.add_argument("--compile", action="store_true", help="include torch.compile in the bench")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "out")))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    summary = []
    status = 0
    if not args.skip_tests:
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
               "tests", *args.pytest_args.split()]
        with open(args.out / "gpu_tests.log", "w") as log:
            r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
            log.write(r.stdout)
        lines = r.stdout.strip().splitlines()
        print("\n".join(lines[-40:]), flush=True)
        summary.append("gpu tests: " + (lines[-1] if lines else "no output"))
        status |= r.returncode
    if not args.skip_bench:
        cmd = [sys.executable, "-m", "nimble.cli", "bench", *args.models.split(","),
               "--json", str(args.out / "bench.json")]
        if not args.compile:
            cmd.append("--no-compile")
        r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        (args.out / "bench.log").write_text(r.stdout)
        out = r.stdout.rstrip()
        table_at = out.find("model   ")
        print(out[:table_at] if table_at > 0 else out, flush=True)
        summary.append(out[table_at:] if table_at >= 0 else "bench printed no table")
        status |= r.returncode
    print("\n" + "\n".join(summary))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
