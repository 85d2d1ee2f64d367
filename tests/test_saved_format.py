"""The saved-graph container and the kernel-binary parsing, on the CPU: every bad file is a
typed LoadError before anything reaches the GPU."""
from __future__ import annotations

import struct

import pytest

from nimble.errors import LoadError
from nimble.ir.saved_format import FORMAT_VERSION, HEADER, BlobWriter, SavedFile
from nimble.record import binaries


def _file(manifest=None, blobs=b"") -> bytes:
    return SavedFile(manifest or {"format": "nimble.saved-graph", "x": [1, 2]}, blobs).to_bytes()


def test_a_saved_file_reads_back_as_written(tmp_path):
    blobs = BlobWriter()
    a = blobs.add(b"weights" * 100)
    b = blobs.add(b"other")
    assert blobs.add(b"weights" * 100) == a  # identical bytes are stored once
    saved = SavedFile({"a": a.as_json(), "b": b.as_json()}, blobs.getvalue())
    path = saved.write(tmp_path / "m.nimble")
    back = SavedFile.read(path)
    assert back.blob(back.manifest["a"]) == b"weights" * 100
    assert back.blob(back.manifest["b"]) == b"other"
    assert a.offset % 64 == 0 and b.offset % 64 == 0


@pytest.mark.parametrize("cut", [1, 10, 100])
def test_a_truncated_file_is_refused(cut):
    data = _file(blobs=b"\1" * 500)
    with pytest.raises(LoadError, match="truncated"):
        SavedFile.from_bytes(data[:-cut])


def test_a_file_with_bytes_appended_is_refused():
    with pytest.raises(LoadError, match="truncated or has bytes appended"):
        SavedFile.from_bytes(_file() + b"\0")


@pytest.mark.parametrize("at", [HEADER.size + 3, -1, -200])
def test_a_flipped_byte_anywhere_after_the_header_is_refused(at):
    data = bytearray(_file(blobs=b"\7" * 300))
    data[at] ^= 0x40
    with pytest.raises(LoadError, match="checksum"):
        SavedFile.from_bytes(bytes(data))


def test_a_future_format_version_is_refused_with_what_to_do():
    data = bytearray(_file())
    struct.pack_into("<I", data, 8, FORMAT_VERSION + 1)
    with pytest.raises(LoadError, match=f"version {FORMAT_VERSION + 1}.*reads version"):
        SavedFile.from_bytes(bytes(data))


def test_something_that_is_no_saved_graph_is_refused(tmp_path):
    with pytest.raises(LoadError, match="not a saved Nimble graph"):
        SavedFile.from_bytes(b"PK\3\4 a zip file, say")
    with pytest.raises(LoadError, match="cannot read"):
        SavedFile.read(tmp_path / "missing.nimble")


def test_a_blob_reference_past_the_blobs_is_refused():
    saved = SavedFile.from_bytes(_file(blobs=b"abc"))
    with pytest.raises(LoadError, match="runs past"):
        saved.blob([2, 5])
    with pytest.raises(LoadError, match="not \\[offset, size\\]"):
        saved.blob("zz")


def test_the_file_holds_no_pickle():
    data = _file({"format": "nimble.saved-graph", "nested": {"k": [1.5, None, "s"]}})
    assert b"\x80\x04" not in data[:HEADER.size + 200]  # pickle's protocol-4 opcode
    assert SavedFile.from_bytes(data).manifest["nested"] == {"k": [1.5, None, "s"]}


def test_a_write_that_fails_leaves_no_file(tmp_path, monkeypatch):
    saved = SavedFile({"a": 1}, b"")

    def broken(self):
        raise RuntimeError("disk full")
    monkeypatch.setattr(SavedFile, "to_bytes", broken)
    with pytest.raises(RuntimeError):
        saved.write(tmp_path / "m.nimble")
    assert list(tmp_path.iterdir()) == []


# ---- fatbin containers and ELF sections ---------------------------------------------------------

def _entry(kind: int, arch: int, payload: bytes, compressed: bool) -> bytes:
    padded = -(-len(payload) // 8) * 8
    head = struct.pack("<HHIQIIII", kind, 0x0101, 64, padded, len(payload), 0, 0, arch)
    head += b"\0" * 8 + struct.pack("<Q", 0x8000 if compressed else 0) + b"\0" * 16
    assert len(head) == 64
    return head + payload + b"\0" * (padded - len(payload))


def _container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", binaries.FATBIN_MAGIC, 1, 16, len(body)) + body


def test_fatbin_containers_are_found_among_other_bytes():
    one = _container(_entry(2, 90, b"\0kernel_a\0code", False))
    two = _container(_entry(2, 80, b"zzzz", True), _entry(2, 90, b"yyyyyyy", True))
    section = b"junk" * 3 + one + b"\0" * 8 + two + b"tail"
    found = binaries.fatbin_containers(section)
    assert [c.offset for c in found] == [12, 12 + len(one) + 8]
    assert [(e.arch, e.compressed) for e in found[1].entries] == [(80, True), (90, True)]
    assert found[0].size == len(one)
    hits = binaries.plain_name_hits(section, found, ["kernel_a", "kernel_b"])
    assert hits == {"kernel_a": found[0]}
    assert [c.offset for c in
            binaries.LibraryFatbins("x", 0, section, found).compressed_for(90)] == [found[1].offset]


def test_the_compressed_containers_listed_are_those_with_a_cubin_the_device_runs():
    """A compressed cubin of the device's major version and no newer minor counts; PTX alone
    (the driver would compile it), another major version or a newer minor does not."""
    kinds = [(2, 90), (2, 86), (1, 90), (2, 80), (2, 100), (2, 89)]
    section = b"".join(_container(_entry(k, a, b"zz", True)) for k, a in kinds)
    found = binaries.fatbin_containers(section)
    lib = binaries.LibraryFatbins("x", 0, section, found)
    assert [c.offset for c in lib.compressed_for(90)] == [found[0].offset]
    assert [c.offset for c in lib.compressed_for(89)] == [found[i].offset for i in (1, 3, 5)]
    assert [c.offset for c in lib.compressed_for(100)] == [found[4].offset]


def test_a_name_inside_a_compressed_entry_or_a_longer_name_is_no_hit():
    c = _container(_entry(2, 90, b"\0kernel_a_long\0", False), _entry(2, 90, b"\0kernel_a\0", True))
    found = binaries.fatbin_containers(c)
    assert binaries.plain_name_hits(c, found, ["kernel_a"]) == {}


def test_a_container_magic_whose_header_does_not_hold_is_skipped():
    fake = struct.pack("<IHHQ", binaries.FATBIN_MAGIC, 7, 16, 10**9)
    real = _container(_entry(1, 90, b".entry k(", False))
    found = binaries.fatbin_containers(fake + real)
    assert [c.offset for c in found] == [len(fake)]


def _elf(sections: dict[str, bytes]) -> bytes:
    names = b"\0" + b"".join(n.encode() + b"\0" for n in sections) + b".shstrtab\0"
    body, offsets = b"", []
    for data in list(sections.values()) + [names]:
        offsets.append(64 + len(body))
        body += data
    shoff = 64 + len(body)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, len(sections) + 2, len(sections) + 1)
    table = bytes(64)  # the null section
    at = 1
    for (name, data), offset in zip(list(sections.items()) + [(".shstrtab", names)], offsets):
        row = bytearray(64)
        struct.pack_into("<II", row, 0, at, 1)
        struct.pack_into("<QQ", row, 24, offset, len(data))
        table += bytes(row)
        at += len(name) + 1
    return bytes(header) + body + table


def test_the_fatbin_sections_of_a_library_file_are_read(tmp_path):
    fatbin = _container(_entry(2, 90, b"\0k\0", False))
    path = tmp_path / "libfake.so"
    path.write_bytes(_elf({".text": b"\x90" * 40, ".nv_fatbin": fatbin,
                           ".cask_resource": b"pad!" + fatbin}))
    read = binaries.LibraryFatbins.read(str(path))
    assert [len(r.containers) for r in read] == [1, 1]
    assert read[0].container_bytes(read[0].containers[0]) == fatbin
    data = path.read_bytes()
    assert data[read[1].section_offset + 4:].startswith(fatbin)


def test_a_file_that_is_no_elf_has_no_fatbins(tmp_path):
    path = tmp_path / "libnot.so"
    path.write_bytes(b"#!/bin/sh\n" * 20)
    assert binaries.LibraryFatbins.read(str(path)) == []
    with pytest.raises(binaries.BinaryFormatError):
        binaries.elf_section(lambda o, n: path.read_bytes()[o:o + n], ".nv_fatbin")


def test_the_compressed_index_is_cached_per_library(tmp_path, monkeypatch):
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    c = _container(_entry(2, 90, b"zz", True))
    path = tmp_path / "liba.so"
    path.write_bytes(b"x")
    lib = binaries.LibraryFatbins(str(path), 0, c, binaries.fatbin_containers(c))
    calls = []

    def names(image: bytes) -> list[str]:
        calls.append(image)
        return ["k1", "k2"]
    assert binaries.compressed_kernel_index(lib, 90, names) == {"k1": 0, "k2": 0}
    assert binaries.compressed_kernel_index(lib, 90, names) == {"k1": 0, "k2": 0}
    assert calls == [c]


def test_a_file_of_several_checksum_chunks_is_checked_in_every_chunk(monkeypatch):
    from nimble.ir import saved_format

    monkeypatch.setattr(saved_format, "CHECKSUM_CHUNK", 1024)
    import random

    blobs = random.Random(0).randbytes(10240)  # ten chunks
    data = _file(blobs=blobs)
    back = SavedFile.from_bytes(data)
    assert bytes(back.blobs) == blobs
    for at in (HEADER.size + 5, len(data) // 2, len(data) - 3):
        broken = bytearray(data)
        broken[at] ^= 1
        with pytest.raises(LoadError, match="checksum"):
            SavedFile.from_bytes(bytes(broken))
    # two chunks swapped: every byte still there, in another order
    body = bytearray(data[HEADER.size:])
    body[1024:2048], body[2048:3072] = body[2048:3072], body[1024:2048]
    assert bytes(body) != data[HEADER.size:]
    with pytest.raises(LoadError, match="checksum"):
        SavedFile.from_bytes(data[:HEADER.size] + bytes(body))


def test_a_saved_training_step_needs_the_model_with_the_saved_parameters():
    import torch

    from nimble.engine.loading import _step_layout

    step = {"forward_inputs": 1, "forward_outputs": 1, "differentiable": [0],
            "inputs_with_grad": [], "grad_output_of": [1, 2],
            "param_names": ["weight", "bias"]}
    with pytest.raises(LoadError, match="pass the model"):
        _step_layout(step, None, 0)
    with pytest.raises(LoadError, match="differ from the saved step's"):
        _step_layout(step, torch.nn.Conv2d(1, 1, 1, bias=False), 0)
    model = torch.nn.Linear(2, 3)
    layout = _step_layout(step, model, 0)
    assert layout.params[0] is model.weight and layout.params[1] is model.bias
    assert layout.grad_output_of == [1, 2] and _step_layout(None, model, 0) is None


def test_a_training_steps_checks_put_back_every_weight_it_points_to():
    """cuDNN's batch norm writes the running statistics through arguments no access records:
    a saved training step's reference runs and its proof at load put every weight back."""
    from helpers import FIXTURE_DIR
    from nimble.engine.arena_layout import written_weights
    from nimble.ir.taskgraph import BufferKind, TaskGraph

    graph = TaskGraph.load(FIXTURE_DIR / "resnet50_train.json.gz")
    by_name = {graph.buffers[b].name for b in written_weights(graph, training=True)}
    assert {"bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"} <= by_name
    recorded = {graph.buffers[b].name for b in written_weights(graph)}
    assert "bn1.num_batches_tracked" in recorded and "bn1.running_mean" not in recorded
    assert all(graph.buffers[b].kind == BufferKind.PARAM
               for b in written_weights(graph, training=True))


def test_every_binary_a_load_reads_is_held_to_its_hash(tmp_path, monkeypatch):
    """The binaries are read and hashed on several threads before any reaches the driver: one
    whose bytes changed is refused with what to do, and no library is loaded."""
    import hashlib

    from nimble.engine import kernel_loading as kl

    blobs = BlobWriter()
    good, bad = blobs.add(b"cubin one"), blobs.add(b"cubin two")
    saved = SavedFile({}, blobs.getvalue())
    library = tmp_path / "libfake.so"
    library.write_bytes(b"head" + b"container" + b"tail")
    rows = [{"kind": "embedded", "blob": good.as_json(),
             "sha256": hashlib.sha256(b"cubin one").hexdigest()},
            {"kind": "embedded", "blob": bad.as_json(), "sha256": hashlib.sha256(b"x").hexdigest()},
            {"kind": "library", "path": str(library), "name": library.name, "file_size": 17,
             "offset": 4, "size": 9, "sha256": hashlib.sha256(b"container").hexdigest()}]
    assert kl.binary_bytes(rows[0], saved) == b"cubin one"
    assert kl.binary_bytes(rows[2], saved) == b"container"
    loaded = []
    monkeypatch.setattr(kl.driver.Library, "load_data",
                        classmethod(lambda cls, image, detail="": loaded.append(1)))
    with pytest.raises(LoadError, match="another version of the library"):
        kl.load_kernels([{"name": "a", "binary": 0}, {"name": "b", "binary": 1}], rows, saved)
    with pytest.raises(LoadError, match="names binary 7"):
        kl.load_kernels([{"name": "a", "binary": 7}], rows, saved)
    assert loaded == []
    moved = dict(rows[2], path=str(tmp_path / "gone.so"))
    with pytest.raises(LoadError, match="not at .*gone.so"):
        kl.binary_bytes(moved, saved)


def test_another_gpu_or_an_older_driver_is_refused_with_what_to_do(monkeypatch):
    from nimble.engine import loading

    monkeypatch.setattr(loading.driver, "device_architecture", lambda device: 90)
    monkeypatch.setattr(loading.driver, "driver_version", lambda: 13000)
    loading._check_machine({"arch": 90, "driver": 13000}, 0)
    with pytest.raises(LoadError, match="compute capability 100 .*this GPU is 90"):
        loading._check_machine({"arch": 100, "device": "B200", "driver": 13000}, 0)
    with pytest.raises(LoadError, match="driver 13010; this machine's driver is 13000, older"):
        loading._check_machine({"arch": 90, "driver": 13010}, 0)


def test_a_models_weights_must_be_those_the_graph_was_saved_for():
    import torch

    from nimble.engine.loaded_memory import _model_storage

    model = torch.nn.Linear(4, 3)
    current = dict(model.named_parameters())
    cpu = torch.device("cpu")
    row = {"names": [{"name": "weight", "offset": 0, "shape": [3, 4], "strides": [4, 1],
                      "dtype": "float32"}]}
    assert _model_storage(row, current, cpu) == model.weight.data_ptr()
    for name, change, message in (
            ("renamed", {"name": "w"}, "has no 'w'"),
            ("dtype", {"dtype": "float16"}, "saved for float16"),
            ("shape", {"shape": [4, 3], "strides": [3, 1]}, r"saved for float32 \[4, 3\]"),
            ("offset", {"offset": 64}, None)):
        bad = {"names": [dict(row["names"][0], **change)]}
        if message is None:  # a tensor at another offset of its storage: another address
            assert _model_storage(bad, current, cpu) == model.weight.data_ptr() - 64
            continue
        with pytest.raises(LoadError, match=message):
            _model_storage(bad, current, cpu)
    two = {"names": [row["names"][0], {"name": "bias", "offset": 0, "shape": [3],
                                       "strides": [1], "dtype": "float32"}]}
    with pytest.raises(LoadError, match="no longer shares its memory"):
        _model_storage(two, current, cpu)
    with pytest.raises(LoadError, match="is on cpu; the graph runs on cuda"):
        _model_storage(row, current, torch.device("cuda", 0))


def test_a_generator_without_graphs_or_weights_is_not_saved(tmp_path):
    from nimble.errors import SaveError
    from nimble.generate import Generator, Limits, _BatchSteps

    generator = Generator.__new__(Generator)
    generator.limits = Limits.checked(64, [16], [1])
    generator.pad_id = 0
    generator._steps = {1: _BatchSteps(None, lambda *a: a, lambda *a: a)}
    with pytest.raises(SaveError, match="prefill step of batch 1 is no prepared Nimble"):
        generator.save(tmp_path / "g.nimble")
    with pytest.raises(SaveError, match="carries its weights"):
        generator.save(tmp_path / "g.nimble", weights=False)
    assert list(tmp_path.iterdir()) == []


def test_the_compressed_index_lists_containers_side_by_side_and_the_first_holder_wins(
        tmp_path, monkeypatch):
    """Containers are listed on several threads; a name two containers hold is the earlier
    container's, however the threads finish, and a container the driver refuses holds none."""
    import threading
    import time

    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    containers = b"".join(_container(_entry(2, 90, bytes([65 + i]) * 8, True)) for i in range(4))
    path = tmp_path / "libb.so"
    path.write_bytes(b"x")
    lib = binaries.LibraryFatbins(str(path), 0, containers,
                                  binaries.fatbin_containers(containers))
    offsets = [c.offset for c in lib.containers]
    threads = set()

    def names(image: bytes) -> list[str]:
        threads.add(threading.get_ident())
        k = next(i for i, c in enumerate(lib.containers) if lib.container_bytes(c) == image)
        time.sleep(0.05 * (4 - k))  # the first container's listing finishes last
        if k == 2:
            raise RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU")
        return ["shared", f"own{k}"]
    index = binaries.compressed_kernel_index(lib, 90, names)
    assert index == {"shared": offsets[0], "own0": offsets[0], "own1": offsets[1],
                     "own3": offsets[3]}
    assert len(threads) > 1


def test_the_binaries_load_side_by_side_and_a_failure_frees_every_library(tmp_path,
                                                                          monkeypatch):
    """Each binary is loaded and its kernels' functions taken on a worker thread with the
    caller's context made current there; the functions come back in the kernels' order, and
    a kernel that fails its check frees every library loaded and raises the first failure in
    binary order."""
    import hashlib
    import threading

    from nimble.engine import kernel_loading as kl

    blobs = BlobWriter()
    images = [b"cubin %d" % i for i in range(5)]
    refs = [blobs.add(data) for data in images]
    saved = SavedFile({}, blobs.getvalue())
    rows = [{"kind": "embedded", "blob": r.as_json(), "name": f"b{i}",
             "sha256": hashlib.sha256(d).hexdigest()} for i, (r, d) in enumerate(zip(refs, images))]
    kernels = [{"name": f"k{b}{j}", "binary": b} for j in range(2) for b in (4, 0, 2, 1, 3)]
    made, closed, current, threads = [], [], {}, set()

    class Library:
        def __init__(self, image):
            self.image = image
            made.append(self)

        def close(self):
            closed.append(self)
    monkeypatch.setattr(kl.driver, "current_context", lambda: "the caller's context")
    monkeypatch.setattr(kl.driver, "use_context",
                        lambda ctx: current.__setitem__(threading.get_ident(), ctx))
    monkeypatch.setattr(kl.driver.Library, "load_data",
                        classmethod(lambda cls, image, detail="": Library(image)))
    failing: set = set()

    def checked(library, row):
        import time

        threads.add(threading.get_ident())
        assert current[threading.get_ident()] == "the caller's context"
        time.sleep(0.02)  # a driver call's length: the other binaries go to other threads
        if row["name"] in failing:
            raise LoadError(f"kernel {row['name']} differs")
        return (library.image, row["name"])
    monkeypatch.setattr(kl, "_checked_function", checked)
    loaded = kl.load_kernels(kernels, rows, saved)
    assert loaded.functions == [(images[k["binary"]], k["name"]) for k in kernels]
    assert [library.image for library in loaded.libraries] == [images[b] for b in (4, 0, 2, 1, 3)]
    assert [t.kernels for t in loaded.timings] == [2] * 5 and len(threads) > 1
    made.clear()
    failing.update({"k21", "k10"})  # binaries 2 and 1 fail; 2 comes first in binary order
    with pytest.raises(LoadError, match="kernel k21 differs"):
        kl.load_kernels(kernels, rows, saved)
    assert sorted(map(id, closed)) == sorted(map(id, made))


def test_a_generator_loaded_with_its_model_finds_every_weight_by_the_steps_names():
    """``Generator.load(path, model=...)`` binds the model's weights by the names the steps
    recorded them under: the step module's, and inside ``torch.compile``'s wrapper."""
    import torch
    from helpers import tiny_decoder

    from nimble.decode_steps import DecodeStep
    from nimble.generate import step_weights
    from nimble.record.module_weights import module_weights

    model = tiny_decoder("Llama")
    named = module_weights(step_weights(model))
    for step in (DecodeStep(model, cache=None), torch.compile(DecodeStep(model, cache=None))):
        recorded = module_weights(step)
        assert recorded and set(recorded) <= set(named)
        assert all(named[name] is t for name, t in recorded.items())
