"""The hot path of two checkouts, in alternated rounds (what a change costs it, e.g. fencing):
``python bench/hot_ab.py --a /path/before --b /path/after --rounds 8``.

Each round runs, once per checkout (order alternating, that checkout first on PYTHONPATH), a
process that starts a cxlrpc echo server (a plain handler, uvloop) and a ``python -m kvservice
serve`` (1 GiB pool) in processes of their own, then times from asyncio clients: echo of 64 B,
1 MiB and 8 MiB (followed through the heap both ways), zero-copy kv gets of 64 KiB and 1 MiB
(one byte read), and a copying kv get of 1 MiB (``get_bytes``). The table shows, per checkout, the median across rounds of each round's
p50 and p99, and B/A.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid

from ab import cli  # run as a script: bench/ is on sys.path
from pool_connect import serving

MiB = 1 << 20
OPS = ("echo 64B", "echo 1M", "echo 8M", "kv get 64K", "kv get 1M", "kv get_bytes 1M")

_ECHO_SERVER = """
import asyncio, sys, uvloop, cxlrpc
async def main():
    server = cxlrpc.Server(sys.argv[1])
    server.add_method("echo", lambda payload: payload)
    async with server:
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.close()
uvloop.run(main())
"""


def _echo_server(url: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER, url], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        proc.wait()
        raise RuntimeError("echo server did not start")
    return proc


async def _timed(out: list[int], n: int, call) -> None:
    clock = time.perf_counter_ns
    for i in range(n + n // 5):  # the first sixth is warm-up
        t = clock()
        await call()
        if i >= n // 5:
            out.append(clock() - t)


async def _measure(echo_url: str, kv_url: str, n: int) -> dict[str, list[int]]:
    import cxlrpc
    from kvservice import KVClient

    out: dict[str, list[int]] = {op: [] for op in OPS}
    small, big, huge = os.urandom(64), os.urandom(MiB), os.urandom(8 * MiB)
    async with cxlrpc.connect(echo_url) as client:
        for payload, op, count in ((small, "echo 64B", 20 * n), (big, "echo 1M", n),
                                   (huge, "echo 8M", max(n // 8, 10))):
            async def echo(payload=payload) -> None:
                if len(await client.call("echo", payload)) != len(payload):
                    raise AssertionError("short echo")
            await _timed(out[op], count, echo)
    kv = await KVClient.connect(kv_url)
    try:
        for i in range(8):
            await kv.put(f"get-1M-{i}", big)
            await kv.put(f"get-64K-{i}", big[:64 << 10])
        for size in ("64K", "1M"):
            async def get(size=size, i=[0]) -> None:
                i[0] += 1
                with await kv.get(f"get-{size}-{i[0] % 8}") as block:
                    block.view()[0]
            await _timed(out[f"kv get {size}"], 4 * n, get)

        async def get_bytes(i=[0]) -> None:
            i[0] += 1
            if len(await kv.get_bytes(f"get-1M-{i[0] % 8}")) != MiB:
                raise AssertionError("short get")
        await _timed(out["kv get_bytes 1M"], n, get_bytes)
    finally:
        await kv.close()
    return out


def _child(n: int) -> None:
    name = f"bench-hot-{uuid.uuid4().hex[:8]}"
    server = _echo_server(f"shm://{name}")
    try:
        with serving("bench-hot-kv", "1GiB") as kv_url:
            print(json.dumps(asyncio.run(_measure(f"shm://{name}", kv_url, n))), flush=True)
    finally:
        server.stdin.close()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


def main() -> None:
    cli(__doc__, os.path.abspath(__file__), _child, OPS, 8, "timed 1 MiB calls per round (64 B: 20x, kv get: 4x)")


if __name__ == "__main__":
    main()
