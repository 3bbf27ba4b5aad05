"""KVServer: the metadata service (a cxlrpc.Server owning a KVIndex) and the pool region.

Clients copy values into and out of the pool themselves; the server only hands out offsets,
tickets and leases, so each request is a small frame. Leases and pending puts are owned by the
calling cxlrpc peer and dropped when that peer detaches or dies; the blocks of its pending puts
are freed only once cxlrpc fences it (it can no longer write: see KVIndex's "Fencing"). Lease
releases mostly ride on the client's next get or put (ended before it is served), else come as
one-way messages.
"""
import asyncio
import contextlib
import functools
import logging
import re
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import cxlrpc
from kvservice import wire as w
from cxlrpc.allocator import PoolAllocator
from kvservice.index import KVIndex, Lease, PoolFull, PutTicket
from cxlrpc.region import RegionError, overlapping
from kvservice.pool import Pool, pool_url_for

INLINE_LIMIT = 32 << 10  # measured: inline wins below ~32 KiB, two-phase from 64 KiB
_EXISTS = PutTicket(0, 0, 0)  # begin's answer for an if_absent key that has a value
logger = logging.getLogger("kvservice.server")


def _first_id() -> int:
    """Where a server's lease and ticket ids, and its value versions, start: at random in
    [1, 2**62], so ids an earlier server on this name handed out (a client that reconnected
    may still send them) name none of this one's, and a block an earlier server leased on the
    same pool memory (a file or device pool outlives its server) never matches a version of
    this one's, save with odds of about the numbers issued over 2**62."""
    return secrets.randbits(62) + 1


def _guard(fn: Callable[[Any], Any], greeted: set[cxlrpc.Peer] | None) -> Callable[[Any], Any]:
    """Map the index's exceptions to RPC status codes; refuse connections not in ``greeted``
    (when given): their client may still map another server's pool."""
    @functools.wraps(fn)
    def handler(*args: Any) -> Any:
        if greeted is not None and cxlrpc.current_peer() not in greeted:
            raise cxlrpc.FailedPrecondition(w.NOT_GREETED)
        try:
            return fn(*args)
        except PoolFull as exc:
            raise cxlrpc.ResourceExhausted(str(exc)) from None
        except KeyError as exc:
            raise cxlrpc.NotFound(str(exc.args[0] if exc.args else exc)) from None
        except (ValueError, TypeError) as exc:
            raise cxlrpc.InvalidArgument(str(exc)) from None
    return handler


class KVServer:
    """A KV-cache store at ``url`` whose values live in a pool region of ``pool_size`` bytes.

    ``async with KVServer("shm://kv", pool_size=8 << 30): ...``; extra keyword arguments go
    to ``cxlrpc.Server`` (its defaults here: 64 client slots, 256 KiB reply rings, as
    replies are small metadata). Values up to ``inline_limit`` bytes may travel in the put
    request. Blocks are whole units of ``alignment`` bytes (a 100-byte value takes 4 KiB with
    the default; KV-cache chunks are 64 KiB and up): lower it for small values. One device
    serves both regions when each is a range of it: ``KVServer("file:///dev/dax0.0?size=64M",
    pool_size, pool_url="file:///dev/dax0.0?offset=64M")``. A put not committed within
    ``put_timeout_s`` fails; its block is freed when its connection is done with it (commits,
    aborts or departs), as that connection may still be writing into it. A connection judged
    gone (its heartbeat stopped for ``client_timeout``, 1 s by default) may be frozen, not dead:
    its pending blocks are freed only when cxlrpc fences it (its process exited, on this host;
    ``fence_timeout`` seconds after it was reaped, 10 s by default, on another host).
    """

    def __init__(self, url: str, pool_size: int, *, pool_url: str | None = None,
                 alignment: int = 4096, inline_limit: int = INLINE_LIMIT,
                 default_lease_s: float = 10.0, max_lease_s: float = 60.0,
                 put_timeout_s: float = 30.0,
                 expire_interval: float = 0.5, high_watermark: float = 0.9,
                 low_watermark: float = 0.8, **rpc_options: Any) -> None:
        self.url = url
        self.pool_url = pool_url or pool_url_for(url)
        if overlapping(url, self.pool_url):
            raise RegionError(f"the service region {url} and the pool {self.pool_url} overlap: "
                              f"give each its own range of the device")
        self._default_pool_url = pool_url is None
        self.pool_size = -(-pool_size // alignment) * alignment
        self.inline_limit = inline_limit
        self.expire_interval = expire_interval
        self.alignment = alignment
        self.index = KVIndex(PoolAllocator(self.pool_size, alignment),
                             high_watermark=high_watermark, low_watermark=low_watermark,
                             default_lease_s=default_lease_s, max_lease_s=max_lease_s,
                             put_timeout_s=put_timeout_s,
                             on_publish=self._publish, on_free=self._clear, on_claim=self._claim,
                             on_reclaim=self._reclaim,
                             first_id=_first_id(), first_version=_first_id())
        rpc_options.setdefault("slots", 64)  # two TP-8 pods and their helpers
        rpc_options.setdefault("response_capacity", 256 << 10)
        self.rpc = cxlrpc.Server(url, **rpc_options)
        #: Connections that said hello (so they map this server's pool): only they are served.
        self._greeted: set[cxlrpc.Peer] = set()
        self.rpc.on_disconnect(self._release_owner)
        self.rpc.on_fenced(self._fence_owner)
        self.rpc.on_disconnect(self._greeted.discard)
        self._pool: Pool | None = None
        self._release_messages = 0
        self._expirer: asyncio.Task[None] | None = None
        for name in ("hello", "begin", "inline", "commit", "abort", "undo", "release",
                     "renew", "exists", "exists_keys", "remove", "remove_keys", "remove_matching",
                     "lookup_prefix", "stats"):
            self.rpc.add_method(name, _guard(getattr(self, "_" + name),
                                             None if name == "hello" else self._greeted))
        self.rpc.add_method("get", self._get)  # guards itself
        self.rpc.add_method("get_stream", self._get_stream)

    # ---- lifetime ------------------------------------------------------------------------
    async def start(self) -> None:
        """Create the service region, then the pool (before any request can be served)."""
        await self.rpc.start()  # fails if a live server owns the name, so the pool is ours
        try:
            self._pool = Pool.create(self.pool_url, self.pool_size, self.alignment, self.rpc.mode,
                                     self.rpc.client_timeout + 1.0, self.rpc.coherence)
        except BaseException as exc:
            await self.rpc.close()
            if isinstance(exc, OSError) and self._default_pool_url:
                raise RegionError(f"cannot create the pool at {self.pool_url} ({exc}); pass "
                                  f"pool_url= (a device or file of its own)") from exc
            raise
        self.rpc.guard_region(self._pool.region)  # a truncated pool file stops the server
        self._expirer = asyncio.get_running_loop().create_task(self._expire_loop())

    async def close(self) -> None:
        """Stop serving, then unlink and unmap the pool."""
        if self._expirer is not None:
            self._expirer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expirer
            self._expirer = None
        await self.rpc.close()
        if self._pool is not None:
            self._pool.retire()
            self._pool.close()
            self._pool = None

    async def serve_forever(self) -> None:
        """Serve until ``close`` is called."""
        await self.rpc.serve_forever()

    async def __aenter__(self) -> "KVServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def set_quota(self, namespace: str, max_bytes: int | None) -> None:
        """Cap the pool bytes ``namespace`` may hold (None lifts the cap)."""
        self.index.set_quota(namespace, max_bytes)

    def stats(self) -> dict[str, Any]:
        """Hits, misses, evictions, occupancy and bytes per namespace, and how many one-way
        release messages came (the other releases rode on gets and puts)."""
        return {"pool_url": self.pool_url, **self.index.stats(),
                "release_messages": self._release_messages}

    # ---- the index's hooks: the pool (made at start) marks what the index decides ----------
    def _publish(self, offset: int, version: int) -> None:
        assert self._pool is not None  # the index changes only while requests are served
        self._pool.publish(offset, version)

    def _clear(self, offset: int) -> None:
        assert self._pool is not None
        self._pool.clear(offset)

    def _claim(self, offset: int, ticket_id: int) -> None:
        assert self._pool is not None
        self._pool.claim(offset, ticket_id)

    def _reclaim(self, offset: int, nbytes: int) -> None:
        """A fenced writer's pending block, before it is freed: written back (memory without
        coherence), so lines a writer dead on this host left dirty in this host's caches land
        now, not over the block's next value (one of another host: docs/operations.md)."""
        assert self._pool is not None
        self._pool.given_back(offset, nbytes)

    def _release_owner(self, peer: cxlrpc.Peer) -> None:
        self.index.release_owner(peer)

    def _fence_owner(self, peer: cxlrpc.Peer) -> None:
        self.index.fence_owner(peer)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.expire_interval)
            try:
                self.index.expire()
            except Exception:  # a bug must not end expiry for good (nor surface at close)
                logger.exception("lease/TTL expiry pass failed")

    # ---- handlers (plain functions: they run inline in cxlrpc's reader) -------------------
    def _hello(self) -> w.Hello:
        self._greeted.add(cxlrpc.current_peer())
        assert self._pool is not None  # served only between start and close
        return w.Hello(self.pool_url, self.pool_size, self._pool.region.epoch, self.inline_limit,
                       self.alignment)

    def _begin(self, req: w.Begin) -> list[PutTicket]:
        """A ticket per key; ticket id 0 (nothing reserved) for an if_absent key that exists."""
        owner = cxlrpc.current_peer()
        self._end_leases(req.release, owner)
        if len(req.keys) != len(req.sizes):
            raise ValueError("keys and sizes differ in length")
        tickets = self._begin_all(req.ns, req.keys, req.sizes, req.ttl, owner, req.if_absent)
        return [_EXISTS if t is None else t for t in tickets]

    def _inline(self, req: w.Inline) -> list[int]:
        """The version of each value stored (0: an if_absent key that had a value)."""
        owner = cxlrpc.current_peer()
        self._end_leases(req.release, owner)
        if len(req.keys) != len(req.values):
            raise ValueError("keys and values differ in length")
        tickets = self._begin_all(req.ns, req.keys, [len(v) for v in req.values], req.ttl, owner,
                                  req.if_absent)
        pool = self._pool
        assert pool is not None  # served only between start and close
        for ticket, value in zip(tickets, req.values):
            if ticket is not None:
                pool.write(ticket.offset, memoryview(value))
        return [0 if t is None else self.index.commit_put(t.ticket_id, owner) for t in tickets]

    def _begin_all(self, ns: str, keys: list[bytes], sizes: list[int], ttl: float | None,
                   owner: cxlrpc.Peer, if_absent: bool = False) -> list[PutTicket | None]:
        """Reserve a block per key, all or none (None for an if_absent key that exists)."""
        tickets: list[PutTicket | None] = []
        try:
            for key, size in zip(keys, sizes):
                tickets.append(self.index.begin_put(ns, key, size, ttl, owner, if_absent))
        except BaseException:
            for ticket in tickets:
                if ticket is not None:
                    self.index.abort_put(ticket.ticket_id, owner)
            raise
        return tickets

    def _commit(self, req: w.Tickets) -> list[int]:
        """Publish the tickets' values; their versions (what an undo names)."""
        owner = cxlrpc.current_peer()
        lost = []
        versions = []
        for ticket_id in req.ids:
            try:
                versions.append(self.index.commit_put(ticket_id, owner))
            except KeyError:
                lost.append(ticket_id)
        if lost:
            raise cxlrpc.NotFound(f"put tickets {lost} expired or unknown: not committed")
        return versions

    def _undo(self, req: w.Undo) -> None:
        if len(req.keys) != len(req.versions):
            raise ValueError("keys and versions differ in length")
        for key, version in zip(req.keys, req.versions):
            self.index.remove_version(req.ns, key, version)

    def _abort(self, req: w.Tickets) -> None:
        owner = cxlrpc.current_peer()
        for ticket_id in req.ids:
            self.index.abort_put(ticket_id, owner)

    def _get(self, req: w.Get) -> list[Lease | None]:
        """The hot path: _guard's checks inline (one peer lookup, no wrapper frame)."""
        owner = cxlrpc.current_peer()
        if owner not in self._greeted:
            raise cxlrpc.FailedPrecondition(w.NOT_GREETED)
        try:
            return self.index.batch_get(req.ns, req.keys, req.lease_s, owner, req.hold_s,
                                        req.release.ids if req.release is not None else ())
        except (ValueError, TypeError) as exc:  # what batch_get raises for bad input
            raise cxlrpc.InvalidArgument(str(exc)) from None

    async def _get_stream(self, req: w.GetStream) -> AsyncIterator[list[Lease | None]]:
        """Lease the keys a chunk at a time, each chunk one item of a server stream: the caller
        reads the first values while the rest are looked up."""
        owner = cxlrpc.current_peer()
        if owner not in self._greeted:
            raise cxlrpc.FailedPrecondition(w.NOT_GREETED)
        self._end_leases(req.release, owner)
        if req.chunk < 1:
            raise cxlrpc.InvalidArgument(f"chunk must be at least 1, got {req.chunk}")
        for at in range(0, len(req.keys), req.chunk):
            try:
                leases = self.index.batch_get(req.ns, req.keys[at:at + req.chunk], req.lease_s, owner)
            except (ValueError, TypeError) as exc:
                raise cxlrpc.InvalidArgument(str(exc)) from None
            yield leases

    def _release(self, req: w.Release) -> None:
        self._release_messages += 1
        self._end_leases(req, cxlrpc.current_peer())

    def _end_leases(self, release: w.Release | None, owner: cxlrpc.Peer) -> None:
        """End the leases a request names that are the caller's (others count as stale)."""
        if release is None:
            return
        for lease_id in release.ids:
            self.index.release(lease_id, owner)

    def _renew(self, req: w.Renew) -> None:
        owner = cxlrpc.current_peer()
        for lease_id in req.ids:
            self.index.renew(lease_id, owner, req.lease_s)

    def _exists(self, req: w.Key) -> bool:
        return self.index.exists(req.ns, req.key)

    def _remove(self, req: w.Key) -> bool:
        return self.index.remove(req.ns, req.key)

    def _remove_keys(self, req: w.RemoveKeys) -> list[int]:
        return self.index.remove_keys(req.ns, req.keys, req.force)

    def _remove_matching(self, req: w.RemoveMatching) -> int:
        try:
            pattern = None if req.pattern is None else re.compile(req.pattern.encode()).pattern
        except re.error as exc:
            raise ValueError(f"bad regular expression {req.pattern!r}: {exc}") from None
        return self.index.remove_matching(req.ns, pattern, req.force)

    def _exists_keys(self, req: w.Keys) -> list[bool]:
        return self.index.exists_keys(req.ns, req.keys)

    def _lookup_prefix(self, req: w.Keys) -> int:
        return self.index.lookup_prefix(req.ns, req.keys)

    def _stats(self, namespace: str | None = None) -> dict[str, Any]:
        stats = self.stats()
        if namespace is not None:
            mine = stats["namespaces"].get(namespace)
            stats["namespaces"] = {} if mine is None else {namespace: mine}
        return stats
