"""A typed service with every kind of stream, behind interceptors on both sides.

``Telemetry`` is the contract server and client share (mypy checks the stub's calls):
``record`` reads a stream of samples and answers once (client stream), ``watch`` streams
summaries (server stream), ``normalize`` answers each sample as it comes (bidirectional),
``reset`` is a plain call. A server interceptor refuses calls without the tenant's token and
logs each call; a client interceptor sends the token.

    python examples/streaming_service.py [URL]   # serves, calls, prints, exits 0
"""
from __future__ import annotations

import asyncio
import sys
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

import msgspec

import cxlrpc

TOKEN = "tenant-a:s3cret"


class Sample(msgspec.Struct):
    sensor: str
    value: float


class Summary(msgspec.Struct):
    count: int
    mean: float


class Telemetry(cxlrpc.Service, Protocol):
    """The contract: names, request and response types, and which sides stream."""

    async def record(self, samples: AsyncIterator[Sample]) -> Summary: ...
    def watch(self, updates: int) -> AsyncIterator[Summary]: ...
    def normalize(self, samples: AsyncIterator[Sample]) -> AsyncIterator[float]: ...
    async def reset(self) -> int: ...


class TelemetryImpl:
    def __init__(self) -> None:
        self.values: list[float] = []
        self.changed = asyncio.Event()

    def summary(self) -> Summary:
        n = len(self.values)
        return Summary(n, sum(self.values) / n if n else 0.0)

    async def record(self, samples: AsyncIterator[Sample]) -> Summary:
        async for s in samples:  # credit-paced: a slow loop here slows the sender
            self.values.append(s.value)
            self.changed.set()
        return self.summary()

    async def watch(self, updates: int) -> AsyncIterator[Summary]:
        for _ in range(updates):
            await self.changed.wait()
            self.changed.clear()
            yield self.summary()

    async def normalize(self, samples: AsyncIterator[Sample]) -> AsyncIterator[float]:
        mean = self.summary().mean or 1.0
        async for s in samples:
            yield s.value / mean

    async def reset(self) -> int:
        n, self.values = len(self.values), []
        return n


# ---------------------------------------------------------------- interceptors
async def require_token(call: cxlrpc.HandlerContext, next: Callable[[], Awaitable[Any]]) -> Any:
    """Refuse calls without the tenant's token: the handler never runs for them."""
    if call.metadata.get("authorization") != f"Bearer {TOKEN}":
        raise cxlrpc.Unauthenticated("missing or wrong token")
    return await next()


async def log_calls(call: cxlrpc.HandlerContext, next: Callable[[], Awaitable[Any]]) -> Any:
    """Log each call; for a method whose replies stream, next() gives the stream before any
    item is sent, so the log wraps it to see the end."""
    t0 = time.perf_counter()
    result = await next()
    if not isinstance(result, AsyncIterator):
        print(f"server: {call.method} -> {result!r} in {(time.perf_counter() - t0) * 1e6:.0f} us")
        return result

    async def logged() -> AsyncIterator[Any]:
        n = 0
        async for item in result:
            n += 1
            yield item
        print(f"server: {call.method} streamed {n} items in {(time.perf_counter() - t0) * 1e3:.1f} ms")
    return logged()


def bearer(token: str) -> cxlrpc.ClientInterceptor:
    """A client interceptor that sends ``token`` with every call, streams included."""
    async def add_token(method: str, arg: Any, metadata: dict, next: Callable) -> Any:
        metadata["authorization"] = f"Bearer {token}"
        return await next(method, arg, metadata)
    return add_token


# ---------------------------------------------------------------- the run
async def samples(n: int) -> AsyncIterator[Sample]:
    for i in range(n):
        yield Sample(f"s{i % 3}", float(i))


async def main(url: str) -> int:
    server = cxlrpc.Server(url, slots=4, interceptors=[require_token, log_calls])
    server.add_service(Telemetry, TelemetryImpl())
    async with server, cxlrpc.connect(url, interceptors=[bearer(TOKEN)]) as client:
        telemetry = client.stub(Telemetry, timeout=10.0)
        watched = asyncio.ensure_future(_collect(telemetry.watch(2)))
        first = await telemetry.record(samples(100))
        print("record:", first)
        await asyncio.sleep(0.01)
        second = await telemetry.record(samples(50))
        print("record:", second)
        print("watch:", await watched)
        ratios = [r async for r in telemetry.normalize(samples(4))]
        print("normalize:", [round(r, 3) for r in ratios])
        print("reset:", await telemetry.reset())
        async with cxlrpc.connect(url) as stranger:  # no token
            try:
                await stranger.stub(Telemetry, timeout=10.0).record(samples(1))
            except cxlrpc.Unauthenticated as exc:
                print("stranger:", exc.code.name)
            else:
                return 1
    return 0 if first.count == 100 and second.count == 150 and len(ratios) == 4 else 1


async def _collect(stream: AsyncIterator[Summary]) -> list[Summary]:
    return [s async for s in stream]


if __name__ == "__main__":
    sys.exit(cxlrpc.run(main(sys.argv[1] if len(sys.argv) > 1 else "shm://streaming-demo")))
