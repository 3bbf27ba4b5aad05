"""Offset allocator for shared regions (the kvservice pool, the RPC heap): hands out aligned
byte ranges, no I/O.

Free ranges live in segregated size classes (TLSF-style: a power-of-two level split into 16
linear sub-classes) whose lists are sorted by (size, offset), plus a bitmap of non-empty classes.
An allocation takes the smallest free range that fits, the lowest address among equal sizes
(address-ordered best fit, which keeps fragmentation low for mixed sizes); a free merges the
range with both free neighbours at once, found through start/end maps, so free space is always
maximally coalesced. Every operation is O(log n) in the number of free ranges.
"""
from __future__ import annotations

from bisect import bisect_left, insort

_SUB_BITS = 4  # 16 sub-classes per power of two
_SUB = 1 << _SUB_BITS


def _size_class(units: int) -> int:
    """Size class of a range of ``units`` alignment units: monotonic, exact below 32 units."""
    if units < 2 * _SUB:
        return units
    shift = units.bit_length() - 1 - _SUB_BITS
    return shift * _SUB + (units >> shift)


class PoolAllocator:
    """Allocates ranges of a pool of ``capacity`` bytes at multiples of ``alignment``.

    Offsets are relative to the start of the pool; sizes are rounded up to ``alignment``.
    Not thread-safe: the metadata server owns it from one thread.
    """

    __slots__ = ("_capacity", "_alignment", "_shift", "_used", "_allocated",
                 "_free_at", "_free_end", "_classes", "_nonempty")

    def __init__(self, capacity: int, alignment: int = 4096) -> None:
        for name, value in (("capacity", capacity), ("alignment", alignment)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int")
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity < alignment or capacity % alignment:
            raise ValueError(f"capacity must be a positive multiple of {alignment}, got {capacity}")
        self._capacity = capacity
        self._alignment = alignment
        self._shift = alignment.bit_length() - 1
        self._used = 0
        self._allocated: dict[int, int] = {}      # offset -> size of live allocations
        self._free_at: dict[int, int] = {}        # start -> size of free ranges
        self._free_end: dict[int, int] = {}       # end -> start of free ranges
        self._classes: list[list[tuple[int, int]]] = [
            [] for _ in range(_size_class(capacity >> self._shift) + 1)]
        self._nonempty = 0                        # bit i set <=> _classes[i] is non-empty
        self._add_free(0, capacity)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def used(self) -> int:
        """Bytes in live allocations (after rounding to the alignment)."""
        return self._used

    def rounded(self, size: int) -> int:
        """Bytes an allocation of ``size`` consumes; ValueError unless 0 < size <= capacity."""
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError("size must be an int")
        if size <= 0 or size > self._capacity:
            raise ValueError(f"size must be in 1..{self._capacity}, got {size}")
        mask = self._alignment - 1
        return (size + mask) & ~mask

    def alloc(self, size: int) -> int | None:
        """Offset of a new range of at least ``size`` bytes, or None if no free range fits."""
        need = self.rounded(size)
        cls = _size_class(need >> self._shift)
        bucket = self._classes[cls]
        i = bisect_left(bucket, (need, -1))
        if i == len(bucket):  # nothing in the request's own class fits: take the next class up
            higher = self._nonempty >> (cls + 1)
            if not higher:
                return None
            cls += (higher & -higher).bit_length()
            bucket, i = self._classes[cls], 0
        have, offset = bucket[i]
        self._take(cls, i)
        if have > need:
            self._add_free(offset + need, have - need)
        self._allocated[offset] = need
        self._used += need
        return offset

    def free(self, offset: int) -> None:
        """Return the range at ``offset`` to the pool; ValueError if it is not a live allocation."""
        size = self._allocated.pop(offset, None)
        if size is None:
            raise ValueError(f"offset {offset!r} is not an allocated block (unknown or freed)")
        self._used -= size
        start, end = offset, offset + size
        right = self._free_at.get(end)
        if right is not None:
            self._remove_free(end, right)
            end += right
        left = self._free_end.get(start)
        if left is not None:
            self._remove_free(left, start - left)
            start = left
        self._add_free(start, end - start)

    def size_of(self, offset: int) -> int:
        """Bytes the live allocation at ``offset`` holds (its size rounded up); ValueError if none."""
        size = self._allocated.get(offset)
        if size is None:
            raise ValueError(f"offset {offset!r} is not an allocated block (unknown or freed)")
        return size

    def largest_free(self) -> int:
        """Size in bytes of the largest free contiguous range (0 when the pool is full)."""
        if not self._nonempty:
            return 0
        return self._classes[self._nonempty.bit_length() - 1][-1][0]

    def stats(self) -> dict[str, int | float]:
        """Occupancy and fragmentation figures (fragmentation = 1 - largest_free / free)."""
        free = self._capacity - self._used
        largest = self.largest_free()
        return {
            "capacity": self._capacity,
            "used": self._used,
            "free": free,
            "allocations": len(self._allocated),
            "free_ranges": len(self._free_at),
            "largest_free": largest,
            "fragmentation": 1.0 - largest / free if free else 0.0,
        }

    def _add_free(self, offset: int, size: int) -> None:
        cls = _size_class(size >> self._shift)
        insort(self._classes[cls], (size, offset))
        self._nonempty |= 1 << cls
        self._free_at[offset] = size
        self._free_end[offset + size] = offset

    def _remove_free(self, offset: int, size: int) -> None:
        cls = _size_class(size >> self._shift)
        bucket = self._classes[cls]
        self._take(cls, bisect_left(bucket, (size, offset)))

    def _take(self, cls: int, i: int) -> None:
        """Drop entry ``i`` of class ``cls`` from every free-range structure."""
        bucket = self._classes[cls]
        size, offset = bucket.pop(i)
        if not bucket:
            self._nonempty &= ~(1 << cls)
        del self._free_at[offset]
        del self._free_end[offset + size]
