"""Where a recorded kernel's binary lives on disk, so that a saved graph can load it again.

A ``CUfunction`` is a handle of one process.  Written down, a kernel is its mangled name plus the
bytes that hold its code.  Those bytes are found, for each kernel a graph launches, in:

* a **fatbin container** of a shared library the process loaded (cuBLAS, cuBLASLt, cuDNN,
  libtorch_cuda): the ``.nv_fatbin`` section of an ELF file is a run of containers, one per
  translation unit, each a header and entries (PTX or cubin per architecture, many of them
  compressed).  A saved graph names the library file and the container's offset, size and
  hash; loading reads those bytes back and hands them to ``cuLibraryLoadData``;
* a **cubin file** of Triton's or Inductor's cache (one kernel per file): its bytes go into the
  saved graph itself, since a cache is emptied at will.

A name found in plain bytes (an uncompressed entry) gives its container at once.  A name in a
compressed entry is found by loading the containers of the libraries that hold compressed code
for the device's architecture and listing their kernels (:class:`KernelIndex`); the index of a
library is kept on disk, keyed by the file's path, size and modification time.

The parsing (:func:`elf_section`, :func:`fatbin_containers`) is plain bytes and tested without a
GPU; the index and :func:`locate` load containers through the driver.
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from ..errors import NimbleError
from ..progress import logger as log

FATBIN_MAGIC = 0xBA55ED50
FATBIN_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, bytes of entries
# kind, version, entry header size, padded payload size, payload size, ?, minor, arch, ...
FATBIN_ENTRY = struct.Struct("<HHIQII II")
ENTRY_KIND_PTX, ENTRY_KIND_ELF = 1, 2
#: An entry's flags for a payload compressed with LZ4 (older toolkits) or zstd (CUDA 12.8 on).
FLAG_LZ4, FLAG_ZSTD = 0x2000, 0x8000
_COMPRESSED_FLAGS = FLAG_LZ4 | FLAG_ZSTD
_FLAGS_AT = 40  # the entry's 64-bit flags


ELF_MAGIC = b"\x7fELF"


def elf64_le(header: bytes) -> bool:
    """Whether ``header`` (a file's first 64 bytes or more) starts a little-endian ELF64."""
    return len(header) >= 64 and header[:4] == ELF_MAGIC and header[4] == 2 and header[5] == 1


class BinaryFormatError(NimbleError, ValueError):
    """Bytes that are not the ELF file or fatbin container they should be."""


@dataclass(frozen=True)
class FatbinEntry:
    """One entry of a fatbin container: PTX or a cubin for one architecture."""

    kind: int  # ENTRY_KIND_PTX, ENTRY_KIND_ELF, or another the driver knows
    arch: int  # 10 * major + minor
    compressed: bool
    payload: slice  # its bytes within the section
    whole: slice  # its header and padded payload within the section


@dataclass(frozen=True)
class Container:
    """One fatbin container: ``size`` bytes at ``offset`` in its section."""

    offset: int
    size: int
    entries: tuple[FatbinEntry, ...]

    @property
    def end(self) -> int:
        return self.offset + self.size


def elf_section(read: Callable[[int, int], bytes], name: str) -> tuple[int, int] | None:
    """``(file offset, size)`` of the ELF64 section ``name``, or None where there is none.

    ``read(offset, size)`` reads the file's bytes (a library is hundreds of megabytes: only its
    headers are read here).  Raises :class:`BinaryFormatError` for a file that is not a
    little-endian ELF64."""
    ident = read(0, 64)
    if not elf64_le(ident):
        raise BinaryFormatError("not a little-endian 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", ident, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", ident, 0x3A)
    if shoff == 0 or shnum == 0 or shentsize < 64 or shstrndx >= shnum:
        return None
    table = read(shoff, shentsize * shnum)
    if len(table) < shentsize * shnum:
        raise BinaryFormatError("the ELF section table runs past the end of the file")

    def header(i: int) -> tuple[int, int, int, int]:
        sh_name, sh_type = struct.unpack_from("<II", table, i * shentsize)
        offset, size = struct.unpack_from("<QQ", table, i * shentsize + 24)
        return sh_name, sh_type, offset, size
    _, _, str_offset, str_size = header(shstrndx)
    strings = read(str_offset, str_size)
    wanted = name.encode()
    for i in range(shnum):
        sh_name, sh_type, offset, size = header(i)
        end = strings.find(b"\0", sh_name)
        if strings[sh_name:end if end >= 0 else None] == wanted and sh_type != 8:  # 8: NOBITS
            return offset, size
    return None


def fatbin_containers(section: bytes) -> list[Container]:
    """The fatbin containers of a section, in order.

    ``.nv_fatbin`` is a run of containers; other sections (cuBLASLt's ``.cask_resource``) hold
    containers among other data.  So the section is scanned for the container magic, and a
    match counts only where its header holds (version 1, a 16-byte header, entries that end
    inside it); the scan goes on after each container found."""
    found: list[Container] = []
    magic = FATBIN_MAGIC.to_bytes(4, "little")
    at = section.find(magic)
    while 0 <= at and at + FATBIN_HEADER.size <= len(section):
        _, version, header_size, body = FATBIN_HEADER.unpack_from(section, at)
        end = at + header_size + body
        if version == 1 and header_size == FATBIN_HEADER.size and end <= len(section):
            try:
                entries = tuple(_entries(section, at + header_size, end))
            except BinaryFormatError:
                entries = ()
            if entries:
                found.append(Container(at, end - at, entries))
                at = section.find(magic, end)
                continue
        at = section.find(magic, at + 4)
    return found


def _entries(section: bytes, at: int, end: int) -> Iterable[FatbinEntry]:
    while at + 64 <= end:
        kind, _, header_size, padded, payload, _, _, arch = FATBIN_ENTRY.unpack_from(section, at)
        if header_size == 0:
            return
        flags, = struct.unpack_from("<Q", section, at + _FLAGS_AT)
        compressed = bool(flags & _COMPRESSED_FLAGS)
        if not compressed and payload == 0:
            # the payload-size field counts compressed bytes: CUDA 13's fatbinary leaves it 0 in
            # an uncompressed entry, whose bytes are then the padded payload
            payload = padded
        start = at + header_size
        if start + payload > end:
            raise BinaryFormatError(f"a fatbin entry at byte {at} runs past its container")
        yield FatbinEntry(kind, arch, compressed, slice(start, start + payload),
                          slice(at, start + padded))
        at = start + padded


def container_at(containers: Sequence[Container], offset: int) -> Container | None:
    """The container holding byte ``offset`` of the section."""
    lo, hi = 0, len(containers)
    while lo < hi:
        mid = (lo + hi) // 2
        if containers[mid].end <= offset:
            lo = mid + 1
        else:
            hi = mid
    if lo < len(containers) and containers[lo].offset <= offset < containers[lo].end:
        return containers[lo]
    return None


def symbol_offsets(data: bytes, name: str, before: bytes = b"\0 .",
                   after: bytes = b"\0 (") -> Iterator[int]:
    """Where ``name`` stands in ``data`` as a whole symbol: preceded by the start of ``data``
    or one of the bytes of ``before``, followed by one of ``after`` (by default a zero byte or
    a dot before it, as in an ELF string table's ``.text.name``, and a zero byte, space or
    parenthesis after it, as in PTX's ``.entry name(``)."""
    needle = name.encode()
    start = data.find(needle)
    while start >= 0:
        end = start + len(needle)
        if (start == 0 or data[start - 1] in before) and end < len(data) and data[end] in after:
            yield start
        start = data.find(needle, start + 1)


def plain_name_hits(section: bytes, containers: Sequence[Container],
                    names: Iterable[str]) -> dict[str, Container]:
    """The container whose uncompressed entries hold each of ``names`` as a whole symbol
    (:func:`symbol_offsets`)."""
    found: dict[str, Container] = {}
    for name in names:
        for start in symbol_offsets(section, name):
            container = container_at(containers, start)
            if container and _in_plain_entry(container, start):
                found[name] = container
                break
    return found


def _in_plain_entry(container: Container, offset: int) -> bool:
    return any(not e.compressed and e.payload.start <= offset < e.payload.stop
               for e in container.entries)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- the libraries of this process ------------------------------------------------------------

def loaded_libraries() -> list[str]:
    """Paths of the shared objects mapped into this process (``/proc/self/maps``), in order."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and ".so" in parts[5] and parts[5].strip() not in paths:
                    paths.append(parts[5].strip())
    except OSError:
        return []
    return [p for p in paths if os.path.isfile(p)]


#: The ELF sections that hold fatbin containers: the toolkit's own, and cuBLASLt's kernel
#: resources (its nvjet and CUTLASS GEMMs).
FATBIN_SECTIONS = (".nv_fatbin", ".cask_resource")


@dataclass
class LibraryFatbins:
    """One section of one library file that holds fatbin containers, and its containers."""

    path: str
    section_offset: int  # where the section starts in the file
    section: bytes
    containers: list[Container]

    @classmethod
    def read(cls, path: str) -> list["LibraryFatbins"]:
        """The library's sections with containers (none for a file without)."""
        found = []
        with open(path, "rb") as f:
            def read(offset: int, size: int) -> bytes:
                f.seek(offset)
                return f.read(size)
            for name in FATBIN_SECTIONS:
                try:
                    where = elf_section(read, name)
                except BinaryFormatError:
                    return []
                if where is None:
                    continue
                section = read(*where)
                containers = fatbin_containers(section)
                if containers:
                    found.append(cls(path, where[0], section, containers))
        return found

    @property
    def key(self) -> str:
        return f"{self.path}@{self.section_offset}"

    def container_bytes(self, c: Container) -> bytes:
        return self.section[c.offset:c.end]

    def compressed_for(self, arch: int) -> list[Container]:
        """The containers with a compressed cubin the device of ``arch`` runs as it is (the
        same major version, a minor no newer): those a plain search cannot see into.  A
        container whose code for it is PTX alone is left out: listing it makes the driver
        compile that PTX (the likely cause of indexing ``libcusparseLt.so.0`` taking 101.9 s
        on an H200, every other library under 0.5 s; not measured since), and a kernel the
        process compiled from PTX is in its kept module images."""
        return [c for c in self.containers
                if any(e.compressed and e.kind == ENTRY_KIND_ELF and e.arch // 10 == arch // 10
                       and e.arch <= arch for e in c.entries)]

    def has_plain_entries(self) -> bool:
        return any(not e.compressed for c in self.containers for e in c.entries)


def _index_path(path: str, section_offset: int, arch: int) -> Path:
    st = os.stat(path)
    # "cubins": indexes listed PTX-only containers too before they were left out
    key = sha256(f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}:{section_offset}:"
                 f"{arch}:cubins".encode())
    folder = Path(os.environ.get("NIMBLE_CACHE_DIR")
                  or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nimble")
    return folder / "kernel-index" / f"{Path(path).name}-{key[:16]}.json"


def index_cached(lib: LibraryFatbins, arch: int) -> bool:
    """Whether ``lib``'s compressed-kernel index for ``arch`` is in the on-disk cache."""
    try:
        return _index_path(lib.path, lib.section_offset, arch).exists()
    except OSError:  # a library file gone since it was read: listing it will say so
        return False


#: Threads listing a library's compressed containers for its kernel index.
INDEX_THREADS = 8


def compressed_kernel_index(lib: LibraryFatbins, arch: int,
                            load_names: Callable[[bytes], list[str]]) -> dict[str, int]:
    """``{kernel name: container offset}`` over the library's containers with compressed code
    (:meth:`LibraryFatbins.compressed_for`), each loaded and listed by ``load_names`` (the
    driver's); read from and written to the on-disk cache (:func:`_index_path`)."""
    cache = _index_path(lib.path, lib.section_offset, arch)
    try:
        return {k: int(v) for k, v in json.loads(cache.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        pass
    def names_in(c) -> list[str]:
        try:
            return load_names(lib.container_bytes(c))
        except Exception as e:  # noqa: BLE001 - a container the driver refuses holds none of ours
            log.debug("container at %d of %s not loadable: %s", c.offset, lib.path, e)
            return []
    containers = list(lib.compressed_for(arch))
    # The driver's loads release the GIL: a library of thousands of containers is listed on
    # several threads, then merged in the containers' order (the first holding a name wins).
    with ThreadPoolExecutor(max_workers=min(INDEX_THREADS, len(containers) or 1)) as pool:
        listed = list(pool.map(names_in, containers))
    index: dict[str, int] = {}
    for c, names in zip(containers, listed):
        for name in names:
            index.setdefault(name, c.offset)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index))
        os.replace(tmp, cache)
    except OSError as e:
        log.info("could not cache the kernel index of %s: %s", lib.path, e)
    return index


# ---- Triton's cubins ----------------------------------------------------------------------------

def cubin_folders() -> list[Path]:
    """Folders where Triton and Inductor keep compiled cubins."""
    folders = []
    triton = os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")
    folders.append(Path(triton))
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor:
        folders.append(Path(inductor))
    else:
        import getpass
        import tempfile

        try:
            user = getpass.getuser()
        except Exception:  # noqa: BLE001 - no user name: Inductor then uses a fixed folder
            user = "unknown"
        folders.append(Path(tempfile.gettempdir()) / f"torchinductor_{user}")
    return [f for f in folders if f.is_dir()]


@dataclass(frozen=True)
class CubinCandidate:
    """A cubin file named for a kernel, and what Triton's metadata beside it gives (if any)."""

    path: Path
    threads: int | None  # num_warps * 32 from Triton's metadata
    shared: int | None  # dynamic shared memory from Triton's metadata
    triton_hash: str | None = None  # the compilation's key, Triton's metadata "hash"


#: Triton names a kernel's cache files by the first 150 characters of its name (Inductor's fused
#: kernels' names run longer), so a longer name's cubin is found by that prefix and told apart
#: from others sharing it by the full name in the metadata beside it.
TRITON_FILE_NAME_LIMIT = 150


def cubin_candidates(name: str, folders: Sequence[Path]) -> list[CubinCandidate]:
    """Every cubin under ``folders`` filed for kernel ``name`` (``<name>.cubin``, or the
    name cut at :data:`TRITON_FILE_NAME_LIMIT`), with Triton's metadata where it sits beside."""
    stem = name[:TRITON_FILE_NAME_LIMIT]
    found = []
    for folder in folders:
        for path in folder.rglob(f"{stem}.cubin"):
            meta = path.with_suffix(".json")
            try:
                data = json.loads(meta.read_text())
            except (OSError, ValueError):
                data = None
            if not isinstance(data, dict):
                data = {}
            if stem != name and data.get("name", name) != name:
                continue  # another kernel whose name begins the same
            try:
                threads = int(data["num_warps"]) * 32
                shared = int(data["shared"])
            except (KeyError, TypeError, ValueError):
                threads = shared = None
            key = data.get("hash")
            found.append(CubinCandidate(path, threads, shared,
                                        key if isinstance(key, str) else None))
    return found


#: Where the objects that load Triton's kernels live: Triton's own ``CompiledKernel`` and
#: Inductor's launchers (its static launcher drops the cubin's path once it has loaded it, but
#: keeps the compilation's hash and the function handle).
_TRITON_HOLDERS = ("triton.", "torch._inductor.")


@dataclass(frozen=True)
class TritonLoaded:
    """What the object that loaded a Triton kernel keeps of it."""

    hash: str  # the compilation's key: the metadata "hash" of its cubin in the cache
    #: The binary it loaded, where it keeps it (Triton's ``CompiledKernel`` does, as its
    #: ``kernel``; Inductor's static launcher drops its copy once loaded).
    image: bytes | None = None


def _triton_holders():
    """``(object, CUfunction handle, its fields)`` for every object of Triton's or Inductor's
    that holds a loaded Triton kernel (attributes read from ``__dict__``: no property runs)."""
    for obj in gc.get_objects():
        module = getattr(type(obj), "__module__", None)
        if not isinstance(module, str) or not module.startswith(_TRITON_HOLDERS):
            continue
        fields = getattr(obj, "__dict__", None) or {}
        function = fields.get("function")
        if isinstance(function, int) and function:
            yield obj, function, fields


def triton_loaded() -> dict[int, TritonLoaded]:
    """``{CUfunction handle: what loaded it}`` for every Triton kernel this process holds
    loaded.  Kernels of one name compiled for other shapes (a batch size, a graph beside)
    carry their sizes in their code and fit one another's fingerprint (registers, parameters),
    so a kernel's name alone does not say which cubin of the cache it was loaded from; the hash
    does (the cubin's metadata holds it), and the binary kept in memory is that cubin itself.
    Read from the objects themselves, since no driver call gives a loaded kernel's code back."""
    out: dict[int, TritonLoaded] = {}
    for _, function, fields in _triton_holders():
        loaded = _loaded_of(fields)
        if loaded is not None:
            out[function] = loaded
    return out


def _loaded_of(fields: dict) -> TritonLoaded | None:
    """What a holder's fields say of the kernel it loaded (None without Triton's hash)."""
    key = fields.get("hash")
    if not isinstance(key, str):
        return None
    image = next((fields[f] for f in ("kernel", "cubin_raw")
                  if isinstance(fields.get(f), bytes) and fields[f]), None)
    return TritonLoaded(key, image)


def triton_owners(functions: set[int]) -> dict[int, list]:
    """``{function: the objects holding it loaded}`` for the Triton kernels among
    ``functions`` (Triton's ``CompiledKernel``, Inductor's static launchers): each unloads its
    module when it is collected, so whatever launches those functions must keep them."""
    return triton_owners_and_loaded(functions)[0]


def triton_owners_and_loaded(functions: set[int]
                             ) -> tuple[dict[int, list], dict[int, TritonLoaded]]:
    """:func:`triton_owners` and :func:`triton_loaded` of the Triton kernels among
    ``functions``, in one scan of the process's objects."""
    owners: dict[int, list] = {}
    loaded: dict[int, TritonLoaded] = {}
    if "triton" not in sys.modules:
        return owners, loaded  # no Triton kernel can be loaded in this process
    for obj, function, fields in _triton_holders():
        if function not in functions:
            continue
        owners.setdefault(function, []).append(obj)
        got = _loaded_of(fields)
        if got is not None and (function not in loaded or loaded[function].image is None):
            loaded[function] = got
    return owners, loaded


def kernel_code(image: bytes, name: str) -> bytes | None:
    """The code of kernel ``name`` in a cubin (its ``.text.<name>`` section, where the sizes a
    compiler baked in stand), or None where the image is no ELF or has no such section: two
    candidates with equal code here are one kernel, whatever else their images hold."""
    try:
        at = elf_section(lambda offset, size: image[offset:offset + size], f".text.{name}")
    except BinaryFormatError:
        return None
    return None if at is None else image[at[0]:at[0] + at[1]]
