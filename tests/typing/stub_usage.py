"""What mypy must accept and reject about typed stubs (checked by tests/test_service.py)."""
from __future__ import annotations

from typing import Protocol

import msgspec

import cxlrpc


class Point(msgspec.Struct):
    x: int
    y: int


class Geometry(cxlrpc.Service, Protocol):
    async def norm(self, p: Point) -> int: ...
    async def origin(self) -> Point: ...


async def good(client: cxlrpc.Client) -> int:
    geo = client.stub(Geometry, timeout=1.0)
    origin: Point = await geo.origin()
    return await geo.norm(origin)


async def bad(client: cxlrpc.Client) -> None:
    geo = client.stub(Geometry)
    await geo.norm("not a point")  # E: wrong request type
    name: str = await geo.origin()  # E: wrong response type
    await geo.nrom(Point(1, 2))  # E: no such method
