"""The key index's read leases: granting (the get hot path), release, renewal, holds, expiry.

A leased block is never freed: a lease pins it (``BlockRec.leases``), and a value hidden while
leased is retired, then freed by the last lease's end (see kvservice.index).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Sequence

import msgspec

from kvservice.keymap import RETIRED, BlockRec, KeyMap, Namespace, check_ns, check_owner, positive
from kvservice.keys import MAX_KEY_BYTES, normalize_key
from kvservice.timers import Soonest, Timers

#: young leases (made, their timer entry not yet pushed) that make _lease arm them all
_YOUNG = 64


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


class LeaseRec(msgspec.Struct, gc=False):
    """One lease (a Struct: made once per get, in C; gc=False, as nothing it holds leads back
    to it)."""

    id: int
    block: BlockRec
    owner: Hashable | None
    expires_at: float
    hold_until: float = 0.0
    #: the deadline of its one live timer entry (at or before ``expires_at``: a renewal that
    #: moves the expiry later adds no entry; the entry re-arms itself when it comes due)
    timer_at: float = math.inf


class Leases:
    """The leases of one index, by id, and their expiry timers.

    Shares the index's state it reads on the hot path by reference (the key map's namespace
    dict, the owner records, the id sequence, the counters), so a get costs no extra lookups;
    ``expire(now)`` is the index's whole expiry pass, run by a get when something is due.
    """

    def __init__(self, keys: KeyMap, owners: dict[Hashable, set[int]], ids: itertools.count[int],
                 counters: dict[str, int], soonest: Soonest, clock: Callable[[], float],
                 expire: Callable[[float], int], default_lease_s: float,
                 max_lease_s: float) -> None:
        self._ns = keys.spaces
        self._free = keys.free
        self._owners = owners
        self._ids = ids
        self._counters = counters
        self._soonest = soonest
        self._clock = clock
        self._expire = expire
        self._default_lease_s = default_lease_s
        self._max_lease_s = max_lease_s
        self._by_id: dict[int, LeaseRec] = {}
        self.timers: Timers[LeaseRec] = Timers(
            lambda rec, at: rec.timer_at == at and self._by_id.get(rec.id) is rec, soonest)
        #: leases made since their timer entries were last armed: pushing each onto the heap
        #: at its get cost more than the get's lookup; most are released before arm_young runs
        self.young: list[LeaseRec] = []

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, ns: str, key: str | bytes, lease_s: float | None, owner: Hashable | None,
            now: float) -> Lease:
        """A lease on ``key``'s value; KeyError on a miss."""
        check_owner(owner)
        key, duration = normalize_key(key), self.lease_s(lease_s)
        lease = self._lease(self._ns.get(check_ns(ns)), key, duration, owner, now)
        if lease is None:
            raise KeyError(key)
        return lease

    def batch_get(self, ns: str, keys: Sequence[str | bytes], lease_s: float | None = None,
                  owner: Hashable | None = None, hold_s: float = 0.0,
                  release: Iterable[int] = ()) -> list[Lease | None]:
        """``get`` of each key, with None for a miss instead of KeyError. ``hold_s``: each lease
        outlives its release until that long after the get (Mooncake's read lease: removal and
        eviction stay blocked for a while after a read). ``release``: leases of ``owner`` to
        end first (see ``KVIndex.release``)."""
        now = self._clock()
        if now >= self._soonest.at:  # the expiry pass's own first test, inline: the hot path
            self._expire(now)
        for lease_id in release:
            self.release(lease_id, owner, now)
        if type(ns) is not str:
            check_ns(ns)
        if owner is not None:
            hash(owner)  # check_owner, inline
        duration = self._default_lease_s if lease_s is None else self.lease_s(lease_s)
        if hold_s:
            duration = max(duration, self.lease_s(hold_s))  # a hold is bounded like a lease
        if len(keys) == 1:  # the common get: normalize_key's first test inline, no lists
            key = keys[0]
            if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
                key = normalize_key(key)
            return [self._lease(self._ns.get(ns), key, duration, owner, now, now + hold_s)]
        wanted = list(map(normalize_key, keys))  # validate all before granting any lease
        space, lease, hold_until = self._ns.get(ns), self._lease, now + hold_s
        return [lease(space, k, duration, owner, now, hold_until) for k in wanted]

    def release(self, lease_id: int, owner: Hashable | None, now: float) -> bool:
        """End a lease (or, if held, let it run to its hold); False for a stale release."""
        lease = self._by_id.get(lease_id)
        if lease is None or (owner is not None and lease.owner != owner):
            self._counters["stale_releases"] += 1
            return False
        if lease.hold_until > now:  # a held read lease lasts its hold, then expires
            lease.expires_at = lease.hold_until
            self._arm(lease)
            return True
        self._end(lease)
        return True

    def renew(self, lease_id: int, owner: Hashable | None, lease_s: float | None,
              now: float) -> float | None:
        """Extend a lease; its new expiry, or None (a stale release) if it already ended."""
        lease = self._by_id.get(lease_id)
        if lease is None or (owner is not None and lease.owner != owner):
            self._counters["stale_releases"] += 1
            return None
        lease.expires_at = now + self.lease_s(lease_s)
        self._arm(lease)
        return lease.expires_at

    def end_held(self, lease_id: int) -> bool:
        """End lease ``lease_id`` if it is held (its owner departed); whether it was."""
        lease = self._by_id.get(lease_id)
        if lease is None:
            return False
        self._end(lease)
        return True

    def expire_due(self, now: float) -> int:
        """End the leases whose expiry has come; how many."""
        n = 0
        self._arm_young()
        for lease in self.timers.pop_due(now):  # entries at their lease's timer_at
            if self._by_id.get(lease.id) is not lease:
                continue  # ended by a twin entry of this pass (two pushed at one deadline)
            if lease.expires_at > now:  # renewed: its entry moves to the new expiry, once
                if lease.timer_at != lease.expires_at:
                    lease.timer_at = lease.expires_at
                    self.timers.push(lease.expires_at, lease, len(self._by_id))
                continue
            self._end(lease)
            self._counters["lease_expirations"] += 1
            n += 1
        return n

    def lease_s(self, lease_s: float | None) -> float:
        """A lease's duration: the default for None, else ``lease_s`` checked against the max."""
        if lease_s is None:
            return self._default_lease_s
        if positive("lease_s", lease_s) > self._max_lease_s:
            raise ValueError(f"lease_s {lease_s} exceeds the server's max_lease_s "
                             f"{self._max_lease_s}: renew a lease instead of asking for a long one")
        return lease_s

    def _lease(self, space: Namespace | None, key: bytes, duration: float, owner: Hashable | None,
               now: float, hold_until: float = 0.0) -> Lease | None:
        """A lease on ``key``'s value in ``space`` (the caller looked the namespace up)."""
        if space is None or (block := space.entries.get(key)) is None:
            self._counters["misses"] += 1
            return None
        self._counters["hits"] += 1
        space.entries.move_to_end(key)
        block.last_access = now
        block.leases += 1
        expires_at = now + duration
        lease_id = next(self._ids)
        record = LeaseRec(lease_id, block, owner, expires_at, hold_until, expires_at)
        self._by_id[lease_id] = record
        if owner is not None:  # own, inline
            ids = self._owners.get(owner)
            if ids is None:
                self._owners[owner] = {lease_id}
            else:
                ids.add(lease_id)
        # its timer entry waits in young (most leases end before it is armed; see _arm_young)
        young = self.young
        young.append(record)
        if expires_at < self._soonest.at:
            self._soonest.at = expires_at
        if len(young) >= _YOUNG:
            self._arm_young()
        return Lease(lease_id, block.offset, block.size, block.version, expires_at, duration)

    def _arm_young(self) -> None:
        """Push the timer entries of the young leases still held (the others ended unarmed)."""
        young, leases, push = self.young, self._by_id, self.timers.push
        for lease in young:
            if leases.get(lease.id) is lease:
                push(lease.timer_at, lease, len(leases))
        young.clear()

    def _arm(self, lease: LeaseRec) -> None:
        """The lease's expiry moved: a new timer entry only if it moved earlier than its live
        one (so renewing a lease any number of times keeps one live entry)."""
        if lease.expires_at < lease.timer_at:
            lease.timer_at = lease.expires_at
            self.timers.push(lease.expires_at, lease, len(self._by_id))

    def _end(self, lease: LeaseRec) -> None:
        del self._by_id[lease.id]
        if lease.owner is not None:  # disown, inline
            ids = self._owners.get(lease.owner)
            if ids is not None:
                ids.discard(lease.id)
        block = lease.block
        block.leases -= 1
        if block.leases == 0 and block.state == RETIRED:
            self._free(block)
