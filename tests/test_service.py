"""Typed services: a contract class shared by server and client; names and types come from it
(and mypy checks calls against it)."""
from __future__ import annotations

from pathlib import Path

from typing import Protocol

import msgspec
import pytest

import cxlrpc
from cxlrpc.service import rpcs

pytestmark = pytest.mark.timeout(60)
USAGE = Path(__file__).with_name("typing") / "stub_usage.py"


class Point(msgspec.Struct):
    x: int
    y: int


class Geometry(cxlrpc.Service, Protocol):
    async def norm(self, p: Point) -> int: ...
    async def origin(self) -> Point: ...
    async def scale(self, factor: float) -> list[float]: ...


class GeometryImpl(Geometry):
    async def norm(self, p: Point) -> int:
        return p.x * p.x + p.y * p.y

    async def origin(self) -> Point:
        return Point(0, 0)

    async def scale(self, factor: float) -> list[float]:
        return [1.0 * factor, 2.0 * factor]


class Duck:  # no subclassing: the same method names are enough
    async def norm(self, p: Point) -> int:
        return -1

    async def origin(self) -> Point:
        return Point(9, 9)

    async def scale(self, factor: float) -> list[float]:
        return []


def _small(url: str) -> dict:
    return ({"request_capacity": 64 << 10, "response_capacity": 64 << 10, "max_message_size": 1 << 20}
            if url.startswith("sim://") else {})


MEMORIES = ("shm", "sim")  # every test here runs on coherent memory and on the simulator


async def test_a_stub_calls_the_service_with_its_types(url):
    server = cxlrpc.Server(url, **_small(url))
    server.add_service(Geometry, GeometryImpl())
    async with server, cxlrpc.connect(url) as client:
        geo = client.stub(Geometry, timeout=5)
        assert await geo.norm(Point(3, 4)) == 25
        origin = await geo.origin()
        assert isinstance(origin, Point) and origin == Point(0, 0)  # decoded into the type
        assert await geo.scale(2.0) == [2.0, 4.0]
        assert await client.methods() == ["Geometry.norm", "Geometry.origin", "Geometry.scale"]
        with pytest.raises(cxlrpc.InvalidArgument):  # the server validates the request type
            await geo.norm("nope")  # type: ignore[arg-type]
        assert "Geometry" in repr(geo)


async def test_prefixes_and_duck_typed_implementations(url):
    server = cxlrpc.Server(url, **_small(url))
    server.add_service(Geometry, Duck(), prefix="v2/")
    async with server, cxlrpc.connect(url) as client:
        assert await client.stub(Geometry, prefix="v2/").origin() == Point(9, 9)
        with pytest.raises(cxlrpc.Unimplemented):  # the default names are not served
            await client.stub(Geometry, timeout=5).origin()


def test_contracts_that_cannot_be_served_are_refused():
    class Plain(cxlrpc.Service):
        def sync(self, x: int) -> int: ...

    class TwoArgs(cxlrpc.Service):
        async def two(self, a: int, b: int) -> int: ...

    class Untyped(cxlrpc.Service):
        async def what(self, a: int): ...

    for bad, why in ((Plain, "async def"), (TwoArgs, "at most one"), (Untyped, "return type"),
                     (cxlrpc.Service, "declares no methods")):
        with pytest.raises(TypeError, match=why):
            rpcs(bad)
    server = cxlrpc.Server("shm://never-started")
    with pytest.raises(TypeError, match="lacks Geometry.scale"):
        class Partial:
            async def norm(self, p: Point) -> int:
                return 0

            async def origin(self) -> Point:
                return Point(0, 0)

        server.add_service(Geometry, Partial())


def test_mypy_checks_calls_against_the_contract(monkeypatch):
    mypy = pytest.importorskip("mypy.api")
    monkeypatch.setenv("MYPYPATH", str(USAGE.parents[2]))  # the checkout: cxlrpc's source
    out, err, rc = mypy.run(["--no-incremental", "--follow-imports=silent", "--show-error-codes",
                             "--cache-dir", "/dev/null", str(USAGE)])
    errors = [line for line in out.splitlines() if "stub_usage.py:" in line and ": error:" in line]
    assert "cxlrpc" not in err and "Cannot find" not in out, (out, err)  # it saw the real types
    flagged = sorted({int(line.split(":")[1]) for line in errors})
    expected = sorted(i for i, text in enumerate(USAGE.read_text().splitlines(), 1) if "# E:" in text)
    assert flagged == expected, out
