#!/usr/bin/env bash
# torch.compile(mode="reduce-overhead") beside every other mode, one process per model so that a
# model whose compile runs past its time limit does not lose the others' results.
#   tools/compile_bench.sh OUT_DIR SECONDS_PER_MODEL MODEL...
set -u
out=$1; limit=$2; shift 2
mkdir -p "$out/compile"
for m in "$@"; do
  timeout "$limit" python3 -m nimble.cli bench "$m" --json "$out/compile/$m.json" \
    > "$out/compile/$m.log" 2>&1 || echo "$m: bench exited $? (limit ${limit}s)"
done
python3 - "$out" "$@" <<'PY'
import json, sys
from pathlib import Path
from nimble.bench_cli import summary_table
out = Path(sys.argv[1]); results = []
for m in sys.argv[2:]:
    p = out / "compile" / f"{m}.json"
    if p.exists():
        results += json.loads(p.read_text())["results"]
(out / "compile.json").write_text(json.dumps(results, indent=1, default=str))
print(summary_table(results) if results else "no model finished")
PY
