"""KVClient (asyncio) and SyncKVClient (blocking): metadata over cxlrpc, bytes through the pool.

Each operation is written once, as a generator that yields the RPCs it needs (``_Call``) and
does the memory copies between them; each client drives those generators its own way.

Lease releases are queued, not sent: gets and puts carry the queued ones (the server ends them
before serving the request), and any other call is preceded by a one-way message of them. So
the server sees a release before the client's next request, as if it had been sent alone (but
for a put of the asyncio client, sent from a task of its own: a concurrent task's request may
go first, which only delays the release).
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Mapping
from typing import Any, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

import cxlrpc
from kvservice import wire as w
from kvservice.keys import chunk_keys, normalize_key
from kvservice.pool import Block, PendingPut, Pool, as_bytes

Key = str | bytes
#: what a batch put takes (a dict[str, ...] is a Mapping[Key, ...] to no type checker)
Items = Mapping[str, Any] | Mapping[bytes, Any] | Mapping[Key, Any]
R = TypeVar("R")
Tokens = Iterable[int] | npt.NDArray[np.integer[Any]]

#: Queued releases that go out at once, in a message of their own, rather than wait for the
#: next request (and the most one request carries): a bound on the request's size.
_MAX_RELEASES = 64
#: How long a queued release waits for a request to ride on before it is sent on its own.
_RELEASE_DELAY_S = 0.0005


class KeyNotFound(KeyError, cxlrpc.NotFound):
    """The key has no live value (a KeyError, and the RPC status NOT_FOUND)."""

    def __init__(self, key: Key) -> None:
        cxlrpc.NotFound.__init__(self, f"no such key {key!r}")
        self.args = (key,)


class _Call(NamedTuple):
    """One RPC a generator needs. ``undo(result)`` names the one-way call that takes back what
    the RPC created on the server, should its caller be cancelled while it is in flight."""

    method: str
    arg: Any = None
    response_type: Any = None
    undo: Callable[[Any], "_Call"] | None = None


#: an operation: yields the RPCs it needs, is sent their results, returns an R
_Steps = Generator[_Call, Any, R]
_LEASES = list[w.Lease | None]  # what a get returns


def _single(call: _Call) -> _Steps[Any]:
    return (yield call)


def _abort(tickets: list[w.PutTicket]) -> _Call:
    """Undo of a begin: free the reservations it made."""
    return _Call("abort", w.Tickets([t.ticket_id for t in tickets if t.ticket_id]))


def _take(queued: deque[int]) -> list[int]:
    """Up to _MAX_RELEASES queued lease ids, oldest first. Pops one at a time, so an id queued
    meanwhile (by the collector ending a block, or another thread) is never lost."""
    ids: list[int] = []
    try:
        while queued and len(ids) < _MAX_RELEASES:
            ids.append(queued.popleft())
    except IndexError:  # another thread took the last ones
        pass
    return ids


class _Ops:
    """The operations, as RPC-yielding generators over a mapped pool."""

    def __init__(self, rpc: Any, hello: w.Hello, pool: Pool) -> None:
        self.rpc = rpc
        self.pool = pool
        self.inline_limit = hello.inline_limit
        self._hello = hello  # what the server whose pool we map said
        self._old_pools: list[Pool] = []  # of servers that restarted: blocks may still read them
        self._released: deque[int] = deque()  # lease ids to release, not yet sent
        self._closed = False
        #: begin_puts not yet committed or aborted (memory without coherence: see _give_back)
        self._pending: set[PendingPut] = set()

    @staticmethod
    def _refused(exc: BaseException) -> bool:
        """Whether ``exc`` is a server refusing a connection that has not said hello to it:
        cxlrpc reconnected us to a restarted server, whose pool we do not map yet."""
        return isinstance(exc, cxlrpc.FailedPrecondition) and exc.message == w.NOT_GREETED

    def _adopt(self, hello: w.Hello) -> None:
        """Map the pool a restarted server advertised (unless we map it already). Leases of
        the old server ended with it; blocks still held keep reading the old mapping."""
        if hello == self._hello:
            return
        pool = Pool.open(hello.pool_url, hello.pool_size, hello.epoch, hello.alignment)
        self._old_pools.append(self.pool)
        self.pool, self._hello = pool, hello
        self.inline_limit = hello.inline_limit
        self._released.clear()

    def _give_back(self) -> None:
        """Before detaching, which frees the blocks of puts still pending: write back what
        was written into them (memory without coherence: Pool.given_back)."""
        for pending in tuple(self._pending):
            pending._abandon()

    def _close_pools(self) -> None:
        """Unmap the pool, and those of servers that restarted."""
        for pool in self._old_pools:
            pool.close()
        self._old_pools.clear()
        self.pool.close()

    @staticmethod
    def _restarted() -> cxlrpc.Unavailable:
        return cxlrpc.Unavailable("the KV server restarted during this operation, which did not "
                                  "complete; nothing of it was kept: retry it")

    def _put(self, items: Items, ns: str, ttl: float | None,
             if_absent: bool = False) -> _Steps[list[bool]]:
        """Store the items; whether each was stored (False: ``if_absent`` and the key had a value)."""
        keys = [normalize_key(k) for k in items]
        # memoryviews (Inline declares bytes, what the server decodes them as)
        datas: list[Any] = [as_bytes(v) for v in items.values()]
        if not all(datas):
            raise ValueError("empty values are not stored")
        if sum(map(len, datas)) <= self.inline_limit:
            versions = yield _Call("inline", w.Inline(ns, keys, datas, ttl, if_absent, self._carry()),
                                   list[int], lambda versions: _Call("undo", w.Undo(ns, keys, versions)))
            return [v != 0 for v in versions]
        tickets = yield _Call("begin", w.Begin(ns, keys, [len(d) for d in datas], ttl, if_absent,
                                               self._carry()), list[w.PutTicket], _abort)
        todo = [(key, ticket, data) for key, ticket, data in zip(keys, tickets, datas) if ticket.ticket_id]
        if not todo:
            return [False] * len(keys)
        ids = [ticket.ticket_id for _, ticket, _ in todo]
        try:
            for _, ticket, data in todo:
                self.pool.write(ticket.offset, data, ticket.ticket_id)
        except BaseException:
            for _, ticket, _ in todo:  # what the copies wrote, before the abort frees it
                self.pool.given_back(ticket.offset, ticket.size)
            yield _Call("abort", w.Tickets(ids))
            raise
        written = [key for key, _, _ in todo]
        versions = yield _Call("commit", w.Tickets(ids), list[int],
                               lambda versions: _Call("undo", w.Undo(ns, written, versions)))
        stored = dict(zip(written, versions))
        return [bool(stored.get(key)) for key in keys]

    def _remove_keys(self, keys: Iterable[Key], ns: str, force: bool) -> _Steps[list[int]]:
        removed: list[int] = yield _Call("remove_keys", w.RemoveKeys(ns, [normalize_key(k) for k in keys], force))
        return removed

    def _remove_matching(self, pattern: str | None, ns: str, force: bool) -> _Steps[int]:
        removed: int = yield _Call("remove_matching", w.RemoveMatching(ns, pattern, force))
        return removed

    def _exists_keys(self, keys: Iterable[Key], ns: str) -> _Steps[list[bool]]:
        present: list[bool] = yield _Call("exists_keys", w.Keys(ns, [normalize_key(k) for k in keys]))
        return present

    def _lookup_keys(self, keys: Iterable[Key], ns: str) -> _Steps[int]:
        present: int = yield _Call("lookup_prefix", w.Keys(ns, [normalize_key(k) for k in keys]))
        return present

    def _begin_put(self, key: Key, size: int, ns: str, ttl: float | None,
                   driver: Any) -> _Steps[PendingPut]:
        (ticket,) = yield _Call("begin", w.Begin(ns, [normalize_key(key)], [size], ttl,
                                                 release=self._carry()), list[w.PutTicket], _abort)
        ticket_id = ticket.ticket_id
        ids = w.Tickets([ticket_id])
        pool, offset, size = self.pool, ticket.offset, ticket.size
        return PendingPut(pool.writable(offset, size),
                          lambda: driver(_single(_Call("commit", ids))),
                          lambda: driver(_single(_Call("abort", ids))),
                          lambda: pool.written(offset, size),
                          lambda: pool.claimed(offset, ticket_id),
                          self._pending if pool.region.mem.flushing else None,
                          lambda: pool.given_back(offset, size))

    def _get(self, keys: Iterable[Key], ns: str, lease_s: float | None,
             hold_s: float = 0.0) -> _Steps[list[Block | None]]:
        leases = yield _Call("get", w.Get(ns, [normalize_key(k) for k in keys], lease_s, hold_s,
                                          self._carry()), _LEASES)
        return self._blocks(leases)

    def _blocks(self, leases: list[w.Lease | None]) -> list[Block | None]:
        """A block per lease (None for a miss); on failure every lease taken is ended."""
        blocks: list[Block | None] = []
        try:
            for lease in leases:
                blocks.append(None if lease is None else self._block(lease))
        except BaseException:
            for lease in leases[len(blocks):]:
                if lease is not None:
                    self._release(lease.lease_id)
            for block in blocks:
                if block is not None:
                    block.release()
            raise
        return blocks

    def _block(self, lease: w.Lease) -> Block:
        return self.pool.leased(lease.offset, lease.size, lease.version, self, lease.lease_id)

    def _release(self, lease_id: int, collected: bool = False) -> None:
        """Queue the end of a lease: a block's release, or its collection (``collected``: the
        collector may run inside one of our pushes, so nothing may be pushed from there)."""
        raise NotImplementedError

    def _queued(self) -> None:
        """Releases were queued: send them if they must not wait for the next request (never
        called from the collector)."""
        raise NotImplementedError

    def _flush(self) -> None:
        """Send every queued release now, as one-way messages."""
        raise NotImplementedError

    def _carry(self) -> w.Release | None:
        """The queued releases, taken to ride on the request being built."""
        queued = self._released
        if not queued:
            return None
        if len(queued) == 1:  # the common case: the block of the previous get
            try:
                return w.Release([queued.popleft()])
            except IndexError:  # another thread took it
                return None
        ids = _take(queued)
        return w.Release(ids) if ids else None

    def _unsent(self, arg: Any, exc: BaseException | None) -> None:
        """A request failed (``exc``; None: cancelled or interrupted): queue the releases it
        carried again, as the server may not have seen them (it ignores a repeated one as
        stale). Not after a lost connection: the server ended that connection's leases."""
        release = getattr(arg, "release", None)  # the field of the requests that carry them
        if release is not None and not isinstance(exc, cxlrpc.Unavailable) and not self._closed:
            self._released.extend(release.ids)
            self._queued()

    @staticmethod
    def _one(key: Key, blocks: list[Block | None]) -> Block:
        if blocks[0] is None:
            raise KeyNotFound(key)
        return blocks[0]

    @staticmethod
    def _copy_into(block: Block, out: Any) -> int:
        with block:
            return block.copy_into(out)

    def _key_call(self, method: str, key: Key, ns: str) -> _Steps[bool]:
        answer: bool = yield _Call(method, w.Key(ns, normalize_key(key)))
        return answer

    def _lookup_prefix(self, token_ids: Tokens, chunk_size: int, ns: str) -> _Steps[int]:
        keys = chunk_keys(token_ids, chunk_size, ns)
        if not keys:
            return 0
        present: int = yield _Call("lookup_prefix", w.Keys(ns, keys))
        return present

    def _stats(self, namespace: str | None) -> _Steps[dict[str, Any]]:
        stats: dict[str, Any] = yield _Call("stats", namespace)
        return stats


class KVClient(_Ops):
    """asyncio client: ``async with KVClient.connect("shm://kv") as kv: await kv.put(k, v)``.

    A block's release (its ``with`` exit cannot await) is queued: this client's next get or
    put carries it, and any other call sends the queued releases just before itself, as one
    one-way message; so in ``with await kv.get(a): ...`` then ``await kv.get(b)`` each get is
    one message. Releases no call took by the time the event loop turns go out then, as one
    message (at once when 64 are queued, and at close). The lease of a block still held is
    renewed at half its life, so a held block never lapses while this client lives.
    """

    def __init__(self, rpc: cxlrpc.Client, hello: w.Hello, pool: Pool) -> None:
        super().__init__(rpc, hello, pool)
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()  # the loop's: the only one that sends
        self._flush_armed = False  # a flush is scheduled (_RELEASE_DELAY_S from the first release)
        self._tasks: set[asyncio.Task[None]] = set()
        self._greeting: asyncio.Task[w.Hello] | None = None  # the hello callers refused meanwhile share
        #: Leases of blocks held, by id: (when to renew, the lease). One timer renews those due.
        self._held: dict[int, tuple[float, w.Lease]] = {}
        self._renewer: asyncio.TimerHandle | None = None
        self._renew_at = math.inf  # when the renewer fires

    @staticmethod
    def connect(url: str, **options: Any) -> "_Connecting":
        """Connect (``await`` it or use ``async with``); options go to ``cxlrpc.connect``."""
        return _Connecting(url, options)

    @staticmethod
    def connect_sync(url: str, **options: Any) -> "SyncKVClient":
        """A blocking client (use ``with``); options go to ``cxlrpc.connect_sync``."""
        return SyncKVClient.connect(url, **options)

    async def put(self, key: Key, value: Any, namespace: str = "", ttl: float | None = None,
                  if_absent: bool = False) -> bool:
        """Store ``value`` (bytes-like or numpy array); returns once every reader can see it.
        ``if_absent``: keep an existing value instead (then False), decided by the server."""
        return (await self._drive(self._put({key: value}, namespace, ttl, if_absent)))[0]

    async def batch_put(self, items: Items, namespace: str = "",
                        ttl: float | None = None, if_absent: bool = False) -> list[bool]:
        """Store several values with one RPC to reserve and one to commit (all or none reserved);
        whether each was stored."""
        return await self._drive(self._put(items, namespace, ttl, if_absent))

    async def begin_put(self, key: Key, size: int, namespace: str = "",
                        ttl: float | None = None) -> PendingPut:
        """Reserve ``size`` bytes to fill in place; ``await pending.commit()`` publishes them.
        A commit later than the server's ``put_timeout_s`` fails (NotFound); the block stays
        reserved for this connection until it commits, aborts or closes, never reused under it."""
        return await self._drive(self._begin_put(key, size, namespace, ttl, self._drive))

    async def get(self, key: Key, namespace: str = "", lease_s: float | None = None) -> Block:
        """Lease ``key``'s value for zero-copy reading (``with`` ends the lease); KeyNotFound.

        The hot path of an inference engine: ``_drive`` of ``_get`` unrolled for one RPC (the
        generator and its driver cost the client more than the RPC layer did)."""
        queued = self._released
        req = w.Get(namespace, [normalize_key(key)], lease_s, 0.0, self._carry() if queued else None)
        if queued:  # more than one request carries: they go first
            self._flush()
        try:
            leases = await self.rpc.call("get", req, response_type=_LEASES)
        except asyncio.CancelledError:
            self._unsent(req, None)
            raise
        except Exception as exc:
            self._unsent(req, exc)
            if not self._refused(exc):
                raise
            await self._greet()  # a restarted server: the get starts anew, as _drive does
            return self._one(key, await self._drive(self._get([key], namespace, lease_s)))
        if len(leases) != 1:  # a server that broke the protocol: end what it leased
            for block in self._blocks(leases):
                if block is not None:
                    block.release()
            raise cxlrpc.Internal(f"the server answered a get of one key with {len(leases)} leases")
        lease = leases[0]
        if lease is None:
            raise KeyNotFound(key)
        try:
            return self._block(lease)
        except BaseException:
            self._release(lease.lease_id)
            raise

    async def batch_get(self, keys: Iterable[Key], namespace: str = "",
                        lease_s: float | None = None, hold_s: float = 0.0) -> list[Block | None]:
        """Lease several values in one RPC; None for each missing key. ``hold_s``: the leases
        keep blocking removal and eviction that long after the get, released or not."""
        return await self._drive(self._get(keys, namespace, lease_s, hold_s))

    async def iter_get(self, keys: Iterable[Key], namespace: str = "", lease_s: float | None = None,
                       chunk: int = 8) -> AsyncIterator[Block | None]:
        """Lease values as the server finds them, ``chunk`` keys per message of a server
        stream: the first blocks are read while the rest are looked up. A Block or None per key,
        in order; leases of chunks not read when the loop is left lapse after ``lease_s``."""
        wanted = [normalize_key(k) for k in keys]
        for attempt in range(2):
            req = w.GetStream(namespace, wanted, lease_s, chunk, self._carry())
            started = False
            try:
                async for leases in self.rpc.stream("get_stream", req, response_type=list[w.Lease | None]):
                    started = True
                    for lease in leases:
                        yield None if lease is None else self._block(lease)
                return
            except BaseException as exc:
                if started:
                    raise
                self._unsent(req, exc if isinstance(exc, Exception) else None)  # never seen
                if not self._refused(exc) or attempt:
                    raise
            await self._greet()

    async def get_bytes(self, key: Key, namespace: str = "") -> bytes:
        """A copy of ``key``'s value."""
        with await self.get(key, namespace) as block:
            return block.tobytes()

    async def get_into(self, key: Key, out: Any, namespace: str = "") -> int:
        """Copy ``key``'s value into the writable buffer ``out``; returns its size."""
        return self._copy_into(await self.get(key, namespace), out)

    async def exists(self, key: Key, namespace: str = "") -> bool:
        """Whether ``key`` has a live value (no lease taken)."""
        return await self._drive(self._key_call("exists", key, namespace))

    async def remove(self, key: Key, namespace: str = "") -> bool:
        """Hide ``key`` now (readers holding leases keep their bytes); False if it was absent."""
        return await self._drive(self._key_call("remove", key, namespace))

    async def batch_remove(self, keys: Iterable[Key], namespace: str = "",
                           force: bool = True) -> list[int]:
        """Remove several keys: REMOVED, ABSENT or LEASED (kept, unless ``force``) for each."""
        return await self._drive(self._remove_keys(keys, namespace, force))

    async def remove_matching(self, pattern: str | None, namespace: str = "",
                              force: bool = True) -> int:
        """Remove the keys a regular expression finds a match in (all keys: None); how many."""
        return await self._drive(self._remove_matching(pattern, namespace, force))

    async def batch_exists(self, keys: Iterable[Key], namespace: str = "") -> list[bool]:
        """``exists`` for several keys in one RPC."""
        return await self._drive(self._exists_keys(keys, namespace))

    async def lookup_keys(self, keys: Iterable[Key], namespace: str = "") -> int:
        """How many leading ``keys`` are present (one RPC), e.g. chunk keys of a prefix."""
        return await self._drive(self._lookup_keys(keys, namespace))

    async def lookup_prefix(self, token_ids: Tokens, chunk_size: int = 256,
                            namespace: str = "") -> int:
        """Number of leading full chunks of ``token_ids`` whose chunk_keys are present."""
        return await self._drive(self._lookup_prefix(token_ids, chunk_size, namespace))

    async def stats(self, namespace: str | None = None) -> dict[str, Any]:
        """The server's counters and per-namespace usage (only ``namespace``'s when given)."""
        return await self._drive(self._stats(namespace))

    async def close(self) -> None:
        """Send pending lease releases, detach and unmap the pool."""
        if self._closed:
            return
        self._flush()
        self._closed = True
        if self._renewer is not None:
            self._renewer.cancel()
        self._held.clear()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._give_back()
        await self.rpc.close()
        self._close_pools()

    async def __aenter__(self) -> "KVClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _drive(self, steps: _Steps[R]) -> R:
        """Run an operation's RPCs. Cancellation (``asyncio.wait_for``, task.cancel) leaves
        nothing behind: a reservation is aborted, a put that committed anyway is undone."""
        call = self.rpc.call
        first = True  # the operation's first RPC: refused, it is retried after a hello
        try:
            step = next(steps)
            while True:
                if self._released:  # not taken by this call (it carries none): they go first
                    self._flush()
                try:
                    if step.undo is None:
                        result = await call(step.method, step.arg, response_type=step.response_type)
                    else:
                        result = await self._undoable(step)
                except asyncio.CancelledError:
                    if step.undo is None:  # an undoable call goes on, its releases with it
                        self._unsent(step.arg, None)
                    raise
                except Exception as exc:
                    self._unsent(step.arg, exc)
                    if self._refused(exc):
                        await self._greet()
                        if first:  # the server did nothing yet: the operation starts anew
                            first = False
                            continue
                        exc = self._restarted()
                    step = steps.throw(exc)
                else:
                    step = steps.send(result)
                first = False
        except StopIteration as done:
            value: R = done.value
            return value

    async def _greet(self) -> None:
        """Say hello to the server anew (one hello for every caller refused meanwhile) and
        map its pool."""
        task = self._greeting
        if task is None:
            task = self._greeting = self._loop.create_task(self.rpc.call("hello", response_type=w.Hello))
            task.add_done_callback(lambda _: setattr(self, "_greeting", None))
        self._adopt(await asyncio.shield(task))

    async def _undoable(self, step: _Call) -> Any:
        """Call ``step`` so that, if we are cancelled meanwhile, its reply is still read and
        what it created on the server is taken back by ``step.undo`` (cxlrpc's on_late_reply:
        no task per call, which a shielded task cost: ~40 us of a 1 MiB put here)."""
        return await self.rpc.call(step.method, step.arg, response_type=step.response_type,
                                   on_late_reply=lambda outcome: self._take_back(step, outcome))

    def _take_back(self, step: _Call, outcome: Any) -> None:
        """The late reply of an undoable call (or the error that ended it): undo what it made."""
        if isinstance(outcome, BaseException):
            self._unsent(step.arg, None if isinstance(outcome, asyncio.CancelledError) else outcome)
            return  # it created nothing (or the server is gone, and reclaims it all)
        assert step.undo is not None  # (what makes a call undoable)
        undo = step.undo(outcome)
        try:
            self.rpc.send_nowait(undo.method, undo.arg)
        except cxlrpc.ResourceExhausted:  # ring full: wait for room in the background
            self._spawn(self._quiet_call(undo))
        except cxlrpc.RpcError:
            pass  # closed or server gone: its reservations die with our slot

    async def _quiet_call(self, step: _Call) -> None:
        try:
            await self.rpc.call(step.method, step.arg)
        except cxlrpc.RpcError:
            pass

    def _spawn(self, coro: Any) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _block(self, lease: w.Lease) -> Block:
        block = self.pool.leased(lease.offset, lease.size, lease.version, self, lease.lease_id)
        at = self._loop.time() + lease.duration / 2
        self._held[lease.lease_id] = (at, lease)  # a dict entry, not a timer, per get
        if at < self._renew_at:
            self._renew_by(at)
        return block

    def _renew_by(self, at: float) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
        self._renew_at = at
        self._renewer = self._loop.call_at(at, self._renew_due)

    def _renew_due(self) -> None:
        """Renew the held leases at half their life (one Renew message per lease term)."""
        self._renewer, self._renew_at = None, math.inf
        if self._closed:
            return
        now, soonest = self._loop.time(), math.inf
        due: dict[float, list[int]] = {}
        for lease_id, (at, lease) in self._held.items():
            if at <= now:
                due.setdefault(lease.duration, []).append(lease_id)
                at = now + lease.duration / 2
                self._held[lease_id] = (at, lease)
            soonest = min(soonest, at)
        for duration, ids in due.items():
            for i in range(0, len(ids), _MAX_RELEASES):
                try:
                    self.rpc.send_nowait("renew", w.Renew(ids[i:i + _MAX_RELEASES], duration))
                except cxlrpc.RpcError:
                    pass  # ring full or server gone: the blocks' checks tell if they lapse
        if soonest < math.inf:
            self._renew_by(soonest)

    def _release(self, lease_id: int, collected: bool = False) -> None:
        if self._closed:
            return  # the server ends the lease when it sees us gone
        self._released.append(lease_id)
        try:
            if threading.get_ident() != self._thread:  # released or collected in another
                self._loop.call_soon_threadsafe(self._ended, lease_id, True)  # thread
            elif collected:  # _ended and _arm inline: this runs once per get nobody released
                self._held.pop(lease_id, None)
                if not self._flush_armed:
                    self._arm()
            else:  # _ended and _queued inline: this runs once per get
                self._held.pop(lease_id, None)
                if len(self._released) >= _MAX_RELEASES:
                    self._flush()
                elif not self._flush_armed:
                    self._arm()
        except RuntimeError:
            pass  # the loop is closed: the server ends the lease when it sees us gone

    def _ended(self, lease_id: int, collected: bool) -> None:
        """In the loop: a lease ended; stop renewing it and see its release sent."""
        self._held.pop(lease_id, None)  # renewed no more
        if collected:
            self._arm()
        else:
            self._queued()

    def _queued(self) -> None:
        if len(self._released) >= _MAX_RELEASES:
            self._flush()
        else:
            self._arm()

    def _arm(self) -> None:
        if self._released and not self._flush_armed:
            # a request sent meanwhile takes them; else this sends them. One timer serves every
            # release of its window: re-arming at each release cost a callback a get.
            self._flush_armed = True
            self._loop.call_later(_RELEASE_DELAY_S, self._armed_flush)

    def _armed_flush(self) -> None:
        self._flush_armed = False
        self._flush()

    def _flush(self) -> None:
        while not self._closed:
            ids = _take(self._released)
            if not ids:
                return
            release = w.Release(ids)
            try:  # one-way and ordered with our later calls; no task, no round trip
                self.rpc.send_nowait("release", release)
            except cxlrpc.ResourceExhausted:  # request ring full: a call waits for room
                self._spawn(self._quiet_call(_Call("release", release)))
            except cxlrpc.RpcError:
                pass  # server gone: it ended this connection's leases (or died with them)


class _Connecting:
    """What ``KVClient.connect`` returns: ``await`` it, or use it with ``async with``."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self._url = url
        self._options = options
        self._client: KVClient | None = None

    async def _open(self) -> KVClient:
        rpc = await cxlrpc.connect(self._url, **self._options)
        try:
            hello = await rpc.call("hello", response_type=w.Hello)
            pool = Pool.open(hello.pool_url, hello.pool_size, hello.epoch, hello.alignment)
        except BaseException:
            await rpc.close()
            raise
        self._client = KVClient(rpc, hello, pool)
        return self._client

    def __await__(self) -> Generator[Any, None, KVClient]:
        return self._open().__await__()

    async def __aenter__(self) -> KVClient:
        return await self._open()

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:  # (made by __aenter__)
            await self._client.close()


class SyncKVClient(_Ops):
    """Blocking client with KVClient's methods.

    A block's release is queued: this client's next get or put carries it, and any other call
    sends the queued releases just before itself, as one one-way message, as do close() and a
    release that makes 64 queued. No loop or thread sends them sooner: while the client sits
    idle, a released block stays leased until its lease's term ends (the ``lease_s`` of its
    get, the server's default 10 s unless given), so it is not evicted, nor its space reused
    after a removal, until then. Leases are not renewed here either (no event loop runs), so
    that term bounds every lease of this client, released or not: a block held past it may
    lapse, and its checks then raise LeaseExpired."""

    @classmethod
    def connect(cls, url: str, **options: Any) -> "SyncKVClient":
        """Connect to the service at ``url``; options go to ``cxlrpc.connect_sync``."""
        rpc = cxlrpc.connect_sync(url, **options)
        try:
            hello = rpc.call("hello", response_type=w.Hello)
            pool = Pool.open(hello.pool_url, hello.pool_size, hello.epoch, hello.alignment)
        except BaseException:
            rpc.close()
            raise
        return cls(rpc, hello, pool)

    def put(self, key: Key, value: Any, namespace: str = "", ttl: float | None = None,
            if_absent: bool = False) -> bool:
        """Store ``value``; returns once every reader can see it (see KVClient.put)."""
        return self._drive(self._put({key: value}, namespace, ttl, if_absent))[0]

    def batch_put(self, items: Items, namespace: str = "",
                  ttl: float | None = None, if_absent: bool = False) -> list[bool]:
        """Store several values (one RPC to reserve, one to commit); whether each was stored."""
        return self._drive(self._put(items, namespace, ttl, if_absent))

    def begin_put(self, key: Key, size: int, namespace: str = "",
                  ttl: float | None = None) -> PendingPut:
        """Reserve ``size`` bytes to fill in place; ``pending.commit()`` publishes them (see
        KVClient.begin_put for a commit later than the server's ``put_timeout_s``)."""
        return self._drive(self._begin_put(key, size, namespace, ttl, self._drive))

    def get(self, key: Key, namespace: str = "", lease_s: float | None = None) -> Block:
        """Lease ``key``'s value for zero-copy reading; KeyNotFound if absent."""
        return self._one(key, self._drive(self._get([key], namespace, lease_s)))

    def batch_get(self, keys: Iterable[Key], namespace: str = "",
                  lease_s: float | None = None, hold_s: float = 0.0) -> list[Block | None]:
        """Lease several values in one RPC; None for each missing key (``hold_s``: see KVClient)."""
        return self._drive(self._get(keys, namespace, lease_s, hold_s))

    def get_bytes(self, key: Key, namespace: str = "") -> bytes:
        """A copy of ``key``'s value."""
        with self.get(key, namespace) as block:
            return block.tobytes()

    def get_into(self, key: Key, out: Any, namespace: str = "") -> int:
        """Copy ``key``'s value into ``out``; returns its size."""
        return self._copy_into(self.get(key, namespace), out)

    def exists(self, key: Key, namespace: str = "") -> bool:
        """Whether ``key`` has a live value."""
        return self._drive(self._key_call("exists", key, namespace))

    def remove(self, key: Key, namespace: str = "") -> bool:
        """Hide ``key`` now; False if it was absent."""
        return self._drive(self._key_call("remove", key, namespace))

    def batch_remove(self, keys: Iterable[Key], namespace: str = "", force: bool = True) -> list[int]:
        """Remove several keys: REMOVED, ABSENT or LEASED (kept, unless ``force``) for each."""
        return self._drive(self._remove_keys(keys, namespace, force))

    def remove_matching(self, pattern: str | None, namespace: str = "", force: bool = True) -> int:
        """Remove the keys a regular expression finds a match in (all keys: None); how many."""
        return self._drive(self._remove_matching(pattern, namespace, force))

    def batch_exists(self, keys: Iterable[Key], namespace: str = "") -> list[bool]:
        """``exists`` for several keys in one RPC."""
        return self._drive(self._exists_keys(keys, namespace))

    def lookup_keys(self, keys: Iterable[Key], namespace: str = "") -> int:
        """How many leading ``keys`` are present (one RPC)."""
        return self._drive(self._lookup_keys(keys, namespace))

    def lookup_prefix(self, token_ids: Tokens, chunk_size: int = 256,
                      namespace: str = "") -> int:
        """Number of leading full chunks of ``token_ids`` present."""
        return self._drive(self._lookup_prefix(token_ids, chunk_size, namespace))

    def stats(self, namespace: str | None = None) -> dict[str, Any]:
        """The server's counters and per-namespace usage (only ``namespace``'s when given)."""
        return self._drive(self._stats(namespace))

    def close(self) -> None:
        """Send queued lease releases, detach and unmap the pool."""
        if not self._closed:
            self._flush()
            self._closed = True
        self._give_back()
        self.rpc.close()
        self._close_pools()

    def __enter__(self) -> "SyncKVClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drive(self, steps: _Steps[R]) -> R:
        call = self.rpc.call
        first = True  # the operation's first RPC: refused, it is retried after a hello
        try:
            step = next(steps)
            while True:
                if self._released:  # not taken by this call (it carries none): they go first
                    self._flush()
                try:
                    result = call(step.method, step.arg, response_type=step.response_type)
                except Exception as exc:
                    self._unsent(step.arg, exc)
                    if self._refused(exc):
                        self._adopt(call("hello", response_type=w.Hello))
                        if first:  # the server did nothing yet: the operation starts anew
                            first = False
                            continue
                        exc = self._restarted()
                    step = steps.throw(exc)
                except BaseException:  # interrupted: the request may not have gone
                    self._unsent(step.arg, None)
                    raise
                else:
                    step = steps.send(result)
                first = False
        except StopIteration as done:
            value: R = done.value
            return value

    def _release(self, lease_id: int, collected: bool = False) -> None:
        if self._closed:
            return  # the server ended our leases when we detached
        self._released.append(lease_id)
        if not collected:  # a collected block's release waits for the next call
            self._queued()

    def _queued(self) -> None:
        if len(self._released) >= _MAX_RELEASES:
            self._flush()

    def _flush(self) -> None:
        while True:
            ids = _take(self._released)
            if not ids:
                return
            release = w.Release(ids)
            try:
                self.rpc.send_nowait("release", release)
            except cxlrpc.ResourceExhausted:  # ring full: wait for room
                with contextlib.suppress(cxlrpc.RpcError):
                    self.rpc.call("release", release)
            except cxlrpc.RpcError:
                pass  # server gone: it ended this connection's leases (or died with them)
