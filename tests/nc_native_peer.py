"""The two processes of tests/test_flush_native_ring.py: a flush-mode server and a client on a
``sim://`` region (each its own simulated cache), natively or on the reference
(CXLRPC_NO_NATIVE=1 in a process's environment), optionally with one native flush site made a
no-op (``Lines.skip``) in that process, to show a scenario catches its removal.

``python nc_native_peer.py serve URL EVICTION SKIP [CAPACITY]``: serve (``echo``, ``aecho``,
``stall``, and ``reset`` / ``counts`` of its flush sites' counts) until standard input closes;
prints ``ready native`` (or ``ready reference``: its dispatch) once serving.

``python nc_native_peer.py call URL EVICTION SKIP SCENARIO``: run one scenario as a client and
print ``ok ...`` or ``fail ...``:

- ``echo``: calls of many sizes (the small rings wrap often; some bodies go through the heap,
  which the reference carries), every reply checked.
- ``repair``: while the server stalls, the client fills its request ring, then a stray write of
  ours that reached memory puts garbage over the ring's tail word: only the producer's repair
  (its full push republishes the tail) lets the server read on, and the next call through.
- ``revoke``: the client freezes (no heartbeat, no monitor) until the server frees its slot;
  its next call must not push into the ring it no longer holds (ClaimRevoked), however stale
  the grant line its own cache holds.
"""
from __future__ import annotations

import asyncio
import sys
import time

CAPACITY = 8192  # both rings: a lap every ~10 calls of the echo scenario
CLIENT_TIMEOUT = 1.0
CALL_TIMEOUT = 2.0
SIZES = (0, 64, 7, 1000, 3000, 120, 4000, 10_000, 64, 2500)  # 10 000: through the heap
STALL_S = 0.6
GARBAGE = 0xDEADBEEFDEADBEEF


def sizes(count: int) -> list[int]:
    return [SIZES[i % len(SIZES)] for i in range(count)]


def payload(i: int, n: int) -> bytes:
    return bytes((i * 7 + k) & 0xFF for k in range(n))


def snapshot(lines) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """A Lines' counts per site and in total, taken together (another thread of ours, a
    heartbeat's, may flush between two reads: read again until none did)."""
    while True:
        totals, sites = lines.counts(), lines.site_counts()
        if lines.counts() == totals:
            return sites, totals


async def serve(url: str, skip: int, capacity: int) -> None:
    import cxlrpc

    server = cxlrpc.Server(url, slots=2, request_capacity=capacity, response_capacity=capacity,
                           max_message_size=1 << 16, coherence="flush", client_timeout=CLIENT_TIMEOUT)
    server.add_method("echo", lambda body: body)

    @server.method("aecho")
    async def aecho(body: bytes) -> bytes:
        return body

    server.add_method("reset", lambda: server._region.mem.lines.reset())  # type: ignore[union-attr]
    server.add_method("counts", lambda: snapshot(server._region.mem.lines))  # type: ignore[union-attr]

    @server.method("stall")
    def stall() -> str:
        time.sleep(STALL_S)  # (blocks the loop: requests pile up in the ring meanwhile)
        return "stalled"

    async with server:
        lines = server._region.mem.lines  # type: ignore[union-attr]
        lines.skip = skip
        print("ready", "native" if server._calls._fast is not None else "reference", flush=True)
        await asyncio.to_thread(sys.stdin.read)  # until the test closes our input


async def echo(client) -> str:
    count = 0
    for i, n in enumerate(sizes(60)):
        body = payload(i, n)
        reply = await client.call("echo" if i % 3 else "aecho", body, timeout=CALL_TIMEOUT)
        if reply != body:
            return f"fail wrong reply at call {i} ({n} bytes)"
        count += 1
    return f"ok {count}"


async def repair(client) -> str:
    from cxlrpc.errors import ResourceExhausted
    from cxlrpc.memory import RELEASE

    stalled = asyncio.ensure_future(client.call("stall", timeout=5.0))
    await asyncio.sleep(0.05)  # it went out: the server is stalled in its handler
    sent = 0
    try:
        while sent < 1000:
            client.send_nowait("echo", b"f" * 100)
            sent += 1
    except ResourceExhausted:
        pass
    else:
        return "fail repair: the request ring never filled"
    chan = client._conn.chan
    ring, mem = chan.requests, chan.region.mem
    mem.store(ring._tail_at, GARBAGE, RELEASE)  # a stray write of ours...
    mem.writeback(ring._tail_at, 8)  # ...that reached memory (an eviction)
    if await stalled != "stalled":
        return "fail repair: wrong reply to stall"
    after = b"after" * 40  # (no smaller than what filled the ring: it waits for room too)
    if await client.call("echo", after, timeout=CALL_TIMEOUT) != after:
        return "fail repair: wrong reply after the stall"
    return f"ok {sent}"


async def revoke(client, url: str) -> str:
    from cxlrpc.channel import _F_GRANT
    from cxlrpc.errors import Unavailable
    from cxlrpc.memory import ACQUIRE
    from cxlrpc.region import Region

    if await client.call("echo", b"first", timeout=CALL_TIMEOUT) != b"first":
        return "fail revoke: wrong first reply"
    conn = client._conn
    chan = conn.chan
    conn.link.stop.set()  # frozen: no heartbeat, no look at the slot...
    conn.link.monitor.join()
    grant_at = chan.geo.slot(chan.slot) + _F_GRANT
    with Region.open(url) as other:  # ...while another cache (ours alone) watches the grant
        deadline = time.monotonic() + 10 * CLIENT_TIMEOUT
        while True:
            other.mem.invalidate(grant_at, 8)
            if other.mem.load(grant_at, ACQUIRE) != chan._word:  # freed (or quarantined: held by nobody)
                break
            if time.monotonic() > deadline:
                return "fail revoke: the server never freed the frozen client's slot"
            await asyncio.sleep(0.02)
    tail = chan.requests._tail_local
    try:
        await client.call("echo", b"zombie", timeout=CALL_TIMEOUT)
    except Unavailable as exc:
        if chan.requests._tail_local != tail:
            return "fail revoke: pushed into the ring of a slot the server freed"
        return f"ok {type(exc.__cause__).__name__}"
    except Exception as exc:  # noqa: BLE001 (what the zombie's call got instead)
        return f"fail revoke: {type(exc).__name__} {exc} (pushed: {chan.requests._tail_local != tail})"
    return "fail revoke: a freed slot's call was answered"


async def call(url: str, skip: int, scenario: str) -> str:
    import cxlrpc

    client = cxlrpc.Client(url, server_timeout=5.0)
    await asyncio.wait_for(client.open(), 5.0)
    try:
        client._conn.chan.region.mem.lines.skip = skip
        native = "native" if client._conn.caller is not None else "reference"
        try:
            if scenario == "echo":
                out = await echo(client)
            elif scenario == "repair":
                out = await repair(client)
            else:
                out = await revoke(client, url)
        except cxlrpc.RpcError as exc:
            out = f"fail {scenario}: {type(exc).__name__} {exc}"
        return f"{out} {native}"
    finally:
        await client.close()


def main(argv: list[str]) -> int:
    role, url, eviction, skip = argv[:4]
    import cxlrpc
    import cxlrpc.simulator

    cxlrpc.simulator.EVICTION_RATE = float(eviction)
    if role == "serve":
        cxlrpc.run(serve(url, int(skip), int(argv[4]) if len(argv) > 4 else CAPACITY))
    else:
        print(cxlrpc.run(call(url, int(skip), argv[4])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
