#!/usr/bin/env bash
# torch.compile(mode="reduce-overhead") beside every other mode, one process per model so that a
# model whose compile runs past its time limit does not lose the others' results.
#   [BENCH_ARGS="--quick --dtype float32,float16"] tools/compile_bench.sh OUT_DIR SECONDS_PER_MODEL MODEL...
# Writes OUT_DIR/compile.json (all results) and OUT_DIR/compile.log (every model's output).
# Each run also has the nimble+inductor rows (Nimble on torch.compile(model)'s kernels).
set -u
out=$1; limit=$2; shift 2
work=$(mktemp -d)
for m in "$@"; do
  # shellcheck disable=SC2086 # BENCH_ARGS is a list of words
  timeout "$limit" python3 -m nimble bench "$m" ${BENCH_ARGS:-} --json "$work/$m.json" \
    > "$work/$m.log" 2>&1 || echo "$m: bench exited $? (limit ${limit}s)"
  cat "$work/$m.log" >> "$out/compile.log"
done
python3 - "$out" "$work" "$@" <<'PY'
import json, sys
from pathlib import Path
from nimble.cli.bench import summary_table
out, work = Path(sys.argv[1]), Path(sys.argv[2]); results = []
for m in sys.argv[3:]:
    p = work / f"{m}.json"
    if p.exists():
        results += json.loads(p.read_text())["results"]
(out / "compile.json").write_text(json.dumps(results, indent=1, default=str))
print(summary_table(results) if results else "no model finished")
PY
