"""Run by test_wheel.py with an installed cxlrpc, from outside the source tree (``python -I
installed_check.py NAME``): an echo round trip (the server here, the blocking client in a child
process), a kvservice put/get round trip, then one JSON line: what came back, the warnings the
import gave, where every cxlrpc and kvservice module was loaded from, and which module's atomics ran."""
from __future__ import annotations

import asyncio
import json
import sys
import warnings
from typing import Any

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import cxlrpc
    import kvservice
    from cxlrpc import memory
    from kvservice import KVClient, KVServer
    from kvservice.compat import mooncake_shim_path

CLIENT = """
import sys, cxlrpc
with cxlrpc.connect_sync(sys.argv[1]) as client:
    print(client.call("echo", b"across processes", timeout=60.0).decode())
"""


async def echo(name: str) -> list[str]:
    """The echo server here; a blocking client in a child process, then an asyncio one here."""
    server = cxlrpc.Server(f"shm://{name}")

    @server.method("echo")
    async def echo(payload: bytes) -> bytes:
        return payload

    async with server:
        child = await asyncio.create_subprocess_exec(sys.executable, "-I", "-W", "ignore", "-c", CLIENT,
                                                     f"shm://{name}", stdout=asyncio.subprocess.PIPE,
                                                     stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(child.communicate(), 120)
        assert child.returncode == 0, err.decode()[-2000:]
        async with cxlrpc.connect(f"shm://{name}") as client:
            local = await client.call("echo", b"in process", timeout=60.0)
    return [out.decode().strip(), local.decode()]


async def kv(name: str) -> list[Any]:
    """A put, then a zero-copy get and a copying get of it."""
    value = bytes(range(256)) * 1024
    async with KVServer(f"shm://{name}-kv", pool_size=16 << 20):
        async with KVClient.connect(f"shm://{name}-kv") as client:
            await client.put("wheel-key", value)
            with await client.get("wheel-key") as block:
                in_place = bytes(block.view()) == value
            copied = await client.get_bytes("wheel-key") == value
            present = await client.exists("wheel-key")
    return [in_place, copied, present]


async def main(name: str) -> None:
    report = {
        "echo": await echo(name),
        "kv": await kv(name),
        "warnings": [[w.category.__name__, w.filename, str(w.message)] for w in caught],
        "modules": {n: getattr(m, "__file__", None) for n, m in sorted(sys.modules.items())
                    if n.split(".")[0] in ("cxlrpc", "kvservice")},
        "atomics": memory.Counter.__module__,
        "shim": mooncake_shim_path(),
        "packages": [cxlrpc.__file__, kvservice.__file__],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    cxlrpc.run(main(sys.argv[1]))
