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

Eviction and fairness: see kvservice.keymap (victims are unleased live blocks, least recently
used first; a quota is a namespace's guaranteed share and its ceiling).

The index is composed of one part per concern, each in its own module: the key map with its
LRU, eviction, quotas and TTLs (``KeyMap``), leases (``Leases``), pending puts (``Puts``),
and owners with their quarantine (``Owners``); expiry and stats span them here.
"""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Literal, overload

from cxlrpc.allocator import PoolAllocator
from kvservice.keymap import ABSENT, LEASED, REMOVED, KeyMap, PoolFull, QuotaExceeded, positive
from kvservice.leases import Lease, Leases
from kvservice.owners import Owners
from kvservice.puts import Puts, PutTicket
from kvservice.timers import Soonest

__all__ = ["KVIndex", "Lease", "PutTicket", "PoolFull", "QuotaExceeded", "REMOVED", "ABSENT",
           "LEASED"]


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
                 on_claim: Callable[[int, int], None] | None = None,
                 on_reclaim: Callable[[int, int], None] | None = None) -> None:
        """``on_publish(offset, version)`` runs when a value becomes live, ``on_free(offset)``
        before its block can be handed out again, ``on_claim(offset, ticket_id)`` when a put
        reserves it (the server marks the pool with them, so readers can tell reused bytes
        and writers a block no longer theirs); ``on_reclaim(offset, nbytes)`` when a fenced
        owner's quarantined block is about to be freed (the server writes back the lines its
        dead writer may have left dirty). Lease and ticket ids count up from
        ``first_id``, value versions from ``first_version`` (a server taking over a pool's
        memory starts both where its predecessor's cannot be: a reader still holding an old
        block must not match)."""
        if not 0 < first_version < 1 << 63 or not 0 < first_id <= 1 << 62:
            raise ValueError("first_version must be in [1, 2**63), first_id in [1, 2**62]")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError("need 0 < low_watermark <= high_watermark <= 1")
        positive("max_lease_s", max_lease_s)
        if not math.isfinite(max_lease_s):
            raise ValueError("max_lease_s must be finite: a lease must end if its holder vanishes")
        default_lease_s = min(positive("default_lease_s", default_lease_s), max_lease_s)
        positive("put_timeout_s", put_timeout_s)
        self._clock = clock
        self._counters = dict.fromkeys(
            ("hits", "misses", "evictions", "expirations", "lease_expirations",
             "put_expirations", "stale_releases"), 0)
        self._soonest = Soonest()
        ids = itertools.count(first_id)  # lease and ticket ids share one sequence
        owners: dict[Hashable, set[int]] = {}
        self._keys = KeyMap(allocator, high_watermark, low_watermark, self._counters,
                            self._soonest, on_free)
        self._leases = Leases(self._keys, owners, ids, self._counters, self._soonest, clock,
                              self._expire, default_lease_s, max_lease_s)
        self._puts = Puts(self._keys, owners, ids, itertools.count(first_version), self._counters,
                          self._soonest, put_timeout_s, on_publish, on_claim)
        self._owners = Owners(owners, self._keys, self._leases, self._puts, on_reclaim)
        #: ``batch_get`` (the server's get): the leases' own method, bound here so the hot path
        #: has no forwarding call
        self.batch_get = self._leases.batch_get

    # ---- puts -------------------------------------------------------------------------------

    @overload
    def begin_put(self, ns: str, key: str | bytes, size: int, ttl: float | None = None,
                  owner: Hashable | None = None, if_absent: Literal[False] = False) -> PutTicket: ...
    @overload
    def begin_put(self, ns: str, key: str | bytes, size: int, ttl: float | None = None,
                  owner: Hashable | None = None, if_absent: bool = False) -> PutTicket | None: ...
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
        return self._puts.begin(ns, key, size, ttl, owner, if_absent, now)

    def commit_put(self, ticket_id: int, owner: Hashable | None = None) -> int:
        """Publish a pending value, atomically replacing the key's old one; return its version
        (0 for an ``if_absent`` put whose key got a value meanwhile: nothing published).

        Raises KeyError if the ticket is unknown, committed, aborted or expired, or (when
        ``owner`` is given) belongs to another owner.
        """
        now = self._clock()
        self._expire(now)
        return self._puts.commit(ticket_id, owner, now)

    def abort_put(self, ticket_id: int, owner: Hashable | None = None) -> bool:
        """Free a pending value; False if the ticket was already committed, aborted or expired
        (or, when ``owner`` is given, belongs to another owner)."""
        self._expire(self._clock())
        return self._puts.abort(ticket_id, owner)

    # ---- reads ------------------------------------------------------------------------------

    def get(self, ns: str, key: str | bytes, lease_s: float | None = None,
            owner: Hashable | None = None) -> Lease:
        """Lease the current value of ``key`` (a hit bumps it in the LRU); KeyError on a miss."""
        now = self._clock()
        self._expire(now)
        return self._leases.get(ns, key, lease_s, owner, now)

    def release(self, lease_id: int, owner: Hashable | None = None) -> bool:
        """End a lease, freeing its block if it was the last holder of a hidden one.

        Returns False (and counts a stale release) if the lease is unknown or already ended, or
        (when ``owner`` is given) belongs to another owner.
        """
        now = self._clock()
        self._expire(now)
        return self._leases.release(lease_id, owner, now)

    def renew(self, lease_id: int, owner: Hashable | None = None,
              lease_s: float | None = None) -> float | None:
        """Extend a lease by ``lease_s`` (its holder still reads it); the new expiry, or None if
        the lease already ended (or belongs to another owner)."""
        now = self._clock()
        self._expire(now)
        return self._leases.renew(lease_id, owner, lease_s, now)

    def exists(self, ns: str, key: str | bytes) -> bool:
        """Whether ``key`` has a live value; takes no lease, bumps no LRU, counts no hit or miss."""
        self._expire(self._clock())
        return self._keys.exists(ns, key)

    def exists_keys(self, ns: str, keys: Iterable[str | bytes]) -> list[bool]:
        """``exists`` of each key, in one call."""
        self._expire(self._clock())
        return self._keys.exists_keys(ns, keys)

    def lookup_prefix(self, ns: str, keys: Sequence[str | bytes]) -> int:
        """How many leading ``keys`` have live values (``exists`` semantics), e.g. chunk_keys."""
        self._expire(self._clock())
        return self._keys.lookup_prefix(ns, keys)

    # ---- removal, quotas, owners, expiry ----------------------------------------------------

    def remove(self, ns: str, key: str | bytes) -> bool:
        """Hide ``key`` at once (its block is freed when its last lease ends); False if absent."""
        self._expire(self._clock())
        return self._keys.remove(ns, key)

    def remove_version(self, ns: str, key: str | bytes, version: int) -> bool:
        """Hide ``key`` if its live value is ``version`` (taking back one put); False otherwise."""
        self._expire(self._clock())
        return self._keys.remove(ns, key, version)

    def remove_keys(self, ns: str, keys: Iterable[str | bytes], force: bool = True) -> list[int]:
        """Hide each key (as ``remove``): REMOVED, ABSENT, or LEASED when a lease holds its
        value and not ``force`` (then it stays)."""
        self._expire(self._clock())
        return self._keys.remove_keys(ns, keys, force)

    def remove_matching(self, ns: str, pattern: bytes | None, force: bool = True) -> int:
        """Hide every key of ``ns`` in which the regular expression ``pattern`` finds a match
        (every key when None), except leased ones unless ``force``; how many."""
        self._expire(self._clock())
        return self._keys.remove_matching(ns, pattern, force)

    def set_quota(self, ns: str, max_bytes: int | None) -> None:
        """Cap the pool bytes ``ns`` may hold (None lifts the cap); enforced from its next put."""
        self._keys.set_quota(ns, max_bytes)

    def release_owner(self, owner: Hashable) -> int:
        """Drop every lease and pending put of ``owner`` (a client seen gone); returns how many.

        Its leases end now; its pending puts' blocks (expired ones too) are quarantined, not
        freed: a frozen writer may still write into them, so they wait for ``fence_owner``."""
        self._expire(self._clock())
        return self._owners.release(owner)

    def fence_owner(self, owner: Hashable) -> int:
        """``owner`` can no longer write into the pool (its process is gone, or its fence
        timeout passed): free the blocks ``release_owner`` quarantined; returns how many.
        Records it still holds are released first (a fence with no disconnect before it)."""
        if owner in self._owners.records:
            self.release_owner(owner)
        return self._owners.fence(owner)

    def expire(self) -> int:
        """End due leases, pending puts and TTLs (cheap if none is due); return how many ended."""
        return self._expire(self._clock())

    def stats(self) -> dict[str, Any]:
        """Counters, occupancy and per-namespace bytes/entries/quota."""
        self._expire(self._clock())
        keys = self._keys
        return {
            **self._counters,
            "entries": keys.entries,
            "leases": len(self._leases),
            "pending_puts": len(self._puts.tickets),
            "expired_puts_held": len(self._puts.expired),
            "quarantined_blocks": self._owners.quarantined_blocks(),
            "quarantined_bytes": self._owners.quarantined_bytes,
            "retired_blocks": keys.retired,
            "pool_used": keys.alloc.used,
            "pool_capacity": keys.alloc.capacity,
            "namespaces": keys.namespace_stats(),
        }

    def _expire(self, now: float) -> int:
        """The expiry pass over leases, pending puts and TTLs, skipped while none is due."""
        soonest = self._soonest
        if now < soonest.at:
            return 0
        n = self._leases.expire_due(now) + self._puts.expire_due(now) + self._keys.expire_due(now)
        soonest.at = min(self._leases.timers.head(), self._puts.timers.head(),
                         self._keys.ttl_timers.head())
        return n
