"""The RPC scenario of tests/test_flush_rpc.py's mutation test: a server and two clients on a
``sim://`` region (each with its own simulated cache, no random evictions), with one write-back
or invalidate call of the single-writer channel removed, to show the simulator catches it.

``python nc_channel_peer.py URL [LINE]`` prints ``ok`` or ``fail <phase>: <why>``. Phases:
connect (knock and grant must cross), beat (calls go on past the client timeout, and the
server never judges the client gone: heartbeats must cross), release (a clean detach must be
seen at once, not after the timeout), peer (a handler reads the new holder's PID at once, not
after the next reap), close (a closed server must be seen at once, not after the server
timeout).
"""
from __future__ import annotations

import ast
import asyncio
import importlib
import os
import sys
import time
import types
from pathlib import Path

CHANNEL = Path(__file__).resolve().parents[1] / "cxlrpc" / "channel.py"
FLUSH_CLASSES = ("FlushServerChannel", "FlushClientChannel")
#: Calls whose removal another call masks: the holder's line is one cache line, and its first
#: heartbeat writes it back whole ~0.1 s later; a closing server also marks the region header
#: closed (written back), which clients read as well. Each fails a channel scenario of its own
#: in tests/test_flush_sites.py.
MASKED = {"FlushClientChannel._take", "FlushServerChannel.close", "FlushClientChannel._server_state"}
#: Calls only a dead writer's dirty lines make load-bearing, which this scenario has none of
#: (tests/test_flush_dead_writers.py removes them, with the simulator's LIMBO on).
ELSEWHERE = {"FlushServerChannel.write_back_holder"}
CLIENT_TIMEOUT = 0.6  # the server reaps a silent client after this
SERVER_TIMEOUT = 5.0  # long: a closed server must be seen by its state word, not by this


def flush_sites() -> list[tuple[str, int]]:
    """(Class.method, line) of every write-back or invalidate call in the single-writer channel."""
    sites = []
    for node in ast.parse(CHANNEL.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name in FLUSH_CLASSES:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef):
                    for call in ast.walk(fn):
                        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                                and call.func.attr in ("writeback", "invalidate")):
                            sites.append((f"{node.name}.{fn.name}", call.lineno))
    return sites


def load(mutation: int | None) -> tuple[type, type]:
    """Server and Client classes over the channel module, with line ``mutation`` made ``pass``."""
    import cxlrpc.channel
    import cxlrpc.client
    import cxlrpc.client_connection
    import cxlrpc.server
    if mutation is not None:
        lines = CHANNEL.read_text().splitlines()
        code = lines[mutation - 1]
        lines[mutation - 1] = code[:len(code) - len(code.lstrip())] + "pass"
        module = types.ModuleType("cxlrpc.channel")
        module.__package__ = "cxlrpc"
        module.__file__ = str(CHANNEL)
        sys.modules["cxlrpc.channel"] = module
        exec(compile("\n".join(lines), str(CHANNEL), "exec"), module.__dict__)
        importlib.reload(cxlrpc.server)
        importlib.reload(cxlrpc.client_connection)  # (it attaches through the channel module)
    return cxlrpc.server.Server, cxlrpc.client.Client


async def scenario(url: str, server_cls: type, client_cls: type) -> str:
    import cxlrpc.simulator
    cxlrpc.simulator.EVICTION_RATE = 0.0  # a forgotten line must stay forgotten
    from cxlrpc.errors import RpcError, Unavailable

    server = server_cls(url, slots=2, request_capacity=1 << 16, response_capacity=1 << 16,
                        client_timeout=CLIENT_TIMEOUT)
    departed: list[float] = []
    server.add_method("echo", lambda payload: payload)
    context = sys.modules[server_cls.__module__].context  # the (reloaded) server module's
    server.add_method("peer", lambda: list(context().peer_info()[:3]))
    server.on_disconnect(lambda peer: departed.append(time.monotonic()))
    async with server:
        client = client_cls(url, server_timeout=SERVER_TIMEOUT)
        try:
            await asyncio.wait_for(client.open(), 3.0)
        except (RpcError, asyncio.TimeoutError) as exc:
            return f"fail connect: {type(exc).__name__} {exc}"
        try:
            end = time.monotonic() + 2.5 * CLIENT_TIMEOUT
            n = 0
            while time.monotonic() < end:
                payload = n.to_bytes(4, "little") * (n % 50)
                if await client.call("echo", payload, timeout=1.0) != payload:
                    return "fail beat: wrong echo"
                n += 1
                await asyncio.sleep(0.005)
            if departed:  # (its calls may have gone on: a revoked client claims a slot again)
                return "fail beat: the server judged the client gone while it called"
        except RpcError as exc:
            return f"fail beat: {type(exc).__name__} {exc}"
        finally:
            closed_at = time.monotonic()
            await client.close()
        while not departed and time.monotonic() < closed_at + CLIENT_TIMEOUT / 2:
            await asyncio.sleep(0.01)
        if not departed:
            return "fail release: the server did not see the detach"
        second = client_cls(url, server_timeout=SERVER_TIMEOUT)
        try:
            await asyncio.wait_for(second.open(), 3.0)
        except (RpcError, asyncio.TimeoutError) as exc:
            return f"fail connect: second client: {type(exc).__name__} {exc}"
        try:
            info = await second.call("peer", timeout=1.0)
        except RpcError as exc:
            await second.close()
            return f"fail peer: {type(exc).__name__} {exc}"
        if info != [second._conn.chan.slot, second._conn.chan.gen, os.getpid()]:
            await second.close()
            return f"fail peer: the server read {info}"
    closed_at = time.monotonic()
    try:
        while time.monotonic() < closed_at + 1.0:
            try:
                await second.call("echo", b"x", timeout=0.2)
            except Unavailable:
                return "ok"
            except RpcError:
                pass
            await asyncio.sleep(0.01)
        return "fail close: calls went on to a closed server"
    finally:
        await second.close()


def main(argv: list[str]) -> int:
    url = argv[0]
    mutation = int(argv[1]) if len(argv) > 1 else None
    server_cls, client_cls = load(mutation)
    print(asyncio.run(scenario(url, server_cls, client_cls)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
