"""Where a saved graph's kernels are found (nimble.engine.kernel_binaries.KernelFinder), on the
CPU with stand-ins for the libraries, the driver's loads, Triton's cache and CUPTI's images:
library containers first, then cubins (Triton's metadata telling variants apart), then the
modules kept since keep_kernel_binaries; a candidate whose kernel differs is passed over; a
kernel found nowhere is a SaveError that says what to do."""
from __future__ import annotations

import json
import struct

import pytest

from nimble.engine import kernel_binaries as kb
from nimble.errors import SaveError
from nimble.ir.saved_format import BlobWriter
from nimble.record import binaries


def _container(tag: bytes) -> bytes:
    payload = tag.ljust(16, b"\0")
    head = struct.pack("<HHIQIIII", 2, 0x0101, 64, len(payload), len(payload), 0, 0, 90)
    head += b"\0" * 8 + struct.pack("<Q", 0x8000) + b"\0" * 16
    body = head + payload
    return struct.pack("<IHHQ", binaries.FATBIN_MAGIC, 1, 16, len(body)) + body


def _kernel(name: str, threads: int = 128, shared: int = 0) -> kb.LiveKernel:
    return kb.LiveKernel(name, None, {"NUM_REGS": 32}, [[0, 8]], {}, threads, shared)


@pytest.fixture
def world(monkeypatch, tmp_path):
    """Stand-ins: one library with two containers (kernel lib_a in the first, lib_b in the
    second, which the driver says is another kernel of that name), a Triton cache with two
    cubins of one name (the first for 256 threads), and CUPTI's images (one naming nvjet)."""
    section = _container(b"A") + _container(b"B")
    lib = binaries.LibraryFatbins("/lib/libfake.so", 4096, section,
                                  binaries.fatbin_containers(section))
    monkeypatch.setattr(binaries, "loaded_libraries", lambda: ["/lib/libfake.so"])
    monkeypatch.setattr(binaries.LibraryFatbins, "read", classmethod(lambda cls, p: [lib]))
    monkeypatch.setattr(kb.os.path, "getsize", lambda p: 123)
    c0, c1 = lib.containers
    monkeypatch.setattr(binaries, "compressed_kernel_index",
                        lambda l, arch, names: {"lib_a": c0.offset, "lib_b": c1.offset})
    cache = tmp_path / "triton"
    for k, (threads, data) in enumerate(((256, b"cubin-256"), (128, b"cubin-128"))):
        folder = cache / f"h{k}"
        folder.mkdir(parents=True)
        (folder / "triton_poi_0.cubin").write_bytes(data)
        (folder / "triton_poi_0.json").write_text(json.dumps({"num_warps": threads // 32,
                                                              "shared": 0}))
    monkeypatch.setattr(binaries, "cubin_folders", lambda: [cache])
    images = [b"\0\0other\0", b"\0\0.text.nvjet_sm90_x\0nvjet_sm90_x\0"]
    monkeypatch.setattr(kb.module_images, "capturing", lambda: True)
    monkeypatch.setattr(kb.module_images, "images", lambda: images)
    wrong = {(bytes(lib.container_bytes(c1)), "lib_b")}
    monkeypatch.setattr(kb, "_loads", lambda image, k: (bytes(image), k.name) not in wrong)
    return lib


def test_each_kernel_is_found_where_it_lives(world):
    table = kb.BinaryTable(BlobWriter(), 90)
    kernels = [_kernel("lib_a"), _kernel("triton_poi_0", threads=128),
               _kernel("nvjet_sm90_x")]
    rows = kb.KernelFinder(90, table).locate(kernels)
    library, cubin, image = (table.rows[r] for r in rows)
    assert library["kind"] == "library" and library["offset"] == 4096 + world.containers[0].offset
    assert library["size"] == world.containers[0].size and library["file_size"] == 123
    assert cubin["kind"] == "embedded" and cubin["origin"].endswith("h1/triton_poi_0.cubin")
    assert image["kind"] == "embedded" and image["origin"] == "module loaded in the saving process"


def test_a_kernel_whose_only_candidate_differs_is_refused_with_what_to_do(world, monkeypatch):
    finder = kb.KernelFinder(90, kb.BinaryTable(BlobWriter(), 90))
    with pytest.raises(SaveError, match=r"1 kernel\(s\) .*\(lib_b\) and none of the modules"):
        finder.locate([_kernel("lib_b")])
    monkeypatch.setattr(kb.module_images, "capturing", lambda: False)
    with pytest.raises(SaveError, match="call nimble.keep_kernel_binaries.. at the start"):
        kb.KernelFinder(90, kb.BinaryTable(BlobWriter(), 90)).locate([_kernel("nowhere")])


def test_a_binary_used_by_several_kernels_is_one_row(world):
    table = kb.BinaryTable(BlobWriter(), 90)
    rows = kb.KernelFinder(90, table).locate([_kernel("lib_a"), _kernel("lib_a", threads=64)])
    assert rows == [0, 0] and len(table.rows) == 1


@pytest.mark.parametrize("cached", [False, True])
def test_a_library_listed_for_the_first_time_on_a_machine_says_so(world, monkeypatch, cached,
                                                                  caplog):
    """Listing a library's compressed kernels can take long the first time on a machine (it is
    cached after): a save that is not quiet says which library it lists and how long it took;
    a cached one says nothing."""
    import logging

    monkeypatch.setattr(binaries, "index_cached", lambda lib, arch: cached)
    with caplog.at_level(logging.INFO, logger="nimble"):
        finder = kb.KernelFinder(90, kb.BinaryTable(BlobWriter(), 90), quiet=False)
        finder.locate([_kernel("lib_a")])
    said = [r.getMessage() for r in caplog.records if "compressed kernels" in r.getMessage()]
    if cached:
        assert said == []
    else:
        assert said[0] == "listing the compressed kernels of libfake.so (once on this machine, " \
                          "then cached)"
        assert said[1].startswith("listed the compressed kernels of libfake.so in ")
