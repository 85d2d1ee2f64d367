"""alloc_events_from_trace: the allocator history of a capture as numbered allocations with the
allocation count at each free (CPU only)."""
from __future__ import annotations

from nimble.record.capture import alloc_events_from_trace
from nimble.record.raw import AllocEvent


def test_allocations_are_numbered_rounded_and_carry_their_free_time():
    trace = [
        {"action": "segment_alloc", "addr": 0x1000_0000, "size": 2 << 20},
        {"action": "alloc", "addr": 0x1000_0000, "size": 100},
        {"action": "alloc", "addr": 0x1000_0200, "size": 4096},
        {"action": "free_requested", "addr": 0x1000_0200, "size": 4096},
        {"action": "free_completed", "addr": 0x1000_0200, "size": 4096},
        {"action": "alloc", "addr": 0x1000_0200, "size": 513},  # the same bytes again
        {"action": "free_completed", "addr": 0x1000_0000, "size": 100},  # no request logged
        {"action": "free_requested", "addr": 0x2000_0000, "size": 64},  # from before capture
    ]
    events = alloc_events_from_trace(trace, alloc_base=7)
    assert events == [AllocEvent(7, 0x1000_0000, 512, freed_at=10),
                      AllocEvent(8, 0x1000_0200, 4096, freed_at=9),
                      AllocEvent(9, 0x1000_0200, 1024, freed_at=None)]


def test_an_empty_history_has_no_allocations():
    assert alloc_events_from_trace([], alloc_base=0) == []


def test_only_driver_allocations_outside_torchs_memory_are_library_memory():
    from nimble.record.recorder import library_memory
    from nimble.record.raw import DeviceRange

    pool = [DeviceRange(0x7F00_0000_0000, 0x20_0000, "graph pool")]
    allocator = [DeviceRange(0x7E00_0000_0000, 0x40_0000, "segment")]  # another graph's pool
    found = [DeviceRange(0x7F00_0000_0000, 0x20_0000), DeviceRange(0x7E00_0000_0000, 0x40_0000),
             DeviceRange(0x7D00_0000_0000, 0x6300)]  # the last: cuDNN's own
    assert [(r.address, r.name) for r in library_memory(found, pool, allocator)] == [
        (0x7D00_0000_0000, "device allocation@0x7d0000000000")]
