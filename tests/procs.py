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
