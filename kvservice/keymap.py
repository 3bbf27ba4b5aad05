"""The key index's map of keys to pool blocks: namespaces in LRU order, quotas, eviction, TTL.

Eviction and fairness. Victims are live blocks without a lease, least recently used first.
A quota is a namespace's guaranteed share of the pool and its ceiling. A put evicts when (a) it
would take its namespace over its quota: only that namespace's own blocks, just enough to fit,
and nothing at all if they cannot make room (QuotaExceeded); or (b) the pool would go over the
high watermark (down to the low watermark) or the allocation fails. In case (b) a put that
stays within its namespace's quota evicts first the unprotected blocks of other namespaces
(those without a quota, or over theirs, only down to it), oldest access first across them, and
its own blocks last: its share is guaranteed against data that has none. Any other put evicts
its own blocks first, then the others' unprotected ones. A namespace within its quota is never
evicted by another namespace's put. If no eligible victim is left and nothing fits, the put
raises PoolFull.
"""
from __future__ import annotations

import heapq
import itertools
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from operator import attrgetter
from typing import Any

from cxlrpc.allocator import PoolAllocator
from kvservice.keys import normalize_key
from kvservice.timers import Soonest, Timers

#: What ``KeyMap.remove_keys`` says of each key.
REMOVED, ABSENT, LEASED = 0, 1, 2
PENDING, LIVE, RETIRED, FREED = range(4)


class PoolFull(Exception):
    """No room for a put, even after evicting every block the fairness rule allows."""


class QuotaExceeded(PoolFull):
    """A put would take its namespace over quota and its own evictable blocks cannot make room."""


class BlockRec:
    """One allocated value; ``nbytes`` is what it takes from the pool (size rounded up)."""

    __slots__ = ("ns", "key", "offset", "size", "nbytes", "state", "version", "created",
                 "last_access", "expires_at", "leases")

    def __init__(self, ns: str, key: bytes, offset: int, size: int, nbytes: int) -> None:
        self.ns = ns
        self.key = key
        self.offset = offset
        self.size = size
        self.nbytes = nbytes
        self.state = PENDING
        self.version = 0
        self.created = 0.0
        self.last_access = 0.0
        self.expires_at: float | None = None
        self.leases = 0


class Namespace:
    """A tenant's live entries in LRU order (oldest first) and the pool bytes it holds."""

    __slots__ = ("name", "entries", "used", "quota")

    def __init__(self, name: str) -> None:
        self.name = name
        self.entries: OrderedDict[bytes, BlockRec] = OrderedDict()
        self.used = 0  # pending, live and retired blocks alike
        self.quota: int | None = None


def positive(name: str, value: float) -> float:
    """``value`` if it is a positive number, else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return value


def check_ns(ns: str) -> str:
    """``ns`` if it is a str (a namespace), else TypeError."""
    if not isinstance(ns, str):
        raise TypeError(f"namespace must be a str, not {type(ns).__name__}")
    return ns


def check_owner(owner: Hashable | None) -> None:
    """Reject an unhashable owner before any state changes (it would fail half-way otherwise)."""
    if owner is not None:
        hash(owner)


class KeyMap:
    """Namespaces -> keys -> live blocks of the pool, with quotas, LRU eviction and TTLs.

    ``counters`` is the index's shared counter dict (this map counts evictions and expirations).
    """

    def __init__(self, allocator: PoolAllocator, high_watermark: float, low_watermark: float,
                 counters: dict[str, int], soonest: Soonest,
                 on_free: Callable[[int], None] | None) -> None:
        self.alloc = allocator
        self._high = high_watermark * allocator.capacity
        self._low = low_watermark * allocator.capacity
        self._counters = counters
        self._on_free = on_free
        self.spaces: dict[str, Namespace] = {}
        self.ttl_timers: Timers[BlockRec] = Timers(lambda block, at: block.state == LIVE, soonest)
        self.entries = 0
        self.retired = 0

    # ---- room for a put -----------------------------------------------------------------------

    def reserve(self, ns: str, size: int, nbytes: int) -> int:
        """The offset of a new ``size``-byte block of ``ns`` (``nbytes`` rounded), evicting as
        the fairness rule allows; PoolFull (or QuotaExceeded) when there is no room."""
        space = self.spaces.get(ns)
        quota = space.quota if space is not None else None
        guaranteed = space is not None and quota is not None and space.used + nbytes <= quota
        if space is not None and quota is not None:
            over = space.used + nbytes - quota
            if over > 0:
                victims = self._plan(ns, over, others=False) if nbytes <= quota else []
                if sum(b.nbytes for b in victims) < over:
                    raise QuotaExceeded(f"namespace {ns!r}: {nbytes} more bytes exceed its "
                                        f"quota of {quota} ({space.used} held)")
                self._evict(victims)
        if self.alloc.used + nbytes > self._high:
            need = math.ceil(self.alloc.used + nbytes - self._low)
            self._evict(self._plan(ns, need, own_first=not guaranteed))
        offset = self.alloc.alloc(size)
        while offset is None:
            victims = self._plan(ns, nbytes, own_first=not guaranteed)
            if not victims:
                raise PoolFull(f"no {nbytes}-byte range free and nothing evictable for {ns!r}")
            self._evict(victims)
            offset = self.alloc.alloc(size)
        self.namespace(ns).used += nbytes  # fetched again: eviction may have dropped it
        return offset

    def insert(self, block: BlockRec, ttl: float | None, now: float) -> None:
        """Make a just-published ``block`` its key's live value (expiring after ``ttl``)."""
        self.spaces[block.ns].entries[block.key] = block
        self.entries += 1
        if ttl is not None:
            block.expires_at = now + ttl
            self.ttl_timers.push(block.expires_at, block, self.entries)

    def _plan(self, ns: str, need: int, others: bool = True, own_first: bool = True) -> list[BlockRec]:
        """Victims freeing ``need`` bytes if possible: own LRU and eligible others' LRU, in the
        order ``own_first`` says."""
        own = self.spaces.get(ns)
        ordered: Iterable[BlockRec] = self._evictable(own, math.inf) if own is not None else ()
        if others:
            rivals = heapq.merge(*(self._evictable(s, math.inf if s.quota is None else s.used - s.quota)
                                   for s in self.spaces.values()
                                   if s is not own and (s.quota is None or s.used > s.quota)),
                                 key=attrgetter("last_access"))
            ordered = itertools.chain(ordered, rivals) if own_first else itertools.chain(rivals, ordered)
        victims: list[BlockRec] = []
        freed = 0
        for block in ordered:
            if freed >= need:
                break
            victims.append(block)
            freed += block.nbytes
        return victims

    @staticmethod
    def _evictable(space: Namespace, budget: float) -> Iterator[BlockRec]:
        """Unleased live blocks of ``space``, LRU first, until ``budget`` bytes are yielded."""
        taken = 0
        for block in space.entries.values():
            if taken >= budget:
                return
            if block.leases == 0:
                taken += block.nbytes
                yield block

    def _evict(self, victims: list[BlockRec]) -> None:
        for block in victims:
            self.unlink(block)
            self._counters["evictions"] += 1

    # ---- hiding and freeing ---------------------------------------------------------------------

    def unlink(self, block: BlockRec) -> None:
        """Hide a live block; free it now unless leases hold it."""
        space = self.spaces[block.ns]
        del space.entries[block.key]
        self.entries -= 1
        if block.leases:
            block.state = RETIRED
            self.retired += 1
        else:
            self.free(block)

    def free(self, block: BlockRec) -> None:
        """Give ``block``'s bytes back to the pool (after ``on_free``)."""
        if block.state == RETIRED:
            self.retired -= 1
        if self._on_free is not None:  # (a pending block's entry holds its put's claim)
            self._on_free(block.offset)
        block.state = FREED
        self.alloc.free(block.offset)
        space = self.spaces[block.ns]
        space.used -= block.nbytes
        self._maybe_drop(space)

    def expire_due(self, now: float) -> int:
        """Hide the values whose TTL has passed; how many."""
        due = self.ttl_timers.pop_due(now)
        for block in due:
            self.unlink(block)
            self._counters["expirations"] += 1
        return len(due)

    def namespace(self, ns: str) -> Namespace:
        """``ns``'s record, made if it has none."""
        space = self.spaces.get(ns)
        if space is None:
            space = self.spaces[ns] = Namespace(ns)
        return space

    def _maybe_drop(self, space: Namespace) -> None:
        """Forget a namespace that holds nothing and has no quota, so metadata stays bounded."""
        if not space.entries and space.used == 0 and space.quota is None:
            del self.spaces[space.name]

    def live(self, ns: str, key: bytes) -> BlockRec | None:
        """``key``'s live block in ``ns``, if any."""
        space = self.spaces.get(ns)
        return space.entries.get(key) if space is not None else None

    # ---- the index's key operations (see KVIndex for what each means) ---------------------------

    def exists(self, ns: str, key: str | bytes) -> bool:
        space = self.spaces.get(check_ns(ns))
        return space is not None and normalize_key(key) in space.entries

    def exists_keys(self, ns: str, keys: Iterable[str | bytes]) -> list[bool]:
        space = self.spaces.get(check_ns(ns))
        return [space is not None and normalize_key(k) in space.entries for k in keys]

    def lookup_prefix(self, ns: str, keys: Sequence[str | bytes]) -> int:
        space = self.spaces.get(check_ns(ns))
        if space is None:
            return 0
        for n, key in enumerate(keys):
            if normalize_key(key) not in space.entries:
                return n
        return len(keys)

    def remove(self, ns: str, key: str | bytes, version: int | None = None) -> bool:
        space = self.spaces.get(check_ns(ns))
        block = space.entries.get(normalize_key(key)) if space is not None else None
        if block is None or (version is not None and block.version != version):
            return False
        self.unlink(block)
        return True

    def remove_keys(self, ns: str, keys: Iterable[str | bytes], force: bool) -> list[int]:
        check_ns(ns)
        out = []
        for key in [normalize_key(k) for k in keys]:
            block = self.live(ns, key)
            if block is None:
                out.append(ABSENT)
            elif block.leases and not force:
                out.append(LEASED)
            else:
                self.unlink(block)
                out.append(REMOVED)
        return out

    def remove_matching(self, ns: str, pattern: bytes | None, force: bool) -> int:
        space = self.spaces.get(check_ns(ns))
        if space is None:
            return 0
        search = re.compile(pattern).search if pattern is not None else None
        victims = [b for k, b in space.entries.items()
                   if (search is None or search(k)) and (force or not b.leases)]
        for block in victims:
            self.unlink(block)
        return len(victims)

    def set_quota(self, ns: str, max_bytes: int | None) -> None:
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes < 0):
            raise ValueError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
        space = self.namespace(check_ns(ns))
        space.quota = max_bytes
        self._maybe_drop(space)

    def namespace_stats(self) -> dict[str, dict[str, Any]]:
        """Bytes, entries and quota of each namespace."""
        return {name: {"bytes": s.used, "entries": len(s.entries), "quota": s.quota}
                for name, s in self.spaces.items()}
