"""Graceful shutdown (``Server.close(grace)``, ``shutdown_grace``) and the methods every server
answers (``cxlrpc.health``, ``cxlrpc.methods``), through the clients and the CLI, on coherent
shared memory (shm://) and on the simulator of memory without coherence (sim://)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import cxlrpc

from procs import run_python, until

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
USER_METHODS = ["echo", "held", "held_in_thread", "slow"]


MEMORIES = ("shm", "sim")  # every test here runs on coherent memory and on the simulator


class Handlers:
    """What the test server's handlers report, and the gates that hold them."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gate = asyncio.Event()  # "held" waits for it
        self.release = threading.Event()  # "held_in_thread" waits for it
        self.cancelled = asyncio.Event()  # set when "held" is cancelled


def make_server(url: str, **opts) -> tuple[cxlrpc.Server, Handlers]:
    if url.startswith("sim://"):  # the simulator copies whole regions: keep them small
        opts.setdefault("request_capacity", 256 << 10)
        opts.setdefault("response_capacity", 256 << 10)
    server = cxlrpc.Server(url, **opts)
    h = Handlers()

    @server.method("echo")
    def echo(payload):
        return payload

    @server.method("held")
    async def held(value):
        h.started.append("held")
        try:
            await h.gate.wait()
        except asyncio.CancelledError:
            h.cancelled.set()
            raise
        return value

    @server.method("held_in_thread", blocking=True)
    def held_in_thread(value: str) -> str:
        h.started.append("held_in_thread")
        h.release.wait(30)
        return value

    @server.method("slow")
    async def slow(seconds: float) -> float:
        h.started.append("slow")
        await asyncio.sleep(seconds)
        return seconds

    return server, h


async def status_is(client: cxlrpc.Client, status: str) -> bool:
    return await client.health(timeout=5) == status


async def cli(*args: str, timeout: float = 30) -> tuple[int, str, str]:
    """Run ``python -m cxlrpc ARGS`` without blocking the loop: (exit status, stdout, stderr)."""
    return await run_python(("-m", "cxlrpc", *args), timeout, cwd=str(ROOT))


async def test_grace_lets_calls_in_flight_finish(url):
    """Async and blocking handlers running when close(grace) begins finish and their replies
    arrive; close returns as soon as they are done, not at the end of the grace."""
    server, h = make_server(url)
    await server.start()
    try:
        async with cxlrpc.connect(url) as client:
            calls = [asyncio.create_task(client.call("held", "a", timeout=30)),
                     asyncio.create_task(client.call("held_in_thread", "b", timeout=30))]
            assert await until(lambda: len(h.started) == 2, 10)
            closing = asyncio.create_task(server.close(grace=30))
            assert await until(lambda: status_is(client, "NOT_SERVING"), 10)
            h.gate.set()
            h.release.set()
            assert await asyncio.wait_for(asyncio.gather(*calls), 10) == ["a", "b"]
            await asyncio.wait_for(closing, 10)
            assert not h.cancelled.is_set()
    finally:
        h.release.set()
        await server.close()


async def test_replies_waiting_for_room_are_delivered_before_the_grace_ends(url):
    """Replies finished in the grace that meet a full response ring wait in the server's
    backlog; close keeps writing them out as the client reads, and only then returns."""
    server, h = make_server(url, response_capacity=4096)
    await server.start()
    try:
        async with cxlrpc.connect(url) as client:
            values = [b"r" * 1500 + bytes([i]) for i in range(20)]  # ~30 KiB through a 4 KiB ring
            calls = [asyncio.create_task(client.call("held", v, timeout=30)) for v in values]
            assert await until(lambda: len(h.started) == len(values), 10)
            closing = asyncio.create_task(server.close(grace=30))
            assert await until(lambda: status_is(client, "NOT_SERVING"), 10)
            h.gate.set()
            assert await asyncio.wait_for(asyncio.gather(*calls), 10) == values
            await asyncio.wait_for(closing, 10)
    finally:
        await server.close()


async def test_calls_still_running_when_the_grace_ends_are_cancelled(url):
    """Calls outlasting the grace are cancelled (the async handler sees CancelledError) and
    their callers get UNAVAILABLE instead of waiting forever."""
    server, h = make_server(url)
    await server.start()
    loop = asyncio.get_running_loop()
    try:
        async with cxlrpc.connect(url) as client:
            calls = [asyncio.create_task(client.call("held", "a")),
                     asyncio.create_task(client.call("held_in_thread", "b"))]
            assert await until(lambda: len(h.started) == 2, 10)
            began = loop.time()
            await asyncio.wait_for(server.close(grace=0.3), 10)
            assert loop.time() - began >= 0.29, "the calls were not given their grace"
            assert h.cancelled.is_set()
            for call in calls:
                with pytest.raises(cxlrpc.Unavailable):
                    await asyncio.wait_for(call, 5)
    finally:
        h.release.set()
        await server.close()


async def test_during_the_grace_new_calls_are_refused_and_health_is_not_serving(url):
    """While the grace runs, new calls (from connected and newly connected clients) get
    UNAVAILABLE; health says NOT_SERVING and the method list is still answered."""
    server, h = make_server(url)
    await server.start()
    try:
        async with cxlrpc.connect(url) as client:
            call = asyncio.create_task(client.call("held", "a", timeout=30))
            assert await until(lambda: h.started == ["held"], 10)
            assert await client.health(timeout=5) == "SERVING"
            closing = asyncio.create_task(server.close(grace=30))
            assert await until(lambda: status_is(client, "NOT_SERVING"), 10)
            with pytest.raises(cxlrpc.Unavailable, match="server is shutting down"):
                await client.call("echo", 1, timeout=5)
            assert await client.methods(timeout=5) == USER_METHODS

            def newcomer() -> str:
                with cxlrpc.connect_sync(url) as sync_client:
                    with pytest.raises(cxlrpc.Unavailable, match="server is shutting down"):
                        sync_client.call("slow", 5.0, timeout=5)
                    return sync_client.health(timeout=5)
            assert await asyncio.to_thread(newcomer) == "NOT_SERVING"
            assert h.started == ["held"], "a refused call ran"
            h.gate.set()
            assert await asyncio.wait_for(call, 10) == "a"
            await asyncio.wait_for(closing, 10)
    finally:
        await server.close()


async def test_close_twice_and_concurrently_returns_and_a_later_close_can_shorten_the_grace(url):
    server, h = make_server(url)
    await server.close()  # never started: nothing to do
    await server.start()
    try:
        async with cxlrpc.connect(url) as client:
            call = asyncio.create_task(client.call("held", "a"))
            assert await until(lambda: h.started == ["held"], 10)
            first = asyncio.create_task(server.close(grace=30))
            second = asyncio.create_task(server.close(grace=30))
            assert await until(lambda: status_is(client, "NOT_SERVING"), 10)
            await asyncio.wait_for(server.close(grace=0.1), 10)  # ends the others' grace too
            await asyncio.wait_for(asyncio.gather(first, second), 10)
            assert h.cancelled.is_set()
            with pytest.raises(cxlrpc.Unavailable):
                await asyncio.wait_for(call, 5)
            await asyncio.wait_for(server.close(grace=30), 5)  # closed already: returns
    finally:
        await server.close()


async def test_a_close_cancelled_in_its_grace_still_closes_the_server(url):
    server, h = make_server(url)
    await server.start()
    try:
        async with cxlrpc.connect(url) as client:
            call = asyncio.create_task(client.call("held", "a"))
            assert await until(lambda: h.started == ["held"], 10)
            closing = asyncio.create_task(server.close(grace=30))
            assert await until(lambda: status_is(client, "NOT_SERVING"), 10)
            closing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await closing
            await asyncio.wait_for(server.serve_forever(), 5)
            assert h.cancelled.is_set() and not server._tasks
            with pytest.raises(cxlrpc.Unavailable):
                await asyncio.wait_for(call, 5)
        with pytest.raises(cxlrpc.Unavailable, match="no server"):
            await cxlrpc.connect(url)  # the region is gone
    finally:
        await server.close()


@pytest.mark.parametrize("grace", [5.0, None])
async def test_async_with_closes_with_the_shutdown_grace(url, grace):
    """Leaving ``async with`` lets a call in flight finish within ``shutdown_grace``; with
    None it is cancelled at once."""
    server, h = make_server(url, shutdown_grace=grace)
    async with server:
        client = await cxlrpc.connect(url)
        call = asyncio.create_task(client.call("slow", 0.3, timeout=30))
        assert await until(lambda: h.started == ["slow"], 10)
    try:
        if grace is None:
            with pytest.raises(cxlrpc.Unavailable):
                await asyncio.wait_for(call, 5)
        else:
            assert await asyncio.wait_for(call, 5) == 0.3
    finally:
        await client.close()


async def test_health_and_methods_from_both_clients(url):
    """A serving server says SERVING and lists its user's methods, sorted, without the reserved ones."""
    server, _ = make_server(url)
    async with server, cxlrpc.connect(url) as client:
        assert await client.health(timeout=5) == "SERVING"
        assert await client.methods(timeout=5) == USER_METHODS

        def blocking() -> tuple[str, list[str]]:
            with cxlrpc.connect_sync(url) as sync_client:
                return sync_client.health(timeout=5), sync_client.methods(timeout=5)
        assert await asyncio.to_thread(blocking) == ("SERVING", USER_METHODS)


def test_reserved_method_names_are_refused(name):
    server = cxlrpc.Server(f"shm://{name}")
    for reserved in ("cxlrpc.health", "cxlrpc.methods", "cxlrpc.mine"):
        with pytest.raises(ValueError, match="reserved"):
            server.add_method(reserved, lambda: None)
    with pytest.raises(ValueError, match="reserved"):
        server.method("cxlrpc.other")(lambda: None)
    server.add_method("cxlrpc_health", lambda: None)  # only the dotted prefix is reserved


async def test_cli_health_and_methods_on_a_live_server(url):
    server, h = make_server(url)
    await server.start()
    try:
        assert await cli("health", url) == (0, "SERVING\n", "")
        assert await cli("methods", url) == (0, "".join(f"{m}\n" for m in USER_METHODS), "")
        async with cxlrpc.connect(url) as client:
            call = asyncio.create_task(client.call("held", "a", timeout=30))
            assert await until(lambda: h.started == ["held"], 10)
            closing = asyncio.create_task(server.close(grace=30))
            assert await cli("health", url) == (1, "NOT_SERVING\n", "")
            h.gate.set()
            assert await asyncio.wait_for(call, 10) == "a"
            await asyncio.wait_for(closing, 10)
    finally:
        await server.close()


async def test_cli_health_without_a_server_or_an_answer_fails(url):
    code, out, err = await cli("health", url)
    assert code == 1 and out == "" and "no server at" in err
    code, out, err = await cli("methods", url, "--timeout", "0.5")
    assert code == 1 and out == "" and "no server at" in err
    server, _ = make_server(url)
    await server.start()
    try:
        # the CLI runs while this loop (the server's) is blocked: nobody answers
        done = subprocess.run([sys.executable, "-m", "cxlrpc", "health", url, "--timeout", "0.5"],
                              cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert done.returncode == 1 and done.stdout == ""
        assert f"no answer from {url} within 0.5 s" in done.stderr
    finally:
        await server.close()
