"""The C plan read back in Python, in the order the C runtime reads it (nimble/c_runtime/
nimble.c: read_plan, rd_bucket, rd_node): what the CPU tests hold the writer to."""
from __future__ import annotations

import struct


class Words:
    def __init__(self, data: bytes) -> None:
        self.words = struct.unpack(f"<{len(data) // 8}Q", data)
        self.at = 0

    def u(self) -> int:
        v = self.words[self.at]
        self.at += 1
        return v

    def i(self) -> int:
        v = self.u()
        return v - (1 << 64) if v >= 1 << 63 else v

    def raw(self) -> bytes:
        n = self.u()
        count = -(-n // 8)
        data = struct.pack(f"<{count}Q", *self.words[self.at:self.at + count])[:n]
        self.at += count
        return data

    def text(self) -> str:
        return self.raw().decode()

    def place(self) -> tuple[int, int, int]:
        return self.u(), self.u(), self.u()

    def blob(self) -> tuple[int, int]:
        return self.u(), self.u()


def _tensor(w: Words) -> dict:
    place, nbytes, dtype, ndim = w.place(), w.u(), w.u(), w.u()
    shape = [w.u() for _ in range(ndim)]
    return {"place": place, "nbytes": nbytes, "dtype": dtype, "shape": shape,
            "contiguous": w.u()}


def _node(w: Words) -> dict:
    kind = w.u()
    if kind == 0:
        node = {"kind": "kernel", "kernel": w.u(), "grid": [w.u() for _ in range(3)],
                "block": [w.u() for _ in range(3)], "shared": w.u(), "has_priority": w.u(),
                "priority": w.i(), "packed": w.u()}
        n = w.u()
        node["params"] = [(w.u(), w.u()) for _ in range(n)]
        node["args"] = w.raw()
        node["relocs"], node["reloc_words"] = [], []  # each place's first word in the plan
        for _ in range(w.u()):
            location = w.u()
            node["reloc_words"].append(w.at)
            node["relocs"].append((location, w.place()))
        node["attrs"] = [(w.u(), w.raw()) for _ in range(w.u())]
        return node
    if kind == 1:
        return {"kind": "memset", "dst": w.place(), "fields": [w.u() for _ in range(5)]}
    if kind == 2:
        return {"kind": "memcpy", "src": w.place(), "dst": w.place(),
                "fields": [w.u() for _ in range(15)]}
    assert kind == 3, kind
    return {"kind": "empty"}


def _bucket(w: Words, version: int = 1) -> dict:
    b = {"plan_bytes": w.u()}
    b["low_bits"] = [{"size": w.u(), "address": w.u(), "poison": w.u(), "blob": w.blob()}
                     for _ in range(w.u())] if version >= 3 else []
    b["inputs"] = [_tensor(w) for _ in range(w.u())]
    b["outputs"] = [_tensor(w) for _ in range(w.u())]
    b["private"] = [(w.u(), w.u(), w.blob()) for _ in range(w.u())]
    b["nodes"] = [_node(w) for _ in range(w.u())]
    b["edges"] = [(w.u(), w.u()) for _ in range(w.u())]
    b["programmatic"] = [(w.u(), w.u()) for _ in range(w.u())] if version >= 2 else []
    sets = []
    for _ in range(w.u()):
        inputs = [w.blob() for _ in b["inputs"]]
        outputs = [(w.blob(), w.u()) for _ in b["outputs"]]
        sets.append({"inputs": inputs, "outputs": outputs})
    b["sets"] = sets
    b["written"] = [(w.place(), w.u()) for _ in range(w.u())]
    return b


def read_plan(data: bytes) -> dict:
    w = Words(data)
    plan = {"magic": w.u(), "version": w.u(), "arch": w.u(), "driver": w.u(),
            "arena_size": w.u(), "alignment": w.u(), "instances": w.u()}
    nbuckets = w.u()
    plan["binaries"] = [{"library": w.u() == 0, "offset": w.u(), "size": w.u(),
                         "sha256": w.raw(), "path": w.text()} for _ in range(w.u())]
    plan["kernels"] = [{"binary": w.u(), "name": w.text(),
                        "fingerprint": [w.i() for _ in range(6)],
                        "settable": [w.i() for _ in range(4)]} for _ in range(w.u())]
    plan["weights"] = [(w.u(), w.blob()) for _ in range(w.u())]
    plan["memory"] = [(w.u(), w.blob()) for _ in range(w.u())]
    plan["buckets"] = [_bucket(w, plan["version"]) for _ in range(nbuckets)]
    plan["unsupported"] = w.text()
    assert w.at == len(w.words), "words left over after the plan"
    return plan


def resolve(place: tuple[int, int, int], arena: int, weights: list[int],
            memory: list[int], low_bits: list[int] = ()) -> int:
    region, index, addend = place
    base = {0: 0, 1: arena, 2: weights[index] if region == 2 else 0,
            3: memory[index] if region == 3 else 0,
            4: low_bits[index] if region == 4 else 0}[region]
    return (base + addend) % (1 << 64)


def relocated_args(node: dict, arena: int, weights: list[int], memory: list[int],
                   low_bits: list[int] = ()) -> bytes:
    args = bytearray(node["args"])
    for loc, place in node["relocs"]:
        args[loc:loc + 8] = resolve(place, arena, weights, memory,
                                    low_bits).to_bytes(8, "little")
    return bytes(args)
