"""What mypy must accept and reject about typed stubs (checked by tests/test_service.py)."""
from __future__ import annotations

from typing import AsyncIterator, Protocol

import msgspec

import cxlrpc


class Point(msgspec.Struct):
    x: int
    y: int


class Geometry(cxlrpc.Service, Protocol):
    async def norm(self, p: Point) -> int: ...
    async def origin(self) -> Point: ...


class Stats(cxlrpc.Service, Protocol):
    async def total(self, xs: AsyncIterator[int]) -> int: ...
    def squares(self, xs: AsyncIterator[int]) -> AsyncIterator[int]: ...
    def countdown(self, n: int) -> AsyncIterator[Point]: ...


async def numbers() -> AsyncIterator[int]:
    yield 1


async def streams(client: cxlrpc.Client) -> list[int]:
    stats = client.stub(Stats)
    total: int = await stats.total(numbers())
    points: list[Point] = [p async for p in stats.countdown(3)]
    return [total, len(points)] + [x async for x in stats.squares(numbers())]


async def bad_streams(client: cxlrpc.Client) -> None:
    stats = client.stub(Stats)
    await stats.total(3)  # E: a stream of requests, not one
    names: list[str] = [p async for p in stats.countdown(3)]  # E: items are Points
    await stats.countdown(3)  # E: a stream is iterated, not awaited


async def good(client: cxlrpc.Client) -> int:
    geo = client.stub(Geometry, timeout=1.0)
    origin: Point = await geo.origin()
    return await geo.norm(origin)


async def bad(client: cxlrpc.Client) -> None:
    geo = client.stub(Geometry)
    await geo.norm("not a point")  # E: wrong request type
    name: str = await geo.origin()  # E: wrong response type
    await geo.nrom(Point(1, 2))  # E: no such method
