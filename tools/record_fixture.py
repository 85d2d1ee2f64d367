"""Record models into TaskGraph fixtures for the CPU tests (run on the GPU machine).

    python3 tools/record_fixture.py [MODEL ...] [--out tests/fixtures] [--batch 1]
                                    [--dtype float16] [--training] [--compiled]

Each model (default: the built-in ones and the zoo) is recorded at batch 1 in eval mode, every
task is timed alone (``duration_us``), and the TaskGraph is written gzipped as
``OUT/<model>.json.gz`` (``OUT/<model>_<dtype>.json.gz`` for another dtype than float32).
With ``--training`` a training step (forward and backward, two phases) is recorded instead, at
the shapes ``nimble bench --training`` uses (CIFAR-10's 3×32×32 and 10 classes for resnet50,
mobilenet_v2 and efficientnet_b0; ImageNet's for the others), as ``OUT/<model>_train.json.gz``.
With ``--compiled`` the model is ``torch.compile(model)`` (Inductor's Triton kernels, traced by
their launches), as ``OUT/<model>_inductor.json.gz``.  A one-line summary per model goes to
stdout; a model that fails is
reported with its error and the others still run (exit status 1 if any failed).

``gpt2`` and ``llama_small`` are transformers decoders with random weights (no downloads; needs
``transformers``): ``GPT2Config()``'s 124M-parameter GPT-2, and a Llama of :data:`LLAMA_SMALL`'s
size, each wrapped to take input ids of :data:`TOKENS` tokens per sequence and return the last
hidden state, with no cache (the pattern of docs/inference.md, "Transformers").  Record them as
the CPU tests expect with ``python3 tools/record_fixture.py gpt2 llama_small --dtype float16``.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

DEFAULT_MODELS = ["branchy", "gemm_chains", "resnet50", "inception_v3", "googlenet",
                  "mobilenet_v2", "efficientnet_b0", "nasnetalarge", "pnasnet5large"]

#: The transformers decoders this tool builds (:func:`transformer_model`).
TRANSFORMERS = ("gpt2", "llama_small")
#: Tokens per sequence of their input ids.
TOKENS = 128
# The Llama-architecture model's size lives beside the causal LMs that decoding is tested and
# measured with (nimble/cli/decoders.py: gpt2_tiny, llama_1b, the language-model head on).
from nimble.cli.decoders import LLAMA_SMALL  # noqa: E402


def transformer_model(name: str, dtype: str = "float16", batch: int = 1):
    """``(model on the GPU in eval mode, input ids (batch, TOKENS))`` for ``gpt2`` or
    ``llama_small``, random weights from seed 0; the model maps input ids to the decoder's last
    hidden state without a cache."""
    import torch
    import transformers

    class LastHiddenState(torch.nn.Module):
        """Input ids in, the last hidden state out, no cache: what a CUDA graph can hold."""

        def __init__(self, model) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False).last_hidden_state

    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config()
        decoder = transformers.GPT2Model(config)
    elif name == "llama_small":
        config = transformers.LlamaConfig(**LLAMA_SMALL)
        decoder = transformers.LlamaModel(config)
    else:
        raise ValueError(f"no transformers model {name!r}; there are {', '.join(TRANSFORMERS)}")
    model = LastHiddenState(decoder).cuda().eval().to(getattr(torch, dtype))
    ids = torch.randint(0, config.vocab_size, (batch, TOKENS), device="cuda")
    return model, ids


def _model_and_input(name: str, batch: int, dtype: str, training: bool):
    """The model on the GPU in ``dtype`` and its example input."""
    import torch

    from nimble.cli import models
    from nimble.cli.train_bench import CIFAR_MODELS

    if name in TRANSFORMERS:
        if training:
            raise ValueError(f"{name} is recorded for inference only (no --training)")
        return transformer_model(name, dtype, batch)
    cifar = training and name in CIFAR_MODELS  # the shapes `nimble bench --training` uses
    model = models.create(name, num_classes=10 if cifar else None)
    model = model.cuda().to(getattr(torch, dtype))
    x = models.example_input(name, batch, side=32 if cifar else None)
    return model, x.to(getattr(torch, dtype))


def record_model(name: str, batch: int, out: Path, time_tasks: bool = True,
                 dtype: str = "float32", training: bool = False, compiled: bool = False) -> dict:
    import torch

    from nimble.record.recorder import record, record_step
    from nimble.driver.gpu import use_cudnn_benchmark
    from nimble.engine.task_timing import time_recording

    use_cudnn_benchmark()
    model, x = _model_and_input(name, batch, dtype, training)
    if compiled:
        model = torch.compile(model)
        with torch.no_grad():
            model.eval()(x)  # compile before the recording's clock starts
    t0 = time.perf_counter()
    if training:
        rec = record_step(model.train(), x, name=name, strict=False)
    else:
        with torch.no_grad():
            rec = record(model, x, name=name, strict=False)
    seconds = time.perf_counter() - t0
    g = rec.graph
    if time_tasks:
        for task, us in zip(g.tasks, time_recording(rec)):
            task.duration_us = round(us, 3)  # keeps the fixtures small
    if g.meta.get("unresolved_report"):
        print(g.meta["unresolved_report"], flush=True)
    stem = name if dtype == "float32" else f"{name}_{dtype}"
    stem += "_train" if training else ""
    stem += "_inductor" if compiled else ""
    path = g.save(out / f"{stem}.json.gz")
    return {"model": stem, "tasks": len(g.tasks), "kernels": len(g.kernel_tasks()),
            "ops": len(g.ops), "buffers": len(g.buffers),
            "unattributed": sum(1 for t in g.kernel_tasks() if t.op < 0),
            "unresolved": len(g.unresolved_pointers()),
            "triton_launches": g.meta.get("triton_launches", 0),
            "stale_pool_words": g.meta.get("stale_pool_words"),
            "scratch": sum(1 for b in g.buffers if b.kind == "scratch"),
            "external": sum(1 for b in g.buffers if b.kind == "external"),
            "record_s": round(seconds, 2), "kB": path.stat().st_size // 1024,
            "sum_us": round(sum(t.duration_us or 0 for t in g.tasks), 1)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=DEFAULT_MODELS)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--no-timing", action="store_true", help="skip per-task timing")
    parser.add_argument("--training", action="store_true",
                        help="record a training step (forward and backward)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="the dtype of the weights and the input (default float32)")
    parser.add_argument("--compiled", action="store_true",
                        help="record torch.compile(model) (Inductor's kernels)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in args.models:
        try:
            print(record_model(name, args.batch, args.out, not args.no_timing, args.dtype,
                               args.training, args.compiled), flush=True)
        except Exception:  # noqa: BLE001 - report and go on with the other models
            failed += 1
            print(f"{name}: FAILED", flush=True)
            traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
