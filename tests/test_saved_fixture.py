"""The recorded saved file of the CPU tests (``tests/fixtures/saved_llama_small_float16.nimble.gz``,
made by ``tests/saved_fixture.py`` from the llama_small recording), and single mutations of it:
each is a LoadError from ``nimble.load`` that names what is wrong, on this machine without a
GPU, before any GPU work; never an exception of another type."""
from __future__ import annotations

import copy
import gzip
import json
import random
import re
import struct

import pytest
import torch

import nimble
from nimble.errors import LoadError, NoGpuError
from nimble.ir.saved_format import FORMAT_VERSION, SavedFile
from nimble.ir.saved_graph_check import bucket_graph, check_bucket_graph
from nimble.ir.saved_manifest import check_manifest
from nimble.ir.taskgraph import TaskGraph

from saved_fixture import NAME, compressed, fixture_path, saved_file


@pytest.fixture(scope="module")
def raw() -> bytes:
    return gzip.decompress(fixture_path().read_bytes())


def _fresh(raw: bytes) -> SavedFile:
    saved = SavedFile.from_bytes(raw)
    return SavedFile(copy.deepcopy(saved.manifest), bytes(saved.blobs))


def _graph(saved: SavedFile) -> TaskGraph:
    return bucket_graph(saved, 0)


def test_the_committed_file_is_what_the_synthesizer_makes_and_small():
    data = fixture_path().read_bytes()
    assert data == compressed(NAME), "run python tests/saved_fixture.py and commit the file"
    assert len(data) < 200_000


def test_the_file_is_a_sound_saved_graph_of_its_recording(raw):
    saved = _fresh(raw)
    m = saved.manifest
    check_manifest(m, len(saved.blobs))
    graph = _graph(saved)
    check_bucket_graph(m, 0, graph, lambda d: getattr(torch, d).itemsize)
    bucket = m["buckets"][0]
    assert len(bucket["nodes"]) == len(graph.tasks) == 219
    assert sum("memset" in n for n in bucket["nodes"]) == 4
    assert {n["kernel"] for n in bucket["nodes"] if "kernel" in n} == set(range(len(m["kernels"])))
    assert len(bucket["outside"]) == len(m["weights"]) and not m["weights_included"]


@pytest.mark.parametrize("name, holds", [("pnasnet5large", "memcpy"),
                                         ("inception_v3_bfloat16", "private"),
                                         ("resnet50_train", "private")])
def test_the_checks_take_the_files_of_other_recordings(name, holds):
    """Memcpy nodes (pnasnet), a private copy of library memory (inception_v3 in bfloat16), a
    training step's two phases with memsets and private copies (resnet50_train)."""
    saved = SavedFile.from_bytes(saved_file(name).to_bytes())
    check_manifest(saved.manifest, len(saved.blobs))
    check_bucket_graph(saved.manifest, 0, _graph(saved), lambda d: getattr(torch, d).itemsize)
    bucket = saved.manifest["buckets"][0]
    assert bucket["private"] if holds == "private" else any(holds in n for n in bucket["nodes"])


def test_a_workspace_is_stored_without_bytes_and_only_a_workspace(tmp_path):
    """A private copy of a workspace (inception_v3 bf16's 32 MiB convolution workspace) holds
    no bytes in the file (null; it starts zeroed), which makes the file version 2; the CPU
    read takes it.  A null in place of library memory whose bytes carry state (cuDNN's
    batch-norm buffers of a training step) is a damaged file, refused before the GPU."""
    from nimble.engine.saved_reading import read_checked

    saved = saved_file("inception_v3_bfloat16")
    assert saved.version == 2 and list(saved.manifest["buckets"][0]["private"].values()) == [None]
    path = saved.write(tmp_path / "workspace.nimble")
    read, _, checksum = read_checked(path)
    checksum.verify()
    assert read.version == 2 and path.stat().st_size < 2 << 20  # not the workspace's 32 MiB
    train = saved_file("resnet50_train")
    assert train.version == 1 and None not in train.manifest["buckets"][0]["private"].values()
    bid = next(iter(train.manifest["buckets"][0]["private"]))
    train.manifest["buckets"][0]["private"][bid] = None
    damaged = train.write(tmp_path / "damaged.nimble")
    with pytest.raises(LoadError, match=rf"private\['{bid}'\] holds no bytes, but buffer {bid} "
                                        "is no workspace"):
        read_checked(damaged)


def test_the_file_passes_every_check_and_then_needs_a_gpu(tmp_path, monkeypatch):
    path = tmp_path / "llama.nimble"
    path.write_bytes(gzip.decompress(fixture_path().read_bytes()))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NoGpuError):
        nimble.load(path)


# ---- single mutations ---------------------------------------------------------------------

def _memset(m: dict) -> int:
    return next(i for i, n in enumerate(m["buckets"][0]["nodes"]) if "memset" in n)


def _set(path: str, value):
    """A mutation setting the manifest field at ``path`` (dotted; ``{memset}``: the first
    memset's node) to ``value`` (a callable: of the manifest and the blobs' size)."""
    def mutate(saved: SavedFile) -> None:
        *parents, last = path.format(memset=_memset(saved.manifest)).split(".")
        target = saved.manifest
        for key in parents:
            target = target[int(key) if isinstance(target, list) else key]
        last = int(last) if isinstance(target, list) else last
        if value is _DELETE:
            del target[last]
        else:
            target[last] = value(saved.manifest, len(saved.blobs)) if callable(value) else value
    return mutate


_DELETE = object()


def _rewrite_graph(saved: SavedFile) -> None:
    """The bucket's graph made to hold a field of the wrong type (a valid gzip of JSON)."""
    data = json.loads(gzip.decompress(saved.blob(saved.manifest["buckets"][0]["graph"])))
    data["tasks"][3]["grid"] = "wide"
    blob = gzip.compress(json.dumps(data).encode())
    saved.manifest["buckets"][0]["graph"] = [len(saved.blobs), len(blob)]
    saved.blobs = saved.blobs + blob


def _unplace(saved: SavedFile) -> None:
    outside = saved.manifest["buckets"][0]["outside"]
    del outside[sorted(outside, key=int)[0]]


#: name -> (a change of the manifest or blobs, what the LoadError says)
STRUCTURAL = {
    "kernel as a string": (_set("buckets.0.nodes.5.kernel", "5"),
                           r"buckets\[0\]\.nodes\[5\]\.kernel is a string \('5'\), not an "
                           r"integer"),
    "kernel out of range": (_set("buckets.0.nodes.0.kernel", lambda m, _: len(m["kernels"])),
                            r"buckets\[0\]\.nodes\[0\]\.kernel is 42, but there are 42 "
                            r"kernels"),
    "binary out of range": (_set("kernels.3.binary", 1),
                            r"kernels\[3\]\.binary is 1, but there are 1 binaries"),
    "weight out of range": (_set("buckets.0.outside.0.weight", 99),
                            r"outside\['0'\]\.weight is 99, but there are 39 weight storages"),
    "graph past the end": (_set("buckets.0.graph", lambda m, size: [64, size]),
                           r"buckets\[0\]\.graph is \[64, \d+\], which runs past the \d+-byte "
                           r"blobs section"),
    "no kernels": (_set("kernels", _DELETE), r"the manifest has no 'kernels'"),
    "no memplan": (_set("buckets.0.memplan", _DELETE), r"buckets\[0\] has no 'memplan'"),
    "negative size": (_set("weights.2.size", -4096), r"weights\[2\]\.size is -4096, a negative"),
    "negative blob size": (_set("buckets.0.reference.inputs.1.0", [0, -8]),
                           r"reference\.inputs\[1\]\[0\] is \[0, -8\], a blob reference with "
                           r"a negative offset or size"),
    "unknown binary kind": (_set("binaries.0.kind", "ptx-jit"),
                            r"binaries\[0\]\.kind is 'ptx-jit', a kind of kernel binary this "
                            r"Nimble does not know: load the file with the Nimble that saved"),
    "packing of the wrong type": (_set("binaries.0.packed", 1),
                                  r"binaries\[0\]\.packed is a number \(1\), not a string"),
    "unknown packing": (_set("binaries.0.packed", "zstd"),
                        r"binaries\[0\]\.packed is 'zstd', not a packing this Nimble reads "
                        r"\(lz4\)"),
    "image size of the wrong type": (_set("binaries.0.image_size", "6762"),
                                     r"binaries\[0\]\.image_size is a string \('6762'\), not an "
                                     r"integer"),
    "packed without its size": (_set("binaries.0.packed", "lz4"),
                                r"binaries\[0\] has no 'image_size'"),
    "another format": (_set("format", "nimble.other"), r"not a saved Nimble graph"),
    "stream out of range": (_set("buckets.0.schedule.stream_of.7", 3),
                            r"schedule\.stream_of\[7\] is 3, but there are 1 streams"),
    "sync edge past the tasks": (_set("buckets.0.schedule.sync_edges", [[0, 219]]),
                                 r"sync_edges\[0\]\[1\] is 219, but there are 219 tasks"),
    "memset element size": (_set("buckets.0.nodes.{memset}.memset.elementSize", 3),
                            r"memset\.elementSize is 3, not 1, 2 or 4"),
    "node of another kind": (_set("buckets.0.nodes.{memset}", {"kernel": 0}),
                             r"nodes\[\d+\] is a kernel node, but task \d+ of the graph is a "
                             r"memset"),
    "short launch attribute": (_set("buckets.0.nodes.0.attributes", {"5": "00ff"}),
                               r"attributes\['5'\] is not a launch attribute's value \(64 "
                               r"bytes"),
    "priorities of another length": (_set("buckets.0.priorities", [0, 1, 2]),
                                     r"priorities has 3 items, not 219"),
    "reference of the wrong size": (_set("buckets.0.reference.outputs.1.0",
                                         lambda m, _: [0, 1000]),
                                    r"reference\.outputs\[1\]\[0\] is 1000 bytes for the "
                                    r"131072 of float16 \[1, 128, 512\]"),
    "weights included without bytes": (_set("weights_included", True),
                                       r"weights\[0\]\.blob is null, but weights_included is "
                                       r"true"),
    "output spec of garbage": (_set("buckets.0.output_spec", "{not a spec"),
                               r"buckets\[0\]\.output_spec does not decode"),
    "graph not gzip": (_set("buckets.0.graph", lambda m, _: m["binaries"][0]["blob"]),
                       r"the graph of bucket 0 does not decode"),
    "graph with a wrong field": (_rewrite_graph, r"tasks\[3\]\.grid is a string"),
    "gradient past the outputs": (_set("buckets.0.reference.gradients", [3]),
                                  r"reference\.gradients names output 3, but the graph has 1"),
    "step of the wrong type": (_set("buckets.0.step", "train"),
                               r"buckets\[0\]\.step is a string \('train'\), not an object"),
    "step past the outputs": (_set("buckets.0.step", {
        "forward_inputs": 1, "forward_outputs": 2, "differentiable": [0], "inputs_with_grad": [],
        "grad_output_of": [], "param_names": []}),
        r"buckets\[0\]\.step\.forward_outputs is 2, more than the 1 of the graph's outputs"),
    "buffer placed nowhere": (_unplace, r"buckets\[0\] does not place buffer 0, which task \d+ "
                                        r"points into"),
}


def _container(how: str, data: bytes) -> bytes:
    if how == "truncated":
        return data[:len(data) // 2]
    if how == "appended":
        return data + b"more"
    out = bytearray(data)
    struct.pack_into("<I", out, 8, FORMAT_VERSION + 1)
    return bytes(out)


# A flipped byte is refused by the checksum, which hashes beside the GPU's first steps and
# holds before any graph is built: tests/test_load_checksum.py.
CONTAINER = {"truncated": r"is truncated", "appended": r"has bytes appended",
             "future version": rf"format version {FORMAT_VERSION + 1}; this Nimble reads "
                               rf"versions 1 to {FORMAT_VERSION}"}



def _load_error(path) -> str:
    with pytest.raises(LoadError) as e:
        nimble.load(path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message, message
    return message


@pytest.mark.parametrize("name", sorted(STRUCTURAL))
def test_a_single_structural_mutation_is_a_load_error_naming_it(raw, tmp_path, no_gpu_work,
                                                                name):
    saved = _fresh(raw)
    mutate, expected = STRUCTURAL[name]
    mutate(saved)
    path = saved.write(tmp_path / "m.nimble")  # a valid checksum over the changed manifest
    message = _load_error(path)
    assert re.search(expected, message), message


@pytest.mark.parametrize("how", sorted(CONTAINER))
def test_a_damaged_container_is_a_load_error_naming_it(raw, tmp_path, no_gpu_work, how):
    path = tmp_path / "m.nimble"
    path.write_bytes(_container(how, raw))
    message = _load_error(path)
    assert re.search(CONTAINER[how], message), message


def _paths(value, path=()):
    """Every field of a manifest (objects and arrays too), as the keys that reach it."""
    yield path
    if isinstance(value, (dict, list)):
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            yield from _paths(item, path + (key,))


def test_a_field_changed_anywhere_is_a_load_error_or_harmless_never_another_error(
        raw, tmp_path, monkeypatch):
    """200 seeded draws: a field anywhere in the manifest replaced by a value of another type
    or range, or deleted; the load says LoadError, or (a change the checks rightly let
    through, a device name, a fingerprint) reaches the GPU question: NoGpuError."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    paths = [p for p in _paths(_fresh(raw).manifest) if p]
    rng = random.Random(48)
    values = ["x", -1, 2**64, None, [], {}, 1.5, True, 0, [1, 2], {"0": 1}]
    refused = 0
    for _ in range(200):
        saved = _fresh(raw)
        *parents, last = rng.choice(paths)
        target = saved.manifest
        for key in parents:
            target = target[key]
        if isinstance(target, dict) and rng.random() < 0.2:
            del target[last]
        else:
            target[last] = rng.choice(values)
        path = saved.write(tmp_path / "m.nimble")
        try:
            nimble.load(path)
        except LoadError:
            refused += 1
        except NoGpuError:
            pass
    assert refused > 130
