"""Helpers the test modules share: the recorded fixtures, random DAGs, zoo models.

Test modules import them as ``from helpers import ...`` (pytest puts ``tests/`` on the path);
``conftest.py`` keeps only pytest's hooks.
"""
from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest

FIXTURE_DIR = Path(__file__).parent / "fixtures"
FIXTURE_PATHS = sorted(FIXTURE_DIR.glob("*.json.gz"))


def random_dag(n: int, fanout: int, window: int, seed: int):
    """A DAG of ``n`` tasks, each after up to ``fanout`` random ones of the ``window`` before it."""
    import random

    from nimble.analysis.deps import dag_from_edges

    rng = random.Random(seed)
    edges = [(u, v) for v in range(1, n)
             for u in rng.sample(range(max(0, v - window), v), min(fanout, v, window))]
    return dag_from_edges(n, edges)


def fixture_ids() -> list[str]:
    return [p.name.split(".")[0] for p in FIXTURE_PATHS]


def zoo_model(name: str):
    """``(model on the GPU, example input)`` for a built-in or zoo model; skips without its package."""
    from nimble.cli import models
    from nimble.driver.gpu import use_cudnn_benchmark

    use_cudnn_benchmark()
    try:
        return models.create(name).cuda(), models.example_input(name)
    except ImportError as e:
        pytest.skip(str(e))


def load_tool(name: str):
    """The script ``tools/<name>.py`` as a module (tools are not a package); ``name`` may name
    a subfolder (``experiments/param_access``), the module is named after the file."""
    import importlib.util
    import sys

    tools = Path(__file__).resolve().parent.parent / "tools"
    if str(tools) not in sys.path:  # as for a script run from there: tools import each other
        sys.path.insert(0, str(tools))
    path = tools / f"{name}.py"
    spec = importlib.util.spec_from_file_location(Path(name).name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _gloo_rank(rank: int, body, world: int, init: str, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        body(rank, results)
    finally:
        dist.destroy_process_group()


def gloo_ranks(body, world: int = 2) -> dict:
    """Run ``body(rank, results)`` (a module-level function) in ``world`` CPU processes of one
    gloo process group; what they put in ``results`` (a shared dict), as a dict.  Skips where
    this torch has no gloo."""
    import os
    import tempfile

    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.spawn(_gloo_rank, args=(body, world, init, results), nprocs=world, join=True)
        return dict(results)


def param_words(kernel_params, count: int) -> list[int]:
    """The first ``count`` 64-bit arguments a kernel node's ``kernelParams`` (an array of
    pointers to the arguments) points at, as a stand-in driver reads them."""
    import ctypes

    slots = ctypes.cast(kernel_params, ctypes.POINTER(ctypes.c_void_p))
    return [ctypes.c_uint64.from_address(slots[i]).value for i in range(count)]


def timed_stand_in(faster: bool, wins):
    """A stand-in for ``nimble.engine.prepared._after_phases``: launches of a built graph for
    which ``wins(built)`` holds take 0.9 of the others' time where ``faster``, and 0.999 (below
    the gain a measured choice must show) where not."""
    def launch(before, stream, refresh):
        def timed(built, count):
            return count * ((0.9 if faster else 0.999) if wins(built) else 1.0)
        return timed
    return launch


def attention_reference(q, k, v, keep, scale):
    """Single-query attention in float64, the key and value heads repeated for the query heads
    that share them, ``keep`` (boolean, broadcastable to the scores) hiding slots: ``(B, 1, H,
    D)``, as ``nimble.decode_attention`` gives it."""
    import torch

    groups = q.shape[1] // k.shape[1]
    keys, values = (t.repeat_interleave(groups, 1).double() for t in (k, v))
    scores = (q.double() @ keys.transpose(-1, -2)) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return (torch.softmax(scores, -1) @ values).transpose(1, 2)


def generator_worker_tokens(tmp_path, save_mode: str, ids) -> tuple:
    """tests/workers/generator_worker.py run twice in fresh processes, ``save_mode`` (which
    saves a Generator to a file) then ``load``, on prompt ``ids``: the tokens each decoded, and
    the load's last line of output."""
    import subprocess
    import sys

    import torch

    worker = Path(__file__).parent / "workers" / "generator_worker.py"
    torch.save(ids, tmp_path / "ids.pt")
    tokens, said = [], ""
    for mode in (save_mode, "load"):
        out = tmp_path / f"{mode}.pt"
        done = subprocess.run([sys.executable, str(worker), mode, str(tmp_path / "g.nimble"),
                               str(tmp_path / "ids.pt"), str(out)],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        said = done.stdout.strip().splitlines()[-1]
        tokens.append(torch.load(out))
    return tokens[0], tokens[1], said



def swapped_llama_small():
    """``llama_small`` in bfloat16 on the GPU with its sibling projections fused, every
    single-row GEMM on Nimble's GEMV whatever was measured, and its attention on
    ``nimble.decode_attention``: ``(model, swap)``, ``swap.undo()`` taking the attention back."""
    pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    from nimble.cli.decoders import causal_lm
    from nimble.decode_attention import decode_attention
    from nimble.fast_gemv import fast_gemv
    from nimble.fused_projections import fuse_projections

    model = causal_lm("llama_small", "bfloat16")
    fuse_projections(model)
    fast_gemv(model, time=lambda config, weights, x: 1.0 if config is None else 0.5)
    return model, decode_attention(model)


def interpreted_cases(worker: Path) -> dict:
    """A worker's kernel cases run by Triton's interpreter in a process of its own (the
    interpreter must be asked for before Triton is imported): its JSON lines by case."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="the kernel's CPU test runs Triton's interpreter")
    done = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["case"]: r for r in map(json.loads, done.stdout.splitlines())}


def tiny_decoder(family: str, *, hidden: int = 128, intermediate: int = 256, vocab: int = 500,
                 head_dim: int = 32, **config):
    """A tiny causal LM of transformers' ``family`` (``Qwen2``, ``Mistral``, ...: its
    ``{family}Config`` and ``{family}ForCausalLM``), two layers of 4 query and 2 key-value
    heads, seeded; the test is skipped where this transformers has no such family."""
    import torch

    transformers = pytest.importorskip("transformers")
    config_class = getattr(transformers, f"{family}Config", None)
    model_class = getattr(transformers, f"{family}ForCausalLM", None)
    if config_class is None or model_class is None:
        pytest.skip(f"this transformers has no {family}")
    made = config_class(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                        pad_token_id=0, head_dim=head_dim, **config)
    torch.manual_seed(0)
    return model_class(made).eval()


@contextlib.contextmanager
def busy_gpu():
    """bf16 matmuls on a stream of their own, in bursts, until the block ends."""
    import torch

    stop = threading.Event()
    stream = torch.cuda.Stream()
    xs = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for n in (256, 1024, 4096)]

    def run():
        k = 0
        with torch.cuda.stream(stream):
            while not stop.is_set():
                x = xs[k % 3]
                for _ in range(1 + k % 7):
                    x @ x
                stream.synchronize()
                k += 1
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()


def in_threads(body, streams) -> list[str]:
    """``body(k, failures)`` on one thread per stream, thread ``k`` on ``streams[k]``; what
    went wrong, an exception included."""
    import torch

    failures: list[str] = []

    def worker(k: int) -> None:
        try:
            with torch.cuda.stream(streams[k]):
                body(k, failures)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            failures.append(f"thread {k} stopped: {type(e).__name__}: {e}")
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures
