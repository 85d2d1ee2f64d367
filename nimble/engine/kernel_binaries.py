"""Every kernel of a prepared graph written down as its name and the binary that holds it, and
loaded back from there (:mod:`nimble.record.binaries` finds the bytes).

At save, each distinct kernel (a name and the fingerprint of its ``CUfunction``: registers,
shared, constant and local memory, thread limit, binary version, parameter layout) is looked up
in the libraries the process loaded, then in Triton's and Inductor's cubin caches (else the
cubin a Triton kernel's loader keeps in memory), then among the module images the process kept
since :func:`keep_kernel_binaries`
(:mod:`nimble.driver.module_images`: cuBLASLt's GEMMs and runtime-compiled kernels are on no
disk); every candidate is loaded through the driver and kept only if the kernel it yields has
the same fingerprint.  A fingerprint does not tell same-named kernels of other sizes apart
(Inductor's and Triton's kernels bake their sizes into their code), so a Triton kernel is
matched to the cubin of its own compilation by Triton's hash, read from the objects that loaded
it (:func:`nimble.record.binaries.triton_loaded`), and where several fitting binaries of a name
hold different code with nothing to tell which one runs, the save is refused rather than
guessed.  A kernel found nowhere raises :class:`~nimble.errors.SaveError` naming it and what to
do.

At load, :mod:`nimble.engine.kernel_loading` reads each binary back and checks each kernel.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .. import driver
from ..errors import CudaError, SaveError
from ..progress import logger as log, say
from ..driver import module_images
from ..record import binaries as found, fatbin_pack


@dataclass
class LiveKernel:
    """A kernel of the prepared graph: its name, its ``CUfunction`` here and how to know it."""

    name: str
    function: Any
    fingerprint: dict
    layout: list  # [(offset, size)] of its parameters
    attributes: dict  # the settable function attributes as the library left them
    threads: int  # threads per block of a launch of it (tells Triton's variants apart)
    shared_mem: int
    #: Triton's compilation hash where a Triton kernel (Inductor's among them) was loaded from
    #: a cubin of its cache (:func:`nimble.record.binaries.triton_loaded`): which of several
    #: cubins of the kernel's name it is.
    triton_hash: str | None = None
    #: The binary Triton's ``CompiledKernel`` loaded it from, where it keeps it in memory: the
    #: kernel's own cubin, taken where no cache file holds it (a cache cleaned since, or filed
    #: elsewhere).
    held_image: bytes | None = field(default=None, repr=False)

    @classmethod
    def of(cls, name: str, function, threads: int, shared_mem: int,
           triton_hash: str | None = None, held_image: bytes | None = None) -> "LiveKernel":
        return cls(name, function, driver.function_fingerprint(function),
                   [list(p) for p in driver.function_param_layout(function)],
                   driver.function_attributes(function, driver.SETTABLE_ATTRIBUTES),
                   threads, shared_mem, triton_hash, held_image)

    def key(self) -> tuple:
        """What makes two loaded functions one kernel of the file: a name, a fingerprint and
        a parameter layout, and for Triton's kernels the compilation (same-named kernels of
        other sizes fit the rest)."""
        return self.name, tuple(sorted(self.fingerprint.items())), \
            tuple(map(tuple, self.layout)), self.triton_hash


def _triton_hint(missing: Sequence[LiveKernel]) -> str:
    """What to add to the refusal where Triton kernels are among those found nowhere: their
    cubin files left the caches, and their loader kept no copy (Inductor's static launcher
    drops its own once the kernel is loaded)."""
    triton = [k for k in missing if k.triton_hash is not None]
    if not triton or module_images.capturing():
        return ""
    return (f"; {len(triton)} of them are Triton kernels whose cubin is in none of the cache "
            f"folders read ({', '.join(map(str, found.cubin_folders())) or 'none exists'}; "
            "TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR name them) and whose loader keeps "
            "no copy (Inductor's static launcher drops its own once loaded): save while the "
            "cache still holds them, or keep the binaries from the start as above")


def _same_kernel(library: driver.Library, kernel: LiveKernel) -> bool:
    function = library.function(kernel.name)
    if function is None:
        return False
    return driver.function_fingerprint(function) == kernel.fingerprint and \
        [list(p) for p in driver.function_param_layout(function)] == kernel.layout


#: Whether the driver loads a form of an image (its bytes as they would be stored) and it yields
#: the kernel the saving process runs.
Verify = Callable[[bytes], bool]
#: The largest image packed: the compressor indexes every byte of an image (tens of bytes of
#: index each), so a larger image is stored as it is.
PACK_LIMIT = 64 * 2**20


def _verifier(kernel: LiveKernel) -> Verify:
    """Whether the driver loads a form of an image as ``kernel`` (for :class:`BinaryTable`)."""
    return lambda image: _loads(image, kernel)


def _loads(image: bytes, kernel: LiveKernel) -> bool:
    try:
        library = driver.Library.load_data(image, detail=kernel.name)
    except CudaError:
        return False
    try:
        return _same_kernel(library, kernel)
    finally:
        library.close()


class BinaryTable:
    """The binaries of a saved graph (library containers and embedded cubins), each once.

    An embedded cubin is stored as a fatbin container of one LZ4-compressed entry
    (:mod:`nimble.record.fatbin_pack`) where that is smaller and the driver loads it as the
    same kernel: the row then says ``packed: "lz4"`` and the ``image_size`` it unpacks to, and
    its ``sha256`` is of the stored bytes, which every loader hashes and hands to the driver."""

    def __init__(self, blobs, arch: int) -> None:
        self.rows: list[dict] = []
        self._index: dict[tuple, int] = {}
        self._blobs = blobs
        self.arch = arch  # the device's: an entry's architecture where the ELF does not say
        self._stored: dict[tuple, bytes] = {}

    def library(self, lib: found.LibraryFatbins, c: found.Container) -> int:
        key = ("library", lib.key, c.offset)
        if key not in self._index:
            data = lib.container_bytes(c)
            self._index[key] = len(self.rows)
            self.rows.append({"kind": "library", "path": os.path.realpath(lib.path),
                              "name": Path(lib.path).name,
                              "file_size": os.path.getsize(lib.path),
                              "offset": lib.section_offset + c.offset, "size": c.size,
                              "sha256": found.sha256(data)})
        return self._index[key]

    def embedded(self, data: bytes, origin: str, verify: Verify | None = None) -> int:
        """The row of the image ``data`` (one per distinct image, keyed by its own hash).

        ``verify(stored)`` says whether the driver loads a form of it as the kernel the caller
        found in ``data``: a packed form is stored only where it does (:meth:`_packed`), and a
        later kernel of a packed image is held to the packed form too (the image is stored as
        it is where that fails); without ``verify`` the image is stored as it is."""
        key = ("embedded", found.sha256(data))
        if key not in self._index:
            packed = self._packed(data, origin, verify)
            self._index[key] = len(self.rows)
            self.rows.append({})
            self._store(key, packed or data, origin, len(data) if packed else None)
        elif verify is not None and self.rows[self._index[key]].get("packed") and \
                not verify(self._stored[key]):
            log.info("the driver does not load a kernel of the LZ4-packed image from %s as it "
                     "runs: the image is stored as it is (%d bytes)", origin, len(data))
            self._store(key, data, origin, None)
        return self._index[key]

    def _store(self, key: tuple, stored: bytes, origin: str, image_size: int | None) -> None:
        """Row ``key`` made to hold ``stored``: a packed image of ``image_size`` bytes, or
        (None) the image itself (a packed form it held before stays in the blobs, unused)."""
        row = {"kind": "embedded", "blob": self._blobs.add(stored).as_json(),
               "sha256": found.sha256(stored), "origin": origin}
        if image_size is not None:
            row.update(packed="lz4", image_size=image_size)
        self.rows[self._index[key]] = row
        self._stored[key] = stored

    def _packed(self, data: bytes, origin: str, verify: Verify | None) -> bytes | None:
        """``data`` as a container of one LZ4-compressed ELF entry, where it is a cubin, the
        container is smaller and ``verify`` holds for it; None otherwise (said at INFO where the
        driver refused it).  An ``sm_90a`` image may or may not be marked so in its ELF
        header, so the container is tried with the architecture-specific flag as the header
        says, then the other way."""
        if verify is None or data[:4] != found.ELF_MAGIC:
            return None
        if len(data) > PACK_LIMIT:
            log.info("the %d-byte image from %s is stored unpacked: packing takes more than %d "
                     "MiB", len(data), origin, PACK_LIMIT >> 20)
            return None
        began = time.perf_counter()
        try:
            image = fatbin_pack.pack(data)
        except (found.BinaryFormatError, fatbin_pack.PackingError) as e:
            log.info("the image from %s is stored unpacked: %s", origin, e)
            return None
        if image.container_size >= len(data):
            return None
        target = fatbin_pack.cubin_target(data)
        arch = target.arch if target else self.arch
        specific = bool(target and target.arch_specific)
        for marked in (specific, not specific):
            container = image.container(arch, marked)
            if verify(container):
                log.debug("packed the %d-byte image from %s into %d bytes in %.2f s", len(data),
                          origin, len(container), time.perf_counter() - began)
                return container
        log.info("the driver does not load the LZ4-packed form of the image from %s as the "
                 "same kernel: stored as it is (%d bytes)", origin, len(data))
        return None


class KernelFinder:
    """Finds the binaries of a process's kernels (see the module docstring)."""

    def __init__(self, arch: int, table: BinaryTable, quiet: bool = True) -> None:
        self.arch, self.table, self.quiet = arch, table, quiet
        self._libraries: list[found.LibraryFatbins] | None = None
        self._indexes: dict[str, dict[str, int]] = {}
        #: Kernel names whose fitting binaries hold different code: how many codes.
        self.ambiguous: dict[str, int] = {}

    def libraries(self) -> list[found.LibraryFatbins]:
        if self._libraries is None:
            t0 = time.perf_counter()
            self._libraries = [section for path in found.loaded_libraries()
                               for section in found.LibraryFatbins.read(path)]
            log.debug("read the fatbins of %d libraries in %.2f s", len(self._libraries),
                      time.perf_counter() - t0)
        return self._libraries

    def locate(self, kernels: Sequence[LiveKernel]) -> list[int]:
        """Per kernel, the row of :attr:`table` holding its binary; SaveError for one found
        nowhere."""
        rows: list[int | None] = [None] * len(kernels)
        self._plain(kernels, rows)
        self._cubins(kernels, rows)
        self._held(kernels, rows)
        self._compressed(kernels, rows)
        self._captured(kernels, rows)
        missing = [k for k, row in zip(kernels, rows) if row is None]
        unsure = [k.name for k in missing if k.name in self.ambiguous]
        if unsure:
            listed = ", ".join(f"{n} ({self.ambiguous[n]} codes)" for n in unsure[:3])
            raise SaveError(
                f"{len(unsure)} kernel(s) of this graph have several binaries of their name "
                f"with different code and nothing tells which one this process runs "
                f"({listed}{', ...' if len(unsure) > 3 else ''}): a wrong pick would compute "
                "wrong values, so nothing is saved; save from a fresh process that compiles "
                "only this graph (same-named kernels of other models or shapes, in the caches "
                "or loaded beside, make the pick ambiguous)")
        if missing:
            names = ", ".join(k.name for k in missing[:3])
            more = ", ..." if len(missing) > 3 else ""
            if module_images.capturing():
                why = ("and none of the modules loaded since nimble.keep_kernel_binaries() "
                       "holds them: call it before the process first runs the model")
            else:
                why = ("(cuBLASLt unpacks its GEMMs itself; cuDNN and PyTorch compile some "
                       "kernels at run time): call nimble.keep_kernel_binaries() at the start "
                       "of the process, before the model first runs, then prepare and save "
                       "(`nimble save` does so)")
            raise SaveError(f"{len(missing)} kernel(s) of this graph are in no library file "
                            f"or cubin this process can read ({names}{more}) {why}"
                            f"{_triton_hint(missing)}")
        return [int(r) for r in rows]

    def _captured(self, kernels: Sequence[LiveKernel], rows: list) -> None:
        """Kernels found in the module images kept since :func:`keep_kernel_binaries`: an
        image that names the kernel as a symbol and yields the same kernel is embedded, where
        every such image holds one code for it (:meth:`_one_code`)."""
        if all(r is not None for r in rows) or not module_images.capturing():
            return
        images = module_images.images()
        for i, k in enumerate(kernels):
            if rows[i] is not None:
                continue
            fits = [image for image in images
                    if next(found.symbol_offsets(image, k.name, b"\0.", b"\0"), None) is not None
                    and _loads(image, k)]
            pick = self._one_code(k, fits)
            if pick is not None:
                rows[i] = self.table.embedded(fits[pick], "module loaded in the saving process",
                                              _verifier(k))

    def _one_code(self, kernel: LiveKernel, fits: Sequence[bytes]) -> int | None:
        """Which of the images that fit ``kernel`` to take, where those whose code for it can
        be read (an ELF's ``.text.<name>`` section) hold one code: the first that shows it,
        else the first; None where none fits, or where the codes differ (then the kernel the
        process runs could be any of them, and a wrong pick computes wrong values: it is
        noted for the SaveError)."""
        codes = [found.kernel_code(image, kernel.name) for image in fits]
        known = {c for c in codes if c is not None}
        if len(known) > 1:
            self.ambiguous[kernel.name] = len(known)
            return None
        if not fits:
            return None
        return next((i for i, c in enumerate(codes) if c is not None), 0)

    def _plain(self, kernels: Sequence[LiveKernel], rows: list) -> None:
        for lib in self.libraries():
            wanted = [k.name for k, r in zip(kernels, rows) if r is None]
            if not wanted:
                return
            if not lib.has_plain_entries():
                continue
            hits = found.plain_name_hits(lib.section, lib.containers, set(wanted))
            for i, k in enumerate(kernels):
                c = hits.get(k.name)
                if rows[i] is None and c is not None and _loads(lib.container_bytes(c), k):
                    rows[i] = self.table.library(lib, c)

    def _cubins(self, kernels: Sequence[LiveKernel], rows: list) -> None:
        """Kernels found in Triton's and Inductor's cubin caches: the cubin of the kernel's own
        compilation where its hash is known, else one whose code every fitting cubin of the
        name shares (:meth:`_one_code`)."""
        folders = found.cubin_folders()
        for i, k in enumerate(kernels):
            if rows[i] is not None or not folders:
                continue
            fits, paths = [], []
            for candidate in found.cubin_candidates(k.name, folders):
                if candidate.threads not in (None, k.threads) or \
                        candidate.shared not in (None, k.shared_mem):
                    continue
                if k.triton_hash is not None and candidate.triton_hash not in (None,
                                                                               k.triton_hash):
                    continue
                data = candidate.path.read_bytes()
                if _loads(data, k):
                    fits.append(data)
                    paths.append(candidate.path)
            pick = self._one_code(k, fits)
            if pick is not None:
                rows[i] = self.table.embedded(fits[pick], str(paths[pick]), _verifier(k))

    def _held(self, kernels: Sequence[LiveKernel], rows: list) -> None:
        """Triton kernels no cache file was found for, from the binary their loader keeps:
        the very image this process loaded, so no other code of the name can be meant."""
        for i, k in enumerate(kernels):
            if rows[i] is None and k.held_image is not None and _loads(k.held_image, k):
                rows[i] = self.table.embedded(k.held_image, "Triton's compiled kernel in the "
                                              "saving process", _verifier(k))

    def _compressed(self, kernels: Sequence[LiveKernel], rows: list) -> None:
        for lib in self.libraries():
            if all(r is not None for r in rows):
                return
            if not lib.compressed_for(self.arch):
                continue
            index = self._indexes.get(lib.key)
            if index is None:
                fresh = not found.index_cached(lib, self.arch)
                if fresh:  # the first save on a machine lists each library once
                    say(f"listing the compressed kernels of {Path(lib.path).name} (once on "
                        "this machine, then cached)", self.quiet)
                t0 = time.perf_counter()
                index = self._indexes[lib.key] = found.compressed_kernel_index(
                    lib, self.arch, _kernel_names)
                if fresh:
                    say(f"listed the compressed kernels of {Path(lib.path).name} in "
                        f"{time.perf_counter() - t0:.1f} s", self.quiet)
            by_offset = {c.offset: c for c in lib.containers}
            for i, k in enumerate(kernels):
                c = by_offset.get(index.get(k.name, -1))
                if rows[i] is None and c is not None and _loads(lib.container_bytes(c), k):
                    rows[i] = self.table.library(lib, c)


def _kernel_names(image: bytes) -> list[str]:
    library = driver.Library.load_data(image)
    try:
        return library.kernel_names()
    finally:
        library.close()


def keep_kernel_binaries() -> None:
    """Keep the image of every module the driver loads from now on, so that a graph prepared
    later in this process can be saved whatever its kernels' origin
    (:mod:`nimble.driver.module_images`).  CUPTI stays attached: graphs prepared in this
    process launch from the host (:mod:`nimble.engine.profiler_guard`)."""
    from .profiler_guard import note_cupti_attached

    module_images.start()
    note_cupti_attached("kept kernel binaries")
