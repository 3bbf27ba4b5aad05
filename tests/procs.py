"""Processes the tests start: servers and clients in their own interpreters (spawn)."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from contextlib import contextmanager
from typing import Iterator

CTX = mp.get_context("spawn")


def _echo_server_main(url: str, ready, opts: dict) -> None:
    import cxlrpc

    async def main() -> None:
        server = cxlrpc.Server(url, **opts)

        @server.method("echo")
        def echo(payload):
            return payload

        @server.method("sleep")
        async def sleep(seconds: float) -> float:
            await asyncio.sleep(seconds)
            return seconds

        @server.method("pid")
        def pid() -> int:
            return os.getpid()

        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: loop.create_task(server.close()))
        async with server:
            ready.set()
            await server.serve_forever()

    asyncio.run(main())


@contextmanager
def echo_server(url: str, **opts) -> Iterator[mp.Process]:
    """Run an echo server in a child process; SIGTERM (clean close) and join on exit."""
    ready = CTX.Event()
    proc = CTX.Process(target=_echo_server_main, args=(url, ready, opts), daemon=True)
    proc.start()
    try:
        if not ready.wait(20):
            raise TimeoutError("echo server did not start")
        yield proc
    finally:
        stop(proc)


def stop(proc: mp.Process, timeout: float = 10.0) -> None:
    """End a child: SIGTERM, then SIGKILL after ``timeout``; always reaped."""
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout)


def wait_for(cond, timeout: float, interval: float = 0.01) -> bool:
    """Poll ``cond()`` until true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())


def _client_hold_main(url: str, ready, call_slow: bool) -> None:
    import cxlrpc

    client = cxlrpc.connect_sync(url)
    client.call("echo", b"attached", timeout=10)
    ready.set()
    if call_slow:
        client.call("sleep", 60.0, timeout=120)
    while True:
        time.sleep(1)


def client_holding_slot(url: str, call_slow: bool = False) -> mp.Process:
    """A child that attaches a blocking client (optionally sits in a slow call) and waits to be killed."""
    ready = CTX.Event()
    proc = CTX.Process(target=_client_hold_main, args=(url, ready, call_slow), daemon=True)
    proc.start()
    if not ready.wait(20):
        stop(proc)
        raise TimeoutError("client child did not attach")
    return proc


def cpu_seconds(pid: int) -> float:
    """User+system CPU time of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
