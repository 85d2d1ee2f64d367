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


def _elf(sections: dict[str, bytes]) -> bytes:
    """A little-endian ELF64 with a section table: a null section, ``.shstrtab`` and
    ``sections`` in order (what kernel_code reads of a cubin)."""
    names = b"\0.shstrtab\0" + b"".join(n.encode() + b"\0" for n in sections)
    body, placed = b"", []
    for data in [names, *sections.values()]:
        placed.append((64 + len(body), len(data)))
        body += data
    shoff = 64 + len(body)
    name_at = [1] + [names.index(b"\0" + n.encode() + b"\0") + 1 for n in sections]
    table = b"\0" * 64
    for (offset, size), sh_name, sh_type in zip(placed, name_at, [3] + [1] * len(sections)):
        table += struct.pack("<IIQQQQIIQQ", sh_name, sh_type, 0, 0, offset, size, 0, 0, 1, 0)
    head = b"\x7fELF" + bytes([2, 1, 1]) + b"\0" * 9
    head += struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, shoff, 0, 64, 0, 0, 64,
                        len(sections) + 2, 1)
    return head + body + table


def _cache_of(tmp_path, monkeypatch, images: dict[str, bytes]) -> None:
    """Triton's cache holding ``{hash: cubin}``, each ``triton_red_0.cubin`` for 128 threads,
    and nothing else to find: no library, no CUPTI."""
    cache = tmp_path / "triton"
    for key, data in images.items():
        folder = cache / key
        folder.mkdir(parents=True)
        (folder / "triton_red_0.cubin").write_bytes(data)
        (folder / "triton_red_0.json").write_text(json.dumps({"num_warps": 4, "shared": 0,
                                                              "hash": key}))
    monkeypatch.setattr(binaries, "cubin_folders", lambda: [cache])
    monkeypatch.setattr(binaries, "loaded_libraries", lambda: [])
    monkeypatch.setattr(kb.module_images, "capturing", lambda: False)
    monkeypatch.setattr(kb, "_loads", lambda image, k: True)  # every one fits the fingerprint


def _hashed(key):
    return kb.LiveKernel("triton_red_0", None, {"NUM_REGS": 32}, [[0, 8]], {}, 128, 0, key)


def test_same_named_cubins_of_other_sizes_are_told_apart_by_trions_hash(tmp_path, monkeypatch):
    """Inductor's kernels bake their sizes into their code: a batch of 1's and of 8's argmax
    kernel share a name and a fingerprint. The one this process loaded (its hash) is saved."""
    one = _elf({".text.triton_red_0": b"xnumel = 1"})
    eight = _elf({".text.triton_red_0": b"xnumel = 8"})
    _cache_of(tmp_path, monkeypatch, {"aa": one, "bb": eight})
    for key, want in (("aa", one), ("bb", eight)):
        table = kb.BinaryTable(BlobWriter(), 90)
        row = table.rows[kb.KernelFinder(90, table).locate([_hashed(key)])[0]]
        assert row["origin"].endswith(f"{key}/triton_red_0.cubin")


def test_same_named_cubins_of_other_code_and_no_hash_refuse_the_save(tmp_path, monkeypatch):
    _cache_of(tmp_path, monkeypatch, {"aa": _elf({".text.triton_red_0": b"xnumel = 1"}),
                                      "bb": _elf({".text.triton_red_0": b"xnumel = 8"})})
    finder = kb.KernelFinder(90, kb.BinaryTable(BlobWriter(), 90))
    with pytest.raises(SaveError, match=r"several binaries .*triton_red_0 \(2 codes\).*nothing "
                                        "is saved"):
        finder.locate([_hashed(None)])


def test_same_named_cubins_of_one_code_are_one_kernel(tmp_path, monkeypatch):
    """Two cubins whose images differ elsewhere (another kernel beside) but hold one code for
    this kernel: either is right."""
    _cache_of(tmp_path, monkeypatch, {
        "aa": _elf({".text.triton_red_0": b"same code"}),
        "bb": _elf({".text.other": b"more", ".text.triton_red_0": b"same code"})})
    table = kb.BinaryTable(BlobWriter(), 90)
    kb.KernelFinder(90, table).locate([_hashed(None)])
    assert len(table.rows) == 1


def test_the_code_of_a_kernel_is_its_text_section_or_the_whole_image():
    image = _elf({".text.k": b"CODE", ".nv.info.k": b"info"})
    assert binaries.kernel_code(image, "k") == b"CODE"
    assert binaries.kernel_code(image, "absent") is None
    assert binaries.kernel_code(b"not an elf", "k") is None


def test_images_whose_code_cannot_be_read_do_not_make_a_kernel_ambiguous(tmp_path,
                                                                         monkeypatch):
    """Two fitting images that show no ``.text`` section for the kernel (a fatbin, say) are
    taken as before, one of them; beside one that shows it, that one."""
    _cache_of(tmp_path, monkeypatch, {"aa": b"fatbin one", "bb": b"fatbin two"})
    table = kb.BinaryTable(BlobWriter(), 90)
    row = table.rows[kb.KernelFinder(90, table).locate([_hashed(None)])[0]]
    assert row["origin"].endswith(("aa/triton_red_0.cubin", "bb/triton_red_0.cubin"))
    _cache_of(tmp_path / "2", monkeypatch, {"aa": b"fatbin one",
                                            "bb": _elf({".text.triton_red_0": b"code"})})
    table = kb.BinaryTable(BlobWriter(), 90)
    row = table.rows[kb.KernelFinder(90, table).locate([_hashed(None)])[0]]
    assert row["origin"].endswith("bb/triton_red_0.cubin")


class _Launcher:
    """Stands for a Triton CompiledKernel (which keeps its cubin as ``kernel``) or Inductor's
    static launcher (``cubin_raw``, dropped once loaded)."""

    def __init__(self, function, key, **image):
        self.function, self.hash = function, key
        self.__dict__.update(image)


def test_the_hashes_of_the_loaded_triton_kernels_are_read_from_their_holders(monkeypatch):
    monkeypatch.setattr(_Launcher, "__module__", "triton.compiler.compiler")
    held = [_Launcher(0x7F00, "aa", kernel=b"CUBIN"), _Launcher(0x7F08, "bb", cubin_raw=None),
            _Launcher(None, "cc"), _Launcher(0x7F18, "ee", cubin_raw=b"RAW")]

    class Elsewhere(_Launcher):
        __module__ = "somebody.else"
    other = Elsewhere(0x7F10, "dd")
    got = binaries.triton_loaded()
    assert got[0x7F00] == binaries.TritonLoaded("aa", b"CUBIN")
    assert got[0x7F08] == binaries.TritonLoaded("bb", None)
    assert got[0x7F18].image == b"RAW"
    assert 0x7F10 not in got and None not in got
    del held, other


def test_two_functions_of_one_name_and_fingerprint_are_two_kernels_where_their_hash_differs(
        monkeypatch):
    from types import SimpleNamespace

    from nimble.engine import saving

    monkeypatch.setattr(kb.driver, "function_fingerprint", lambda f: {"NUM_REGS": 32})
    monkeypatch.setattr(kb.driver, "function_param_layout", lambda f: [(0, 8)])
    monkeypatch.setattr(kb.driver, "function_attributes", lambda f, names: {})
    task = SimpleNamespace(name="triton_red_0", block=(128, 1, 1), shared_mem=0)
    kernels = saving._Kernels({f: binaries.TritonLoaded(key)
                               for f, key in ((1, "aa"), (2, "bb"), (3, "aa"))})
    assert [kernels.index(task, f) for f in (1, 2, 3, 4, 1)] == [0, 1, 0, 2, 0]
    assert [k.triton_hash for k in kernels.kernels] == ["aa", "bb", None]


def test_a_kernel_name_past_tritons_file_name_limit_is_found_by_its_cut_name(tmp_path,
                                                                            monkeypatch):
    """Triton files a kernel's cubin under the first 150 characters of its name (Inductor's
    fused names run longer): found there by its hash, and a kernel whose name only begins the
    same (its metadata names it) is not taken for it."""
    name = "triton_poi_fused_" + "_".join(f"op{i}" for i in range(60))
    assert len(name) > binaries.TRITON_FILE_NAME_LIMIT
    cache = tmp_path / "triton"
    stem = name[:binaries.TRITON_FILE_NAME_LIMIT]
    for key, kernel_name in (("aa", name), ("bb", name + "_other")):
        folder = cache / key
        folder.mkdir(parents=True)
        (folder / f"{stem}.cubin").write_bytes(_elf({f".text.{kernel_name}": key.encode()}))
        (folder / f"{stem}.json").write_text(json.dumps(
            {"num_warps": 4, "shared": 0, "hash": key, "name": kernel_name}))
    assert [c.triton_hash for c in binaries.cubin_candidates(name, [cache])] == ["aa"]
    _cache_of(tmp_path / "empty", monkeypatch, {})
    monkeypatch.setattr(binaries, "cubin_folders", lambda: [cache])
    kernel = kb.LiveKernel(name, None, {"NUM_REGS": 32}, [[0, 8]], {}, 128, 0, "aa")
    table = kb.BinaryTable(BlobWriter(), 90)
    row = table.rows[kb.KernelFinder(90, table).locate([kernel])[0]]
    assert row["origin"].endswith(f"aa/{stem}.cubin")


def test_a_triton_kernel_whose_cubin_left_the_cache_is_saved_from_the_image_its_loader_keeps(
        tmp_path, monkeypatch):
    """The cache holds two cubins of the name with other code (no hash fits: the kernel's own
    was cleaned away), so the cache alone leaves the save refused; the image Triton's
    CompiledKernel keeps in memory is the kernel's own, and is embedded."""
    _cache_of(tmp_path, monkeypatch, {"aa": _elf({".text.triton_red_0": b"xnumel = 1"}),
                                      "bb": _elf({".text.triton_red_0": b"xnumel = 8"})})
    own = _elf({".text.triton_red_0": b"xnumel = 4"})
    kernel = kb.LiveKernel("triton_red_0", None, {"NUM_REGS": 32}, [[0, 8]], {}, 128, 0, None)
    with pytest.raises(SaveError, match="2 codes"):
        kb.KernelFinder(90, kb.BinaryTable(BlobWriter(), 90)).locate([kernel])
    kernel.held_image = own
    table = kb.BinaryTable(BlobWriter(), 90)
    row = table.rows[kb.KernelFinder(90, table).locate([kernel])[0]]
    assert row["origin"] == "Triton's compiled kernel in the saving process"
    assert ("embedded", binaries.sha256(own)) in table._index


def test_a_triton_kernel_in_no_cache_and_kept_by_no_loader_is_refused_naming_the_caches(
        tmp_path, monkeypatch):
    """Inductor's static launcher keeps no copy of a cubin once loaded: where its cache file is
    gone too, the refusal says so, names the folders read and what to do; a kernel of no
    Triton compilation gets no such words."""
    monkeypatch.setattr(binaries, "cubin_folders", lambda: [tmp_path])
    monkeypatch.setattr(binaries, "loaded_libraries", lambda: [])
    monkeypatch.setattr(kb.module_images, "capturing", lambda: False)
    static = kb.LiveKernel("triton_poi_7", None, {"NUM_REGS": 32}, [[0, 8]], {}, 128, 0, "ab12")
    with pytest.raises(SaveError, match=r"1 of them are Triton kernels whose cubin is in none "
                       rf"of the cache folders read \({tmp_path}; .*static launcher"):
        kb.KernelFinder(90, kb.BinaryTable(BlobWriter(), 90)).locate([static])
    with pytest.raises(SaveError) as refused:
        kb.KernelFinder(90, kb.BinaryTable(BlobWriter(), 90)).locate([_kernel("nowhere")])
    assert "Triton" not in str(refused.value)


def test_a_kernel_unloaded_since_the_prepare_refuses_the_save_saying_so(monkeypatch):
    """A kernel whose module its owner unloaded answers the driver with an invalid handle: the
    save says which kernel and what to do, and any other driver failure stays itself."""
    from types import SimpleNamespace

    from nimble.engine import saving
    from nimble.errors import CudaError

    def gone(f):
        raise CudaError("cuFuncGetAttribute", 400, "CUDA_ERROR_INVALID_HANDLE",
                        "MAX_THREADS_PER_BLOCK")
    monkeypatch.setattr(kb.driver, "function_fingerprint", gone)
    task = SimpleNamespace(name="triton_poi_3", block=(128, 1, 1), shared_mem=0)
    with pytest.raises(SaveError, match="triton_poi_3 of this graph is no longer loaded.*"
                       "prepare again"):
        saving._Kernels({}).index(task, 7)

    def busy(f):
        raise CudaError("cuFuncGetAttribute", 999, "CUDA_ERROR_UNKNOWN")
    monkeypatch.setattr(kb.driver, "function_fingerprint", busy)
    with pytest.raises(CudaError, match="CUDA_ERROR_UNKNOWN"):
        saving._Kernels({}).index(task, 8)


def test_an_unloaded_kernels_refusal_says_what_the_kept_owners_hold():
    """Whether an object the graph keeps still holds the handle (another holder of its
    module unloaded it) or none does (an owner was closed): what to look at next."""
    from types import SimpleNamespace

    from nimble.engine import saving

    class Launcher:  # an owner as Inductor's static launcher holds a kernel
        def __init__(self, function):
            self.function = function

    prepared = SimpleNamespace(kernel_owners=[Launcher(7), Launcher(9)])
    said = saving._owners_state(prepared, 7)
    assert "keeps 1 object(s) still holding it (Launcher)" in said
    assert "another object holding its module unloaded it" in said
    prepared.kernel_owners[0].function = None
    said = saving._owners_state(prepared, 7)
    assert "no object the graph keeps holds it any more; 1 of the 2 it keeps were closed " \
           "(Launcher)" in said
