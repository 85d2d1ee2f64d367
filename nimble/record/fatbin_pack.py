"""An embedded cubin packed as a fatbin container of one LZ4-compressed ELF entry.

A saved graph embeds the cubins no library file holds (Triton's, and the module images kept by
``keep_kernel_binaries``).  ``cuLibraryLoadData`` takes a fatbin container as readily as a
cubin, and decompresses a compressed entry itself; so an image stored as a container of one
LZ4-compressed entry makes the file smaller (a cubin's code and tables shrink about 3.5 times)
while every loader, Python's and the C runtime's, hands the stored bytes to the driver as
before.

The layout is the one the CUDA 13.0 ``fatbinary`` tool writes for
``--image3=kind=elf,sm=90 --compress-all --compress-mode=speed`` (its LZ4 mode; the default,
zstd, would need a zstd encoder): a 16-byte header (magic, version 1, header size 16, bytes
after it), then one entry of 64 bytes (:data:`ENTRY`) with the compressed payload after it,
padded with zeros to 8 bytes.  The entry carries the ELF's architecture, its code version
``[1, EI_ABIVERSION]``, the flags 64-bit, host Linux and LZ4 (and architecture-specific for an
``sm_90a`` image), and the size of the image it unpacks to.

:func:`lz4_compress` writes the LZ4 *block* format (no frame): every position's candidates (the
nearest earlier positions with the same five bytes) are found and measured for all positions at
once with numpy, then a Python loop walks match by match (the first match, or the next
position's where that is longer); :func:`pack` checks that every compressed image decompresses
to its input before it is used.  Plain bytes: no driver, no torch.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ..errors import NimbleError
from .binaries import (ELF_MAGIC, ENTRY_KIND_ELF, FATBIN_HEADER, FATBIN_MAGIC, FLAG_LZ4,
                       FLAG_ZSTD, BinaryFormatError, elf64_le)

#: One fatbin entry's 64-byte header as written here: kind, version (0x0101), header size,
#: padded payload size, payload size, options offset, code version minor and major, arch,
#: identifier offset and length, flags, reserved, the size the payload unpacks to.
ENTRY = struct.Struct("<HHIQIIHHIIIQQQ")
ENTRY_VERSION = 0x0101
FLAG_64BIT = 0x1
FLAG_HOST_LINUX = 0x10
#: What ``fatbinary`` adds for an architecture-specific target (``sm=90a``).
FLAG_ARCH_SPECIFIC = 0x100000
_EM_CUDA = 190

# The LZ4 block format's rules: a match is at least 4 bytes, reaches at most 65535 bytes back,
# starts at least 12 bytes before the end of the block and ends at least 5 bytes before it.
MIN_MATCH = 4
MAX_OFFSET = 65535
MATCH_LIMIT = 12
LAST_LITERALS = 5


class PackingError(NimbleError, RuntimeError):
    """An image whose compressed form does not decompress to it (a fault of the compressor:
    the image is then stored as it is)."""


# ---- LZ4 blocks ---------------------------------------------------------------------------

#: The bytes a candidate shares with the position it is found for: the key of the search.
KEY_BYTES = 5
#: How many earlier positions with the same key each position tries (the nearest first).
CANDIDATES = 2
#: The match length measured for every position at once; a longer match taken is measured on.
_MEASURED = 32
#: A position fits in the low bits of a sort key beside its :data:`KEY_BYTES` key.
_POSITION_BITS = 64 - 8 * KEY_BYTES
_NONE = -(1 << 20)  # no earlier position: farther back than any window
#: The largest image packed: its positions and their distances fit in 32-bit integers.
MAX_IMAGE = 1 << 30


def _words(data: bytes) -> np.ndarray:
    """``words[i]``: the 8 bytes from ``i`` as a little-endian integer, for ``i`` up to
    :data:`_MEASURED` past the end (zeros there)."""
    padded = data + bytes(_MEASURED + 8)
    return np.ndarray((len(data) + _MEASURED,), "<u8", padded, 0, (1,)).copy()


def _previous(words: np.ndarray, last: int) -> np.ndarray:
    """Per position ``0..last``, the last earlier position whose :data:`KEY_BYTES` bytes are
    the same (:data:`_NONE` where none): one sort of (key, position) pairs, packed in one
    integer each where the positions fit beside the key."""
    count = last + 1
    shift = np.uint64(64 - 8 * KEY_BYTES)
    previous = np.full(count, _NONE, np.int32)
    if count <= 1 << _POSITION_BITS:
        pairs = words[:count] << shift
        pairs |= np.arange(count, dtype=np.uint64)
        pairs.sort()
        order = (pairs & np.uint64((1 << _POSITION_BITS) - 1)).astype(np.int32)
        same = (pairs[1:] ^ pairs[:-1]) < np.uint64(1 << _POSITION_BITS)
    else:
        keys = words[:count] << shift
        order = np.argsort(keys, kind="stable").astype(np.int32)
        sorted_keys = keys[order]
        same = sorted_keys[1:] == sorted_keys[:-1]
    previous[order[1:]] = np.where(same, order[:-1], np.int32(_NONE))
    return previous


def _equal_bytes(x: np.ndarray) -> np.ndarray:
    """Per 64-bit XOR of two words, how many of their low bytes are equal (8 for 0), as
    ``uint8``."""
    below = (x & (~x + np.uint64(1))) - np.uint64(1)  # the bits under the lowest set bit
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(below) >> np.uint8(3)
    bits = np.frexp(below.astype(np.float64) + 1.0)[1] - 1
    return (bits >> 3).astype(np.uint8)


def _measured(words: np.ndarray, starts: np.ndarray | None, at: np.ndarray,
              room: np.ndarray) -> np.ndarray:
    """Per match (from ``at`` to ``starts``: arrays of positions, None for every position in
    order), how many bytes are equal, up to its ``room`` (at most :data:`_MEASURED`), as
    ``uint8``: 8 bytes at a time, the next 8 measured only for the matches still whole (for
    every match where most are)."""
    def ahead(step: int, which: np.ndarray | None = None) -> np.ndarray:
        if starts is None:
            return words[step:step + len(at)] if which is None else words[step:][which]
        return words[step:][starts if which is None else starts[which]]
    found = _equal_bytes(ahead(0) ^ words[at])
    for step in range(8, _MEASURED, 8):
        whole = found == step
        if np.count_nonzero(whole) > len(found) // 4:
            found += np.where(whole, _equal_bytes(ahead(step) ^ words[step:][at]), np.uint8(0))
        else:
            which = np.flatnonzero(whole)
            found[which] += _equal_bytes(ahead(step, which) ^ words[step:][at[which]])
    return np.minimum(found, room)


def _best_matches(words: np.ndarray, last: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Per position ``0..last`` (and a 0 after), the longest match among its
    :data:`CANDIDATES` nearest earlier positions with the same key within :data:`MAX_OFFSET`,
    measured up to :data:`_MEASURED` bytes and ending by ``limit`` (0 where none), and where
    it starts.  A farther candidate is measured only where the nearer one fell short."""
    count = last + 1
    positions = np.arange(count, dtype=np.int32)
    room = np.minimum(limit - positions, _MEASURED).astype(np.uint8)
    previous = _previous(words, last)
    near = positions - previous <= MAX_OFFSET
    source = np.zeros(count + 1, np.int32)
    source[:count] = np.where(near, previous, 0)
    length = np.zeros(count + 1, np.uint8)
    length[:count] = np.where(near, _measured(words, None, source[:count], room), np.uint8(0))
    todo = np.flatnonzero(near & (length[:count] < room)).astype(np.int32)
    for _ in range(1, CANDIDATES):
        at = previous[source[todo]]
        closer = np.flatnonzero(todo - at <= MAX_OFFSET)
        todo, at = todo[closer], at[closer]
        found = _measured(words, todo, at, room[todo])
        longer = np.flatnonzero(found > length[todo])
        length[todo[longer]] = found[longer]
        source[todo[longer]] = at[longer]
        todo = todo[np.flatnonzero(found < room[todo])]
    return length, source


def _common_length(data: bytes, a: int, b: int, limit: int) -> int:
    """How many bytes from ``a`` equal those from ``b`` (``a < b``), with ``b`` stopping at
    ``limit``: slices compared in doubling chunks, then the last chunk halved."""
    start = b
    step = 16
    while b + step <= limit and data[a:a + step] == data[b:b + step]:
        a += step
        b += step
        if step < 4096:
            step <<= 1
    low, high = 0, min(step, limit - b)  # data[a:a+low] == data[b:b+low]; no more than high
    while low < high:
        mid = (low + high + 1) >> 1
        if data[a + low:a + mid] == data[b + low:b + mid]:
            low = mid
        else:
            high = mid - 1
    return b + low - start


@dataclass
class _Sequences:
    """The matches of a parse, in order: where each starts, its length, where it copies from."""

    starts: np.ndarray
    lengths: np.ndarray
    sources: np.ndarray


def _parse(data: bytes) -> _Sequences:
    """The matches :func:`lz4_compress` writes: at the first position with a match, or one on
    where that has a longer one (a lazy step), then on after the match."""
    n = len(data)
    last, limit = n - MATCH_LIMIT, n - LAST_LITERALS
    if last < 1:
        none = np.zeros(0, np.int64)
        return _Sequences(none, none, none)
    length, source = _best_matches(_words(data), last, limit)
    first = np.where(length[:last + 1] > 0, np.arange(last + 1), n)
    following = np.full(n + 1, n, np.int64)
    following[:last + 1] = np.minimum.accumulate(first[::-1])[::-1]
    at, measured, copied = memoryview(following), memoryview(length), memoryview(source)
    starts: list[int] = []
    lengths: list[int] = []
    add_start, add_length = starts.append, lengths.append
    j = at[0]
    while j < n:
        size = measured[j]
        while measured[j + 1] > size:
            j += 1
            size = measured[j]
        if size == _MEASURED:
            size += _common_length(data, copied[j] + size, j + size, limit)
        add_start(j)
        add_length(size)
        j = at[j + size]
    starts_array = np.array(starts, np.int64)
    return _Sequences(starts_array, np.array(lengths, np.int64),
                      source[starts_array].astype(np.int64))


def _more_bytes(n: np.ndarray) -> np.ndarray:
    """How many bytes after a token a length field of ``n`` takes (15 and more spill over)."""
    return np.where(n >= 15, (n - 15) // 255 + 1, 0)


def _encode(data: bytes, seq: _Sequences) -> bytes:
    """The LZ4 block of ``seq``'s matches, every other byte of ``data`` a literal: each
    sequence's bytes placed at once (tokens, length bytes, literals, offsets)."""
    n = len(data)
    anchors = np.concatenate(([0], seq.starts + seq.lengths))
    literals = np.append(seq.starts, n) - anchors
    extra = np.append(seq.lengths - MIN_MATCH, 0)  # the last sequence has no match
    more_literal, more_match = _more_bytes(literals), _more_bytes(extra)
    has_match = np.arange(len(literals)) < len(seq.starts)
    sizes = 1 + more_literal + literals + has_match * 2 + more_match
    begins = np.concatenate(([0], np.cumsum(sizes)))
    out = np.full(int(begins[-1]), 255, np.uint8)  # every spilled length byte but the last
    token = np.minimum(literals, 15) << 4 | np.minimum(extra, 15)
    out[begins[:-1]] = token
    spill = np.flatnonzero(more_literal)
    out[begins[spill] + more_literal[spill]] = (literals[spill] - 15) % 255
    literal_at = begins[:-1] + 1 + more_literal
    before = np.cumsum(literals) - literals  # literals of the earlier sequences
    total = int(literals.sum())
    shift = np.repeat(anchors - before, literals)
    taken = np.arange(total, dtype=np.int64) + shift
    out[taken + np.repeat(literal_at - anchors, literals)] = \
        np.frombuffer(data, np.uint8)[taken]
    offset_at = (literal_at + literals)[:-1]
    offsets = seq.starts - seq.sources
    out[offset_at] = offsets & 255
    out[offset_at + 1] = offsets >> 8
    spill = np.flatnonzero(more_match[:-1])
    out[offset_at[spill] + 1 + more_match[spill]] = (extra[spill] - 15) % 255
    return out.tobytes()


def lz4_compress(data: bytes) -> bytes:
    """``data`` as one LZ4 block (the format ``LZ4_decompress_safe`` reads).

    Each position's candidates are the :data:`CANDIDATES` nearest earlier positions with the
    same :data:`KEY_BYTES` bytes (from one sort of all positions), measured at once with
    numpy; the parse then walks match by match in Python (:func:`_parse`) and the block is
    written at once (:func:`_encode`)."""
    data = bytes(data)
    return _encode(data, _parse(data))


def _read_length(data: bytes, i: int, length: int) -> tuple[int, int]:
    while True:
        if i >= len(data):
            raise BinaryFormatError("an LZ4 block ends inside a length")
        more = data[i]
        i += 1
        length += more
        if more != 255:
            return length, i


def lz4_decompress(data: bytes, size: int) -> bytes:
    """The ``size`` bytes the LZ4 block ``data`` holds; :class:`BinaryFormatError` for a block
    that is malformed or holds another number of bytes."""
    out = bytearray()
    i, n = 0, len(data)
    while True:
        if i >= n:
            raise BinaryFormatError("an LZ4 block ends before its last literals")
        token = data[i]
        i += 1
        literals = token >> 4
        if literals == 15:
            literals, i = _read_length(data, i, literals)
        if i + literals > n:
            raise BinaryFormatError("an LZ4 block's literals run past its end")
        out += data[i:i + literals]
        i += literals
        if i == n:
            break
        if i + 2 > n:
            raise BinaryFormatError("an LZ4 block ends inside an offset")
        offset = data[i] | data[i + 1] << 8
        i += 2
        if not 0 < offset <= len(out):
            raise BinaryFormatError(f"an LZ4 match reaches {offset} bytes back, before the "
                                    "start of the block")
        length = (token & 15) + MIN_MATCH
        if token & 15 == 15:
            length, i = _read_length(data, i, length)
        start = len(out) - offset
        if offset >= length:
            out += out[start:start + length]
        else:  # the match overlaps what it writes: its first `offset` bytes repeat
            out += (out[start:] * (length // offset + 1))[:length]
        if len(out) > size:
            break
    if len(out) != size:
        raise BinaryFormatError(f"an LZ4 block holds {len(out)} bytes, not {size}")
    return bytes(out)


# ---- fatbin containers --------------------------------------------------------------------

@dataclass(frozen=True)
class CubinTarget:
    """What a CUDA ELF's header says it runs on."""

    arch: int  # 10 * major + minor
    arch_specific: bool  # an ``sm_90a``-style target, where the header marks it


def cubin_target(cubin: bytes) -> CubinTarget | None:
    """The target in a CUDA ELF's ``e_flags`` (None for bytes that are not one): the SM in the
    low byte and ``0x800`` for an architecture-specific target before ELF ABI version 8, the SM
    in bits 8 to 15 and ``0x8`` from version 8 (CUDA 13's ``ptxas`` leaves that bit clear for
    ``sm_90a``, so False here proves nothing)."""
    if not elf64_le(cubin):
        return None
    machine, = struct.unpack_from("<H", cubin, 18)
    flags, = struct.unpack_from("<I", cubin, 48)
    if machine != _EM_CUDA:
        return None
    if cubin[8] >= 8:
        return CubinTarget((flags >> 8) & 0xFF, bool(flags & 0x8))
    return CubinTarget(flags & 0xFF, bool(flags & 0x800))


@dataclass(frozen=True)
class PackedImage:
    """An ELF image compressed once (checked to decompress to it), and the containers that
    hold it for a given architecture."""

    compressed: bytes
    image_size: int
    abi_version: int  # the ELF's EI_ABIVERSION: the entry's code version is [1, this]

    @property
    def container_size(self) -> int:
        return FATBIN_HEADER.size + ENTRY.size + _padded(len(self.compressed))

    def container(self, arch: int, arch_specific: bool = False) -> bytes:
        """The fatbin container of one LZ4-compressed ELF entry for ``arch`` (10 * major +
        minor) holding the image (see the module docstring)."""
        padded = _padded(len(self.compressed))
        flags = FLAG_64BIT | FLAG_HOST_LINUX | FLAG_LZ4
        if arch_specific:
            flags |= FLAG_ARCH_SPECIFIC
        entry = ENTRY.pack(ENTRY_KIND_ELF, ENTRY_VERSION, ENTRY.size, padded,
                           len(self.compressed), 0, self.abi_version, 1, arch, 0, 0, flags, 0,
                           self.image_size)
        header = FATBIN_HEADER.pack(FATBIN_MAGIC, 1, FATBIN_HEADER.size, ENTRY.size + padded)
        return header + entry + self.compressed + b"\0" * (padded - len(self.compressed))


def _padded(n: int) -> int:
    return -(-n // 8) * 8


def pack(cubin: bytes) -> PackedImage:
    """``cubin`` (an ELF file) compressed; :class:`BinaryFormatError` for bytes that are not
    an ELF file, :class:`PackingError` where the compressed form does not decompress to it."""
    cubin = bytes(cubin)
    if len(cubin) < 16 or cubin[:4] != ELF_MAGIC:
        raise BinaryFormatError("not an ELF file: only a cubin is packed")
    if len(cubin) > MAX_IMAGE:
        raise PackingError(f"a {len(cubin)}-byte image is past the {MAX_IMAGE} bytes packed")
    compressed = lz4_compress(cubin)
    try:
        same = lz4_decompress(compressed, len(cubin)) == cubin
    except BinaryFormatError:
        same = False
    if not same:
        raise PackingError(f"the LZ4 form of a {len(cubin)}-byte image does not decompress to it")
    return PackedImage(compressed, len(cubin), cubin[8])


def packed_cubin(cubin: bytes, arch: int, arch_specific: bool = False) -> bytes:
    """``cubin`` as a fatbin container of one LZ4-compressed ELF entry for ``arch``."""
    return pack(cubin).container(arch, arch_specific)


def unpacked(container: bytes) -> bytes:
    """The image a container of :func:`packed_cubin` holds (the inverse);
    :class:`BinaryFormatError` for bytes that are not one container of one LZ4-compressed ELF
    entry."""
    container = bytes(container)
    if len(container) < FATBIN_HEADER.size + ENTRY.size:
        raise BinaryFormatError(f"{len(container)} bytes are too few for a packed image")
    magic, version, header_size, body = FATBIN_HEADER.unpack_from(container)
    if magic != FATBIN_MAGIC or version != 1 or header_size != FATBIN_HEADER.size:
        raise BinaryFormatError("not a fatbin container (its magic, version or header size)")
    if header_size + body != len(container):
        raise BinaryFormatError(f"a fatbin container of {len(container)} bytes says it has "
                                f"{header_size + body}")
    (kind, _, entry_size, padded, size, _, _, _, _, _, _, flags, _,
     image_size) = ENTRY.unpack_from(container, header_size)
    start = header_size + entry_size
    if kind != ENTRY_KIND_ELF or not flags & FLAG_LZ4 or flags & FLAG_ZSTD:
        raise BinaryFormatError(f"a fatbin entry of kind {kind} and flags {flags:#x}, not an "
                                "LZ4-compressed ELF image")
    if entry_size < ENTRY.size or size > padded or start + padded != len(container):
        raise BinaryFormatError("a fatbin container that holds other than one entry")
    return lz4_decompress(container[start:start + size], image_size)
