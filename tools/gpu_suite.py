"""The whole GPU check in one call: the GPU tests, then the benchmark, its table last.

    python3 tools/gpu_suite.py [--models M,M,...] [--dtypes D,D,...] [--compile] [--full]
                               [--training-models M,M,...] [--training-batches B,B,...]
                               [--skip-tests] [--skip-bench] [--skip-training] [--out DIR]
                               [--jobs N] [--gpus auto|I,I,...] [--only F,F] [--exclude F,F]
                               [--part K/N] [--deadline S]

Runs, in order:

1. ``pytest -m gpu``: every test that needs the GPU (383-551 s on the H200 on 2026-11-25, with the
   two-model training sequence and the expandable-segments test in child processes; the files
   added since have made it longer).  On a machine with several GPUs the test files are spread
   over all of them, a *lane* per GPU (each pytest process sees its GPU alone,
   ``CUDA_VISIBLE_DEVICES``); with ``--jobs N``, N pytest processes side by side on each GPU
   (correctness tests only: none times anything); a file of :data:`SPLIT`, too long for one
   process within a device call, runs as that many shares, each a process of its own
   (``NIMBLE_TEST_SHARD``, tests/conftest.py) spread like files; the files that need several
   GPUs (:data:`MULTI_GPU`) run beside them in one more process that sees every GPU.  Then the
   files that measure the device's free memory (:data:`EXCLUSIVE`) run alone on their GPUs.
   Where one device call is too short for the whole suite, ``--part K/N`` runs the K-th of N
   groups of about equal :data:`WEIGHTS` (how long each run took: docs/results.md, "The GPU
   suite on four GPUs").  The GPUs are those of
   ``CUDA_VISIBLE_DEVICES`` where it is set, else those ``nvidia-smi -L`` lists (torch is not
   asked: importing it here would start CUDA in this process), or ``--gpus``; every process
   this tool starts has NVLink multicast off (:data:`NO_MULTICAST`);
2. ``nimble bench --quick --dtype float32,float16,bfloat16 --rounds 5 --iters 50`` on
   ``--models`` (default: branchy and the seven zoo models): eager, ``torch.cuda.graph`` (input
   copied in on every call), Nimble single and multi, in each dtype (258 s for the seven zoo
   models on the H200 on 2026-11-25).  Together the two pass one device command's 10 minutes:
   run them as two calls (``--skip-bench --skip-training``, then ``--skip-tests``);
3. ``nimble bench --training --rounds 3 --iters 10`` on ``--training-models`` (default resnet50,
   mobilenet_v2, efficientnet_b0, googlenet) at ``--training-batches`` (default 32): eager,
   ``make_graphed_callables``, Nimble single and multi training steps;
4. with ``--full``, also ``nimble bench`` in float32 with every variant (stream caps, uncapped,
   host launch) and the critical-path limit: several more minutes, so better as its own call
   (``--skip-tests --skip-bench --full``), since one device command may run 10 minutes.

``torch.compile`` is left out unless ``--compile``.  Each pytest process's summary line is
printed as the process ends, with the seconds since its stage began (a call cut off by a time
limit still shows what ended); with ``--deadline S``, the processes still running S seconds
after the tests began are stopped, each with a line of what its tests did so far (every
process writes each test's outcome and seconds to ``gpu_tests_NAME.times.tsv`` as it ends,
:data:`TIMES_ENV`); after the tests, the slowest of them; at the end, every such line again and
the benchmark tables.  Logs and the benchmark JSON go to
``--out`` (default ``$OUT`` on the device machine, else ``./out``): ``gpu_tests_NAME.log`` (one
per pytest process, named after its first test file, ``gpu_tests_all.log`` for one process),
``bench.log`` / ``bench.json`` and ``bench_full.log`` / ``bench_full.json`` (a bench's log holds
its stdout and stderr), and ``nimble-fault-*.json.gz`` and ``nimble-mismatch-*.json.gz``, the
recording of any graph that faulted in its proof (:class:`nimble.GraphFaultError`) or failed it
(:class:`nimble.VerificationError`); the logs are written as the phases run, so a
phase cut off by a time limit leaves what it printed so far.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ZOO_MODELS = "resnet50,inception_v3,googlenet,mobilenet_v2,efficientnet_b0,nasnetalarge," \
             "pnasnet5large"
ALL_MODELS = "branchy," + ZOO_MODELS
QUICK_ARGS = ["--quick", "--rounds", "5", "--iters", "50"]
#: GPU test files that measure the whole device's free memory or serve under a time window:
#: they run alone, after the rest.
EXCLUSIVE = ("test_gpu_serving.py", "test_gpu_serve_bench.py")
#: Rough minutes per GPU test file on an H200 shared with other pytest processes, to spread the
#: files over the lanes (a file not listed counts 1), from the suite's runs on four H200s
#: (docs/results.md): saved-graph shares 5-8 minutes, training 5-8, the proof with two small
#: files 8, the collectives' file 8 beside the lanes, each share of the C runtime's zoo file 4
#: beside one other process; both debugging tools' files, alone on a GPU, 1.3 minutes since the
#: walks' compares run on the GPU.  Each test's seconds are in the times files
#: (:data:`TIMES_ENV`) to set them from.
WEIGHTS = {"test_gpu_debug_tools.py": 2, "test_gpu_debug_tools_wide.py": 1,
           "test_gpu_training.py": 8, "test_gpu_proof.py": 5,
           "test_gpu_runtime.py": 1, "test_gpu_compiled.py": 1, "test_gpu_generate.py": 1,
           "test_gpu_record.py": 1, "test_gpu_proof_power.py": 1, "test_gpu_c_host.py": 1,
           "test_gpu_deploy.py": 1, "test_gpu_saved.py": 24, "test_gpu_c_runtime.py": 1,
           "test_gpu_compile_backend.py": 1, "test_gpu_collectives.py": 7,
           "test_gpu_c_zoo.py": 8}
#: Files too long for one process within a device call: each runs as this many shares, a
#: process each (``NIMBLE_TEST_SHARD``, tests/conftest.py: a test's index modulo the count),
#: spread like files.  Two of the training file's shares keep its 8.6 minutes from being the
#: longest lane.
SPLIT = {"test_gpu_saved.py": 5, "test_gpu_training.py": 2, "test_gpu_c_zoo.py": 2}
#: GPU test files that need several GPUs (each its count): one process sees every GPU.
MULTI_GPU = {"test_gpu_collectives.py": 2}
#: In the environment of every process the suite starts: NVLink multicast (NVLS) off, for
#: NCCL, torch's symmetric memory and NVSHMEM alike, as the multi-GPU tests are run.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
#: NCCL's guard for graph-captured and eager collectives on one communicator (an event wait and
#: an event record around each captured collective) off: those event nodes keep a graph from
#: being device-launched (docs/inference.md, "Device launch").  With it off, an eager collective
#: must not run on the communicator while a graph launch that uses it is still running; one
#: stream's order, as the benches keep, is enough.
GRAPH_MIXING_OFF = {"NCCL_GRAPH_MIXING_SUPPORT": "0"}
#: Each pytest process writes its tests' outcomes and seconds to the file this names as each
#: test ends (tests/conftest.py), so that a process cut off at the deadline still says what it
#: passed and where its time went.
TIMES_ENV = "NIMBLE_TEST_TIMES"
#: The slowest tests printed after the test stages, from every process's times file.
SLOWEST = 15


def collective_environment(keep_graph_mixing: bool) -> dict:
    """What a bench across GPUs sets before it makes its process group: multicast off, and
    NCCL's graph mixing off unless ``keep_graph_mixing``."""
    return {**NO_MULTICAST, **({} if keep_graph_mixing else GRAPH_MIXING_OFF)}


def start_rank(keep_graph_mixing: bool) -> tuple[int, int]:
    """A bench's rank under ``torchrun``: :func:`collective_environment` set, this rank's GPU
    current and the NCCL process group made; ``(rank, world size)``."""
    os.environ.update(collective_environment(keep_graph_mixing))
    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", 0))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    return rank, dist.get_world_size()


@dataclass(frozen=True)
class Share:
    """The ``index``-th of ``count`` shares of a test file's tests (:data:`SPLIT`)."""

    path: Path
    index: int
    count: int

    @property
    def name(self) -> str:
        return self.path.name

    def __str__(self) -> str:
        return str(self.path)


def weight(f) -> float:
    """A file's (or share's) rough minutes (:data:`WEIGHTS`)."""
    return WEIGHTS.get(f.name, 1) / (f.count if isinstance(f, Share) else 1)


def shares(files: list) -> list:
    """``files`` with each file of :data:`SPLIT` as its shares (a share stays as it is)."""
    return [Share(f, i, SPLIT[f.name]) for f in files
            if f.name in SPLIT and not isinstance(f, Share) for i in range(SPLIT[f.name])] + \
        [f for f in files if f.name not in SPLIT or isinstance(f, Share)]


def part_of(files: list, part: int, parts: int) -> list:
    """The ``part``-th (from 1) of ``parts`` groups of about equal :data:`WEIGHTS` that
    ``files`` (split files as their shares) fall into, for a suite run over several device
    calls; the groups together hold every file and share once."""
    if parts == 1:
        return shares(files)
    groups = test_groups(shares(files), parts)
    return groups[part - 1] if part <= len(groups) else []


def parse_part(text: str) -> tuple[int, int]:
    """``--part K/N`` as ``(K, N)``; SystemExit unless 1 <= K <= N."""
    k, _, n = text.partition("/")
    try:
        part, parts = int(k), int(n)
    except ValueError:
        part, parts = 0, 0
    if not 1 <= part <= parts:
        raise SystemExit(f"gpu_suite: --part {text!r} is not K/N with 1 <= K <= N")
    return part, parts


def shard_setting(files) -> str:
    """``NIMBLE_TEST_SHARD`` for a process running ``files`` ("" where none is a share)."""
    picked: dict = {}
    for f in files:
        if isinstance(f, Share):
            picked.setdefault((f.name, f.count), set()).add(f.index)
    return ";".join(f"{name}:{','.join(map(str, sorted(i)))}/{k}"
                    for (name, k), i in sorted(picked.items()))


def process_files(files) -> list[str]:
    """The paths a pytest process is given: each file once, its shares set apart."""
    out: list[str] = []
    for f in files:
        if str(f) not in out:
            out.append(str(f))
    return out


@dataclass(frozen=True)
class Run:
    """One pytest process: its test files (or folders), and the GPUs it sees (its
    ``CUDA_VISIBLE_DEVICES``; empty: as the suite's own environment has it)."""

    files: tuple
    gpus: tuple = ()


def visible_gpus(environ, list_gpus=None) -> list[str]:
    """The GPUs to spread the tests over: ``CUDA_VISIBLE_DEVICES``'s entries where it is set,
    else the indices ``list_gpus()`` (default: ``nvidia-smi -L``'s lines) names; [] where
    neither says (the tests then run in the environment as it is)."""
    given = environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    lines = (list_gpus or _nvidia_smi)()
    return [m.group(1) for m in (re.match(r"GPU (\d+):", line) for line in lines) if m]


def _nvidia_smi() -> list[str]:
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return r.stdout.splitlines() if r.returncode == 0 else []


def parse_gpus(text: str, environ, list_gpus=None) -> list[str]:
    """``--gpus``: "auto" (:func:`visible_gpus`) or the GPUs' indices, comma-separated."""
    if text == "auto":
        return visible_gpus(environ, list_gpus)
    return [d.strip() for d in text.split(",") if d.strip()]


def plan_runs(files: list[Path], gpus: list[str], jobs: int) -> list[list[Run]]:
    """The test files as stages of pytest processes; the processes of a stage run at once.

    First every shared file, in ``jobs`` groups per GPU of about equal :data:`WEIGHTS`, and
    beside them the :data:`MULTI_GPU` files in one process that sees every GPU (their tests
    time nothing, and their ranks' processes fit beside the lanes); then the
    :data:`EXCLUSIVE` files, at most one process per GPU, alone on the machine.  Where there is
    one GPU or none, the multi-GPU files run with the shared files and skip themselves."""
    lanes = [(g,) for g in gpus] or [()]
    multi = [f for f in files if f.name in MULTI_GPU and len(gpus) > 1]
    alone = [f for f in files if f.name in EXCLUSIVE and f not in multi]
    shared = [f for f in files if f not in multi and f not in alone]
    stages = [[Run(tuple(g), lanes[k % len(lanes)])
               for k, g in enumerate(test_groups(shares(shared), len(lanes) * max(jobs, 1)))]
              + ([Run(tuple(multi), tuple(gpus))] if multi else []),
              [Run(tuple(g), lanes[k]) for k, g in enumerate(test_groups(alone, len(lanes)))]]
    return [stage for stage in stages if stage]


def run_environment(env: dict, run: Run) -> dict:
    """The environment of ``run``'s process: ``env``, multicast off, its GPUs, and the shares
    of split files it runs."""
    out = {**env, **NO_MULTICAST}
    if run.gpus:
        out["CUDA_VISIBLE_DEVICES"] = ",".join(run.gpus)
    shard = shard_setting(run.files)
    if shard:
        out["NIMBLE_TEST_SHARD"] = shard
    else:
        out.pop("NIMBLE_TEST_SHARD", None)
    return out


def test_groups(files: list[Path], jobs: int) -> list[list[Path]]:
    """``files`` in ``jobs`` groups of about equal :data:`WEIGHTS`, heaviest placed first."""
    groups: list[list[Path]] = [[] for _ in range(max(jobs, 1))]
    load = [0.0] * len(groups)
    for f in sorted(files, key=lambda f: -weight(f)):
        k = load.index(min(load))
        groups[k].append(f)
        load[k] += weight(f)
    return [g for g in groups if g]


def _selected(files: list[Path], args) -> list[Path]:
    """``files`` narrowed by ``--only`` and ``--exclude`` (comma-separated file names, with or
    without the ``test_gpu_`` prefix and ``.py``)."""
    def names(text: str) -> set[str]:
        out = set()
        for n in filter(None, (t.strip() for t in text.split(","))):
            n = n if n.endswith(".py") else n + ".py"
            out.add(n if n.startswith("test_gpu_") else "test_gpu_" + n)
        return out
    only, exclude = names(args.only), names(args.exclude)
    unknown = (only | exclude) - {f.name for f in files}
    if unknown:
        raise SystemExit(f"gpu_suite: no such GPU test file: {', '.join(sorted(unknown))}")
    return [f for f in files if (not only or f.name in only) and f.name not in exclude]


def _pytest(files: list[Path], log_path: Path, extra: list[str], env) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           *process_files(files), *extra]
    log = open(log_path, "w")
    # a session of its own: a cut-off process's children (torchrun's ranks) are stopped with it
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    proc.log = log  # type: ignore[attr-defined]  # closed when the process is waited for
    return proc


def _log_name(group: list[Path]) -> str:
    """A group's log, named after its first test file: a second invocation (another group)
    never writes over the log of a failure."""
    first = group[0]
    path = first.path if isinstance(first, Share) else Path(first)
    share = f"_{first.index + 1}of{first.count}" if isinstance(first, Share) else ""
    return "gpu_tests_" + (path.stem.removeprefix("test_gpu_") + share if path.suffix
                           else "all") + ".log"


def _stages(args) -> list[list[Run]]:
    """What :func:`_run_tests` runs: the whole folder in one process on one GPU (or none)
    without ``--jobs``, ``--only``, ``--exclude`` or ``--part``; else :func:`plan_runs` of
    the files (of ``--part``'s group of them)."""
    part, parts = parse_part(args.part)
    if len(args.gpus) <= 1 and args.jobs <= 1 and not (args.only or args.exclude) \
            and parts == 1:
        return [[Run((ROOT / "tests",), tuple(args.gpus))]]
    files = _selected(sorted((ROOT / "tests").glob("test_gpu_*.py")), args)
    return plan_runs(part_of(files, part, parts), args.gpus, args.jobs)


def _run_tests(args, env) -> tuple[int, list[str]]:
    """The GPU tests, stage by stage (:func:`_stages`); (status, summary lines).  Each
    process's result is printed as soon as it ends, with its own seconds, so that a call cut
    off by a time limit still shows what ended and how long it took."""
    extra = shlex.split(args.pytest_args)
    status, summary = 0, []
    began = time.perf_counter()
    stages = _stages(args)
    for at, stage in enumerate(stages):
        t0 = time.perf_counter()
        logs = [args.out / _log_name(list(run.files)) for run in stage]
        for log in logs:
            times_path(log).unlink(missing_ok=True)  # a former run's, in the same folder
        running = {k: _pytest(list(run.files), log, extra,
                              {**run_environment(env, run), TIMES_ENV: str(times_path(log))})
                   for k, (run, log) in enumerate(zip(stage, logs))}
        while running:
            if args.deadline is not None and time.perf_counter() - began > args.deadline:
                for k, proc in sorted(running.items()):
                    _stop(proc)
                    proc.log.close()
                    line = _cut_off(stage[k], logs[k], time.perf_counter() - t0)
                    summary.append(line)
                    print(line, flush=True)
                later = [_names(run) for stage in stages[at + 1:] for run in stage]
                if later:
                    summary.append("not started at the deadline: " + "; ".join(later))
                    print(summary[-1], flush=True)
                return 1, summary + _slowest(args.out)
            ended = [k for k, proc in running.items() if proc.poll() is not None]
            if not ended:
                time.sleep(0.5)
                continue
            for k in ended:
                proc = running.pop(k)
                proc.log.close()
                line = _ended(stage[k], logs[k], time.perf_counter() - t0)
                summary.append(line)
                print(line, flush=True)
                status |= proc.returncode
    return status, summary + _slowest(args.out)


def times_path(log: Path) -> Path:
    """The times file (:data:`TIMES_ENV`) of the pytest process that writes ``log``."""
    return log.with_suffix(".times.tsv")


def read_times(path: Path) -> list[tuple[str, float, str]]:
    """``(outcome, seconds, test id)`` per test a process ended, from its times file (none
    where it wrote none)."""
    rows = []
    try:
        text = path.read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        outcome, _, rest = line.partition("\t")
        seconds, _, test = rest.partition("\t")
        try:
            rows.append((outcome, float(seconds), test))
        except ValueError:
            continue  # a line cut off as the process was stopped
    return rows


def _stop(proc) -> None:
    """Stop a pytest process cut off at the deadline, and its children: SIGTERM to its session,
    SIGKILL 10 s later if it still runs."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _names(run: Run) -> str:
    """The test files of ``run``'s process, each share with its number."""
    return " ".join(f"{f.name} ({f.index + 1}/{f.count})" if isinstance(f, Share)
                    else Path(f).name for f in run.files)


def _cut_off(run: Run, log: Path, seconds: float) -> str:
    """The summary line of ``run``'s process stopped at the deadline: what its tests did so
    far, from its times file."""
    rows = read_times(times_path(log))
    counts: dict[str, int] = {}
    for outcome, _, _ in rows:
        counts[outcome] = counts.get(outcome, 0) + 1
    failed = [test for outcome, _, test in rows if outcome in ("failed", "error")]
    if failed:
        print("\n".join(f"FAILED {test}" for test in failed), flush=True)
    done = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no test ended"
    return f"{_head(run, seconds)}cut off at the deadline; {done}"


def _slowest(out: Path, count: int = SLOWEST) -> list[str]:
    """One summary block: the ``count`` slowest tests of every times file under ``out``."""
    rows = [row for path in sorted(out.glob("*.times.tsv")) for row in read_times(path)]
    if not rows:
        return []
    rows.sort(key=lambda r: -r[1])
    return ["slowest tests (s, outcome, test):\n" + "\n".join(
        f"{seconds:8.1f}  {outcome:7}  {test}" for outcome, seconds, test in rows[:count])]


def _ended(run: Run, log: Path, seconds: float) -> str:
    """The summary line of ``run``'s ended process (its failures printed first)."""
    lines = log.read_text().strip().splitlines()
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    if failed:
        print("\n".join(failed), flush=True)
    return _head(run, seconds) + (lines[-1] if lines else "no output")


def _head(run: Run, seconds: float) -> str:
    """How a summary line of ``run``'s process begins: its GPUs, files and seconds."""
    where = f" on GPU {','.join(run.gpus)}" if run.gpus else ""
    return f"gpu tests{where} [{_names(run)}] ({seconds:.0f} s): "


def _split_table(out: str) -> tuple[str, str | None]:
    """``(the rest, the table)`` of a bench's log: the table runs from its header line (which
    starts with ``model``) to its legend (which starts with ``times:``)."""
    lines = out.rstrip().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("model ")), None)
    if start is None:
        return "\n".join(lines), None
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("times:")),
               len(lines) - 1) + 1
    return "\n".join(lines[:start] + lines[end:]), "\n".join(lines[start:end])


def _bench(title: str, models: str, extra: list[str], name: str, args, env) -> tuple[int, str]:
    """Run one ``nimble bench``; print its per-model reports, return its status and table."""
    cmd = [sys.executable, "-m", "nimble", "bench", *models.split(","),
           "--json", str(args.out / f"{name}.json"), *extra]
    if not args.compile:
        cmd.append("--no-compile")
    print(f"\n$ nimble {' '.join(cmd[3:])}", flush=True)
    t0 = time.perf_counter()
    with open(args.out / f"{name}.log", "w") as log:  # progress and errors (stderr) too
        r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                           text=True)
    seconds = time.perf_counter() - t0
    before, table = _split_table((args.out / f"{name}.log").read_text())
    print(before, flush=True)
    if table is None:
        table = "bench printed no table; it ended with:\n" + "\n".join(before.splitlines()[-5:])
    return r.returncode, f"{title} ({seconds:.0f} s, exit {r.returncode}):\n{table}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=ALL_MODELS, help="the benchmark's models")
    p.add_argument("--dtypes", default="float32,float16,bfloat16",
                   help="the benchmark's dtypes (default float32,float16,bfloat16)")
    p.add_argument("--compile", action="store_true", help="include torch.compile in the benches")
    p.add_argument("--full", action="store_true",
                   help="also the float32 bench with every variant and the critical-path limit")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-bench", action="store_true", help="skip the (quick) benchmark")
    p.add_argument("--training-models", default="resnet50,mobilenet_v2,efficientnet_b0,googlenet",
                   help="the training benchmark's models")
    p.add_argument("--training-batches", default="32", help="the training benchmark's batches")
    p.add_argument("--skip-training", action="store_true", help="skip the training benchmark")
    p.add_argument("--pytest-args", default="",
                   help="extra pytest arguments, one string split as a shell does")
    p.add_argument("--jobs", type=int, default=1,
                   help="run the GPU test files in this many pytest processes at once per GPU")
    p.add_argument("--gpus", default="auto",
                   help="the GPUs to spread the test files over: auto (CUDA_VISIBLE_DEVICES, "
                        "else nvidia-smi -L) or indices like 0,2,3")
    p.add_argument("--only", default="",
                   help="run only these GPU test files (comma-separated, e.g. serving,proof)")
    p.add_argument("--exclude", default="", help="leave these GPU test files out")
    p.add_argument("--part", default="1/1",
                   help="K/N: run the K-th of N groups of about equal length of the test files "
                        "and shares (the suite over N device calls)")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="stop the test processes still running S seconds after the tests "
                        "began, and report what each passed so far (set it under the device "
                        "call's limit, so that the report is printed)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "out")))
    args = p.parse_args(argv)
    args.gpus = parse_gpus(args.gpus, os.environ)
    args.out.mkdir(parents=True, exist_ok=True)
    # a recording whose rebuilt graph faults in its proof is saved beside the logs
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NIMBLE_FAULT_DIR": str(args.out),
           **NO_MULTICAST}
    summary = []
    status = 0
    if not args.skip_tests:
        rc, lines = _run_tests(args, env)
        summary += lines
        status |= rc
    if not args.skip_bench:
        rc, table = _bench(f"bench {args.dtypes} (--quick)", args.models,
                           ["--dtype", args.dtypes, *QUICK_ARGS], "bench", args, env)
        summary.append(table)
        status |= rc
    if not args.skip_training:
        rc, table = _bench(f"training bench, batch {args.training_batches}",
                           args.training_models, ["--training", "--batch", args.training_batches,
                                                  "--rounds", "3", "--iters", "10"],
                           "bench_training", args, env)
        summary.append(table)
        status |= rc
    if args.full:
        rc, table = _bench("bench float32, every variant", args.models, [], "bench_full", args,
                           env)
        summary.append(table)
        status |= rc
    print("\n" + "\n\n".join(summary))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
