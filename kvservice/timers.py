"""Deadline heaps the key index expires leases, pending puts and TTLs by (see kvservice.index)."""
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Generic, TypeVar

R = TypeVar("R")


class Soonest:
    """The earliest deadline pushed on any of an index's timer heaps since its last expiry
    pass (or earlier: never later), so that an operation with nothing due skips the pass with
    one comparison."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = math.inf


class Timers(Generic[R]):
    """Deadlines in a min-heap with lazy deletion; rebuilt when dead entries outnumber live ones.
    ``alive(record, deadline)`` tells a live entry from a superseded or ended one."""

    __slots__ = ("_heap", "_seq", "_alive", "_soonest")

    def __init__(self, alive: Callable[[R, float], bool], soonest: Soonest) -> None:
        self._heap: list[tuple[float, int, R]] = []
        self._seq = itertools.count()
        self._alive = alive
        self._soonest = soonest

    def push(self, deadline: float, record: R, live: int) -> None:
        """Add ``record``'s entry at ``deadline``; ``live`` is how many records are live now."""
        heapq.heappush(self._heap, (deadline, next(self._seq), record))
        if deadline < self._soonest.at:
            self._soonest.at = deadline
        if len(self._heap) > 2 * live + 64:
            self._heap = [e for e in self._heap if self._alive(e[2], e[0])]
            heapq.heapify(self._heap)

    def head(self) -> float:
        """The earliest deadline held (live or dead), inf when none."""
        heap = self._heap
        return heap[0][0] if heap else math.inf

    def pop_due(self, now: float) -> list[R]:
        """Take the entries due at ``now``; the records of the live ones."""
        due = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, _, record = heapq.heappop(heap)
            if self._alive(record, deadline):
                due.append(record)
        return due
