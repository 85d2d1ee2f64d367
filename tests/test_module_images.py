"""The module images kept for saving (nimble.driver.module_images), fed through its CUPTI
callback on the CPU: a module loaded again is kept once, a new one beside it, in load order."""
from __future__ import annotations

import ctypes

import pytest

from nimble.driver import module_images


@pytest.fixture
def kept(monkeypatch):
    monkeypatch.setattr(module_images, "_images", {})
    return module_images


def _load(image: bytes, keep: list) -> None:
    """One MODULE_LOADED event for ``image``, laid out as CUPTI's resource data is."""
    cubin = ctypes.create_string_buffer(image, len(image))
    descriptor = (ctypes.c_uint64 * 3)(7, len(image), ctypes.addressof(cubin))
    data = (ctypes.c_uint64 * 3)(0, 0, ctypes.addressof(descriptor))
    keep += [cubin, descriptor, data]
    module_images._on_event(None, module_images._CB_DOMAIN_RESOURCE,
                            module_images._CBID_MODULE_LOADED, ctypes.addressof(data))


def test_a_module_loaded_again_is_kept_once(kept):
    alive: list = []
    for image in (b"\x7fELF-a", b"\x7fELF-b", b"\x7fELF-a", b"\x7fELF-a", b"\x7fELF-c"):
        _load(image, alive)
    assert kept.images() == [b"\x7fELF-a", b"\x7fELF-b", b"\x7fELF-c"]


def test_images_that_differ_in_one_byte_are_both_kept(kept):
    alive: list = []
    _load(b"\x7fELF" + b"\0" * 64, alive)
    _load(b"\x7fELF" + b"\0" * 63 + b"\1", alive)
    assert len(kept.images()) == 2


def test_events_of_other_callbacks_keep_nothing(kept):
    module_images._on_event(None, module_images._CB_DOMAIN_RESOURCE, 1, 0)
    module_images._on_event(None, 2, module_images._CBID_MODULE_LOADED, 0)
    assert kept.images() == []
