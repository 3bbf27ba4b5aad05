"""cxlrpc echo: an asyncio server process, and asyncio / blocking client openers."""
from __future__ import annotations

import functools
import os
from multiprocessing.connection import Connection
from typing import Any

import cxlrpc

from .grpc_echo import run_loop
from .procs import wait_readable

#: The server's default ring capacity: frames up to 2 MiB go through the rings, bigger bodies
#: (the 16 MiB payload) through the region's heap, with every other setting at its default.
DEFAULT_CAPACITY = 4 << 20


def serve(conn: Connection, address: str, max_payload: int = 1 << 20, doorbell: str = "adaptive",
          loop: str = "uvloop", handler: str = "async", coherence: str = "hardware", **_: object) -> None:
    """Serve ``echo`` on ``address`` until the parent says stop; close cleanly (unlinks the region).

    ``handler``: ``"async"`` (an ``async def``, what users write and what grpc.aio servicers
    are), ``"plain"`` (a plain function, the cheapest shape) or ``"view"`` (a plain function
    taking a ``memoryview``: it reads the request in place, as iceoryx2's server does). ``coherence``: the server's
    ``"hardware"`` or ``"flush"`` layout (flush: each client's own request ring of ``cap``).
    Bodies past a ring go through the heap: ``max_payload`` raises ``max_message_size`` only
    past its 64 MiB default."""
    cap = DEFAULT_CAPACITY

    async def main() -> None:
        server = cxlrpc.Server(address, doorbell=doorbell, request_capacity=cap, response_capacity=cap,
                               coherence=coherence, max_message_size=max(64 << 20, max_payload))

        async def echo_async(payload: bytes) -> bytes:
            return payload

        def echo_plain(payload: bytes) -> bytes:
            return payload

        def echo_view(payload: memoryview) -> memoryview:
            return payload

        server.add_method("echo", {"async": echo_async, "plain": echo_plain, "view": echo_view}[handler])

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
