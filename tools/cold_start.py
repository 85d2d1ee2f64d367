"""Cold start: how long a fresh process takes to serve a model, each way, and what a call costs.

    python tools/cold_start.py [MODEL ...] [--dtype float16] [--batch 1] [--rounds 3]
        [--calls 200] [--skip compile,aoti] [--json F]
    python tools/cold_start.py --generate LM [--prompt-buckets 128,512] [--batch 1,8] ...

Per model (default resnet50), every measurement in its own fresh process, ``--rounds`` times:

- ``prepare``: ``Nimble(model).prepare(x)``, the seconds to the end of the first call;
- ``nimble load``: ``nimble.load(FILE)`` of a file ``nimble save`` wrote once beforehand (its
  prepare and save seconds and size are reported too);
- ``compile warm``: ``torch.compile(model, mode="reduce-overhead")`` to the end of its first
  call in a process that loaded the cache artifacts (``torch.compiler.load_cache_artifacts``)
  an earlier process saved after compiling the same model;
- ``aoti load``: ``torch._inductor.aoti_load_package`` of a package
  ``torch._inductor.aoti_compile_and_package`` wrote once beforehand, to its first call.

Each child creates the CUDA context and the model before its clock starts (the load-time
figures leave both out, and Python's start and imports too), then times ``--calls`` calls in
five rounds with CUDA events.  The parent prints, per mode, the median seconds to the first
call with the spread over rounds, the median ms per call, and the load's share of prepare.
With ``--generate LM`` (a causal LM of ``nimble.cli.decoders``), the modes are a decoding
Generator's: ``generator prepare`` (building it: every batch size's prefill buckets and decode
step) and ``generator load`` (``Generator.load`` of a file ``nimble save --generate`` wrote),
each to the end of its first ``generate`` of 16 tokens; ms per call is then per token.
A child runs as ``python tools/cold_start.py --child MODE ...`` and prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
from gpu_suite import NO_MULTICAST  # tools/ is a script's first path entry

MODES = ("prepare", "nimble load", "compile warm", "aoti load")
GENERATOR_MODES = ("generator prepare", "generator load")
SKIPPABLE = {"compile": "compile warm", "aoti": "aoti load"}


# ---- the arithmetic (no GPU) -------------------------------------------------------------------

def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """Per mode, from its children's JSON lines: the median seconds to the first call with the
    min and max, the median ms per call, and the share of prepare's median."""
    rows = []
    prepare = [r["first_call_s"] for r in runs.get("prepare") or runs.get("generator prepare")
               or [] if "failed" not in r]
    base = statistics.median(prepare) if prepare else None
    for mode in MODES + GENERATOR_MODES:
        every = runs.get(mode) or []
        got = [r for r in every if "failed" not in r]
        failed = [r["failed"] for r in every if "failed" in r]
        if not got:
            if failed:
                rows.append({"mode": mode, "failed": failed[0], "processes": len(failed)})
            continue
        first = [r["first_call_s"] for r in got]
        calls = [r["ms_per_call"] for r in got]
        median = statistics.median(first)
        stages = [r["stages"] for r in got if r.get("stages")]
        rows.append({"mode": mode, "first_call_s": median, "min_s": min(first),
                     "max_s": max(first), "ms_per_call": statistics.median(calls),
                     "of_prepare": median / base if base else None, "processes": len(got),
                     "failed_processes": len(failed),
                     "stages": {k: statistics.median(s.get(k, 0.0) for s in stages)
                                for k in (stages[0] if stages else {})}})
    return rows


def report(names, measure_one, table_of, json_path: str | None) -> dict:
    """Each of ``names`` measured (``measure_one(name) -> (rows, once)``), its table printed as
    it ends (``table_of(name, rows, once)``), and every result written to ``json_path`` where
    given; the results by name."""
    results = {}
    for name in names:
        rows, once = measure_one(name)
        results[name] = {"rows": rows, "once": once}
        print(table_of(name, rows, once), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return results


def table(model: str, rows: list[dict], extra: dict) -> str:
    """The rows as a Markdown table, with what the one-off steps cost beneath."""
    lines = [f"### {model}", "",
             "| mode | s to first call (min-max) | ms per call | of prepare | processes |",
             "|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['mode']} | failed in {r['processes']} of {r['processes']}: "
                         f"{r['failed']} | - | - | 0 |")
            continue
        share = f"{100 * r['of_prepare']:.1f}%" if r["of_prepare"] is not None else "-"
        lines.append(f"| {r['mode']} | {r['first_call_s']:.3f} ({r['min_s']:.3f}-"
                     f"{r['max_s']:.3f}) | {r['ms_per_call']:.4f} | {share} | "
                     f"{r['processes']} |")
    once = ", ".join(f"{k} {v}" for k, v in extra.items())
    stages = [f"{r['mode']}: " + ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in
                                           r["stages"].items())
              for r in rows if r.get("stages")]
    return "\n".join(lines + (["", f"Once: {once}."] if once else [])
                     + (["", "Load stages (medians): " + "; ".join(stages) + "."]
                        if stages else []))


def time_calls(call, sync, rounds: int = 5, calls: int = 200) -> float:
    """Median ms per call of ``rounds`` rounds of ``calls`` calls, timed with CUDA events."""
    import torch

    for _ in range(10):
        call()
    per = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call()
        end.record()
        end.synchronize()
        per.append(start.elapsed_time(end) / calls)
    sync()
    return statistics.median(per)


# ---- the children (GPU) ------------------------------------------------------------------------

def _model(name: str, dtype: str, batch: int):
    import torch

    from nimble.cli import models
    from nimble.driver.gpu import use_cudnn_benchmark

    use_cudnn_benchmark()
    model = models.create(name).cuda().to(getattr(torch, dtype)).eval()
    return model, models.example_input(name, batch).to(getattr(torch, dtype))


def _generator_child(mode: str, args) -> dict:
    """A Generator built or loaded, to the end of its first generate; then ms per token."""
    import torch

    from nimble.generate import Generator

    torch.zeros(1, device="cuda")
    buckets = [int(b) for b in args.prompt_buckets.split(",")]
    batch = int(args.batch)
    ids = torch.randint(0, 100, (batch, buckets[0]), device="cuda")
    model = None
    if mode == "generator prepare":
        from nimble.cli.decoders import causal_lm

        model = causal_lm(args.model, args.dtype)
    torch.cuda.synchronize()
    began = time.perf_counter()
    generator = Generator(model, max_cache_len=buckets[-1] + 64, prompt_buckets=buckets,
                          batch_sizes=[batch]) if model is not None else Generator.load(args.path)
    generator.generate(ids, 16)
    torch.cuda.synchronize()
    first = time.perf_counter() - began
    decode, _ = generator.steps(batch)
    token, position = ids[:, :1].clone(), torch.full((1,), buckets[0], device="cuda")
    ms = time_calls(lambda: decode(token, position), torch.cuda.synchronize, calls=args.calls)
    return {"mode": mode, "first_call_s": first, "ms_per_call": ms,
            "stages": _load_stages(decode) if mode == "generator load" else {}}


def _load_stages(nm) -> dict:
    """A loaded graph's load seconds by stage (the whole file's load: every graph in it)."""
    report = getattr(nm, "prepare_report", None)
    buckets = getattr(report, "buckets", None) or []
    return {k: round(v, 4) for k, v in (buckets[0].seconds if buckets else {}).items()}


def _child(mode: str, args) -> dict:
    import torch

    import nimble

    if mode in GENERATOR_MODES:
        return _generator_child(mode, args)

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    model, x = _model(args.model, args.dtype, args.batch) if mode != "aoti load" else (None, None)
    if mode == "aoti load":
        x = torch.load(args.path + ".input.pt").cuda()
    began = time.perf_counter()
    if mode == "prepare":
        run = nimble.Nimble(model).prepare(x)
    elif mode == "nimble load":
        run = nimble.load(args.path)
    elif mode == "compile warm":
        torch.compiler.load_cache_artifacts(Path(args.path).read_bytes())
        run = torch.compile(model, mode="reduce-overhead")
    else:
        run = torch._inductor.aoti_load_package(args.path)
    with torch.no_grad():
        out = run(x)
        torch.cuda.synchronize()
        first = time.perf_counter() - began
        del out
        if mode == "compile warm":
            def call():
                torch.compiler.cudagraph_mark_step_begin()
                return run(x)
        else:
            def call():
                return run(x)
        ms = time_calls(call, torch.cuda.synchronize, calls=args.calls)
    return {"mode": mode, "first_call_s": first, "ms_per_call": ms,
            "stages": _load_stages(run) if mode == "nimble load" else {}}


def _write_once(what: str, args) -> dict:
    """The one-off artifacts a child loads: a compile cache or an AOTInductor package."""
    import torch

    model, x = _model(args.model, args.dtype, args.batch)
    began = time.perf_counter()
    with torch.no_grad():
        if what == "compile cache":
            compiled = torch.compile(model, mode="reduce-overhead")
            for _ in range(3):
                torch.compiler.cudagraph_mark_step_begin()
                compiled(x)
            data, _ = torch.compiler.save_cache_artifacts()
            Path(args.path).write_bytes(data)
        else:
            exported = torch.export.export(model, (x,))
            torch._inductor.aoti_compile_and_package(exported, package_path=args.path)
            torch.save(x.cpu(), args.path + ".input.pt")
    return {"what": what, "seconds": time.perf_counter() - began,
            "bytes": os.path.getsize(args.path)}


# ---- the parent --------------------------------------------------------------------------------

def _spawn(argv: list[str], timeout: int = 1200) -> dict:
    """The child's JSON line; or ``{"failed": why}`` where it died (a crash in one way of
    loading, AOTInductor's say, leaves the others' rows standing)."""
    env = {**os.environ, **NO_MULTICAST}
    try:
        done = subprocess.run([sys.executable, __file__, *argv], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"failed": f"no answer in {timeout} s"}
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output"
        how = f"signal {-done.returncode}" if done.returncode < 0 else \
            f"exit status {done.returncode}"
        return {"failed": f"{how}: {last[-300:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _saved_file(model: str, args, folder: Path) -> tuple[str, dict]:
    path = folder / f"{model}.nimble"
    env = {**os.environ, **NO_MULTICAST}
    done = subprocess.run([sys.executable, "-m", "nimble", "save", model, "--dtype", args.dtype,
                           "--batch", str(args.batch), "-o", str(path), "-q"],
                          capture_output=True, text=True, env=env, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"nimble save {model} failed: {done.stderr.strip()[-500:]}")
    _, size, prepare, save = done.stdout.strip().split("\t")
    return str(path), {"nimble save": f"{prepare}, {save}, {int(size.split()[0]) / 2**20:.1f} MB"}


def measure(model: str, args, skip: set[str]) -> tuple[list[dict], dict]:
    """Every mode of ``model`` in fresh processes (see the module docstring)."""
    runs: dict[str, list[dict]] = {}
    extra: dict = {}
    common = ["--model", model, "--dtype", args.dtype, "--batch", str(args.batch),
              "--calls", str(args.calls)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        paths = {"prepare": ""}
        paths["nimble load"], once = _saved_file(model, args, folder)
        extra.update(once)
        for mode, what, name in (("compile warm", "compile cache", "cache.bin"),
                                 ("aoti load", "aoti package", "model.pt2")):
            if mode in skip:
                continue
            paths[mode] = str(folder / name)
            wrote = _spawn(["--write", what, *common, "--path", paths[mode]])
            if "failed" in wrote:
                extra[what] = f"failed ({wrote['failed']})"
                skip = skip | {mode}
                continue
            extra[what] = f"{wrote['seconds']:.1f} s, {wrote['bytes'] / 2**20:.1f} MB"
        for _ in range(args.rounds):
            for mode in MODES:
                if mode in skip:
                    continue
                runs.setdefault(mode, []).append(
                    _spawn(["--child", mode, *common, "--path", paths.get(mode, "")]))
    return summarize(runs), extra


def measure_generator(lm: str, args) -> tuple[list[dict], dict]:
    """A Generator of ``lm`` built and loaded in fresh processes, round after round."""
    common = ["--model", lm, "--dtype", args.dtype, "--batch", str(args.batch),
              "--calls", str(args.calls), "--prompt-buckets", args.prompt_buckets]
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / f"{lm}.nimble")
        env = {**os.environ, **NO_MULTICAST}
        done = subprocess.run([sys.executable, "-m", "nimble", "save", lm, "--generate",
                               "--dtype", args.dtype, "--batch", str(args.batch),
                               "--prompt-buckets", args.prompt_buckets, "-o", path, "-q"],
                              capture_output=True, text=True, env=env, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"nimble save {lm} --generate failed: {done.stderr[-500:]}")
        _, size, prepare, save = done.stdout.strip().split("\t")
        extra = {"nimble save --generate":
                 f"{prepare}, {save}, {int(size.split()[0]) / 2**20:.1f} MB"}
        for _ in range(args.rounds):
            for mode in GENERATOR_MODES:
                runs.setdefault(mode, []).append(
                    _spawn(["--child", mode, *common, "--path", path]))
    return summarize(runs), extra


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", default=["resnet50"])
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--skip", default="", help="modes to leave out: compile, aoti")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--generate", metavar="LM", help="a Generator of this causal LM instead")
    p.add_argument("--prompt-buckets", default="128", help="with --generate (default 128)")
    p.add_argument("--child", choices=MODES + GENERATOR_MODES, help=argparse.SUPPRESS)
    p.add_argument("--write", choices=("compile cache", "aoti package"), help=argparse.SUPPRESS)
    p.add_argument("--path", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child or args.write:
        print(json.dumps(_child(args.child, args) if args.child else _write_once(args.write,
                                                                                 args)))
        return 0
    unknown = [s for s in args.skip.split(",") if s and s not in SKIPPABLE]
    if unknown:
        p.error(f"--skip takes {', '.join(SKIPPABLE)}, not {unknown[0]}")
    skip = {SKIPPABLE[s] for s in args.skip.split(",") if s}
    if args.generate:
        report([args.generate], lambda name: measure_generator(name, args),
               lambda name, rows, extra: table(f"{name} Generator", rows, extra), args.json)
    else:
        report(args.models, lambda model: measure(model, args, skip), table, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
