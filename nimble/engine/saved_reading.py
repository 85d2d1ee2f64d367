"""A saved file read and its structure checked on the CPU, for :mod:`nimble.engine.loading`: the
container, the manifest, each bucket's graph against its row, with the file's checksum still
hashing beside the load (:class:`~nimble.ir.saved_format.PendingChecksum`) until the load waits
for it before building any graph."""
from __future__ import annotations

import time
from typing import Any

from ..errors import LoadError
from ..ir.saved_format import PendingChecksum, SavedFile
from ..ir.saved_graph_check import UndecodableGraph, bucket_graph, check_bucket_graph
from ..ir.saved_manifest import check_manifest
from ..ir.taskgraph import TaskGraph
from .arena_layout import zeroed_copies


def itemsize(dtype: str) -> int | None:
    import torch

    found = getattr(torch, dtype, None)
    return found.itemsize if isinstance(found, torch.dtype) else None


def decoded_bucket(saved: SavedFile, k: int) -> tuple[TaskGraph, Any]:
    """Bucket ``k``'s graph and output structure, decoded and checked against its row."""
    from torch.utils._pytree import treespec_loads

    row = saved.manifest["buckets"][k]
    try:
        graph = bucket_graph(saved, k)
    except UndecodableGraph as e:
        raise LoadError(f"{saved.path}: the graph of bucket {k} does not decode ({e}): the file "
                        "is damaged, save the model again") from None
    check_bucket_graph(saved.manifest, k, graph, itemsize, saved.path)
    check_zeroed(row, graph, k, saved.path)
    spec = row.get("output_spec")
    try:
        return graph, treespec_loads(spec) if spec else None
    # torch's decoder of a pytree's structure raises what its parts raise on text it did not
    # write: any of them means a damaged file.
    except Exception as e:  # noqa: BLE001
        raise LoadError(f"{saved.path}: buckets[{k}].output_spec does not decode ({e}): the "
                        "file is damaged, save the model again") from None


def check_zeroed(row: dict, graph: TaskGraph, k: int, path) -> None:
    """LoadError where bucket ``k`` stores a private copy without bytes (null) that is no
    workspace (:func:`~nimble.engine.arena_layout.zeroed_copies`): only a workspace's copy
    starts zeroed, the bytes of any other carry state."""
    empty = {int(bid) for bid, ref in row["private"].items() if ref is None}
    wrong = sorted(empty - zeroed_copies(graph))
    if wrong:
        raise LoadError(f"{path}: buckets[{k}].private['{wrong[0]}'] holds no bytes, but buffer "
                        f"{wrong[0]} is no workspace that may start zeroed: the file is "
                        "damaged, save the model again")


def read_checked(path, seconds: dict | None = None
          ) -> tuple[SavedFile, list[tuple[TaskGraph, Any]], PendingChecksum]:
    """The file read and every part of its structure checked, on the CPU: the container, the
    manifest (:func:`~nimble.ir.saved_manifest.check_manifest`), each bucket's graph against
    its row; and the file's checksum, still hashing on threads of its own (the caller waits for
    it before anything of the file runs on the GPU).  An error here is the checksum's where
    that fails.  ``seconds`` gets ``read_file`` (mapping it, its header, section table and
    manifest) and ``read_check`` (the rest)."""
    began = time.perf_counter()
    saved, checksum = SavedFile.read_pending(path)
    mapped = time.perf_counter()
    with checksum.blaming():
        check_manifest(saved.manifest, len(saved.blobs), str(path))
        decoded = [decoded_bucket(saved, k) for k in range(len(saved.manifest["buckets"]))]
    if seconds is not None:
        seconds["read_file"] = mapped - began
        seconds["read_check"] = time.perf_counter() - mapped
    return saved, decoded, checksum


def wait_for_checksum(checksum: PendingChecksum, seconds: dict) -> None:
    """Wait for the file's checksum (LoadError where the file is damaged); ``seconds`` gets
    ``checksum`` (its hashing's wall-clock seconds, beside the rest of the load) and
    ``checksum_wait`` (what the load waited for it)."""
    began = time.perf_counter()
    try:
        checksum.verify()
    finally:
        seconds["checksum"] = checksum.seconds
        seconds["checksum_wait"] = time.perf_counter() - began
