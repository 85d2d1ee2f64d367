"""A saved file whose container or manifest does not hold is a LoadError naming what is wrong,
on any machine and before anything reaches the GPU: ``nimble.load`` reads and checks the whole
file (:mod:`nimble.ir.saved_manifest`) before it asks for a GPU."""
from __future__ import annotations

import pytest
import torch

import nimble
from nimble.engine import loading
from nimble.errors import LoadError, NoGpuError
from nimble.ir.saved_format import HEADER, SavedFile
from nimble.ir.saved_manifest import (FORMAT_NAME, MEMCPY_FIELDS, MEMSET_FIELDS,
                                      check_manifest)
from nimble.ir.synthetic import branchy_graph

from saved_fixture import saved_file_of


@pytest.fixture
def no_gpu_work(monkeypatch):
    """Fail the test where a load asks for the GPU (or the driver) at all."""
    def asked(*args, **kwargs):
        raise AssertionError("the load reached the GPU with a damaged file")
    monkeypatch.setattr(torch.cuda, "is_available", asked)
    monkeypatch.setattr(loading.driver, "ensure_context", asked)


def _small() -> SavedFile:
    return saved_file_of(branchy_graph(seed=1))


def _damaged(how: str) -> bytes:
    data = bytearray(_small().to_bytes())
    if how == "truncated":
        return bytes(data[:-100])
    if how == "appended":
        return bytes(data) + b"\0" * 8
    if how == "flipped":
        data[HEADER.size + 200] ^= 0x10
        return bytes(data)
    if how == "mistyped":
        saved = _small()
        saved.manifest["buckets"][0]["nodes"][3]["kernel"] = "3"
        return saved.to_bytes()
    return b"#!/bin/sh\necho not a saved graph\n" * 4


@pytest.mark.parametrize("how", ["truncated", "appended", "flipped", "mistyped", "foreign"])
def test_a_damaged_file_is_a_load_error_before_any_gpu_work(tmp_path, no_gpu_work, how):
    path = tmp_path / "m.nimble"
    path.write_bytes(_damaged(how))
    with pytest.raises(LoadError) as e:
        nimble.load(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_sound_file_passes_every_check_and_then_needs_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = _small().write(tmp_path / "m.nimble")
    with pytest.raises(NoGpuError):
        nimble.load(path)


def test_the_first_field_of_the_wrong_type_is_named_by_its_path():
    saved = _small()
    saved.manifest["buckets"][0]["nodes"][3]["kernel"] = "3"
    with pytest.raises(LoadError, match=r"^m\.nimble: buckets\[0\]\.nodes\[3\]\.kernel is a "
                                        r"string \('3'\), not an integer: the file is damaged"):
        check_manifest(saved.manifest, len(saved.blobs), "m.nimble")


def test_a_sound_manifest_passes():
    saved = _small()
    check_manifest(saved.manifest, len(saved.blobs))


def test_the_check_knows_what_the_driver_writes():
    from nimble.driver import stored

    assert MEMSET_FIELDS == stored._MEMSET_FIELDS and MEMCPY_FIELDS == stored._MEMCPY_FIELDS
