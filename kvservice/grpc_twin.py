"""The gRPC twin of the KV service: the same API over grpc.aio, values carried in the messages.

It is the network baseline the shared-memory service is measured against: the same KVIndex and
allocator, over a private in-process pool. Methods are raw-bytes gRPC handlers whose messages
are kvservice.wire's msgspec Structs (MessagePack) — no protobuf, no generated code, no
grpcio-tools. ``get`` returns a copy of the value (zero-copy cannot cross a network).
"""
from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
import msgspec
import numpy as np
import numpy.typing as npt

from cxlrpc.errors import StatusCode, error_for
from kvservice import wire as w
from cxlrpc.allocator import PoolAllocator
from kvservice.client import Items, KeyNotFound
from kvservice.index import KVIndex, PoolFull, PutTicket
from kvservice.keys import chunk_keys, normalize_key
from kvservice.pool import Block, as_bytes

SERVICE = "kvservice.KV"
OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
Key = str | bytes
_Handler = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]


def _handler(fn: Callable[[bytes], bytes]) -> _Handler:
    """Wrap a bytes -> bytes function as a gRPC handler that maps errors to status codes."""
    @functools.wraps(fn)
    # (ignore: each except ends in context.abort, which raises; grpc ships no py.typed saying so)
    async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:  # type: ignore[return]
        try:
            return fn(request)
        except KeyNotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except PoolFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except (ValueError, TypeError, msgspec.DecodeError) as exc:  # incl. ValidationError
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    return handle


class GrpcKVServer:
    """The gRPC KV service on ``address`` (``host:port``, port 0 = any; or ``unix:/path``)."""

    def __init__(self, address: str, pool_size: int, *, alignment: int = 4096,
                 default_lease_s: float = 10.0, high_watermark: float = 0.9,
                 low_watermark: float = 0.8) -> None:
        self.address = address
        pool_size = -(-pool_size // alignment) * alignment
        self.index = KVIndex(PoolAllocator(pool_size, alignment), default_lease_s=default_lease_s,
                             high_watermark=high_watermark, low_watermark=low_watermark)
        self._pool = np.zeros(pool_size, np.uint8).data  # calloc: pages on first touch
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Bind and start serving; ``address`` becomes the bound one (real port)."""
        methods = {"Put": self._put, "Get": self._get, "BatchGet": self._batch_get,
                   "Exists": self._exists, "Remove": self._remove,
                   "LookupPrefix": self._lookup_prefix, "Stats": self._stats}
        handlers = {name: grpc.unary_unary_rpc_method_handler(_handler(fn))
                    for name, fn in methods.items()}
        self._server = grpc.aio.server(options=OPTIONS)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = self._server.add_insecure_port(self.address)
        if not self.address.startswith("unix:"):
            self.address = f"{self.address.rsplit(':', 1)[0]}:{port}"
        await self._server.start()

    async def close(self) -> None:
        """Stop serving (in-flight calls are cancelled)."""
        if self._server is not None:
            await self._server.stop(None)
            self._server = None

    async def __aenter__(self) -> "GrpcKVServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def set_quota(self, namespace: str, max_bytes: int | None) -> None:
        """Cap the pool bytes ``namespace`` may hold (None lifts the cap)."""
        self.index.set_quota(namespace, max_bytes)

    # ---- handlers: each takes and returns the raw message bytes ----------------------------
    def _put(self, request: bytes) -> bytes:
        req = w.decode(request, w.Inline)
        if len(req.keys) != len(req.values):
            raise ValueError("keys and values differ in length")
        tickets: list[PutTicket] = []
        try:
            for key, value in zip(req.keys, req.values):
                tickets.append(self.index.begin_put(req.ns, key, len(value), req.ttl))
        except BaseException:
            for ticket in tickets:
                self.index.abort_put(ticket.ticket_id)
            raise
        for ticket, value in zip(tickets, req.values):
            self._pool[ticket.offset:ticket.offset + ticket.size] = value
            self.index.commit_put(ticket.ticket_id)
        return b""

    def _read(self, ns: str, keys: list[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for lease in self.index.batch_get(ns, keys, 1.0):
            if lease is None:
                out.append(None)
                continue
            out.append(self._pool[lease.offset:lease.offset + lease.size].tobytes())
            self.index.release(lease.lease_id)
        return out

    def _get(self, request: bytes) -> bytes:
        req = w.decode(request, w.Key)
        (value,) = self._read(req.ns, [req.key])
        if value is None:
            raise KeyNotFound(req.key)
        return value

    def _batch_get(self, request: bytes) -> bytes:
        req = w.decode(request, w.Keys)
        return w.encode(self._read(req.ns, req.keys))

    def _exists(self, request: bytes) -> bytes:
        req = w.decode(request, w.Key)
        return w.encode(self.index.exists(req.ns, req.key))

    def _remove(self, request: bytes) -> bytes:
        req = w.decode(request, w.Key)
        return w.encode(self.index.remove(req.ns, req.key))

    def _lookup_prefix(self, request: bytes) -> bytes:
        req = w.decode(request, w.Keys)
        return w.encode(self.index.lookup_prefix(req.ns, req.keys))

    def _stats(self, request: bytes) -> bytes:
        return w.encode({"address": self.address, **self.index.stats()})


class GrpcKVClient:
    """asyncio client of ``GrpcKVServer`` with KVClient's methods (``async with`` it)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=OPTIONS)
        self._calls = {name: self.channel.unary_unary(f"/{SERVICE}/{name}")
                       for name in ("Put", "Get", "BatchGet", "Exists", "Remove",
                                    "LookupPrefix", "Stats")}

    async def _call(self, method: str, request: bytes) -> bytes:
        try:
            reply: bytes = await self._calls[method](request)
            return reply
        except grpc.aio.AioRpcError as exc:
            code = exc.code().value[0]
            if code == StatusCode.NOT_FOUND:
                raise KeyNotFound(exc.details()) from None
            raise error_for(code, exc.details() or "") from None

    async def put(self, key: Key, value: Any, namespace: str = "", ttl: float | None = None) -> None:
        """Store ``value`` (bytes-like or numpy array); the bytes travel in the request."""
        await self.batch_put({key: value}, namespace, ttl)

    async def batch_put(self, items: Items, namespace: str = "",
                        ttl: float | None = None) -> None:
        """Store several values in one request."""
        # memoryviews (Inline declares bytes, what the server decodes them as)
        values: list[Any] = [as_bytes(v) for v in items.values()]
        if not all(values):
            raise ValueError("empty values are not stored")
        keys = [normalize_key(k) for k in items]
        await self._call("Put", w.encode(w.Inline(namespace, keys, values, ttl)))

    async def get(self, key: Key, namespace: str = "") -> Block:
        """A copy of ``key``'s value, behind the Block interface; KeyNotFound if absent."""
        try:
            data = await self._call("Get", w.encode(w.Key(namespace, normalize_key(key))))
        except KeyNotFound:
            raise KeyNotFound(key) from None
        return Block(memoryview(data))

    async def batch_get(self, keys: Iterable[Key], namespace: str = "") -> list[Block | None]:
        """Copies of several values in one request; None for each missing key."""
        reply = await self._call("BatchGet", w.encode(w.Keys(namespace, [normalize_key(k) for k in keys])))
        return [None if v is None else Block(memoryview(v))
                for v in w.decode(reply, list[bytes | None])]

    async def get_bytes(self, key: Key, namespace: str = "") -> bytes:
        """``key``'s value."""
        return (await self.get(key, namespace)).tobytes()

    async def get_into(self, key: Key, out: Any, namespace: str = "") -> int:
        """Copy ``key``'s value into the writable buffer ``out``; returns its size."""
        with await self.get(key, namespace) as block:
            dst = memoryview(out).cast("B")
            if len(dst) < block.size:
                raise ValueError(f"buffer of {len(dst)} bytes is too small for {block.size}")
            dst[:block.size] = block.view()
            return block.size

    async def exists(self, key: Key, namespace: str = "") -> bool:
        """Whether ``key`` has a live value."""
        return w.decode(await self._call("Exists", w.encode(w.Key(namespace, normalize_key(key)))), bool)

    async def remove(self, key: Key, namespace: str = "") -> bool:
        """Remove ``key``; False if it was absent."""
        return w.decode(await self._call("Remove", w.encode(w.Key(namespace, normalize_key(key)))), bool)

    async def lookup_prefix(self, token_ids: Iterable[int] | npt.NDArray[np.integer[Any]], chunk_size: int = 256,
                            namespace: str = "") -> int:
        """Number of leading full chunks of ``token_ids`` present."""
        keys = chunk_keys(token_ids, chunk_size, namespace)
        if not keys:
            return 0
        return w.decode(await self._call("LookupPrefix", w.encode(w.Keys(namespace, keys))), int)

    async def stats(self) -> dict[str, Any]:
        """The server's counters and per-namespace usage."""
        return w.decode(await self._call("Stats", b""), dict[str, Any])

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "GrpcKVClient":
        await self.channel.channel_ready()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
