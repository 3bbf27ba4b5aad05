"""The metadata the kvservice server owns: key index, two-phase puts, leases, TTL, quotas, eviction.

Pure and I/O-free: the server calls it from one thread (not thread-safe) and maps its exceptions
to status codes; clients copy the bytes in and out of the pool at the offsets it hands out.

Lifecycle of a block: ``begin_put`` allocates it (pending, invisible) -> ``commit_put`` publishes it
(live, replacing any previous value of the key) -> it is hidden by ``remove``, TTL expiry,
eviction or a newer commit (retired) -> it is freed once no lease holds it. Leases and pending
puts end by release/commit/abort, by timeout in ``expire()``, or by ``release_owner``.

Fencing. The writer of a pending put holds a writable view of its block; when its connection is
judged gone (``release_owner``) it may only be frozen, and would write on when it resumes. So
its pending blocks are quarantined -- neither live nor free, counted in ``stats()`` -- until
``fence_owner`` says that writer can no longer write into the pool; only then are they freed
and handed to other puts. A reader's leases end at once: its copies check the block's version
after copying (a reused block never matches), so a late reader fails instead of pinning memory.

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
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from operator import attrgetter
from typing import Any

import msgspec

from cxlrpc.allocator import PoolAllocator
from kvservice.keys import MAX_KEY_BYTES, normalize_key


#: What :meth:`KVIndex.remove_keys` says of each key.
REMOVED, ABSENT, LEASED = 0, 1, 2


class PoolFull(Exception):
    """No room for a put, even after evicting every block the fairness rule allows."""


class QuotaExceeded(PoolFull):
    """A put would take its namespace over quota and its own evictable blocks cannot make room."""


class PutTicket(msgspec.Struct, frozen=True, array_like=True):
    """Where the writer copies a pending value; ``commit_put(ticket_id)`` publishes it. (On
    the wire, as every kvservice message, an array: no field names to encode and match.)"""

    ticket_id: int
    offset: int
    size: int


class Lease(msgspec.Struct, frozen=True, array_like=True):
    """A reader's right to read ``size`` bytes at ``offset`` until ``expires_at`` (server clock),
    that is for ``duration`` seconds unless renewed. (An array on the wire: a get's reply is
    most of its bytes.)"""

    lease_id: int
    offset: int
    size: int
    version: int
    expires_at: float
    duration: float


_PENDING, _LIVE, _RETIRED, _FREED = range(4)
#: young leases (made, their timer entry not yet pushed) that make _lease arm them all
_YOUNG = 64


class _Block:
    """One allocated value; ``nbytes`` is what it takes from the pool (size rounded up)."""

    __slots__ = ("ns", "key", "offset", "size", "nbytes", "state", "version", "created",
                 "last_access", "expires_at", "leases")

    def __init__(self, ns: str, key: bytes, offset: int, size: int, nbytes: int) -> None:
        self.ns = ns
        self.key = key
        self.offset = offset
        self.size = size
        self.nbytes = nbytes
        self.state = _PENDING
        self.version = 0
        self.created = 0.0
        self.last_access = 0.0
        self.expires_at: float | None = None
        self.leases = 0


class _Ticket:
    __slots__ = ("id", "block", "owner", "ttl", "if_absent")

    def __init__(self, id: int, block: _Block, owner: Hashable | None, ttl: float | None,
                 if_absent: bool = False) -> None:
        self.id = id
        self.block = block
        self.owner = owner
        self.ttl = ttl
        self.if_absent = if_absent


class _LeaseRec(msgspec.Struct, gc=False):
    """One lease (a Struct: made once per get, in C; gc=False, as nothing it holds leads back
    to it)."""

    id: int
    block: _Block
    owner: Hashable | None
    expires_at: float
    hold_until: float = 0.0
    #: the deadline of its one live timer entry (at or before ``expires_at``: a renewal that
    #: moves the expiry later adds no entry; the entry re-arms itself when it comes due)
    timer_at: float = math.inf


class _Namespace:
    """A tenant's live entries in LRU order (oldest first) and the pool bytes it holds."""

    __slots__ = ("name", "entries", "used", "quota")

    def __init__(self, name: str) -> None:
        self.name = name
        self.entries: OrderedDict[bytes, _Block] = OrderedDict()
        self.used = 0  # pending, live and retired blocks alike
        self.quota: int | None = None


class _Soonest:
    """The earliest deadline pushed on any of an index's timer heaps since its last expiry
    pass (or earlier: never later), so that an operation with nothing due skips the pass with
    one comparison."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = math.inf


class _Timers:
    """Deadlines in a min-heap with lazy deletion; rebuilt when dead entries outnumber live ones.
    ``alive(record, deadline)`` tells a live entry from a superseded or ended one."""

    __slots__ = ("_heap", "_seq", "_alive", "_soonest")

    def __init__(self, alive: Callable[[object, float], bool], soonest: _Soonest) -> None:
        self._heap: list[tuple[float, int, object]] = []
        self._seq = itertools.count()
        self._alive = alive
        self._soonest = soonest

    def push(self, deadline: float, record: object, live: int) -> None:
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

    def pop_due(self, now: float) -> list[object]:
        due = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, _, record = heapq.heappop(heap)
            if self._alive(record, deadline):
                due.append(record)
        return due


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return value


def _check_ns(ns: str) -> str:
    if not isinstance(ns, str):
        raise TypeError(f"namespace must be a str, not {type(ns).__name__}")
    return ns


def _check_owner(owner: Hashable | None) -> None:
    """Reject an unhashable owner before any state changes (it would fail half-way otherwise)."""
    if owner is not None:
        hash(owner)


class KVIndex:
    """Keys -> blocks of a pool, with two-phase puts, leases, TTL, quotas and LRU eviction.

    ``release`` of an unknown, expired or already released lease is not an error (a client may
    race the expiry): it returns False and is counted as ``stale_releases``.
    """

    def __init__(self, allocator: PoolAllocator, *, high_watermark: float = 0.9,
                 low_watermark: float = 0.8, default_lease_s: float = 10.0,
                 max_lease_s: float = 60.0, put_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_publish: Callable[[int, int], None] | None = None,
                 on_free: Callable[[int], None] | None = None, first_id: int = 1,
                 first_version: int = 1,
                 on_claim: Callable[[int, int], None] | None = None) -> None:
        """``on_publish(offset, version)`` runs when a value becomes live, ``on_free(offset)``
        before its block can be handed out again, ``on_claim(offset, ticket_id)`` when a put
        reserves it (the server marks the pool with them, so readers can tell reused bytes
        and writers a block no longer theirs). Lease and ticket ids count up from
        ``first_id``, value versions from ``first_version`` (a server taking over a pool's
        memory starts both where its predecessor's cannot be: a reader still holding an old
        block must not match)."""
        if not 0 < first_version < 1 << 63 or not 0 < first_id <= 1 << 62:
            raise ValueError("first_version must be in [1, 2**63), first_id in [1, 2**62]")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError("need 0 < low_watermark <= high_watermark <= 1")
        self._alloc = allocator
        self._high = high_watermark * allocator.capacity
        self._low = low_watermark * allocator.capacity
        self._max_lease_s = _positive("max_lease_s", max_lease_s)
        if not math.isfinite(max_lease_s):
            raise ValueError("max_lease_s must be finite: a lease must end if its holder vanishes")
        self._default_lease_s = min(_positive("default_lease_s", default_lease_s), max_lease_s)
        self._on_publish = on_publish
        self._on_free = on_free
        self._on_claim = on_claim
        self._put_timeout_s = _positive("put_timeout_s", put_timeout_s)
        self._clock = clock
        self._ns: dict[str, _Namespace] = {}
        self._tickets: dict[int, _Ticket] = {}
        #: expired tickets whose owner is still connected: it holds a writable view of the
        #: block and may still be writing, so the block is freed only when it commits or
        #: aborts, or is quarantined when it departs (handing it to another put meanwhile
        #: would let it overwrite that value)
        self._expired_tickets: dict[int, _Ticket] = {}
        #: owner -> blocks its pending puts held when it departed: kept until fence_owner
        self._quarantine: dict[Hashable, list[_Block]] = {}
        self._quarantined_bytes = 0
        self._leases: dict[int, _LeaseRec] = {}
        #: owner -> ids of its leases and tickets; an owner's entry lasts until release_owner
        #: (a server's connections all end so): one set per get and release to make and drop
        #: was a tenth of a get's cost
        self._owners: dict[Hashable, set[int]] = {}
        self._ids = itertools.count(first_id)  # lease and ticket ids share one sequence
        self._versions = itertools.count(first_version)
        self._soonest = _Soonest()
        self._lease_timers = _Timers(lambda rec, at: rec.timer_at == at and self._leases.get(rec.id) is rec,
                                     self._soonest)
        #: leases made since their timer entries were last armed: pushing each onto the heap
        #: at its get cost more than the get's lookup; most are released before _arm_young runs
        self._young: list[_LeaseRec] = []
        self._ticket_timers = _Timers(lambda rec, at: rec.id in self._tickets, self._soonest)
        self._ttl_timers = _Timers(lambda block, at: block.state == _LIVE, self._soonest)
        self._entries = 0
        self._retired = 0
        self._counters = dict.fromkeys(
            ("hits", "misses", "evictions", "expirations", "lease_expirations",
             "put_expirations", "stale_releases"), 0)

    # ---- puts -------------------------------------------------------------------------------

    def begin_put(self, ns: str, key: str | bytes, size: int, ttl: float | None = None,
                  owner: Hashable | None = None, if_absent: bool = False) -> PutTicket | None:
        """Reserve ``size`` bytes for a value of ``key``, evicting as the fairness rule allows.

        The value stays invisible until ``commit_put``; an uncommitted ticket expires after
        ``put_timeout_s`` (its commit fails). Its block is freed then, or, for an ``owner``
        (who may still be writing into it), when that owner commits or aborts, or is fenced
        after it departs.
        Raises PoolFull (or its subclass QuotaExceeded) when there is no room.
        ``if_absent``: None (nothing reserved) when the key has a live value; the commit also
        keeps an existing value should one appear meanwhile.
        """
        now = self._clock()
        self._expire(now)
        _check_ns(ns)
        key = normalize_key(key)
        if if_absent and self._live(ns, key) is not None:
            return None
        nbytes = self._alloc.rounded(size)
        if ttl is not None:
            _positive("ttl", ttl)
        _check_owner(owner)
        space = self._ns.get(ns)
        quota = space.quota if space is not None else None
        guaranteed = quota is not None and space.used + nbytes <= quota
        if quota is not None:
            over = space.used + nbytes - quota
            if over > 0:
                victims = self._plan(ns, over, others=False) if nbytes <= quota else []
                if sum(b.nbytes for b in victims) < over:
                    raise QuotaExceeded(f"namespace {ns!r}: {nbytes} more bytes exceed its "
                                        f"quota of {quota} ({space.used} held)")
                self._evict(victims)
        if self._alloc.used + nbytes > self._high:
            need = math.ceil(self._alloc.used + nbytes - self._low)
            self._evict(self._plan(ns, need, own_first=not guaranteed))
        offset = self._alloc.alloc(size)
        while offset is None:
            victims = self._plan(ns, nbytes, own_first=not guaranteed)
            if not victims:
                raise PoolFull(f"no {nbytes}-byte range free and nothing evictable for {ns!r}")
            self._evict(victims)
            offset = self._alloc.alloc(size)
        self._namespace(ns).used += nbytes  # fetched again: eviction may have dropped it
        ticket = _Ticket(next(self._ids), _Block(ns, key, offset, size, nbytes), owner, ttl, if_absent)
        if self._on_claim is not None:
            self._on_claim(offset, ticket.id)
        self._tickets[ticket.id] = ticket
        self._own(owner, ticket.id)
        self._ticket_timers.push(now + self._put_timeout_s, ticket, len(self._tickets))
        return PutTicket(ticket.id, offset, size)

    def commit_put(self, ticket_id: int, owner: Hashable | None = None) -> int:
        """Publish a pending value, atomically replacing the key's old one; return its version
        (0 for an ``if_absent`` put whose key got a value meanwhile: nothing published).

        Raises KeyError if the ticket is unknown, committed, aborted or expired, or (when
        ``owner`` is given) belongs to another owner.
        """
        now = self._clock()
        self._expire(now)
        ticket = self._tickets.get(ticket_id)
        if ticket is None or (owner is not None and ticket.owner != owner):
            self._end_expired(ticket_id, owner)
            raise KeyError(f"unknown or expired put ticket {ticket_id!r}")
        block = ticket.block
        space = self._ns[block.ns]
        old = space.entries.get(block.key)
        if old is not None and ticket.if_absent:
            self._drop_ticket(ticket)
            return 0
        del self._tickets[ticket_id]
        self._disown(ticket.owner, ticket.id)
        if old is not None:
            self._unlink(old)
        block.state = _LIVE
        block.version = next(self._versions)
        block.created = block.last_access = now
        if self._on_publish is not None:
            self._on_publish(block.offset, block.version)
        space.entries[block.key] = block
        self._entries += 1
        if ticket.ttl is not None:
            block.expires_at = now + ticket.ttl
            self._ttl_timers.push(block.expires_at, block, self._entries)
        return block.version

    def abort_put(self, ticket_id: int, owner: Hashable | None = None) -> bool:
        """Free a pending value; False if the ticket was already committed, aborted or expired
        (or, when ``owner`` is given, belongs to another owner)."""
        self._expire(self._clock())
        ticket = self._tickets.get(ticket_id)
        if ticket is None or (owner is not None and ticket.owner != owner):
            self._end_expired(ticket_id, owner)
            return False
        self._drop_ticket(ticket)
        return True

    def _end_expired(self, ticket_id: int, owner: Hashable | None) -> None:
        """The owner of an expired ticket is done with its block (it committed or aborted too
        late): free it now."""
        ticket = self._expired_tickets.get(ticket_id)
        if ticket is not None and (owner is None or ticket.owner == owner):
            self._drop_ticket(ticket)

    def remove_keys(self, ns: str, keys: list[str | bytes], force: bool = True) -> list[int]:
        """Hide each key (as ``remove``): REMOVED, ABSENT, or LEASED when a lease holds its
        value and not ``force`` (then it stays)."""
        self._expire(self._clock())
        _check_ns(ns)
        out = []
        for key in [normalize_key(k) for k in keys]:
            block = self._live(ns, key)
            if block is None:
                out.append(ABSENT)
            elif block.leases and not force:
                out.append(LEASED)
            else:
                self._unlink(block)
                out.append(REMOVED)
        return out

    def remove_matching(self, ns: str, pattern: bytes | None, force: bool = True) -> int:
        """Hide every key of ``ns`` in which the regular expression ``pattern`` finds a match
        (every key when None), except leased ones unless ``force``; how many."""
        self._expire(self._clock())
        space = self._ns.get(_check_ns(ns))
        if space is None:
            return 0
        search = re.compile(pattern).search if pattern is not None else None
        victims = [b for k, b in space.entries.items()
                   if (search is None or search(k)) and (force or not b.leases)]
        for block in victims:
            self._unlink(block)
        return len(victims)

    def exists_keys(self, ns: str, keys: list[str | bytes]) -> list[bool]:
        """``exists`` of each key, in one call."""
        self._expire(self._clock())
        space = self._ns.get(_check_ns(ns))
        return [space is not None and normalize_key(k) in space.entries for k in keys]

    def _live(self, ns: str, key: bytes) -> _Block | None:
        space = self._ns.get(ns)
        return space.entries.get(key) if space is not None else None

    def remove_version(self, ns: str, key: str | bytes, version: int) -> bool:
        """Hide ``key`` if its live value is ``version`` (taking back one put); False otherwise."""
        self._expire(self._clock())
        space = self._ns.get(_check_ns(ns))
        block = space.entries.get(normalize_key(key)) if space is not None else None
        if block is None or block.version != version:
            return False
        self._unlink(block)
        return True

    # ---- reads ------------------------------------------------------------------------------

    def get(self, ns: str, key: str | bytes, lease_s: float | None = None,
            owner: Hashable | None = None) -> Lease:
        """Lease the current value of ``key`` (a hit bumps it in the LRU); KeyError on a miss."""
        now = self._clock()
        self._expire(now)
        _check_owner(owner)
        key, duration = normalize_key(key), self._lease_s(lease_s)
        lease = self._lease(self._ns.get(_check_ns(ns)), key, duration, owner, now)
        if lease is None:
            raise KeyError(key)
        return lease

    def batch_get(self, ns: str, keys: list[str | bytes], lease_s: float | None = None,
                  owner: Hashable | None = None, hold_s: float = 0.0,
                  release: Iterable[int] = ()) -> list[Lease | None]:
        """``get`` of each key, with None for a miss instead of KeyError. ``hold_s``: each lease
        outlives its release until that long after the get (Mooncake's read lease: removal and
        eviction stay blocked for a while after a read). ``release``: leases of ``owner`` to
        end first (see :meth:`release`)."""
        now = self._clock()
        if now >= self._soonest.at:  # _expire's own first test, inline: a get is the hot path
            self._expire(now)
        for lease_id in release:
            self._release(lease_id, owner, now)
        if type(ns) is not str:
            _check_ns(ns)
        if owner is not None:
            hash(owner)  # _check_owner, inline
        duration = self._default_lease_s if lease_s is None else self._lease_s(lease_s)
        if hold_s:
            duration = max(duration, self._lease_s(hold_s))  # a hold is bounded like a lease
        if len(keys) == 1:  # the common get: normalize_key's first test inline, no lists
            key = keys[0]
            if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
                key = normalize_key(key)
            return [self._lease(self._ns.get(ns), key, duration, owner, now, now + hold_s)]
        wanted = list(map(normalize_key, keys))  # validate all before granting any lease
        space, lease, hold_until = self._ns.get(ns), self._lease, now + hold_s
        return [lease(space, k, duration, owner, now, hold_until) for k in wanted]

    def release(self, lease_id: int, owner: Hashable | None = None) -> bool:
        """End a lease, freeing its block if it was the last holder of a hidden one.

        Returns False (and counts a stale release) if the lease is unknown or already ended, or
        (when ``owner`` is given) belongs to another owner.
        """
        now = self._clock()
        self._expire(now)
        return self._release(lease_id, owner, now)

    def _release(self, lease_id: int, owner: Hashable | None, now: float) -> bool:
        lease = self._leases.get(lease_id)
        if lease is None or (owner is not None and lease.owner != owner):
            self._counters["stale_releases"] += 1
            return False
        if lease.hold_until > now:  # a held read lease lasts its hold, then expires
            lease.expires_at = lease.hold_until
            self._arm(lease)
            return True
        self._end_lease(lease)
        return True

    def renew(self, lease_id: int, owner: Hashable | None = None,
              lease_s: float | None = None) -> float | None:
        """Extend a lease by ``lease_s`` (its holder still reads it); the new expiry, or None if
        the lease already ended (or belongs to another owner)."""
        now = self._clock()
        self._expire(now)
        lease = self._leases.get(lease_id)
        if lease is None or (owner is not None and lease.owner != owner):
            self._counters["stale_releases"] += 1
            return None
        lease.expires_at = now + self._lease_s(lease_s)
        self._arm(lease)
        return lease.expires_at

    def exists(self, ns: str, key: str | bytes) -> bool:
        """Whether ``key`` has a live value; takes no lease, bumps no LRU, counts no hit or miss."""
        self._expire(self._clock())
        space = self._ns.get(_check_ns(ns))
        return space is not None and normalize_key(key) in space.entries

    def lookup_prefix(self, ns: str, keys: list[str | bytes]) -> int:
        """How many leading ``keys`` have live values (``exists`` semantics), e.g. chunk_keys."""
        self._expire(self._clock())
        space = self._ns.get(_check_ns(ns))
        if space is None:
            return 0
        for n, key in enumerate(keys):
            if normalize_key(key) not in space.entries:
                return n
        return len(keys)

    # ---- removal, quotas, owners, expiry ----------------------------------------------------

    def remove(self, ns: str, key: str | bytes) -> bool:
        """Hide ``key`` at once (its block is freed when its last lease ends); False if absent."""
        self._expire(self._clock())
        space = self._ns.get(_check_ns(ns))
        block = space.entries.get(normalize_key(key)) if space is not None else None
        if block is None:
            return False
        self._unlink(block)
        return True

    def set_quota(self, ns: str, max_bytes: int | None) -> None:
        """Cap the pool bytes ``ns`` may hold (None lifts the cap); enforced from its next put."""
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes < 0):
            raise ValueError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
        space = self._namespace(_check_ns(ns))
        space.quota = max_bytes
        self._maybe_drop(space)

    def release_owner(self, owner: Hashable) -> int:
        """Drop every lease and pending put of ``owner`` (a client seen gone); returns how many.

        Its leases end now; its pending puts' blocks (expired ones too) are quarantined, not
        freed: a frozen writer may still write into them, so they wait for ``fence_owner``."""
        self._expire(self._clock())
        ids = self._owners.pop(owner, ())
        for record_id in ids:
            lease = self._leases.get(record_id)
            if lease is not None:
                self._end_lease(lease)
                continue
            ticket = self._tickets.pop(record_id, None) or self._expired_tickets.pop(record_id)
            self._quarantine.setdefault(owner, []).append(ticket.block)
            self._quarantined_bytes += ticket.block.nbytes
        return len(ids)

    def fence_owner(self, owner: Hashable) -> int:
        """``owner`` can no longer write into the pool (its process is gone, or its fence
        timeout passed): free the blocks ``release_owner`` quarantined; returns how many.
        Records it still holds are released first (a fence with no disconnect before it)."""
        if owner in self._owners:
            self.release_owner(owner)
        blocks = self._quarantine.pop(owner, ())
        for block in blocks:
            self._quarantined_bytes -= block.nbytes
            self._free(block)
        return len(blocks)

    def expire(self) -> int:
        """End due leases, pending puts and TTLs (cheap if none is due); return how many ended."""
        return self._expire(self._clock())

    def stats(self) -> dict[str, Any]:
        """Counters, occupancy and per-namespace bytes/entries/quota."""
        self._expire(self._clock())
        return {
            **self._counters,
            "entries": self._entries,
            "leases": len(self._leases),
            "pending_puts": len(self._tickets),
            "expired_puts_held": len(self._expired_tickets),
            "quarantined_blocks": sum(map(len, self._quarantine.values())),
            "quarantined_bytes": self._quarantined_bytes,
            "retired_blocks": self._retired,
            "pool_used": self._alloc.used,
            "pool_capacity": self._alloc.capacity,
            "namespaces": {name: {"bytes": s.used, "entries": len(s.entries), "quota": s.quota}
                           for name, s in self._ns.items()},
        }

    # ---- internals --------------------------------------------------------------------------

    def _expire(self, now: float) -> int:
        soonest = self._soonest
        if now < soonest.at:
            return 0
        n = 0
        self._arm_young()
        for lease in self._lease_timers.pop_due(now):  # entries at their lease's timer_at
            if self._leases.get(lease.id) is not lease:
                continue  # ended by a twin entry of this pass (two pushed at one deadline)
            if lease.expires_at > now:  # renewed: its entry moves to the new expiry, once
                if lease.timer_at != lease.expires_at:
                    lease.timer_at = lease.expires_at
                    self._lease_timers.push(lease.expires_at, lease, len(self._leases))
                continue
            self._end_lease(lease)
            self._counters["lease_expirations"] += 1
            n += 1
        for ticket in self._ticket_timers.pop_due(now):
            if ticket.owner is None:
                self._drop_ticket(ticket)
            else:  # its writer may still be writing: the block waits for it (see __init__)
                del self._tickets[ticket.id]
                self._expired_tickets[ticket.id] = ticket
            self._counters["put_expirations"] += 1
            n += 1
        for block in self._ttl_timers.pop_due(now):
            self._unlink(block)
            self._counters["expirations"] += 1
            n += 1
        soonest.at = min(self._lease_timers.head(), self._ticket_timers.head(), self._ttl_timers.head())
        return n

    def _lease_s(self, lease_s: float | None) -> float:
        if lease_s is None:
            return self._default_lease_s
        if _positive("lease_s", lease_s) > self._max_lease_s:
            raise ValueError(f"lease_s {lease_s} exceeds the server's max_lease_s "
                             f"{self._max_lease_s}: renew a lease instead of asking for a long one")
        return lease_s

    def _lease(self, space: _Namespace | None, key: bytes, duration: float, owner: Hashable | None,
               now: float, hold_until: float = 0.0) -> Lease | None:
        """A lease on ``key``'s value in ``space`` (the caller looked the namespace up)."""
        block = space.entries.get(key) if space is not None else None
        if block is None:
            self._counters["misses"] += 1
            return None
        self._counters["hits"] += 1
        space.entries.move_to_end(key)
        block.last_access = now
        block.leases += 1
        expires_at = now + duration
        lease_id = next(self._ids)
        record = _LeaseRec(lease_id, block, owner, expires_at, hold_until, expires_at)
        leases = self._leases
        leases[lease_id] = record
        if owner is not None:  # _own, inline
            ids = self._owners.get(owner)
            if ids is None:
                self._owners[owner] = {lease_id}
            else:
                ids.add(lease_id)
        # its timer entry waits in _young (most leases end before it is armed; see _arm_young)
        young = self._young
        young.append(record)
        if expires_at < self._soonest.at:
            self._soonest.at = expires_at
        if len(young) >= _YOUNG:
            self._arm_young()
        return Lease(lease_id, block.offset, block.size, block.version, expires_at, duration)

    def _plan(self, ns: str, need: int, others: bool = True, own_first: bool = True) -> list[_Block]:
        """Victims freeing ``need`` bytes if possible: own LRU and eligible others' LRU, in the
        order ``own_first`` says."""
        own = self._ns.get(ns)
        ordered: Iterable[_Block] = self._evictable(own, math.inf) if own is not None else ()
        if others:
            rivals = heapq.merge(*(self._evictable(s, math.inf if s.quota is None else s.used - s.quota)
                                   for s in self._ns.values()
                                   if s is not own and (s.quota is None or s.used > s.quota)),
                                 key=attrgetter("last_access"))
            ordered = itertools.chain(ordered, rivals) if own_first else itertools.chain(rivals, ordered)
        victims: list[_Block] = []
        freed = 0
        for block in ordered:
            if freed >= need:
                break
            victims.append(block)
            freed += block.nbytes
        return victims

    @staticmethod
    def _evictable(space: _Namespace, budget: float) -> Iterator[_Block]:
        """Unleased live blocks of ``space``, LRU first, until ``budget`` bytes are yielded."""
        taken = 0
        for block in space.entries.values():
            if taken >= budget:
                return
            if block.leases == 0:
                taken += block.nbytes
                yield block

    def _evict(self, victims: list[_Block]) -> None:
        for block in victims:
            self._unlink(block)
            self._counters["evictions"] += 1

    def _unlink(self, block: _Block) -> None:
        """Hide a live block; free it now unless leases hold it."""
        space = self._ns[block.ns]
        del space.entries[block.key]
        self._entries -= 1
        if block.leases:
            block.state = _RETIRED
            self._retired += 1
        else:
            self._free(block)

    def _free(self, block: _Block) -> None:
        if block.state == _RETIRED:
            self._retired -= 1
        if self._on_free is not None:  # (a pending block's entry holds its put's claim)
            self._on_free(block.offset)
        block.state = _FREED
        self._alloc.free(block.offset)
        space = self._ns[block.ns]
        space.used -= block.nbytes
        self._maybe_drop(space)

    def _arm_young(self) -> None:
        """Push the timer entries of the young leases still held (the others ended unarmed)."""
        young, leases, push = self._young, self._leases, self._lease_timers.push
        for lease in young:
            if leases.get(lease.id) is lease:
                push(lease.timer_at, lease, len(leases))
        young.clear()

    def _arm(self, lease: _LeaseRec) -> None:
        """The lease's expiry moved: a new timer entry only if it moved earlier than its live
        one (so renewing a lease any number of times keeps one live entry)."""
        if lease.expires_at < lease.timer_at:
            lease.timer_at = lease.expires_at
            self._lease_timers.push(lease.expires_at, lease, len(self._leases))

    def _end_lease(self, lease: _LeaseRec) -> None:
        del self._leases[lease.id]
        if lease.owner is not None:  # _disown, inline
            ids = self._owners.get(lease.owner)
            if ids is not None:
                ids.discard(lease.id)
        block = lease.block
        block.leases -= 1
        if block.leases == 0 and block.state == _RETIRED:
            self._free(block)

    def _drop_ticket(self, ticket: _Ticket) -> None:
        if self._tickets.pop(ticket.id, None) is None:
            del self._expired_tickets[ticket.id]
        self._disown(ticket.owner, ticket.id)
        self._free(ticket.block)

    def _namespace(self, ns: str) -> _Namespace:
        space = self._ns.get(ns)
        if space is None:
            space = self._ns[ns] = _Namespace(ns)
        return space

    def _maybe_drop(self, space: _Namespace) -> None:
        """Forget a namespace that holds nothing and has no quota, so metadata stays bounded."""
        if not space.entries and space.used == 0 and space.quota is None:
            del self._ns[space.name]

    def _own(self, owner: Hashable | None, record_id: int) -> None:
        if owner is not None:
            ids = self._owners.get(owner)
            if ids is None:  # not setdefault: that makes a set per lease to throw away
                self._owners[owner] = {record_id}
            else:
                ids.add(record_id)

    def _disown(self, owner: Hashable | None, record_id: int) -> None:
        ids = self._owners.get(owner) if owner is not None else None
        if ids is not None:
            ids.discard(record_id)
