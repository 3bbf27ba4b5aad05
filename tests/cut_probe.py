"""Processes for tests/test_region_truncation.py: a server, and a client that waits to be told
its region's file was truncated (issue 40, item 12).

    python tests/cut_probe.py server URL       # echo server; prints "ready", serves until it stops
    python tests/cut_probe.py kv URL           # a KVServer; prints its pool's file, serves until it stops
    python tests/cut_probe.py client URL       # prints {"heap": ...}; on a line of stdin, waits
                                               # to be told the server is gone, then calls with a
                                               # 1 MiB body (through the heap): JSON of both
A process that stops by an exception prints it as JSON ({"raised": "Type: message"}) and exits 3.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

SMALL = dict(slots=2, request_capacity=64 << 10, response_capacity=64 << 10,
             max_message_size=4 << 20, client_timeout=5.0)


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def server(url: str) -> None:
    import cxlrpc

    srv = cxlrpc.Server(url, **SMALL)
    srv.add_method("echo", lambda payload: payload)
    async with srv:
        say(ready=True)
        await srv.serve_forever()


async def kv(url: str) -> None:
    from kvservice import KVServer

    async with KVServer(url, pool_size=8 << 20, **SMALL) as srv:
        say(ready=True, pool=srv._pool.region.path)
        await srv.serve_forever()


def client(url: str) -> None:
    import cxlrpc

    with cxlrpc.connect_sync(url) as c:
        assert c.call("echo", b"hello", timeout=10) == b"hello"
        say(heap=c._conn.chan.geo.heap, size=c._conn.chan.region.size)
        sys.stdin.readline()  # the test truncated the region's file meanwhile
        deadline = time.monotonic() + 10
        while c._conn.gone is None and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            c.call("echo", bytes(1 << 20), timeout=10)
            outcome = "ok"
        except cxlrpc.RpcError as exc:
            outcome = f"{type(exc).__name__}: {exc.message}"
        say(gone=c._conn.gone, call=outcome)


if __name__ == "__main__":
    role, where = sys.argv[1], sys.argv[2]
    try:
        if role == "client":
            client(where)
        else:
            asyncio.run({"server": server, "kv": kv}[role](where))
    except Exception as exc:
        say(raised=f"{type(exc).__name__}: {exc}")
        sys.exit(3)
