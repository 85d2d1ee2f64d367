"""Address intervals: which of a set of non-overlapping ``[start, end)`` intervals holds an
address (:class:`Intervals`, newest wins), and an index over device ranges
(:func:`range_index`), for resolving a capture's addresses (:mod:`nimble.record.pointers`).
"""
from __future__ import annotations

import bisect

from .raw import DeviceRange


class Intervals:
    """Non-overlapping ``[start, end) -> value`` intervals; a new interval clips older ones."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._items: list[tuple[int, int, object]] = []

    def insert(self, start: int, end: int, value) -> None:
        i = bisect.bisect_right(self._starts, start) - 1
        if i >= 0 and self._items[i][1] > start:
            s, e, v = self._items[i]
            self._starts[i:i + 1], self._items[i:i + 1] = [s], [(s, start, v)]
            if e > end:
                self._put(end, e, v)
        j = bisect.bisect_left(self._starts, start)
        while j < len(self._items) and self._items[j][0] < end:
            s, e, v = self._items.pop(j)
            self._starts.pop(j)
            if e > end:
                self._put(end, e, v)
                break
        self._put(start, end, value)

    def _put(self, start: int, end: int, value) -> None:
        k = bisect.bisect_left(self._starts, start)
        self._starts.insert(k, start)
        self._items.insert(k, (start, end, value))

    def find(self, address: int):
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0:
            s, e, v = self._items[i]
            if s <= address < e:
                return v
        return None


def range_index(ranges: list[DeviceRange]) -> Intervals:
    """An index from address to the position in ``ranges`` of the range holding it; where
    ranges nest, the smaller one wins."""
    index = Intervals()
    for r in sorted(range(len(ranges)), key=lambda k: ranges[k].size, reverse=True):
        index.insert(ranges[r].address, ranges[r].end, r)
    return index
