"""Where a load from a file puts the memory outside the arena that its graphs point into, for
:mod:`nimble.engine.loading`: each weight storage (the model's, by name, or the file's bytes in
memory of its own) and each external memory range, those that a kernel word which may be an
integer points into at their recorded low 32 bits (:func:`~nimble.engine.arena_layout.
low_word_outside`)."""
from __future__ import annotations

import logging

from .. import driver
from ..errors import LoadError
from ..ir.saved_format import SavedFile
from .arena_layout import low_word_outside
from .weights import named_weights

log = logging.getLogger("nimble")


def low_bits_rows(manifest: dict, decoded: list) -> dict[tuple[str, int], int]:
    """Per weight storage or memory range of the file (``("weight" | "memory", index)``) that
    a word which may be an integer points into (:func:`~nimble.engine.arena_layout.
    low_word_outside`), the recorded address of its start: the load keeps its low 32 bits, so
    that relocating the word rewrites only its top half."""
    wanted: dict[tuple[str, int], int] = {}
    for row, (graph, _) in zip(manifest["buckets"], decoded):
        for bid in low_word_outside(graph):
            source = row["outside"].get(str(bid))
            if source is None:
                continue
            recorded = graph.buffers[bid].address
            if "weight" in source:
                wanted[("weight", int(source["weight"]))] = recorded
            else:
                wanted[("memory", int(source["memory"]))] = recorded - int(source["offset"])
    return wanted


def _placed(view: memoryview, size: int, recorded: int | None, device, empty_size: int):
    """``(address, owner)`` of the bytes of ``view`` on ``device``: in a tensor of their own
    (:func:`on_device`), or, with ``recorded``, zero-padded to ``size`` in memory whose address
    keeps ``recorded``'s low 32 bits (:class:`~nimble.driver.LowBitsMemory`)."""
    if recorded is None:
        tensor = on_device(view, device, empty_size)
        return tensor.data_ptr(), tensor
    memory = driver.LowBitsMemory.allocate(max(size, len(view), 1), recorded, device.index or 0)
    data = bytes(view)
    driver.copy_to_device(memory.address, data + bytes(max(size - len(data), 0)))
    return memory.address, memory


def place_weights(manifest: dict, saved: SavedFile, model, device, low: dict | None = None,
                  verify: bool = True) -> tuple[list[int], list]:
    """Per weight storage of the file, its address now, and the memory to keep alive; the
    file's weights in ``low`` (:func:`low_bits_rows`) at their recorded low 32 bits."""
    addresses, keep = [], []
    low = low or {}
    current = named_weights(model) if model is not None else {}
    for i, row in enumerate(manifest.get("weights", [])):
        if model is None:
            if row.get("blob") is None:
                raise LoadError("the file was saved without its weights (weights=False): pass "
                                "the model, nimble.load(path, model=...)")
            address, owner = _placed(saved.blob_view(row["blob"]), int(row["size"]),
                                     low.get(("weight", i)), device, 0)
            addresses.append(address)
            keep.append(owner)
            continue
        addresses.append(_model_storage(row, current, device))
        if ("weight", i) in low:
            model_low_bits(row, addresses[-1], low[("weight", i)], verify)
    return addresses, keep


def model_low_bits(row: dict, address: int, recorded: int, verify: bool) -> None:
    """A model's weight storage that a word which may be an integer points into, where its low
    32 bits differ from the recorded ones: the word is relocated as a pointer, which the proof
    at load judges; without the proof, refused."""
    if (address - recorded) % (1 << 32) == 0:
        return
    name = row["names"][0]["name"]
    if not verify:
        raise LoadError(f"a kernel word that may be an integer points into '{name}', which "
                        "the model holds at other low address bits than when saved: load it "
                        "with verify=True (the proof judges the word) or without model= (the "
                        "file's weights are placed at their recorded low bits)")
    log.warning("a kernel word that may be an integer points into '%s', which the model holds "
                "at other low address bits than when saved; the proof at load judges it",
                name)


def _model_storage(row: dict, current: dict, device) -> int:
    """Where the model's tensors of one saved storage live: every name there, of the saved
    dtype, shape and strides, at the saved offsets of one storage."""
    base = None
    for entry in row.get("names", []):
        name = entry["name"]
        t = current.get(name)
        if t is None:
            raise LoadError(f"the model has no '{name}', which the saved graph reads: pass the "
                            "model the graph was saved from")
        want = (entry["dtype"], list(entry["shape"]), list(entry["strides"]))
        have = (str(t.dtype).removeprefix("torch."), list(t.shape), list(t.stride()))
        if want != have:
            raise LoadError(f"'{name}' is {have[0]} {have[1]} (strides {have[2]}); the graph "
                            f"was saved for {want[0]} {want[1]} (strides {want[2]}): pass a "
                            "model of the saved dtype and shapes")
        if t.device != device:
            raise LoadError(f"'{name}' is on {t.device}; the graph runs on {device}: move the "
                            "model there first")
        at = t.data_ptr() - int(entry["offset"])
        if base is not None and at != base:
            raise LoadError(f"'{name}' no longer shares its memory with the weights it shared "
                            "it with when saved: pass the model as it was saved")
        base = at
    if base is None:
        raise LoadError("a weight storage of the file names no tensor: the file is damaged")
    return base


def host_bytes(view: memoryview, empty_size: int = 0):
    """The bytes of ``view`` as a uint8 tensor on the host over the file's buffer itself (no
    copy, where the mapping is writable); ``empty_size`` bytes where there are none."""
    import torch

    if not len(view):
        return torch.empty(empty_size, dtype=torch.uint8)
    return torch.frombuffer(view if not view.readonly else bytearray(view), dtype=torch.uint8)


def on_device(view: memoryview, device, empty_size: int):
    """The bytes of ``view`` in a uint8 tensor of their own on ``device``, copied from the
    file's buffer itself (no host copy first); ``empty_size`` bytes where there are none."""
    import torch

    if not len(view):
        return torch.empty(empty_size, dtype=torch.uint8, device=device)
    return host_bytes(view).to(device)


def place_memory(manifest: dict, saved: SavedFile, device, low: dict | None = None
                 ) -> tuple[list[int], list]:
    """The saved external memory, each range in memory of its own (those in ``low`` at their
    recorded low 32 bits, :func:`low_bits_rows`), and its owners."""
    addresses, keep = [], []
    low = low or {}
    for i, row in enumerate(manifest.get("memory", [])):
        address, owner = _placed(saved.blob_view(row.get("blob")), int(row["size"]),
                                 low.get(("memory", i)), device, 1)
        addresses.append(address)
        keep.append(owner)
    return addresses, keep
