"""A peer run in other PID, network and UTS namespaces (``unshare -pfnu --mount-proc``): it
shares only /dev/shm with the test, like a container of another pod or another host.

``python ns_peer.py client URL``: connects, then (after a line on stdin) measures busy round
trips for at least 0.3 s, then (after another line) after-idle round trips and its own idle
CPU, printing one JSON line per phase; then keeps calling until the server is gone and
reports how long that took after the test wrote ``killed`` on stdin.
``python ns_peer.py server URL``: serves echo until SIGTERM, printing ``ready`` first.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


async def client(url: str) -> None:
    import cxlrpc

    t0 = time.perf_counter()
    async with cxlrpc.connect(url) as c:
        emit(phase="connected", connect_s=time.perf_counter() - t0, host=socket.gethostname(),
             pid=os.getpid())
        await asyncio.to_thread(sys.stdin.readline)  # the test's local client is calling now
        lat = []
        busy_until = time.perf_counter() + 0.3  # long enough for the local client to call meanwhile
        i = 0
        while i < 2000 or time.perf_counter() < busy_until:
            p = i.to_bytes(8, "little") * 8
            t = time.perf_counter()
            assert await c.call("echo", p, timeout=5) == p
            lat.append(time.perf_counter() - t)
            i += 1
        lat.sort()
        emit(phase="busy", p50_us=lat[len(lat) // 2] * 1e6, p99_us=lat[int(len(lat) * 0.99)] * 1e6)
        await asyncio.to_thread(sys.stdin.readline)  # the test stops its local client first
        after_idle = []
        for idle in (0.5, 0.5, 1.0, 3.0):
            await asyncio.sleep(idle)  # the scenario itself: a client idle for this long
            t = time.perf_counter()
            assert await c.call("echo", b"after idle", timeout=5) == b"after idle"
            after_idle.append((idle, (time.perf_counter() - t) * 1e6))
        emit(phase="after_idle", calls=after_idle)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(3.0)  # idle, connected: how much CPU does waiting cost?
        emit(phase="idle_cpu", share=(time.process_time() - cpu0) / (time.perf_counter() - wall0))
        emit(phase="waiting_for_kill")
        loop = asyncio.get_running_loop()
        killed_at: list[float] = []
        loop.add_reader(sys.stdin.fileno(), lambda: (sys.stdin.readline(), killed_at.append(time.perf_counter())))
        while True:
            try:
                await c.call("echo", b"x", timeout=1.0)
            except cxlrpc.Unavailable as exc:
                if not killed_at:
                    raise
                emit(phase="server_gone", detect_s=time.perf_counter() - killed_at[0], error=str(exc))
                return
            except cxlrpc.DeadlineExceeded:
                pass
            await asyncio.sleep(0.01)


async def server(url: str) -> None:
    import cxlrpc

    srv = cxlrpc.Server(url, client_timeout=1.0)

    @srv.method("echo")
    async def echo(payload: bytes) -> bytes:
        return payload

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: loop.create_task(srv.close()))
    async with srv:
        emit(phase="ready", pid=os.getpid(), host=socket.gethostname())
        await srv.serve_forever()


if __name__ == "__main__":
    role, url = sys.argv[1], sys.argv[2]
    import cxlrpc

    cxlrpc.run(client(url) if role == "client" else server(url))  # uvloop, as users run it
