"""cxlrpc echo: an asyncio server process, and asyncio / blocking client openers."""
from __future__ import annotations

import functools
import os
from multiprocessing.connection import Connection
from typing import Any

import cxlrpc

from .grpc_echo import run_loop
from .procs import wait_readable

DEFAULT_CAPACITY = 4 << 20


def capacity_for(max_payload: int) -> int:
    """Ring capacity (power of two, >= the 4 MiB default, as the bare ring) whose payload limit fits ``max_payload``."""
    cap = DEFAULT_CAPACITY
    while cap // 2 - 4096 < max_payload:
        cap *= 2
    return cap


def serve(conn: Connection, address: str, max_payload: int = 1 << 20, doorbell: str = "adaptive",
          loop: str = "uvloop", handler: str = "async", coherence: str = "hardware", **_: object) -> None:
    """Serve ``echo`` on ``address`` until the parent says stop; close cleanly (unlinks the region).

    ``handler``: ``"async"`` (an ``async def``, what users write and what grpc.aio servicers
    are) or ``"plain"`` (a plain function, the cheapest shape). ``coherence``: the server's
    ``"hardware"`` or ``"flush"`` layout (flush: each client's own request ring of ``cap``)."""
    cap = capacity_for(max_payload)

    async def main() -> None:
        server = cxlrpc.Server(address, doorbell=doorbell, request_capacity=cap, response_capacity=cap,
                               coherence=coherence)

        async def echo_async(payload: bytes) -> bytes:
            return payload

        def echo_plain(payload: bytes) -> bytes:
            return payload

        server.add_method("echo", echo_async if handler == "async" else echo_plain)

        async with server:
            conn.send(("ready", {"pid": os.getpid(), "address": address, "capacity": cap}))
            await wait_readable(conn, on_sigterm=True)
            await server.close()

    run_loop(main(), loop)


class AsyncEcho:
    """An asyncio cxlrpc client bound to the ``echo`` method: ``await c.call(payload)``."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.call = functools.partial(client.call, "echo")

    async def close(self) -> None:
        await self.client.close()


class SyncEcho:
    """A blocking cxlrpc client bound to ``echo``: ``c.call(payload)``."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.call = functools.partial(client.call, "echo")

    def close(self) -> None:
        self.client.close()


async def open_async(address: str, doorbell: str = "adaptive", **_: object) -> AsyncEcho:
    """Connect an asyncio client with the given doorbell strategy."""
    return AsyncEcho(await cxlrpc.connect(address, doorbell=doorbell))


def open_sync(address: str, doorbell: str = "adaptive", **_: object) -> SyncEcho:
    """Connect a blocking client with the given doorbell strategy."""
    return SyncEcho(cxlrpc.connect_sync(address, doorbell=doorbell))
