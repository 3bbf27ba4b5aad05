"""The key index's pending puts: two-phase begin/commit/abort, their timeout, the claim hooks.

A pending block is invisible until its commit publishes it. A ticket not committed in time
expires; its block is freed then, or, for an owner (who may still be writing into it), when
that owner commits or aborts, or is fenced after it departs (kvservice.owners).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable

import msgspec

from kvservice.keymap import LIVE, BlockRec, KeyMap, check_ns, check_owner, positive
from kvservice.keys import normalize_key
from kvservice.timers import Soonest, Timers


class PutTicket(msgspec.Struct, frozen=True, array_like=True):
    """Where the writer copies a pending value; ``commit_put(ticket_id)`` publishes it. (On
    the wire, as every kvservice message, an array: no field names to encode and match.)"""

    ticket_id: int
    offset: int
    size: int


class Ticket:
    """A pending put: its block, its writer and what its commit does."""

    __slots__ = ("id", "block", "owner", "ttl", "if_absent")

    def __init__(self, id: int, block: BlockRec, owner: Hashable | None, ttl: float | None,
                 if_absent: bool = False) -> None:
        self.id = id
        self.block = block
        self.owner = owner
        self.ttl = ttl
        self.if_absent = if_absent


class Puts:
    """The pending puts of one index, by ticket id, and their timeouts."""

    def __init__(self, keys: KeyMap, owners: dict[Hashable, set[int]], ids: itertools.count[int],
                 versions: itertools.count[int], counters: dict[str, int], soonest: Soonest,
                 put_timeout_s: float, on_publish: Callable[[int, int], None] | None,
                 on_claim: Callable[[int, int], None] | None) -> None:
        self._keys = keys
        self._owners = owners
        self._ids = ids
        self._versions = versions
        self._counters = counters
        self._put_timeout_s = put_timeout_s
        self._on_publish = on_publish
        self._on_claim = on_claim
        self.tickets: dict[int, Ticket] = {}
        #: expired tickets whose owner is still connected: it holds a writable view of the
        #: block and may still be writing, so the block is freed only when it commits or
        #: aborts, or is quarantined when it departs (handing it to another put meanwhile
        #: would let it overwrite that value)
        self.expired: dict[int, Ticket] = {}
        self.timers: Timers[Ticket] = Timers(lambda rec, at: rec.id in self.tickets, soonest)

    def begin(self, ns: str, key: str | bytes, size: int, ttl: float | None,
              owner: Hashable | None, if_absent: bool, now: float) -> PutTicket | None:
        """Reserve a block for ``key``'s next value (see ``KVIndex.begin_put``)."""
        check_ns(ns)
        key = normalize_key(key)
        if if_absent and self._keys.live(ns, key) is not None:
            return None
        nbytes = self._keys.alloc.rounded(size)
        if ttl is not None:
            positive("ttl", ttl)
        check_owner(owner)
        offset = self._keys.reserve(ns, size, nbytes)
        ticket = Ticket(next(self._ids), BlockRec(ns, key, offset, size, nbytes), owner, ttl, if_absent)
        if self._on_claim is not None:
            self._on_claim(offset, ticket.id)
        self.tickets[ticket.id] = ticket
        if owner is not None:
            ids = self._owners.get(owner)
            if ids is None:  # not setdefault: that makes a set per lease to throw away
                self._owners[owner] = {ticket.id}
            else:
                ids.add(ticket.id)
        self.timers.push(now + self._put_timeout_s, ticket, len(self.tickets))
        return PutTicket(ticket.id, offset, size)

    def commit(self, ticket_id: int, owner: Hashable | None, now: float) -> int:
        """Publish a pending value; its version, 0 for an if_absent put that lost (see
        ``KVIndex.commit_put``)."""
        ticket = self.tickets.get(ticket_id)
        if ticket is None or (owner is not None and ticket.owner != owner):
            self._end_expired(ticket_id, owner)
            raise KeyError(f"unknown or expired put ticket {ticket_id!r}")
        block = ticket.block
        old = self._keys.spaces[block.ns].entries.get(block.key)
        if old is not None and ticket.if_absent:
            self.drop(ticket)
            return 0
        del self.tickets[ticket_id]
        self._disown(ticket)
        if old is not None:
            self._keys.unlink(old)
        block.state = LIVE
        block.version = next(self._versions)
        block.created = block.last_access = now
        if self._on_publish is not None:
            self._on_publish(block.offset, block.version)
        self._keys.insert(block, ticket.ttl, now)
        return block.version

    def abort(self, ticket_id: int, owner: Hashable | None) -> bool:
        """Free a pending value; False if there is none of ``owner``'s by that id."""
        ticket = self.tickets.get(ticket_id)
        if ticket is None or (owner is not None and ticket.owner != owner):
            self._end_expired(ticket_id, owner)
            return False
        self.drop(ticket)
        return True

    def take(self, ticket_id: int) -> Ticket:
        """Forget ticket ``ticket_id`` (pending or expired) of a departed owner; its block is
        left for the caller to quarantine."""
        return self.tickets.pop(ticket_id, None) or self.expired.pop(ticket_id)

    def expire_due(self, now: float) -> int:
        """Time out the pending puts due; how many."""
        due = self.timers.pop_due(now)
        for ticket in due:
            if ticket.owner is None:
                self.drop(ticket)
            else:  # its writer may still be writing: the block waits for it (see self.expired)
                del self.tickets[ticket.id]
                self.expired[ticket.id] = ticket
            self._counters["put_expirations"] += 1
        return len(due)

    def drop(self, ticket: Ticket) -> None:
        """End a ticket (pending or expired) and free its block."""
        if self.tickets.pop(ticket.id, None) is None:
            del self.expired[ticket.id]
        self._disown(ticket)
        self._keys.free(ticket.block)

    def _end_expired(self, ticket_id: int, owner: Hashable | None) -> None:
        """The owner of an expired ticket is done with its block (it committed or aborted too
        late): free it now."""
        ticket = self.expired.get(ticket_id)
        if ticket is not None and (owner is None or ticket.owner == owner):
            self.drop(ticket)

    def _disown(self, ticket: Ticket) -> None:
        ids = self._owners.get(ticket.owner) if ticket.owner is not None else None
        if ids is not None:
            ids.discard(ticket.id)
