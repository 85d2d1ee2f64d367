"""Saved graphs on the GPU: save in this process, load in a fresh one, outputs bit for bit."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import zoo_model
from nimble.cli.models import ZOO

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).parent / "workers" / "load_worker.py"


def _conv_net():
    """A branchy convolutional network whose kernels are all in the fatbins of library files
    (cuDNN's and ATen's): no linear layer and no 1x1 convolution, which run cuBLASLt GEMMs
    (see the test below), and an input for it."""
    import torch
    from torch import nn

    def branch(c: int, k: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c, c, k, padding=k // 2), nn.BatchNorm2d(c), nn.ReLU())

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 32, 3, padding=1)
            self.branches = nn.ModuleList([branch(32, k) for k in (3, 5, 7)])
            self.head = nn.Conv2d(96, 10, 3, padding=1)

        def forward(self, x):
            x = torch.relu(self.stem(x))
            x = torch.cat([b(x) for b in self.branches], 1)
            return self.head(x).mean((2, 3))

    torch.manual_seed(0)
    return Net().cuda().eval(), torch.randn(2, 3, 32, 32, device="cuda")


def _prepared(name: str, dtype: str, **prepare):
    import torch

    import nimble

    model, x = _conv_net() if name == "convnet" else zoo_model(name)
    model, x = model.to(getattr(torch, dtype)), x.to(getattr(torch, dtype))
    nm = nimble.Nimble(model).prepare(x, return_copies=True, **prepare)
    return model, x, nm


def _load_elsewhere(saved, inputs, tmp_path, *extra) -> dict:
    """The worker's outputs for ``inputs`` (None: three random ones) from a fresh process that
    loads ``saved``, with its load-to-first-call seconds."""
    import torch

    out = tmp_path / "out.pt"
    given = "-"
    if inputs is not None:
        given = str(tmp_path / "inputs.pt")
        torch.save([x.cpu() for x in inputs], given)
    done = subprocess.run([sys.executable, str(WORKER), str(saved), given, str(out), *extra],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    print(f"load {Path(saved).name}: {done.stdout.strip().splitlines()[-1]}")
    return torch.load(out)


def _same_elsewhere(nm, saved, x, count: int, tmp_path) -> None:
    """``count`` fresh inputs like ``x`` through ``nm`` here and through ``saved`` loaded in a
    fresh process: the outputs bit for bit."""
    import torch

    inputs = [torch.randn_like(x) for _ in range(count)]
    want = [nm(i) for i in inputs]
    got = _load_elsewhere(saved, inputs, tmp_path)
    for g, w in zip(got["outputs"], want):
        _bitwise(g.cuda(), w)


def _bitwise(got, want) -> None:
    import torch

    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", ["convnet"])
def test_saved_graph_loads_in_a_fresh_process_bit_for_bit(name, dtype, tmp_path):
    model, x, nm = _prepared(name, dtype)
    _same_elsewhere(nm, nm.save(tmp_path / "model.nimble"), x, 3, tmp_path)


def test_a_graph_saved_without_weights_reads_the_models_by_name(tmp_path):
    import torch

    import nimble

    model, x, nm = _prepared("convnet", "float16")
    saved = nm.save(tmp_path / "model.nimble", weights=False)
    with_weights = nm.save(tmp_path / "full.nimble")
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert with_weights.stat().st_size - saved.stat().st_size >= weight_bytes * 0.9
    inputs = [torch.randn_like(x) for _ in range(2)]
    want = [nm(i) for i in inputs]
    with pytest.raises(nimble.LoadError, match="without its weights"):
        nimble.load(saved)
    got = {"outputs": [nimble.load(saved, model=model)(i).clone() for i in inputs]}
    for g, w in zip(got["outputs"], want):
        _bitwise(g.cuda(), w)


def test_buckets_and_instances_load_and_serve_from_threads(tmp_path):
    import threading

    import torch

    import nimble

    model, x = _conv_net()
    nm = nimble.Nimble(model).prepare(x, batch_sizes=[1, 4], instances=2, return_copies=True)
    saved = nm.save(tmp_path / "served.nimble")
    loaded = nimble.load(saved, model=model, return_copies=True)
    assert loaded.instances == 2 and len(loaded.buckets) == 2
    more = nimble.load(saved, model=model, instances=3)
    assert more.instances == 3 and len(more.device_bytes.instance_bytes) == 3
    more.close()
    inputs = [torch.randn(b, *x.shape[1:], device="cuda") for b in (1, 4, 4, 1)]
    want = [nm(i) for i in inputs]
    got: dict[int, object] = {}

    def call(k: int) -> None:
        got[k] = loaded(inputs[k])
    threads = [threading.Thread(target=call, args=(k,)) for k in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    for k, w in enumerate(want):
        _bitwise(got[k], w)


def test_a_loaded_graph_follows_the_models_weights_when_they_change(tmp_path):
    import torch

    import nimble

    model, x, nm = _prepared("convnet", "float32")
    saved = nm.save(tmp_path / "m.nimble", weights=False)
    loaded = nimble.load(saved, model=model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
        want = model(x)
    _bitwise(loaded(x).clone(), nm(x))
    torch.testing.assert_close(loaded(x), want, rtol=1e-3, atol=1e-3)


def test_a_file_for_another_gpu_architecture_is_refused(tmp_path):
    import nimble
    from nimble.ir.saved_format import SavedFile

    model, x, nm = _prepared("convnet", "float16")
    saved = SavedFile.read(nm.save(tmp_path / "m.nimble"))
    saved.manifest["arch"] = 80
    saved.write(tmp_path / "other.nimble")
    with pytest.raises(nimble.LoadError, match="compute capability 80"):
        nimble.load(tmp_path / "other.nimble")


def test_a_cublaslt_gemm_kernel_that_is_on_no_disk_is_refused_by_name(tmp_path):
    """cuBLASLt 13 keeps its sm90 nvjet GEMMs outside every fatbin container of its file: in a
    process that did not keep its kernel binaries from the start, saving says what to do."""
    import nimble
    from nimble.driver import module_images

    if module_images.capturing():
        pytest.skip("this process keeps its kernel binaries")
    model, x, nm = _prepared("resnet50", "float16")
    names = {t.name for t in nm.graph.kernel_tasks()}
    if not any(n.startswith("nvjet_") for n in names):
        pytest.skip("this cuBLASLt picked no nvjet kernel")
    with pytest.raises(nimble.SaveError, match="nvjet_.*keep_kernel_binaries"):
        nm.save(tmp_path / "m.nimble")
    assert not (tmp_path / "m.nimble").exists()


#: Every zoo model in every dtype the issue names (the wide NASNet and PNASNet the longest).
ZOO_SAVES = [(name, dtype) for name in ZOO for dtype in ("float32", "float16", "bfloat16")]


@pytest.mark.parametrize("name,dtype", ZOO_SAVES)
def test_a_zoo_model_saved_by_the_command_loads_and_proves_in_a_fresh_process(name, dtype,
                                                                              tmp_path):
    """``nimble save`` in one process, ``nimble.load`` in another: the load's proof holds the
    loaded graph bit for bit to the outputs the saving process's graph gave."""
    pytest.importorskip("torchvision")
    saved = tmp_path / f"{name}.nimble"
    done = subprocess.run([sys.executable, "-m", "nimble", "save", name, "--dtype", dtype,
                           "-o", str(saved), "-q"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    print(f"save {name} {dtype}: {done.stdout.strip()}")
    out = _load_elsewhere(saved, None, tmp_path)
    assert out["seconds"] > 0


def test_a_graph_of_inductors_kernels_embeds_its_triton_cubins(tmp_path):
    """Inductor's Triton kernels live in cubin files of a cache that can be emptied: a saved
    graph carries them, and a fresh process loads it bit for bit."""
    import torch

    import nimble
    from nimble.ir.saved_format import SavedFile

    model, x = _conv_net()
    compiled = torch.compile(model)
    nm = nimble.Nimble(compiled).prepare(x, return_copies=True)
    triton = [t for t in nm.graph.kernel_tasks() if t.short_name.startswith("triton")]
    assert triton, "Inductor launched no Triton kernel"
    saved = nm.save(tmp_path / "compiled.nimble")
    rows = SavedFile.read(saved).manifest["binaries"]
    assert any(r["kind"] == "embedded" and r["origin"].endswith(".cubin") for r in rows)
    _same_elsewhere(nm, saved, x, 2, tmp_path)


def test_a_triton_kernel_saved_with_no_cache_folder_to_read_embeds_its_loaders_image(
        tmp_path, monkeypatch):
    """Where no cache folder Nimble reads holds a Triton kernel's cubin (a cache emptied since
    the compile, or filed elsewhere), the save embeds the image Triton's ``CompiledKernel``
    keeps in memory (here Nimble's own GEMV), and a fresh process loads it bit for bit."""
    import torch
    from torch import nn

    import nimble
    from nimble.fast_gemv import GemvConfig, launch_gemv
    from nimble.ir.saved_format import SavedFile
    from nimble.record import binaries

    class Gemv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(512, 1024, device="cuda",
                                                   dtype=torch.float16), requires_grad=False)

        def forward(self, x):
            return launch_gemv(torch.relu(x), self.weight, GemvConfig(4, 1024, 8, 1))

    torch.manual_seed(0)
    x = torch.randn(1024, device="cuda", dtype=torch.float16)
    nm = nimble.Nimble(Gemv().eval()).prepare(x, return_copies=True)
    monkeypatch.setattr(binaries, "cubin_folders", lambda: [])
    saved = nm.save(tmp_path / "held.nimble")
    rows = SavedFile.read(saved).manifest["binaries"]
    assert any(r["kind"] == "embedded" and r["origin"] == "Triton's compiled kernel in the "
               "saving process" for r in rows), [r.get("origin") for r in rows]
    _same_elsewhere(nm, saved, x, 2, tmp_path)


def test_inductors_kernels_with_no_cache_folder_to_read_are_refused_saying_why(tmp_path,
                                                                              monkeypatch):
    """Inductor's static launcher keeps no copy of a cubin once it has loaded it: with no cache
    folder to read, the save is refused, naming the launcher and what to do."""
    import torch
    from torch._inductor import config

    import nimble
    from nimble.errors import SaveError
    from nimble.record import binaries

    if not getattr(config, "use_static_cuda_launcher", False):
        pytest.skip("this torch's Inductor launches its kernels through Triton's launcher")
    model, x = _conv_net()
    nm = nimble.Nimble(torch.compile(model)).prepare(x)
    monkeypatch.setattr(binaries, "cubin_folders", lambda: [])
    with pytest.raises(SaveError, match="static launcher"):
        nm.save(tmp_path / "gone.nimble")
    assert not (tmp_path / "gone.nimble").exists()


def test_a_training_step_saved_and_loaded_fills_the_same_gradients(tmp_path):
    """A training step's two graphs saved and loaded with the model: a step through the loaded
    graph fills ``.grad`` as the prepared one does (cuDNN's backward adds with atomics: within
    the proof's gradient tolerance), and the model's running statistics are left as they were
    by the load's proof."""
    import torch

    import nimble

    model, x = _conv_net()
    model.train()
    nm = nimble.Nimble(model).prepare(x, training=True)
    saved = nm.save(tmp_path / "step.nimble", weights=False)
    stats = [b.clone() for b in model.buffers()]
    loaded = nimble.load(saved, model=model)
    for before, after in zip(stats, model.buffers()):
        assert torch.equal(before, after)
    assert [p.name for p in loaded.phases] == ["forward", "backward"]

    def grads(runner) -> list:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        fresh = torch.randn_like(x)
        runner(fresh).square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]
    want, got = grads(nm), grads(loaded)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-2 * float(w.abs().max()) + 1e-6)


def test_a_generator_saved_in_one_process_decodes_the_same_tokens_in_another(tmp_path):
    """A Generator's prefill and decode graphs in one file, their static cache one memory
    range they share: loaded elsewhere, it decodes the tokens the saving process decoded."""
    import torch

    pytest.importorskip("transformers")
    from helpers import generator_worker_tokens

    torch.manual_seed(0)
    saved, loaded, said = generator_worker_tokens(tmp_path, "save",
                                                  torch.randint(0, 100, (1, 20)))
    print(said)
    assert torch.equal(loaded, saved)


def test_a_loaded_graph_keeps_its_outputs_after_a_profiler_run(tmp_path):
    """A torch.profiler run in the process of a loaded graph: the graph is rebuilt for host
    launch from its own nodes, as a prepared one is, and gives the same outputs bit for bit."""
    import torch

    import nimble

    model, x, nm = _prepared("convnet", "float16")
    loaded = nimble.load(nm.save(tmp_path / "m.nimble"), return_copies=True)
    fresh = torch.randn_like(x)
    before = loaded(fresh)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
        model(fresh)
    import warnings

    with warnings.catch_warnings():  # said once per process, maybe by an earlier test
        warnings.simplefilter("ignore", RuntimeWarning)
        after = loaded(fresh)
    assert loaded.launch_mode == "host"
    _bitwise(after, before)
