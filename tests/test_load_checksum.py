"""The saved file's checksum hashed beside the load's other work (no GPU: stand-ins for it): the
file's structure is checked before anything reaches the GPU, its checksum before any graph is
built from it, and a damaged file is the checksum's LoadError whatever its damage broke first,
with everything loaded so far closed."""
from __future__ import annotations

import gzip
import threading

import pytest
import torch

import nimble
from nimble.engine import loading
from nimble.errors import LoadError, NoGpuError
from nimble.ir import saved_format
from nimble.ir.saved_format import HEADER, PendingChecksum, SavedFile, checksum

from saved_fixture import fixture_path

DAMAGED = r"is damaged: its checksum does not match its contents; save the model again"


@pytest.fixture(scope="module")
def raw() -> bytes:
    return gzip.decompress(fixture_path().read_bytes())


def _flipped(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x01
    return bytes(out)


def _in_section(raw: bytes, name: str, at: int = 0) -> int:
    """The file offset of byte ``at`` of section ``name``."""
    return SavedFile.from_bytes(raw).sections[name][0] + at


def _middle_of(raw: bytes, name: str) -> int:
    offset, size = SavedFile.from_bytes(raw).sections[name]
    return offset + size // 2


# ---- the pending checksum, alone ----------------------------------------------------------

def test_a_pending_checksum_holds_against_the_digest_of_every_chunk(monkeypatch):
    monkeypatch.setattr(saved_format, "CHECKSUM_CHUNK", 1000)
    data = bytes(range(256)) * 40  # eleven chunks
    sound = PendingChecksum(data, checksum(data), "m.nimble")
    assert sound.error() is None and sound.seconds >= 0
    sound.verify()
    for at in (0, 5000, len(data) - 1):
        damaged = PendingChecksum(_flipped(data, at), checksum(data), "m.nimble")
        with pytest.raises(LoadError, match="^m.nimble " + DAMAGED):
            damaged.verify()


def test_the_hashing_goes_on_while_the_caller_does(monkeypatch):
    """parse returns with the file's manifest while every chunk is still being hashed, on
    threads other than the caller's."""
    data = SavedFile({"format": "x"}, b"\1" * 5000).to_bytes()
    release, threads = threading.Event(), set()
    digest = saved_format._digest

    def held(chunk):
        threads.add(threading.current_thread())
        assert release.wait(10)
        return digest(chunk)
    monkeypatch.setattr(saved_format, "_digest", held)
    saved, pending = SavedFile.parse(data, "m.nimble")
    assert saved.manifest == {"format": "x"} and not release.is_set()
    release.set()
    pending.verify()
    assert threads and threading.current_thread() not in threads


def test_an_error_within_gives_way_to_a_failed_checksum_only():
    data = b"\7" * 3000
    with pytest.raises(LoadError, match=DAMAGED) as e:
        with PendingChecksum(data, b"\0" * 32, "m.nimble").blaming():
            raise ValueError("what the damage broke")
    assert isinstance(e.value.__context__, ValueError)  # kept, for whoever debugs it
    with pytest.raises(ValueError, match="not the damage"):
        with PendingChecksum(data, checksum(data), "m.nimble").blaming():
            raise ValueError("not the damage")
    with pytest.raises(KeyboardInterrupt):  # an interrupt is never replaced
        with PendingChecksum(data, b"\0" * 32, "m.nimble").blaming():
            raise KeyboardInterrupt


# ---- the container ------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["section table", "manifest", "blobs", "last byte"])
def test_a_byte_damaged_anywhere_is_the_checksums_error_from_from_bytes(raw, where):
    at = {"section table": HEADER.size + 24, "manifest": _middle_of(raw, "manifest"),
          "blobs": _middle_of(raw, "blobs"), "last byte": len(raw) - 1}
    with pytest.raises(LoadError, match=DAMAGED):
        SavedFile.from_bytes(_flipped(raw, at[where]), "m.nimble")


def test_a_file_damaged_in_its_blobs_parses_and_fails_its_pending_checksum(raw):
    saved, pending = SavedFile.parse(_flipped(raw, _middle_of(raw, "blobs")))
    assert saved.manifest["format"] == "nimble.saved-graph"
    with pytest.raises(LoadError, match=DAMAGED):
        pending.verify()


# ---- the load -----------------------------------------------------------------------------

def _binary_at(raw: bytes) -> int:
    """A byte inside the file's (only) embedded kernel binary."""
    ref = SavedFile.from_bytes(raw).manifest["binaries"][0]["blob"]
    return _in_section(raw, "blobs", ref[0] + ref[1] // 2)


@pytest.mark.parametrize("where", ["manifest", "blobs", "kernel binary"])
def test_a_damaged_file_is_the_checksums_error_on_a_machine_without_a_gpu(raw, tmp_path,
                                                                          monkeypatch, where):
    """Not NoGpuError: the checksum, still hashing when the load asks for the GPU, is waited
    for before that error leaves the load."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    at = {"manifest": _middle_of(raw, "manifest"), "blobs": _middle_of(raw, "blobs"),
          "kernel binary": _binary_at(raw)}
    path = tmp_path / "m.nimble"
    path.write_bytes(_flipped(raw, at[where]))
    with pytest.raises(LoadError, match=f"^{path} {DAMAGED}"):
        nimble.load(path)
    path.write_bytes(raw)
    with pytest.raises(NoGpuError):
        nimble.load(path)


class Kernels:
    functions: list = []

    def __init__(self) -> None:
        self.closed = False
        self.seconds = {"kernels_read_threads": 0.0}

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def stand_in_gpu(monkeypatch):
    """The load's GPU steps stood in for: the GPU found, the weights and memory copied (none),
    every bucket read, every graph built (recorded in ``made["built"]``)."""
    made = {"built": [], "kernels": []}
    monkeypatch.setattr(loading, "_this_gpu", lambda manifest: "cuda:0")
    monkeypatch.setattr(loading.driver, "current_context", lambda: "ctx")
    monkeypatch.setattr(loading.driver, "use_context", lambda ctx: None)
    monkeypatch.setattr(loading, "place_weights", lambda *a: ([], []))
    monkeypatch.setattr(loading, "place_memory", lambda *a: ([], []))

    def load_kernels(rows, binaries, saved):
        made["kernels"].append(Kernels())
        return made["kernels"][-1]
    monkeypatch.setattr(loading, "load_kernels", load_kernels)
    monkeypatch.setattr(loading, "_read_bucket", lambda *a, **kw: object())
    monkeypatch.setattr(loading._Graph, "build",
                        lambda self, model: made["built"].append(self.name))
    return made


def test_a_kernel_binary_damaged_is_the_checksums_error_not_the_binarys(raw, tmp_path,
                                                                         stand_in_gpu,
                                                                         monkeypatch):
    """The damage breaks the binary's own hash on the kernels' worker first; the checksum's
    error is the one raised, and nothing was built."""
    from nimble.engine import kernel_loading

    monkeypatch.setattr(loading, "load_kernels", kernel_loading.load_kernels)
    path = tmp_path / "m.nimble"
    damaged = SavedFile.from_bytes(raw)
    damaged = SavedFile(damaged.manifest, _flipped(bytes(damaged.blobs),
                                                   _binary_at(raw) - _in_section(raw, "blobs")))
    damaged.write(path)  # the same damage under a checksum that holds: the binary's error
    with pytest.raises(LoadError, match="kernel binary .* is not the one the graph was saved"):
        nimble.load(path)
    path.write_bytes(_flipped(raw, _binary_at(raw)))
    with pytest.raises(LoadError, match=DAMAGED) as e:
        nimble.load(path)
    assert "is not the one the graph was saved" in str(e.value.__context__)
    assert stand_in_gpu["built"] == []


def test_the_checksum_holds_before_any_graph_is_built_and_a_failure_closes_the_kernels(
        raw, tmp_path, stand_in_gpu):
    path = tmp_path / "m.nimble"
    # A reference output's bytes: nothing reads them before the proof, after the build.
    ref = SavedFile.from_bytes(raw).manifest["buckets"][0]["reference"]["outputs"][0][0]
    path.write_bytes(_flipped(raw, _in_section(raw, "blobs", ref[0])))
    with pytest.raises(LoadError, match=DAMAGED):
        nimble.load(path)
    assert stand_in_gpu["built"] == [] and stand_in_gpu["kernels"][0].closed


def test_an_error_of_a_sound_file_is_its_own_and_closes_what_was_loaded(raw, tmp_path,
                                                                       stand_in_gpu,
                                                                       monkeypatch):
    def refused(*a, **kw):
        raise LoadError("task 3 names kernel 99, which the file does not have")
    monkeypatch.setattr(loading, "_read_bucket", refused)
    path = tmp_path / "m.nimble"
    path.write_bytes(raw)
    with pytest.raises(LoadError, match="kernel 99"):
        nimble.load(path)
    assert stand_in_gpu["kernels"][0].closed


def test_a_sound_file_reaches_the_build_with_its_checksum_timed(raw, tmp_path, stand_in_gpu,
                                                                monkeypatch):
    seconds = {}
    checked = loading.wait_for_checksum

    def timed(pending, into):
        checked(pending, into)
        seconds.update(into)
        raise RuntimeError("stop before the GPU's build")
    monkeypatch.setattr(loading, "wait_for_checksum", timed)
    path = tmp_path / "m.nimble"
    path.write_bytes(raw)
    with pytest.raises(RuntimeError, match="stop before"):
        nimble.load(path)
    assert {"read_file", "read_check", "read", "checksum", "checksum_wait"} <= set(seconds)
    assert all(v >= 0 for v in seconds.values()) and stand_in_gpu["kernels"][0].closed


def test_a_load_runs_with_the_garbage_collector_paused_and_puts_it_back(tmp_path, monkeypatch):
    """Full collections set off by the load's own allocations walk every object of a process
    that imported torch (tools/load_read_bench.py): the collector is off for the load and as
    it was after, an error included."""
    import gc

    seen = []

    def refused(path, seconds=None):
        seen.append(gc.isenabled())
        raise LoadError("stop here")
    monkeypatch.setattr(loading, "read_checked", refused)
    was = gc.isenabled()
    try:
        gc.enable()
        with pytest.raises(LoadError, match="stop here"):
            nimble.load(tmp_path / "m.nimble")
        assert seen == [False] and gc.isenabled()
        gc.disable()
        with pytest.raises(LoadError, match="stop here"):
            nimble.load(tmp_path / "m.nimble")
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
