"""A typed service: one contract class for server and client, checked by mypy.

    python examples/typed_service.py        # serves, calls, prints, exits
"""
from __future__ import annotations

import os
from typing import Protocol

import msgspec

import cxlrpc


class Point(msgspec.Struct):
    x: float
    y: float


class Geometry(cxlrpc.Service, Protocol):
    """The contract: names, request and response types (bodies are never run)."""

    async def norm(self, p: Point) -> float: ...
    async def midpoint(self, pair: tuple[Point, Point]) -> Point: ...


class GeometryImpl:
    async def norm(self, p: Point) -> float:
        return (p.x * p.x + p.y * p.y) ** 0.5

    async def midpoint(self, pair: tuple[Point, Point]) -> Point:
        a, b = pair
        return Point((a.x + b.x) / 2, (a.y + b.y) / 2)


async def main() -> None:
    url = f"shm://typed-example-{os.getpid()}"
    server = cxlrpc.Server(url)
    server.add_service(Geometry, GeometryImpl())
    async with server, cxlrpc.connect(url) as client:
        geo = client.stub(Geometry, timeout=1.0)
        print("norm:", await geo.norm(Point(3, 4)))
        print("midpoint:", await geo.midpoint((Point(0, 0), Point(2, 4))))
        print("methods:", await client.methods())


if __name__ == "__main__":
    cxlrpc.run(main())
