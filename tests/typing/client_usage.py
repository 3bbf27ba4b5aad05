"""What mypy infers of the client's calls (checked by tests/test_typing_client.py): each
``reveal_type`` line ends with the type it must show."""
from __future__ import annotations

import msgspec

import cxlrpc
from cxlrpc.channel import ClientChannel, FlushClientChannel
from cxlrpc.transport import ClientTransport


class Point(msgspec.Struct):
    x: int
    y: int


async def unary(client: cxlrpc.Client, sync: cxlrpc.SyncClient) -> None:
    reveal_type(await client.call("norm", Point(3, 4), response_type=Point))  # R: client_usage.Point
    reveal_type(await client.call("names", response_type=list[str]))  # R: list[str]
    reveal_type(await client.call("echo", b"x"))  # R: Any
    reveal_type(sync.call("norm", Point(3, 4), timeout=1.0, response_type=Point))  # R: client_usage.Point
    reveal_type(sync.call("echo", b"x"))  # R: Any


async def streams(client: cxlrpc.Client) -> None:
    async for tick in client.stream("ticks", 3, response_type=Point):
        reveal_type(tick)  # R: client_usage.Point
    async for item in client.stream("ticks", 3):
        reveal_type(item)  # R: Any
    call = client.open_stream("total", response_type=int)
    reveal_type(call)  # R: cxlrpc.streams.StreamCall[int]
    reveal_type(await call.response())  # R: int
    async with client.open_stream("chat", response_type=Point) as chat:
        async for reply in chat:
            reveal_type(reply)  # R: client_usage.Point


def seam(chan: ClientChannel, flushing: FlushClientChannel) -> list[ClientTransport]:
    return [chan, flushing]  # both channels implement the client's transport
