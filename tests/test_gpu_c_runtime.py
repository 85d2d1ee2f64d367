"""Saved graphs run from C with no Python in the process (issue 49): nimble/c_runtime built with
the system compiler, tests/c_host/run_saved.c loading a file and running it."""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from nimble.engine.proof import NONDETERMINISTIC_SLACK as PROOF_SLACK
from test_gpu_saved import _conv_net

pytestmark = pytest.mark.gpu

HOST = Path(__file__).parent / "c_host" / "run_saved.c"
FORMAT, VERSION, DEVICE = 3, 4, 5  # nimble_status codes (nimble.h)


@pytest.fixture(scope="module")
def run_saved(tmp_path_factory) -> Path:
    from nimble.cli import c_runtime
    from nimble.cli.common import Fail

    out = tmp_path_factory.mktemp("c") / "run_saved"
    try:
        cmd = [c_runtime.compiler(), "-O2", "-std=c11", "-pthread", "-Wall", "-Wextra", "-I",
               str(c_runtime.FOLDER), "-I", str(c_runtime.cuda_include()), str(HOST),
               *[str(c_runtime.FOLDER / s) for s in c_runtime.SOURCES], "-o", str(out),
               *c_runtime.libcuda()]
    except Fail as e:
        pytest.skip(str(e))
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, " ".join(cmd) + "\n" + done.stderr
    return out


def _raw(t) -> bytes:
    import torch

    return t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()


def test_a_saved_graph_runs_from_c_bit_for_bit_with_python(run_saved, tmp_path):
    import nimble

    model, x = _conv_net()
    model.half()
    x = x.half()
    nm = nimble.Nimble(model).prepare(x, return_copies=True)
    _same_from_c(run_saved, nm, nm.save(tmp_path / "m.nimble"), x, tmp_path)


def _same_from_c(run_saved, nm, saved, x, tmp_path) -> None:
    """Three fresh inputs like ``x`` through ``saved`` run from C and through ``nm``: the same
    bytes out."""
    import torch

    inputs = [torch.randn_like(x) for _ in range(3)]
    (tmp_path / "in.raw").write_bytes(b"".join(_raw(i) for i in inputs))
    done = subprocess.run([str(run_saved), str(saved), str(tmp_path / "in.raw"),
                           str(tmp_path / "out.raw")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out.raw").read_bytes() == b"".join(_raw(nm(i)) for i in inputs)


def _low_bits_from_c(run_saved, tmp_path, listed, every: int) -> None:
    """A small network prepared again from its recording with every ``every``-th buffer that
    ``listed(buffer)`` picks among those its kernels point into listed as kept at its low address
    bits (as a recording lists those a word that may be an integer points into): the file's plan
    is of version 3, and the C runtime runs it with Python's bits."""
    import nimble
    from nimble.ir.saved_format import SavedFile

    model, x = _conv_net()
    first = nimble.Nimble(model).prepare(x, options=nimble.PrepareOptions(keep_recording=True))
    rec = first.recording
    graph = rec.graph
    pointed = {p.buffer for t in graph.tasks for p in t.pointers}
    graph.meta["low_word_buffers"] = [b.id for b in graph.buffers
                                      if listed(b) and b.id in pointed][::every]
    assert graph.meta["low_word_buffers"]
    nm = nimble.Nimble(model).prepare(x, return_copies=True,
                                      options=nimble.PrepareOptions(recording=rec))
    saved = nm.save(tmp_path / "low.nimble")
    assert int.from_bytes(SavedFile.read(saved).extra["c_plan"][8:16], "little") == 3
    _same_from_c(run_saved, nm, saved, x, tmp_path)


def test_buffers_kept_at_their_low_bits_run_from_c_bit_for_bit_with_python(run_saved,
                                                                          tmp_path):
    """Arena buffers kept at their low bits: the C runtime maps each at its recorded address
    plus a multiple of 4 GiB, proves the graph with them poisoned, and gives Python's bits."""
    _low_bits_from_c(run_saved, tmp_path, lambda b: b.relocatable, every=3)


def test_weights_kept_at_their_low_bits_run_from_c_bit_for_bit_with_python(run_saved,
                                                                          tmp_path):
    """Weight storages kept at their low bits (nasnetalarge's float16 file came with one): the
    plan keeps each as a low-bits buffer holding the file's bytes, and the C runtime, which
    refused such a file before, proves it and gives Python's bits."""
    _low_bits_from_c(run_saved, tmp_path, lambda b: b.kind == "param", every=2)


def test_bad_files_give_their_error_codes(run_saved, tmp_path):
    import nimble
    from nimble.ir.saved_format import SavedFile

    model, x = _conv_net()
    saved = nimble.Nimble(model).prepare(x).save(tmp_path / "m.nimble")
    data = saved.read_bytes()

    def code(name: str, content: bytes) -> tuple[int, str]:
        path = tmp_path / name
        path.write_bytes(content)
        done = subprocess.run([str(run_saved), str(path), "--bench", "1"], capture_output=True,
                              text=True, timeout=120)
        return done.returncode, done.stderr
    rc, err = code("truncated.nimble", data[:-100])
    assert rc == FORMAT and "truncated" in err
    newer = bytearray(data)
    struct.pack_into("<I", newer, 8, 3)
    rc, err = code("version.nimble", bytes(newer))
    assert rc == VERSION and "version 3" in err
    other = SavedFile.read(saved)
    plan = bytearray(other.extra["c_plan"])
    struct.pack_into("<Q", plan, 16, 80)  # the plan's third word: the architecture
    other.extra = {"c_plan": bytes(plan)}
    other.blobs = bytes(other.blobs)
    other.write(tmp_path / "arch.nimble")
    rc, err = code("arch2.nimble", (tmp_path / "arch.nimble").read_bytes())
    assert rc == DEVICE and "compute capability 80" in err


def _python_host_us(saved: Path, calls: int) -> float:
    """The host microseconds of one Python call of the same file (GPU idle before each),
    median of ``calls``: what run_saved's nimble_run is set against."""
    import statistics
    import time

    import torch

    import nimble

    nm = nimble.load(saved)
    slot = nm.engine.launcher.slots[0]
    x = torch.randn(slot.shape, device="cuda").to(slot.dtype)
    for _ in range(20):
        nm(x)
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        nm(x)
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(times), 2)


_PYTHON_DECODE = """
import json, sys
import torch, nimble
def _raw(t):
    return t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
step = nimble.load(sys.argv[1])
for s in step.engine.launcher.slots:
    print(json.dumps({"slot": list(s.shape), "dtype": str(s.dtype)}))
# Each step's outputs are read before the next call: a loaded graph's outputs are views of its
# static output buffers, which the next call writes again.
got = b""
for i, p in torch.load(sys.argv[2]):
    t, logits = step(i.cuda(), p.cuda())
    got += _raw(t) + _raw(logits)
open(sys.argv[3], "wb").write(got)
"""


def test_a_generators_decode_step_runs_from_c_as_from_python(run_saved, tmp_path):
    """A Generator's decode step saved alone (its static cache the file's external memory)
    runs from C: for a few steps at successive positions, the next token and the logits equal
    those of the same file loaded by Python, fed the same inputs from the same cache: bit for
    bit, except an output the saving process saw vary between replays of its own recording
    (its saved spread), which is held, as the proof at load holds it, to that spread."""
    import torch

    pytest.importorskip("transformers")
    worker = Path(__file__).parent / "workers" / "generator_worker.py"
    torch.save(torch.randint(0, 100, (1, 20)), tmp_path / "ids.pt")
    saved = tmp_path / "decode.nimble"
    done = subprocess.run([sys.executable, str(worker), "save-decode", str(saved),
                           str(tmp_path / "ids.pt"), str(tmp_path / "tokens.pt")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    steps = [(torch.tensor([[t]]), torch.tensor([p])) for t, p in ((5, 20), (17, 21), (3, 22))]
    (tmp_path / "in.raw").write_bytes(b"".join(_raw(ids) + _raw(pos) for ids, pos in steps))
    torch.save(steps, tmp_path / "steps.pt")
    # Python's side first, in its own process: a device-side assert there is then told apart
    # from one in the C runtime's run, and the slots it reports stand beside C's --info.
    python_side = subprocess.run([sys.executable, "-c", _PYTHON_DECODE, str(saved),
                                  str(tmp_path / "steps.pt"), str(tmp_path / "want.raw")],
                                 capture_output=True, text=True, timeout=300)
    print(python_side.stdout)
    assert python_side.returncode == 0, python_side.stderr[-4000:]
    info = subprocess.run([str(run_saved), str(saved), "--info"], capture_output=True,
                          text=True, timeout=120)
    print(info.stdout)
    assert info.returncode == 0, info.stderr
    done = subprocess.run([str(run_saved), str(saved), str(tmp_path / "in.raw"),
                           str(tmp_path / "out.raw")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    _same_steps((tmp_path / "out.raw").read_bytes(), (tmp_path / "want.raw").read_bytes(),
                len(steps), _saved_spread(saved), torch.float16)


def _same_steps(got: bytes, want: bytes, steps: int, spread: dict, dtype) -> None:
    """Per step, the next token (8 bytes) bit for bit and the logits (``dtype``) bit for bit,
    or within the proof's slack of the saved spread where the saving process saw them vary."""
    import torch

    assert len(got) == len(want)
    per_step = len(want) // steps
    for k in range(steps):
        at = k * per_step
        token = slice(at, at + 8)
        assert got[token] == want[token], f"step {k}: the next token differs"
        logits = [torch.frombuffer(bytearray(raw[at + 8:at + per_step]), dtype=dtype)
                  for raw in (got, want)]
        if 1 not in spread:
            assert torch.equal(*logits), f"step {k}: the logits (held bit for bit) differ"
        else:
            worst = float((logits[0].float() - logits[1].float()).abs().max())
            assert worst <= PROOF_SLACK * spread[1], (k, worst, spread[1])


def test_a_decode_steps_programmatic_edges_built_from_c_give_its_full_dependencies_outputs(
        run_saved, tmp_path):
    """The swapped tiny Llama's decode step, served with programmatic edges into Nimble's
    kernels and saved alone (tests/workers/programmatic_load_worker.py), loaded by the C runtime
    with NIMBLE_LOAD_PROGRAMMATIC (its proof at load passing with them built) and without: the
    same next tokens and logits for a few steps from the same cache.  Each way's host and GPU
    time per call is printed, not judged."""
    import json
    import os

    import torch

    pytest.importorskip("transformers")
    worker = Path(__file__).parent / "workers" / "programmatic_load_worker.py"
    saved = tmp_path / "decode.nimble"
    done = subprocess.run([sys.executable, str(worker), str(tmp_path / "g.nimble"), "24",
                           str(saved)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["saved_edges"] > 0
    steps = [(torch.tensor([[t]]), torch.tensor([p])) for t, p in ((5, 64), (17, 65), (3, 66))]
    (tmp_path / "in.raw").write_bytes(b"".join(_raw(ids) + _raw(pos) for ids, pos in steps))
    outputs = {}
    for way, env in (("full", {}), ("programmatic", {"RUN_SAVED_PROGRAMMATIC": "1"})):
        env = {**os.environ, **env}
        done = subprocess.run([str(run_saved), str(saved), str(tmp_path / "in.raw"),
                               str(tmp_path / f"{way}.raw")], capture_output=True, text=True,
                              timeout=120, env=env)
        assert done.returncode == 0, (way, done.stderr[-4000:])
        outputs[way] = (tmp_path / f"{way}.raw").read_bytes()
        bench = subprocess.run([str(run_saved), str(saved), "--bench", "200"],
                               capture_output=True, text=True, timeout=120, env=env)
        assert bench.returncode == 0, (way, bench.stderr[-4000:])
        print(way, bench.stdout.strip().splitlines()[-1])
    _same_steps(outputs["programmatic"], outputs["full"], len(steps), _saved_spread(saved),
                torch.bfloat16)


def _saved_spread(saved: Path) -> dict[int, float]:
    """The saved spread of the file's (one) graph's outputs: output index to the largest
    difference between replays of the saving process's own recording."""
    from nimble.ir.saved_format import SavedFile

    (bucket,) = SavedFile.read(saved).manifest["buckets"]
    return {int(i): float(d) for i, d in bucket["reference"]["spread"].items()}
