"""Peers of the per-connection bounds tests (tests/test_bounds.py): a server with a ``stats``
method, hostile clients in child processes (one that stops reading its replies, one that
floods ALLOCs, one that drip-feeds followed requests), and the bystander's latency probe."""
from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator

from procs import CTX, _serve_until_sigterm, stop


def _stats(server: Any) -> dict:
    """What the server holds for its clients (works on any version of Server's structures)."""
    backlog = [entry for queue in server._replies.backlog.values() for entry in queue]
    heap = server._bodies.heap
    return {"backlog_replies": len(backlog),
            "backlog_bytes": sum(len(head) + len(body) for _, head, body in backlog),
            "alloc_waiters": len(server._bodies.heap_waiting),
            "following": len(server._bodies.following),
            "heap_used": heap.used if heap is not None else 0}


def _server_main(url: str, opts: dict, ready) -> None:
    import cxlrpc

    async def main() -> None:
        server = cxlrpc.Server(url, **opts)

        @server.method("echo")
        def echo(payload: bytes) -> bytes:
            return payload

        @server.method("size")
        def size(payload: bytes) -> int:
            return len(payload)

        @server.method("stats")
        def stats() -> dict:
            return _stats(server)

        await _serve_until_sigterm(server, ready)

    asyncio.run(main())


@contextmanager
def bounded_server(url: str, **opts: Any) -> Iterator[Any]:
    """A server (echo, size, stats, pid) in a child process; SIGTERM and join on exit."""
    ready = CTX.Event()
    proc = CTX.Process(target=_server_main, args=(url, opts, ready), daemon=True)
    proc.start()
    try:
        if not ready.wait(30):
            raise TimeoutError("server did not start")
        yield proc
    finally:
        stop(proc)


def rss_bytes(pid: int) -> int:
    """A process's resident memory."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def p50_ratios(idle: Any, busy: Any, rounds: int, calls: int = 60,
               between: Any = None) -> list[float]:
    """Echo p50 against ``busy``'s over ``idle``'s (two blocking clients), measured alternately
    ``rounds`` times; ``between()`` runs after each round."""
    payload = b"x" * 64
    ratios = []
    for _ in range(rounds):
        p50 = []
        for client in (idle, busy):
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                assert client.call("echo", payload, timeout=10) == payload
                times.append(time.perf_counter() - t0)
            p50.append(statistics.median(times))
        ratios.append(p50[1] / p50[0])
        if between is not None:
            between()
    return ratios


# --------------------------------------------------------------------------- hostile peers
def _statuses(chan: Any) -> Counter:
    """Read what is in the client's response ring now: a count per (kind, status)."""
    from cxlrpc import frame as fr

    seen: Counter = Counter()

    def on(view: memoryview) -> None:
        kind, _, status = fr.HEADER.unpack_from(view)[:3]
        seen[(kind, status)] += 1

    while chan.responses.poll(on):
        pass
    return seen


def _drain(chan: Any, quiet: float, most: float) -> Counter:
    """Read replies until none came for ``quiet`` seconds (``most`` in all)."""
    seen: Counter = Counter()
    end = time.monotonic() + most
    last = time.monotonic()
    while time.monotonic() < end and time.monotonic() - last < quiet:
        got = _statuses(chan)
        if got:
            seen += got
            last = time.monotonic()
        else:
            time.sleep(0.001)
    return seen


def _report(seen: Counter) -> dict:
    from cxlrpc import StatusCode
    from cxlrpc import frame as fr

    ok, exhausted = (fr.RESPONSE, 0), (fr.ERROR, int(StatusCode.RESOURCE_EXHAUSTED))
    return {"responses": seen[ok], "exhausted": seen[exhausted],
            "other": sum(n for what, n in seen.items() if what not in (ok, exhausted))}


def _non_reader_main(url: str, size: int, started, stopping, out) -> None:
    """Calls ``echo`` with ``size``-byte bodies, bursts of 8 every 2 ms, never reading a reply
    until ``stopping``; then reads them all and reports what it got."""
    import cxlrpc
    from cxlrpc import frame as fr

    client = cxlrpc.connect_sync(url)
    client.call("echo", b"attached", timeout=10)
    chan, body, call_id, sent = client._conn.chan, bytes(size), 1 << 20, 0
    started.set()
    while not stopping.is_set():
        for _ in range(8):
            head = fr.HEADER.pack(fr.REQUEST, fr.RAW, 0, chan.slot, chan.gen, call_id, 0.0, 4)
            if chan.push((head, b"echo", body)):
                call_id += 1
                sent += 1
        chan.server_bell.ring()
        time.sleep(0.002)
    out.send({"sent": sent, **_report(_drain(chan, 1.0, 10.0))})
    client.close()


def _alloc_flooder_main(url: str, size: int, started, stopping, out) -> None:
    """ALLOCs ``size`` bytes without a deadline, bursts of 16 every 2 ms (reading its replies)
    until ``stopping``; reports what it got (it never uses a grant)."""
    import cxlrpc
    from cxlrpc import frame as fr
    from cxlrpc.heap import GRANT

    client = cxlrpc.connect_sync(url)
    client.call("echo", b"attached", timeout=10)
    chan, call_id, sent, seen = client._conn.chan, 1 << 20, 0, Counter()
    started.set()
    while not stopping.is_set():
        for _ in range(16):
            head = fr.header(fr.ALLOC, fr.RAW, 0, chan.slot, chan.gen, call_id, 0.0, b"")
            if chan.push((head, GRANT.pack(size, 0))):
                call_id += 1
                sent += 1
        chan.server_bell.ring()
        seen += _statuses(chan)
        time.sleep(0.002)
    seen += _drain(chan, 0.5, 5.0)
    out.send({"sent": sent, **_report(seen)})
    client.close()


def _drip_feeder_main(url: str, count: int, length: int, started, stopping, out) -> None:
    """Starts ``count`` followed requests of ``length`` bytes (ALLOC each, send its frame) and
    moves each one's progress by one byte every 0.3 s, never finishing, until ``stopping``;
    reports the replies it got."""
    import cxlrpc
    from cxlrpc import frame as fr
    from cxlrpc.heap import EXTENT, FOLLOW_HEADER, GRANT
    from cxlrpc.memory import RELEASE

    client = cxlrpc.connect_sync(url)
    client.call("echo", b"attached", timeout=10)
    chan, heap = client._conn.chan, client._bodies.heap
    offsets: list[int] = []
    grants: dict[int, int] = {}
    seen: Counter = Counter()

    def on(view: memoryview) -> None:
        kind, _, status, _, _, call_id = fr.HEADER.unpack_from(view)[:6]
        if kind == fr.RESPONSE and call_id < 1 << 20:
            grants[call_id] = GRANT.unpack_from(view, fr.HEADER_SIZE)[0]
        else:
            seen[(kind, status)] += 1

    for i in range(1, count + 1):  # one ALLOC at a time: a grant each
        head = fr.header(fr.ALLOC, fr.RAW, 0, chan.slot, chan.gen, i, 10.0, b"")
        while not chan.push((head, GRANT.pack(FOLLOW_HEADER + length, 0))):
            time.sleep(0.001)
        chan.server_bell.ring()
        end = time.monotonic() + 10
        while i not in grants and time.monotonic() < end:
            if not chan.responses.poll(on):
                time.sleep(0.0002)
        offset = grants[i]
        heap.check(offset, FOLLOW_HEADER + length)
        heap.mem.store(heap.start + offset, 0, RELEASE)
        offsets.append(offset)
    for i, offset in enumerate(offsets):
        head = fr.HEADER.pack(fr.REQUEST, fr.RAW | fr.HEAP | fr.FOLLOW, 0, chan.slot, chan.gen,
                              (1 << 20) + i, 0.0, 4)
        while not chan.push((head, b"size", EXTENT.pack(offset, length))):
            time.sleep(0.001)
    chan.server_bell.ring()
    started.set()
    done = 0
    while not stopping.wait(0.3):
        done = min(done + 1, length - 1)
        for offset in offsets:
            heap.mem.store(heap.start + offset, done, RELEASE)
        while chan.responses.poll(on):
            pass
    while chan.responses.poll(on):
        pass
    out.send({"sent": count, **_report(seen)})
    client.close()


@contextmanager
def hostile(main: Any, url: str, *args: Any) -> Iterator[Any]:
    """A hostile client ``main(url, *args, started, stopping, out)`` in a child process, once it
    started: ``with hostile(...) as peer``, then ``peer.stopping.set()`` and ``peer.result()``."""
    started, stopping = CTX.Event(), CTX.Event()
    receive, send = CTX.Pipe(duplex=False)
    proc = CTX.Process(target=main, args=(url, *args, started, stopping, send), daemon=True)
    proc.start()
    proc.stopping = stopping

    def result(timeout: float = 20.0) -> dict:
        stopping.set()
        if not receive.poll(timeout):
            raise TimeoutError("the hostile client did not report")
        return receive.recv()

    proc.result = result
    try:
        if not started.wait(30):
            raise TimeoutError("the hostile client did not start")
        yield proc
    finally:
        stopping.set()
        stop(proc)
        receive.close()
        send.close()
