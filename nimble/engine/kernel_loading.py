"""A saved graph's kernels loaded back from their binaries: each binary read (from its library
file, checked by the container's hash, or from the saved file) and held to its SHA-256, loaded
once with ``cuLibraryLoadData``, and each kernel's ``CUfunction`` taken from it and checked
against the saved fingerprint (:mod:`nimble.engine.kernel_binaries` writes them down).
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .. import driver
from ..errors import LoadError
from ..progress import logger as log
from ..record import binaries as found


def _library_file(row: dict) -> str:
    """The library file a binary row names: its saved path, or one of the same name among the
    libraries this process loaded (a relocated virtual environment)."""
    path = row.get("path", "")
    if os.path.isfile(path) and os.path.getsize(path) == row.get("file_size"):
        return path
    for other in found.loaded_libraries():
        if Path(other).name == row.get("name") and os.path.getsize(other) == row.get("file_size"):
            return other
    raise LoadError(
        f"the library {row.get('name')} ({row.get('file_size')} bytes) that the saved graph's "
        f"kernels come from is not at {path} and not loaded in this process: install the "
        "same CUDA libraries (the same torch build) as the saving machine, or save the model "
        "again here")


def binary_bytes(row: dict, saved) -> bytes:
    """The bytes of one binary row, checked against its hash (``saved``: the SavedFile)."""
    if row.get("kind") == "embedded":
        data = saved.blob(row.get("blob"))
    elif row.get("kind") == "library":
        path = _library_file(row)
        with open(path, "rb") as f:
            f.seek(int(row["offset"]))
            data = f.read(int(row["size"]))
    else:
        raise LoadError(f"a kernel binary of kind {row.get('kind')!r}, which this Nimble does "
                        "not know: load the file with the Nimble that saved it")
    if found.sha256(data) != row.get("sha256"):
        where = row.get("path") or "the saved file"
        raise LoadError(f"the kernel binary at byte {row.get('offset', 0)} of {where} is not "
                        "the one the graph was saved with (another version of the library): "
                        "use the same CUDA libraries as the saving machine, or save again here")
    return data


#: Worker threads of a load's binaries.
LOAD_THREADS = 8


@dataclass
class BinaryTiming:
    """What one binary cost a load: its reading and hashing (on a worker thread, beside the
    others), ``cuLibraryLoadData``, and taking and checking its kernels' functions."""

    name: str
    kind: str
    nbytes: int
    read_s: float
    load_s: float
    functions_s: float = 0.0
    kernels: int = 0


@dataclass
class LoadedKernels:
    """The libraries a loaded graph's kernels live in (owned), each kernel's function, and
    what each binary cost."""

    libraries: list
    functions: list
    timings: list

    @property
    def seconds(self) -> dict[str, float]:
        """The binaries' reading, loading and function seconds, each summed over the worker
        threads (beside the stage's wall-clock seconds, what running them side by side won)."""
        return {"kernels_read_threads": sum(t.read_s for t in self.timings),
                "kernels_library_load_threads": sum(t.load_s for t in self.timings),
                "kernels_functions_threads": sum(t.functions_s for t in self.timings)}

    def close(self) -> None:
        for library in self.libraries:
            library.close()


def load_kernels(kernel_rows: Sequence[dict], binary_rows: Sequence[dict], saved
                 ) -> LoadedKernels:
    """Each kernel's ``CUfunction`` loaded from its binary and checked (see the module
    docstring); LoadError for a binary or kernel that does not hold.  The binaries are read and
    hashed on worker threads, then each is loaded and its kernels' functions taken on one
    (file reads, hashlib and the driver's calls release the GIL; a library loads without a
    context and a function is taken in the caller's, made current on the worker).  What each
    binary cost is in the result's ``timings``."""
    used: list[int] = []
    kernels_of: dict[int, list[int]] = {}
    for k, row in enumerate(kernel_rows):
        b = int(row["binary"])
        if not 0 <= b < len(binary_rows):
            raise LoadError(f"kernel {row.get('name')!r} names binary {b}, which the file does "
                            "not have: the file is damaged")
        if b not in kernels_of:
            used.append(b)
        kernels_of.setdefault(b, []).append(k)

    def read(b: int) -> tuple[bytes, float]:
        began = time.perf_counter()
        return binary_bytes(binary_rows[b], saved), time.perf_counter() - began
    threads = min(LOAD_THREADS, len(used) or 1)
    # Every binary read and held to its hash first: a wrong one is refused before the driver
    # loads anything.
    with ThreadPoolExecutor(max_workers=threads) as pool:
        images = dict(zip(used, pool.map(read, used)))
    context = driver.current_context() if used else None

    def load_one(b: int) -> _LoadedBinary:
        driver.use_context(context)
        image, read_s = images[b]
        began = time.perf_counter()
        library = driver.Library.load_data(image, detail=str(binary_rows[b].get("name", "")))
        loaded = time.perf_counter()
        try:
            functions = [_checked_function(library, kernel_rows[k]) for k in kernels_of[b]]
        except BaseException:
            library.close()
            raise
        timing = BinaryTiming(str(binary_rows[b].get("name") or binary_rows[b].get("path") or b),
                              str(binary_rows[b].get("kind")), len(image), read_s,
                              loaded - began, time.perf_counter() - loaded, len(functions))
        return _LoadedBinary(library, functions, timing)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = [pool.submit(load_one, b) for b in used]
    images.clear()
    results = {b: f.result() for b, f in zip(used, futures) if f.exception() is None}
    failed = next((f.exception() for f in futures if f.exception() is not None), None)
    if failed is not None:
        for done in results.values():
            done.library.close()
        raise failed
    functions: list = [None] * len(kernel_rows)
    for b, done in results.items():
        for k, function in zip(kernels_of[b], done.functions):
            functions[k] = function
    loaded = LoadedKernels([results[b].library for b in used], functions,
                           [results[b].timing for b in used])
    for t in sorted(loaded.timings, key=lambda t: -(t.read_s + t.load_s + t.functions_s)):
        log.debug("kernel binary %s (%s, %d bytes, %d kernels): read and hashed %.1f ms, "
                  "loaded %.1f ms, functions %.1f ms", t.name, t.kind, t.nbytes, t.kernels,
                  1e3 * t.read_s, 1e3 * t.load_s, 1e3 * t.functions_s)
    return loaded


@dataclass
class _LoadedBinary:
    library: Any
    functions: list
    timing: BinaryTiming


def _checked_function(library, row: dict):
    name = str(row["name"])
    function = library.function(name)
    if function is None:
        raise LoadError(f"kernel {name} is not in the binary the file names for it: the file "
                        "is damaged")
    have = driver.function_fingerprint(function)
    if have != row.get("fingerprint"):
        raise LoadError(f"kernel {name} loaded here differs from the one saved ({have} against "
                        f"{row.get('fingerprint')}): save the model again on this machine")
    driver.set_function_attributes(function, {k: int(v) for k, v in
                                              row.get("attributes", {}).items()
                                              if k in driver.SETTABLE_ATTRIBUTES})
    return function
