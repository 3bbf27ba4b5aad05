"""gRPC echo over raw bytes (no protobuf, no serializers): grpc.aio and sync servers and clients."""
from __future__ import annotations

import asyncio
import os
from concurrent import futures
from multiprocessing.connection import Connection
from typing import Awaitable, Callable

import grpc

from .procs import wait_for_stop, wait_readable

METHOD = "/bench.Echo/Echo"
OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]


def _handler(fn: Callable) -> grpc.GenericRpcHandler:
    rpc = grpc.unary_unary_rpc_method_handler(fn, request_deserializer=None, response_serializer=None)
    return grpc.method_handlers_generic_handler("bench.Echo", {"Echo": rpc})


def _unlink_socket(address: str) -> None:
    if address.startswith("unix:"):
        try:
            os.unlink(address[len("unix:"):])
        except FileNotFoundError:
            pass


def _bind(server, address: str) -> str:
    """Bind ``address`` (port 0 = any free port); returns the address clients should use."""
    _unlink_socket(address)
    port = server.add_insecure_port(address)
    if address.startswith("unix:"):
        return address
    if port == 0:
        raise RuntimeError(f"cannot bind {address}")
    return f"{address.rsplit(':', 1)[0]}:{port}"


def run_loop(main: Awaitable, loop: str = "uvloop") -> object:
    """Run a coroutine on uvloop (default) or the stock asyncio loop."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def serve_aio(conn: Connection, address: str, loop: str = "uvloop", **_: object) -> None:
    """grpc.aio server on ``address`` (host:port or unix:/path) until the parent says stop."""

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def main() -> None:
        server = grpc.aio.server(options=OPTIONS)
        server.add_generic_rpc_handlers((_handler(echo),))
        bound = _bind(server, address)
        await server.start()
        conn.send(("ready", {"pid": os.getpid(), "address": bound}))
        await wait_readable(conn, on_sigterm=True)
        await server.stop(None)

    try:
        run_loop(main(), loop)
    finally:
        _unlink_socket(address)


def serve_sync(conn: Connection, address: str, workers: int = 8, **_: object) -> None:
    """grpc.server with a thread pool on ``address`` until the parent says stop."""

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        return request

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=OPTIONS)
    server.add_generic_rpc_handlers((_handler(echo),))
    bound = _bind(server, address)
    server.start()
    try:
        conn.send(("ready", {"pid": os.getpid(), "address": bound}))
        wait_for_stop(conn)
    finally:
        server.stop(None).wait(5)
        _unlink_socket(address)


class AioClient:
    """grpc.aio channel with a raw-bytes unary call: ``await client.call(payload)``."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=OPTIONS)
        self.call = self.channel.unary_unary(METHOD)

    async def close(self) -> None:
        await self.channel.close()


class SyncClient:
    """Blocking gRPC channel with a raw-bytes unary call: ``client.call(payload)``."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=OPTIONS)
        self.call = self.channel.unary_unary(METHOD)

    def close(self) -> None:
        self.channel.close()


async def open_aio(address: str, **_: object) -> AioClient:
    """Connect an aio client (waits until the channel is ready)."""
    c = AioClient(address)
    await asyncio.wait_for(c.channel.channel_ready(), 30)
    return c


def open_sync(address: str, **_: object) -> SyncClient:
    """Connect a blocking client (waits until the channel is ready)."""
    c = SyncClient(address)
    grpc.channel_ready_future(c.channel).result(timeout=30)
    return c
