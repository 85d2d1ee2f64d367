"""The modes of ``nimble bench --serve`` on the GPU: each built for a model and a set of batch
sizes as a :class:`~nimble.cli.serve_load.Served` (a call per client and what frees them), the
clients' CUDA streams, the device memory probe, and the load's inputs with their eager outputs.
"""
from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from typing import Callable, ContextManager

from .serve_load import INPUTS_PER_BATCH, Load, ModeRun, Served


class CudaStreams:
    """:class:`~nimble.cli.serve_load.StreamOps` on torch's CUDA streams."""

    def new(self):
        import torch

        return torch.cuda.Stream()

    def on(self, stream) -> ContextManager:
        import torch

        return torch.cuda.stream(stream)

    def wait(self, stream) -> None:
        stream.synchronize()


class CudaMemory:
    """:class:`~nimble.cli.serve_load.DeviceMemory` from ``torch.cuda.mem_get_info()``, dead
    objects collected first.

    Releasing the cache drops torch's cuBLAS workspaces too (one per handle and stream, held
    outside the cache): a prepare drops them around its capture, so workspaces cached by the
    previous mode's client streams would otherwise be freed inside the next mode's build and
    counted against it."""

    def free_bytes(self, release_cache: bool) -> int:
        import torch

        from ..record.capture import clear_blas_workspaces

        gc.collect()
        torch.cuda.synchronize()
        if release_cache:
            clear_blas_workspaces()
            torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]


def _clone(out):
    if isinstance(out, (tuple, list)):
        return type(out)(_clone(o) for o in out)
    return out.clone()


@dataclass
class _BucketGraph:
    """One batch size's ``torch.cuda.graph`` and its static input and output."""
    static_x: object
    graph: object
    static_out: object


def _capture_buckets(model, examples: dict[int, object], pool) -> dict[int, _BucketGraph]:
    """A graph per batch size into ``pool``, largest first (the others then fit in its blocks)."""
    import torch

    graphs = {}
    for batch in sorted(examples, reverse=True):
        static_x = examples[batch].clone()
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, pool=pool):
            static_out = model(static_x)
        graphs[batch] = _BucketGraph(static_x, graph, static_out)
    return graphs


def _warm_on_side_stream(model, examples: dict[int, object]) -> None:
    """Three eager calls per batch size on a side stream, as capture wants (cuDNN's autotuning
    and lazy initialization over before it)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for x in examples.values():
            for _ in range(3):
                model(x)
    torch.cuda.current_stream().wait_stream(side)


def build_graphs(model, examples: dict[int, object], clients: int) -> Served:
    """Per client, its graphs (one per batch size) sharing a pool of its own."""
    import torch

    _warm_on_side_stream(model, examples)
    per_client = [_capture_buckets(model, examples, torch.cuda.graph_pool_handle())
                  for _ in range(clients)]

    def call_of(graphs: dict[int, _BucketGraph]) -> Callable:
        def call(x):
            g = graphs[x.shape[0]]
            g.static_x.copy_(x)
            g.graph.replay()
            return _clone(g.static_out)
        return call
    return Served([call_of(g) for g in per_client], per_client.clear)


def build_eager(model, clients: int) -> Served:
    """The model itself under ``torch.inference_mode()``, the same for every client."""
    import torch

    def call(x):
        with torch.inference_mode():
            return model(x)
    return Served([call] * clients, lambda: None)


def bucket_batch(bucket) -> int:
    """The batch size of one of ``nm.buckets``: its first input's first dimension."""
    return int(bucket.input_shapes[0][0])


def nimble_reports(nm) -> dict:
    """What a prepared Nimble says of itself, as plain data: its instances, its prepare's
    seconds (the total and per stage over every bucket), its device memory beyond the weights
    and each bucket's arena plan (MB by batch size)."""
    memory, report = nm.device_bytes, nm.prepare_report
    return {"instances": nm.instances, "prepare_total_s": report.total,
            "prepare_stages_s": report.stage_totals(),
            "device_bytes": {**dataclasses.asdict(memory), "total_bytes": memory.total_bytes},
            "arena_mb": {bucket_batch(b): b.arena_bytes / 2**20 for b in nm.buckets}}


def build_nimble(model, examples: dict[int, object], instances: int, clients: int,
                 quiet: bool) -> Served:
    """One Nimble, a bucket per batch size, ``instances`` copies, fresh output tensors."""
    import nimble

    largest = examples[max(examples)]
    nm = nimble.Nimble(model).prepare(largest, batch_sizes=sorted(examples), instances=instances,
                                      return_copies=True, quiet=quiet)
    return Served([nm] * clients, nm.close, nimble_reports(nm))


def make_load(model, example, args) -> Load:
    """:data:`INPUTS_PER_BATCH` random inputs per batch size of the mix (seeded) and the model's
    eager outputs of each, made on this thread before any client starts."""
    import torch

    gen = torch.Generator(device=example.device).manual_seed(0)
    inputs, references = {}, {}
    for batch in args.serve_batches.buckets:
        shape = (batch, *example.shape[1:])
        inputs[batch] = [torch.randn(shape, generator=gen, device=example.device,
                                     dtype=example.dtype) for _ in range(INPUTS_PER_BATCH)]
        with torch.inference_mode():
            references[batch] = [_clone(model(x)) for x in inputs[batch]]
    torch.cuda.synchronize()
    return Load(args.serve_batches, inputs, references, args.warmup, args.seconds,
                args.check_every)


def gpu_mode_run(model, load: Load, args) -> tuple[ModeRun, Callable[[int], Callable]]:
    """The builders of every mode on the GPU, and that of the equal-memory mode for K."""
    examples = {b: xs[0] for b, xs in load.inputs.items()}
    t, k = args.threads, args.instances
    builders = {"eager": lambda: build_eager(model, t),
                "graphs": lambda: build_graphs(model, examples, t),
                "nimble": lambda: build_nimble(model, examples, 1, t, args.quiet),
                "instances": lambda: build_nimble(model, examples, k, t, args.quiet)}

    def equal_memory(n: int) -> Callable[[], Served]:
        return lambda: build_nimble(model, examples, n, n, args.quiet)
    return ModeRun(builders, CudaStreams(), CudaMemory()), equal_memory
