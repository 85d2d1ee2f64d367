"""The container of a saved graph: a small binary header, a section table, the sections.

::

    header      64 bytes   magic "NIMBLEGR", format version (u32), flags (u32), section count
                           (u32), reserved (u32), file size (u64), checksum of every byte after
                           the header (32 bytes: :func:`checksum`)
    sections    48 bytes each: name (16 bytes, ASCII, zero-padded), offset (u64), size (u64),
                           reserved (16 bytes)
    data        each section at a 64-byte aligned offset

Every integer is little-endian.  The sections: ``manifest`` (UTF-8 JSON: the graph's
structure, see ``docs/saved-format.md``), ``blobs`` (raw bytes the manifest points into by
offset and size: weights, library memory, embedded cubins, the reference inputs and outputs),
and ``c_plan`` (the graph resolved for the C runtime, :mod:`nimble.engine.c_plan`).

A file is read whole and its checksum held against it: a truncated, damaged or altered file is
refused with a :class:`~nimble.errors.LoadError`.  :meth:`SavedFile.from_bytes` and
:meth:`SavedFile.read` wait for the checksum before they return; :meth:`SavedFile.parse` and
:meth:`SavedFile.read_pending` return with it still running (:class:`PendingChecksum`), for a
loader that has work to do beside it and waits for it before anything of the file runs on the
GPU.  Either way a failed checksum is the error of a damaged file, whatever else its damage
broke first.  Nothing in the file is executable Python (no pickle): the manifest is JSON.
Plain bytes and JSON: no GPU, no torch.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..errors import LoadError

MAGIC = b"NIMBLEGR"
#: The newest format version this Nimble reads and writes.  A file is written at the lowest
#: version that holds it, so that an older Nimble still reads what it can: version 2 adds
#: private copies stored without bytes (null in a bucket's ``private``: workspaces, which
#: start zeroed), :data:`ZEROED_WORKSPACES_VERSION`.
FORMAT_VERSION = 2
ZEROED_WORKSPACES_VERSION = 2
HEADER = struct.Struct("<8sIIIIQ32s")
SECTION = struct.Struct("<16sQQ16s")
ALIGN = 64
MANIFEST, BLOBS, C_PLAN = "manifest", "blobs", "c_plan"


#: The checksum's chunk: each is hashed on its own (in parallel), then the list of digests.
CHECKSUM_CHUNK = 8 << 20


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _digest(chunk) -> bytes:
    return hashlib.sha256(chunk).digest()


def _chunks(data) -> list[memoryview]:
    view = memoryview(data)
    return [view[i:i + CHECKSUM_CHUNK] for i in range(0, len(view), CHECKSUM_CHUNK)]


def _hash_threads(chunks: list, spare: int = 0) -> int:
    return max(min(8, len(chunks), (os.cpu_count() or 1) - spare), 1)


def checksum(data) -> bytes:
    """SHA-256 of the SHA-256 digests of ``data``'s consecutive 8 MiB chunks (the last one
    shorter): a hash list, so that a large file is checked on several cores (hashlib releases
    the GIL) while any changed byte still changes the result."""
    chunks = _chunks(data)
    if len(chunks) > 1:
        with ThreadPoolExecutor(max_workers=_hash_threads(chunks)) as pool:
            digests = list(pool.map(_digest, chunks))
    else:
        digests = [_digest(c) for c in chunks]
    return hashlib.sha256(b"".join(digests)).digest()


def damaged_file(where: str) -> LoadError:
    """The LoadError of a file whose checksum does not match its contents."""
    return LoadError(f"{where} is damaged: its checksum does not match its contents; "
                     "save the model again")


class PendingChecksum:
    """:func:`checksum` of a file's bytes, hashed on threads of its own from construction on
    while the caller goes on (hashlib releases the GIL), and held against the header's
    ``digest`` when asked: :meth:`error`, :meth:`verify`, :meth:`blaming`.  The bytes must not
    change until then: the loader only reads the file's mapping before it waits."""

    def __init__(self, data, digest: bytes, where: str, spare_cores: int = 1) -> None:
        self.where = where
        self._digest = digest
        self._began = time.perf_counter()
        chunks = _chunks(data)
        # By default a core is left to the caller, whose work beside the hashing is why it
        # is pending (on a 2-core machine, hashing on both slowed a stand-in load's CPU side
        # by ~10 ms).
        self._pool = ThreadPoolExecutor(max_workers=_hash_threads(chunks, spare_cores),
                                        thread_name_prefix="nimble-checksum")
        self._futures = [self._pool.submit(self._timed, c) for c in chunks]
        self._matches: bool | None = None
        #: The hashing's wall-clock seconds, from construction to its last chunk's digest.
        self.seconds = 0.0

    @staticmethod
    def _timed(chunk) -> tuple[bytes, float]:
        return _digest(chunk), time.perf_counter()

    def error(self) -> LoadError | None:
        """Wait for the hashing; a damaged file's LoadError (a new one each call), or None."""
        if self._matches is None:
            try:
                done = [f.result() for f in self._futures]
            finally:
                self._pool.shutdown(wait=True)
                self._futures = []  # the chunks' views: the file's buffer may be closed
            self.seconds = max((end for _, end in done), default=self._began) - self._began
            self._matches = hashlib.sha256(b"".join(d for d, _ in done)).digest() == self._digest
        return None if self._matches else damaged_file(self.where)

    def verify(self) -> None:
        """Wait for the hashing; LoadError where the file is damaged."""
        error = self.error()
        if error is not None:
            raise error

    def abandon(self) -> None:
        """Stop hashing without a verdict (chunks not begun are dropped); ask nothing after."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    @contextmanager
    def blaming(self) -> Iterator["PendingChecksum"]:
        """Within: an error gives way to the damaged file's LoadError where the checksum fails,
        since damaged bytes can break anything read from them first (a manifest that no longer
        parses, a binary that no longer hashes to its row), and the damage is what to report.
        An interrupt (not an Exception) goes on as it is, and stops the hashing."""
        try:
            yield self
        except Exception:
            error = self.error()
            if error is not None:
                raise error  # the error the damage caused stays its __context__
            raise
        except BaseException:
            self.abandon()
            raise


@dataclass(frozen=True)
class BlobRef:
    """``size`` bytes at ``offset`` of the blobs section."""

    offset: int
    size: int

    def as_json(self) -> list[int]:
        return [self.offset, self.size]


class BlobWriter:
    """The blobs section under construction; identical byte strings are stored once."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0
        self._seen: dict[str, BlobRef] = {}

    def add(self, data: bytes) -> BlobRef:
        data = bytes(data)
        key = hashlib.sha256(data).hexdigest()
        ref = self._seen.get(key)
        if ref is None:
            pad = _aligned(self._size) - self._size
            if pad:
                self._parts.append(b"\0" * pad)
                self._size += pad
            ref = BlobRef(self._size, len(data))
            self._parts.append(data)
            self._size += len(data)
            self._seen[key] = ref
        return ref

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


@dataclass
class SavedFile:
    """A saved graph as read or about to be written: its manifest and its blobs."""

    manifest: dict
    blobs: bytes = b""
    #: The format version written (the lowest that holds the file: the writer raises it).
    version: int = 1
    path: str = ""
    sections: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Further sections by name (``c_plan``), written after the blobs.
    extra: dict = field(default_factory=dict)

    def blob(self, ref) -> bytes:
        """The bytes a manifest's ``[offset, size]`` names; LoadError where they run out."""
        return bytes(self.blob_view(ref))

    def blob_view(self, ref) -> memoryview:
        """:meth:`blob` without the copy: a view of the file's bytes (for the weights, which
        go straight to the GPU)."""
        try:
            offset, size = (int(v) for v in ref)
        except (TypeError, ValueError):
            raise LoadError(f"{self.path or 'the file'}: a blob reference {ref!r} is not "
                            "[offset, size]: the file is damaged") from None
        if offset < 0 or size < 0 or offset + size > len(self.blobs):
            raise LoadError(f"{self.path or 'the file'}: a blob reference [{offset}, {size}] "
                            f"runs past the {len(self.blobs)}-byte blobs section: the file is "
                            "damaged")
        return memoryview(self.blobs)[offset:offset + size]

    def to_bytes(self) -> bytes:
        manifest = json.dumps(self.manifest, separators=(",", ":"), sort_keys=True).encode()
        parts = [(MANIFEST, manifest), (BLOBS, self.blobs), *self.extra.items()]
        out = bytearray(HEADER.size + SECTION.size * len(parts))
        for i, (name, data) in enumerate(parts):
            at = _aligned(len(out))
            out += b"\0" * (at - len(out))
            SECTION.pack_into(out, HEADER.size + SECTION.size * i,
                              name.encode().ljust(16, b"\0"), at, len(data), b"")
            out += data
        HEADER.pack_into(out, 0, MAGIC, self.version, 0, len(parts), 0, len(out),
                         checksum(memoryview(out)[HEADER.size:]))
        return bytes(out)

    def write(self, path: str | os.PathLike) -> Path:
        """Write the file atomically (a partial write never leaves a file at ``path``)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(self.to_bytes())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        return path

    @classmethod
    def from_bytes(cls, data: bytes, path: str = "") -> "SavedFile":
        """Parse and check a whole file (see the module docstring); LoadError for anything
        that does not hold (the checksum's, where it fails, over any other)."""
        saved, pending = cls.parse(data, path, spare_cores=0)  # waited for: every core
        pending.verify()
        return saved

    @classmethod
    def parse(cls, data: bytes, path: str = "", spare_cores: int = 1
              ) -> tuple["SavedFile", PendingChecksum]:
        """:meth:`from_bytes` without waiting for the checksum: the file, and its checksum
        still hashing (on all cores but ``spare_cores``).  The header is checked before the
        hashing starts (magic, version, size); the section table and the manifest while it
        runs, their errors giving way to the checksum's where that fails
        (:meth:`PendingChecksum.blaming`)."""
        where = path or "the file"
        if len(data) < HEADER.size or bytes(data[:8]) != MAGIC:
            raise LoadError(f"{where} is not a saved Nimble graph (no NIMBLEGR header)")
        magic, version, _, count, _, size, digest = HEADER.unpack_from(data)
        if version > FORMAT_VERSION or version < 1:
            raise LoadError(f"{where} is a saved graph of format version {version}; this "
                            f"Nimble reads versions 1 to {FORMAT_VERSION}: load it with the "
                            "Nimble that saved it, or save the model again with this one")
        if size != len(data):
            raise LoadError(f"{where} is truncated or has bytes appended: its header says "
                            f"{size} bytes, the file has {len(data)}; save the model again")
        pending = PendingChecksum(memoryview(data)[HEADER.size:], digest, where, spare_cores)
        with pending.blaming():
            return cls._sections(data, count, version, where), pending

    @classmethod
    def _sections(cls, data, count: int, version: int, where: str) -> "SavedFile":
        sections = {}
        for i in range(count):
            at = HEADER.size + SECTION.size * i
            if at + SECTION.size > len(data):
                raise LoadError(f"{where}: its section table runs past the file")
            raw, offset, length, _ = SECTION.unpack_from(data, at)
            name = raw.rstrip(b"\0").decode("ascii", errors="replace")
            if offset + length > len(data):
                raise LoadError(f"{where}: section {name!r} runs past the end of the file")
            sections[name] = (offset, length)
        for name in (MANIFEST, BLOBS):
            if name not in sections:
                raise LoadError(f"{where} has no {name!r} section: the file is damaged")
        offset, length = sections[MANIFEST]
        try:
            manifest = json.loads(bytes(data[offset:offset + length]).decode())
        except (UnicodeDecodeError, ValueError) as e:
            raise LoadError(f"{where}: its manifest is not valid JSON ({e})") from None
        if not isinstance(manifest, dict):
            raise LoadError(f"{where}: its manifest is not a JSON object")
        offset, length = sections[BLOBS]
        extra = {name: memoryview(data)[o:o + n] for name, (o, n) in sections.items()
                 if name not in (MANIFEST, BLOBS)}
        # A view, not a copy: the weights are most of a file.
        return cls(manifest, memoryview(data)[offset:offset + length], version, where,
                   sections, extra)

    @classmethod
    def read(cls, path: str | os.PathLike) -> "SavedFile":
        """The file at ``path``, mapped, parsed and checked (:meth:`from_bytes`)."""
        return cls.from_bytes(_mapped(path), str(path))

    @classmethod
    def read_pending(cls, path: str | os.PathLike) -> tuple["SavedFile", PendingChecksum]:
        """:meth:`read` without waiting for the checksum (:meth:`parse`)."""
        return cls.parse(_mapped(path), str(path))


def _mapped(path: str | os.PathLike) -> memoryview:
    # Mapped copy-on-write rather than read into a copy: the checksum and the weights' copies
    # to the GPU read the page cache's bytes where they are, and a view of them is writable
    # (torch.frombuffer takes it without a warning) without touching the file.
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else b""
    except (OSError, ValueError) as e:
        raise LoadError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    return memoryview(data)
