"""An embedded cubin packed as a fatbin container of one LZ4-compressed ELF entry
(nimble.record.fatbin_pack), on the CPU: LZ4 blocks that round-trip and that a decoder written
here, byte by byte, reads under the block format's rules; containers laid out as CUDA's own
``fatbinary`` lays them out, which the library scan reads as one compressed ELF entry.

``fixtures/gather_input_sm90_lz4.fatbin`` is CUDA 13.0.88's output for the repository's
``kernels/gather_input.ptx``::

    ptxas -arch=sm_90 kernels/gather_input.ptx -o gather_input.cubin
    fatbinary -64 --compress-all --compress-mode=speed --create=gather_input_sm90_lz4.fatbin \\
        --image3=kind=elf,sm=90,file=gather_input.cubin
"""
from __future__ import annotations

import gzip
import hashlib
import random
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest

from nimble.ir.saved_format import SavedFile
from nimble.record import binaries, fatbin_pack as fp
from nimble.record.binaries import BinaryFormatError

from saved_fixture import fixture_path

FIXTURES = Path(__file__).parent / "fixtures"
NVIDIA_CONTAINER = FIXTURES / "gather_input_sm90_lz4.fatbin"
#: The SHA-256 of the cubin ptxas wrote (4608 bytes), which the container holds.
NVIDIA_CUBIN_SHA256 = "f37be16adaa21eabe69fbf0e1aeccd25127c88a2edc5c4ae47f037884b2ce22c"


@dataclass
class Decoded:
    """What the reference decoder read: the bytes, and each match as (start, offset, length)."""

    data: bytes
    matches: list


def reference_decode(block: bytes) -> Decoded:
    """An LZ4 block read one byte at a time, holding it to the format's rules (a match of 4
    bytes or more, reaching 1 to 65535 bytes back; the last sequence literals only)."""
    out = bytearray()
    matches = []
    pos = 0

    def length(base: int) -> int:
        nonlocal pos
        if base < 15:
            return base
        while True:
            byte = block[pos]
            pos += 1
            base += byte
            if byte < 255:
                return base
    while True:
        token = block[pos]
        pos += 1
        for _ in range(length(token >> 4)):
            out.append(block[pos])
            pos += 1
        if pos == len(block):
            return Decoded(bytes(out), matches)
        offset = block[pos] + 256 * block[pos + 1]
        pos += 2
        size = length(token & 15) + 4
        assert 1 <= offset <= 65535 and offset <= len(out)
        matches.append((len(out), offset, size))
        for _ in range(size):
            out.append(out[-offset])


def _assert_round_trip(data: bytes) -> bytes:
    block = fp.lz4_compress(data)
    assert fp.lz4_decompress(block, len(data)) == data
    decoded = reference_decode(block)
    assert decoded.data == data
    for start, _, size in decoded.matches:  # the end rules of the block format
        assert start <= len(data) - fp.MATCH_LIMIT
        assert start + size <= len(data) - fp.LAST_LITERALS
    return block


def _fixture_image() -> bytes:
    """The embedded image of the saved-graph fixture (a stand-in ELF: a header and the
    kernels' names)."""
    saved = SavedFile.from_bytes(gzip.decompress(fixture_path().read_bytes()))
    row = next(r for r in saved.manifest["binaries"] if r["kind"] == "embedded")
    return saved.blob(row["blob"])


def _nvidia_cubin() -> bytes:
    cubin = fp.unpacked(NVIDIA_CONTAINER.read_bytes())
    assert hashlib.sha256(cubin).hexdigest() == NVIDIA_CUBIN_SHA256
    return cubin


def _cubin_like(size: int, seed: int) -> bytes:
    """Bytes shaped like code: 16-byte instructions drawn from a few hundred, with random
    register fields, and runs of zeros between functions."""
    rng = random.Random(seed)
    vocabulary = [rng.randbytes(16) for _ in range(300)]
    out = bytearray(binaries.ELF_MAGIC + bytes(60))
    while len(out) < size:
        if rng.random() < 0.02:
            out += bytes(rng.randrange(16, 512))
        word = bytearray(rng.choice(vocabulary))
        word[2] = rng.randrange(32)
        out += word
    return bytes(out[:size])


# ---- LZ4 blocks ---------------------------------------------------------------------------

@pytest.mark.parametrize("size", range(21))
def test_short_inputs_round_trip(size):
    for data in (bytes(size), bytes(range(size)), (b"ab" * size)[:size]):
        block = _assert_round_trip(data)
        if size < 13:  # too short for any match: one sequence of literals
            assert block == bytes([size << 4]) + data


@pytest.mark.parametrize("size", [1000, 65536, 300_000])
def test_random_bytes_round_trip_and_grow_by_the_literal_lengths_only(size):
    data = random.Random(size).randbytes(size)
    block = _assert_round_trip(data)
    assert len(block) <= size + size // 255 + 16


@pytest.mark.parametrize("size", [13, 100, 4096, 1 << 20])
def test_zeros_shrink_to_a_few_long_matches(size):
    block = _assert_round_trip(bytes(size))
    assert len(block) < 16 + size // 250
    assert len(reference_decode(block).matches) <= 1


@pytest.mark.parametrize("period", [1, 2, 3, 7, 16, 255, 4099])
def test_repetitive_data_round_trips_small(period):
    unit = random.Random(period).randbytes(period)
    data = unit * (200_000 // period)
    assert len(_assert_round_trip(data)) < period + 2000


def test_a_match_exactly_65535_bytes_back_is_taken_and_one_65536_back_is_not():
    rng = random.Random(5)
    phrase = rng.randbytes(64)
    for gap, found in ((65535, True), (65536, False)):
        data = phrase + rng.randbytes(gap - len(phrase)) + phrase + rng.randbytes(40)
        matches = reference_decode(_assert_round_trip(data)).matches
        assert any(offset == 65535 and size >= 64 for _, offset, size in matches) == found
        assert all(offset <= 65535 for _, offset, _ in matches)


def test_matches_overlapping_what_they_write_and_mixed_data_round_trip():
    rng = random.Random(9)
    parts = []
    for _ in range(400):
        kind = rng.randrange(4)
        if kind == 0:
            parts.append(rng.randbytes(rng.randrange(1, 40)))
        elif kind == 1:
            parts.append(bytes([rng.randrange(256)]) * rng.randrange(1, 300))
        elif kind == 2 and parts:
            parts.append(rng.choice(parts))
        else:
            parts.append(rng.randbytes(2) * rng.randrange(1, 50))
    _assert_round_trip(b"".join(parts))


def test_cubins_round_trip_and_shrink():
    """The saved-graph fixture's stand-in image (an ELF header and the kernels' names), a real
    cubin (ptxas's, in the fatbinary fixture) and 1 MiB shaped like code."""
    assert len(_assert_round_trip(_fixture_image())) < len(_fixture_image()) / 2
    cubin = _nvidia_cubin()
    assert len(_assert_round_trip(cubin)) < len(cubin) / 2
    like = _cubin_like(1 << 20, 1)
    assert len(_assert_round_trip(like)) < len(like) / 2


def test_the_wide_position_sort_gives_the_same_block(monkeypatch):
    """Images past 2**24 bytes sort their keys apart from their positions: the same blocks."""
    data = _cubin_like(200_000, 2)
    packed_sort = fp.lz4_compress(data)
    monkeypatch.setattr(fp, "_POSITION_BITS", 8)
    assert fp.lz4_compress(data) == packed_sort


@pytest.mark.parametrize("block, size, message", [
    (b"", 0, "ends before its last literals"),
    (b"\x10", 1, "literals run past its end"),
    (b"\x00\x00\x00", 4, "reaches 0 bytes back"),
    (b"\x10a\x05\x00", 9, "reaches 5 bytes back"),
    (b"\x10a\x01", 5, "ends inside an offset"),
    (b"\x10a\x01\x00\x10b", 7, "holds 6 bytes, not 7"),
    (b"\xf0", 20, "ends inside a length"),
])
def test_a_malformed_block_is_a_format_error(block, size, message):
    with pytest.raises(BinaryFormatError, match=message):
        fp.lz4_decompress(block, size)


# ---- containers ---------------------------------------------------------------------------

def test_a_packed_cubin_is_laid_out_as_cuda_lays_out_a_compressed_entry():
    cubin = _nvidia_cubin()
    ours = fp.packed_cubin(cubin, 90)
    theirs = NVIDIA_CONTAINER.read_bytes()
    magic, version, header_size, body = struct.unpack_from("<IHHQ", ours)
    assert (magic, version, header_size, body) == (0xBA55ED50, 1, 16, len(ours) - 16)
    (kind, entry_version, entry_size, padded, size, _, minor, major, arch, _, _, flags, _,
     unpacked_size) = struct.unpack_from("<HHIQIIHHIIIQQQ", ours, 16)
    assert (kind, entry_version, entry_size, arch) == (2, 0x0101, 64, 90)
    assert (major, minor) == (1, cubin[8])  # the ELF's code version, [1, EI_ABIVERSION]
    assert flags == 0x2011 and unpacked_size == len(cubin)
    assert padded == -(-size // 8) * 8 and len(ours) == 80 + padded
    assert ours[80 + size:] == bytes(padded - size)
    # CUDA's header, but for the sizes of the compressed payload (its compressor is its own)
    sizes = slice(8, 24)
    header = bytearray(ours[16:80])
    header[sizes] = theirs[16:80][sizes]
    assert bytes(header) == theirs[16:80] and theirs[:8] == ours[:8]
    assert fp.unpacked(ours) == cubin == fp.unpacked(theirs)


def test_the_library_scan_reads_a_packed_cubin_as_one_compressed_elf_entry():
    cubin = _nvidia_cubin()
    packed = fp.packed_cubin(cubin, 90)
    container, = binaries.fatbin_containers(packed)
    assert (container.offset, container.size) == (0, len(packed))
    entry, = container.entries
    assert (entry.kind, entry.arch, entry.compressed) == (binaries.ENTRY_KIND_ELF, 90, True)
    block = fp.pack(cubin).compressed
    assert packed[entry.payload] == block
    assert fp.lz4_decompress(packed[entry.payload], len(cubin)) == cubin
    marked = fp.packed_cubin(cubin, 90, arch_specific=True)
    flags, = struct.unpack_from("<Q", marked, 16 + 40)
    assert flags == 0x102011  # what fatbinary writes for sm=90a


def test_an_uncompressed_entry_as_cuda_writes_it_holds_its_cubin_and_its_names_are_found():
    """``fixtures/gather_input_sm90_plain.fatbin``: the same cubin through ``fatbinary -64
    --create=... --image3=kind=elf,sm=90,file=gather_input.cubin`` (no compression), whose entry
    leaves its payload-size field 0 (it counts compressed bytes): the library scan takes the
    padded payload for its bytes, so a kernel's name in a plain entry is found there."""
    plain = (FIXTURES / "gather_input_sm90_plain.fatbin").read_bytes()
    cubin = _nvidia_cubin()
    assert struct.unpack_from("<I", plain, 16 + 16)[0] == 0  # as CUDA 13.0's fatbinary writes
    container, = binaries.fatbin_containers(plain)
    entry, = container.entries
    assert (entry.kind, entry.arch, entry.compressed) == (binaries.ENTRY_KIND_ELF, 90, False)
    assert plain[entry.payload].rstrip(b"\0") == cubin.rstrip(b"\0")
    hits = binaries.plain_name_hits(plain, [container], ["nimble_gather_input"])
    assert hits == {"nimble_gather_input": container}


def test_a_cubins_target_is_read_from_either_elf_layout():
    cubin = bytearray(_nvidia_cubin())
    assert fp.cubin_target(bytes(cubin)) == fp.CubinTarget(90, False)  # ABI 8: SM in bits 8-15
    struct.pack_into("<I", cubin, 48, 0x06006402 | 0x8)
    assert fp.cubin_target(bytes(cubin)) == fp.CubinTarget(100, True)
    cubin[8] = 7  # before ABI 8: the SM in the low byte, 0x800 for sm_90a
    struct.pack_into("<I", cubin, 48, 0x5A0F5A | 0x800)
    assert fp.cubin_target(bytes(cubin)) == fp.CubinTarget(90, True)
    assert fp.cubin_target(_fixture_image()) is None  # a stand-in: no CUDA machine
    assert fp.cubin_target(b"not an ELF file") is None


def _entry_changed(container: bytes, at: int, fmt: str, value: int) -> bytes:
    changed = bytearray(container)
    struct.pack_into(fmt, changed, 16 + at, value)
    return bytes(changed)


def test_what_is_not_one_packed_cubin_is_a_format_error():
    cubin = _nvidia_cubin()
    packed = fp.packed_cubin(cubin, 90)
    bad = {
        "too few": packed[:70],
        "magic": b"\0" * 4 + packed[4:],
        "size": packed + bytes(8),
        "kind": _entry_changed(packed, 0, "<H", 1),
        "plain": _entry_changed(packed, 40, "<Q", 0x11),
        "zstd": _entry_changed(packed, 40, "<Q", 0xA011),
        "entries": _entry_changed(packed, 8, "<Q", 8),
        "unpacked size": _entry_changed(packed, 56, "<Q", len(cubin) + 1),
    }
    for what, data in bad.items():
        with pytest.raises(BinaryFormatError):
            fp.unpacked(data)
    with pytest.raises(BinaryFormatError, match="only a cubin is packed"):
        fp.pack(b"PTX, not an ELF file")


def test_a_compressor_fault_is_a_packing_error(monkeypatch):
    monkeypatch.setattr(fp, "lz4_compress", lambda data: b"\x10x")
    with pytest.raises(fp.PackingError, match="does not decompress to it"):
        fp.pack(_nvidia_cubin())
