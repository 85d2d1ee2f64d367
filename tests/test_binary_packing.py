"""A saved graph's embedded cubins stored LZ4-packed (nimble.engine.kernel_binaries.BinaryTable
with nimble.record.fatbin_pack), on the CPU with the driver's load stood in: a packed form is
kept only where the driver loads it as the same kernel (for every kernel of the image), its row
says so and hashes the bytes it stores, which the load reads back; a form the driver refuses, an
image that does not shrink and one that is no cubin are stored as they are."""
from __future__ import annotations

import gzip
import hashlib
import logging
import random
import struct
from pathlib import Path

import pytest

from nimble.engine import kernel_binaries as kb
from nimble.engine.kernel_loading import binary_bytes
from nimble.ir.saved_format import BlobWriter, SavedFile
from nimble.record import binaries, fatbin_pack as fp

from saved_fixture import fixture_path

FIXTURES = Path(__file__).parent / "fixtures"


def _cubin() -> bytes:
    """ptxas's cubin of kernels/gather_input.ptx (test_fatbin_pack.py says how it was made)."""
    return fp.unpacked((FIXTURES / "gather_input_sm90_lz4.fatbin").read_bytes())


def _packed_form(data: bytes) -> bool:
    return data[:4] == binaries.FATBIN_MAGIC.to_bytes(4, "little")


def _flags(container: bytes) -> int:
    return struct.unpack_from("<Q", container, 16 + 40)[0]


class Driver:
    """``verify`` stand-ins: each call's bytes kept; ``accept`` says which forms load."""

    def __init__(self, accept=lambda data: True) -> None:
        self.accept, self.seen = accept, []

    def __call__(self, data: bytes) -> bool:
        self.seen.append(bytes(data))
        return self.accept(bytes(data))


def _stored(table: kb.BinaryTable, blobs: BlobWriter, row: int) -> bytes:
    offset, size = table.rows[row]["blob"]
    return blobs.getvalue()[offset:offset + size]


def test_a_cubin_the_driver_loads_packed_is_stored_packed_and_loads_back_as_stored():
    blobs = BlobWriter()
    table, driver, cubin = kb.BinaryTable(blobs, 90), Driver(), _cubin()
    row = table.embedded(cubin, "triton cache", driver)
    stored = _stored(table, blobs, row)
    assert table.rows[row] == {"kind": "embedded", "blob": table.rows[row]["blob"],
                               "sha256": hashlib.sha256(stored).hexdigest(),
                               "origin": "triton cache", "packed": "lz4",
                               "image_size": len(cubin)}
    assert len(stored) < len(cubin) / 2 and fp.unpacked(stored) == cubin
    assert driver.seen == [stored] and _flags(stored) == 0x2011
    saved = SavedFile({"binaries": table.rows}, blobs.getvalue())
    assert binary_bytes(table.rows[row], saved) == stored  # held to the hash of what it holds


def test_an_image_is_packed_once_and_each_later_kernel_is_held_to_the_packed_form(monkeypatch):
    packs = []
    real_pack = fp.pack
    monkeypatch.setattr(fp, "pack", lambda data: packs.append(1) or real_pack(data))
    blobs = BlobWriter()
    table, first, second = kb.BinaryTable(blobs, 90), Driver(), Driver()
    rows = [table.embedded(_cubin(), "a", first), table.embedded(_cubin(), "a", second)]
    assert rows == [0, 0] and len(table.rows) == 1 and packs == [1]
    assert second.seen == first.seen == [_stored(table, blobs, 0)]


def test_a_packed_form_the_driver_refuses_is_not_stored_and_is_said(caplog):
    blobs = BlobWriter()
    table, driver = kb.BinaryTable(blobs, 90), Driver(lambda data: not _packed_form(data))
    with caplog.at_level(logging.INFO, logger="nimble"):
        row = table.embedded(_cubin(), "triton cache", driver)
    assert "packed" not in table.rows[row] and _stored(table, blobs, row) == _cubin()
    assert table.rows[row]["sha256"] == hashlib.sha256(_cubin()).hexdigest()
    assert [_flags(d) for d in driver.seen] == [0x2011, 0x102011]  # both markings tried
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert said == ["the driver does not load the LZ4-packed form of the image from triton "
                    "cache as the same kernel: stored as it is (4608 bytes)"]


def test_an_image_that_loads_only_marked_architecture_specific_is_stored_so():
    blobs = BlobWriter()
    driver = Driver(lambda data: not _packed_form(data) or _flags(data) & 0x100000)
    table = kb.BinaryTable(blobs, 90)
    row = table.embedded(_cubin(), "a", driver)
    assert table.rows[row]["packed"] == "lz4"
    assert _flags(_stored(table, blobs, row)) == 0x102011


def test_a_later_kernel_the_packed_form_does_not_hold_stores_the_image_as_it_is(caplog):
    blobs = BlobWriter()
    table = kb.BinaryTable(blobs, 90)
    assert table.embedded(_cubin(), "a", Driver()) == 0
    with caplog.at_level(logging.INFO, logger="nimble"):
        again = table.embedded(_cubin(), "a", Driver(lambda data: not _packed_form(data)))
    assert again == 0 and "packed" not in table.rows[0]
    assert _stored(table, blobs, 0) == _cubin()
    assert table.rows[0]["sha256"] == hashlib.sha256(_cubin()).hexdigest()
    assert any("stored as it is" in r.getMessage() for r in caplog.records)


def test_what_is_not_a_shrinking_verified_cubin_is_stored_as_it_is(monkeypatch, caplog):
    incompressible = b"\x7fELF" + random.Random(0).randbytes(5000)
    cases = {"no verify": (_cubin(), None), "not an ELF file": (b"PTX " * 100, Driver()),
             "does not shrink": (incompressible, Driver())}
    for what, (data, driver) in cases.items():
        blobs = BlobWriter()
        table = kb.BinaryTable(blobs, 90)
        row = table.embedded(data, what, driver)
        assert "packed" not in table.rows[row] and _stored(table, blobs, row) == data, what
        assert driver is None or driver.seen == [], what
    monkeypatch.setattr(kb, "PACK_LIMIT", len(_cubin()) - 1)  # larger than packing takes
    blobs, driver = BlobWriter(), Driver()
    table = kb.BinaryTable(blobs, 90)
    with caplog.at_level(logging.INFO, logger="nimble"):
        row = table.embedded(_cubin(), "large", driver)
    assert "packed" not in table.rows[row] and driver.seen == []
    assert any("stored unpacked: packing takes more than" in r.getMessage()
               for r in caplog.records)
    monkeypatch.undo()
    monkeypatch.setattr(fp, "lz4_compress", lambda data: b"\x10x")
    blobs = BlobWriter()
    table = kb.BinaryTable(blobs, 90)
    with caplog.at_level(logging.INFO, logger="nimble"):
        row = table.embedded(_cubin(), "faulty", Driver())
    assert "packed" not in table.rows[row] and _stored(table, blobs, row) == _cubin()
    assert any("stored unpacked" in r.getMessage() and "does not decompress" in r.getMessage()
               for r in caplog.records)


def test_a_stand_in_elf_takes_the_devices_architecture():
    """An ELF whose header names no CUDA machine (the saved fixture's stand-in image): the
    entry says the device's architecture."""
    saved = SavedFile.from_bytes(gzip.decompress(fixture_path().read_bytes()))
    image = saved.blob(saved.manifest["binaries"][0]["blob"])
    blobs = BlobWriter()
    table = kb.BinaryTable(blobs, 89)
    row = table.embedded(image, "stand-in", Driver())
    entry, = binaries.fatbin_containers(_stored(table, blobs, row))[0].entries
    assert entry.arch == 89 and fp.unpacked(_stored(table, blobs, row)) == image


@pytest.fixture
def finder_world(monkeypatch, tmp_path):
    """No libraries; a Triton cache with the real cubin as ``nimble_gather_input.cubin``; the
    saved fixture's stand-in image among CUPTI's module images; ``_loads`` keeps what it is
    given and refuses the packed forms where ``refuse_packed`` holds."""
    monkeypatch.setattr(binaries, "loaded_libraries", lambda: [])
    folder = tmp_path / "triton" / "h0"
    folder.mkdir(parents=True)
    (folder / "nimble_gather_input.cubin").write_bytes(_cubin())
    monkeypatch.setattr(binaries, "cubin_folders", lambda: [tmp_path / "triton"])
    saved = SavedFile.from_bytes(gzip.decompress(fixture_path().read_bytes()))
    monkeypatch.setattr(kb.module_images, "capturing", lambda: True)
    monkeypatch.setattr(kb.module_images, "images",
                        lambda: [saved.blob(saved.manifest["binaries"][0]["blob"])])
    world = {"loaded": [], "refuse_packed": False, "kernel": saved.manifest["kernels"][0]["name"]}

    def loads(image, kernel):
        world["loaded"].append((kernel.name, bytes(image)))
        return not (world["refuse_packed"] and _packed_form(image))
    monkeypatch.setattr(kb, "_loads", loads)
    return world


@pytest.mark.parametrize("refuse_packed", [False, True])
def test_the_finder_has_each_embedded_image_packed_through_the_driver(finder_world,
                                                                     refuse_packed):
    finder_world["refuse_packed"] = refuse_packed
    blobs = BlobWriter()
    table = kb.BinaryTable(blobs, 90)
    kernels = [kb.LiveKernel(name, None, {"NUM_REGS": 32}, [[0, 8]], {}, 128, 0)
               for name in ("nimble_gather_input", finder_world["kernel"])]
    rows = kb.KernelFinder(90, table).locate(kernels)
    assert [table.rows[r]["origin"].endswith("nimble_gather_input.cubin") for r in rows] == \
        [True, False]
    for kernel, r in zip(kernels, rows):
        stored = _stored(table, blobs, r)
        tried = [image for name, image in finder_world["loaded"] if name == kernel.name]
        assert _packed_form(tried[1])  # the image as found, then its packed form
        assert ("packed" in table.rows[r]) == (not refuse_packed)
        assert _packed_form(stored) == (not refuse_packed)
        assert table.rows[r]["sha256"] == hashlib.sha256(stored).hexdigest()
