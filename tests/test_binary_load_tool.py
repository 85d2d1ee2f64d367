"""tools/experiments/binary_load.py on the CPU: a container's entries as the library scan reads
them, and this GPU's ELF entry cut out as a container of its own that the scan reads back."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import load_tool

from nimble.record import binaries as found

tool = load_tool("experiments/binary_load")
FIXTURE = Path(__file__).parent / "fixtures" / "gather_input_sm90_lz4.fatbin"


def _two_arch_container() -> bytes:
    """The fixture's one sm_90 entry after a copy of it marked sm_80."""
    one = FIXTURE.read_bytes()
    (entry,) = tool.entries(one)
    body = bytearray(one[entry.whole])
    other = bytearray(body)
    other[28:32] = (80).to_bytes(4, "little")  # the entry header's arch
    both = bytes(other) + bytes(body)
    return found.FATBIN_HEADER.pack(found.FATBIN_MAGIC, 1, 16, len(both)) + both


def test_the_entries_of_a_container_are_read_from_their_headers():
    one = FIXTURE.read_bytes()
    (entry,) = tool.entries(one)
    assert (entry.kind, entry.arch, entry.whole.start) == (found.ENTRY_KIND_ELF, 90, 16)
    assert entry.compressed
    listed = tool.entries(_two_arch_container())
    assert [e.arch for e in listed] == [80, 90]
    assert listed[1].whole.start == listed[0].whole.stop


def test_this_gpus_entry_is_cut_out_as_a_container_the_scan_reads_back():
    both = _two_arch_container()
    cut = tool.own_arch_container(both, 90)
    (container,) = found.fatbin_containers(cut)
    (entry,) = container.entries
    _, want = found.fatbin_containers(both)[0].entries
    assert (entry.arch, entry.compressed) == (90, True)
    assert cut[entry.payload] == both[want.payload]
    assert tool.own_arch_container(both, 86) is None  # no entry for that GPU
    assert tool.own_arch_container(FIXTURE.read_bytes(), 90) is None  # nothing else to cut
    assert tool.own_arch_container(b"\x7fELF" + bytes(60), 90) is None  # no container


def test_the_command_takes_one_file():
    with pytest.raises(SystemExit):
        tool.main([])
