"""What a client's connection to the pool costs must not grow with the pool (issue 39, item 6):
a client maps in the pool pages it writes (in windows, a few ahead) and a bounded head start,
not the whole pool;
the bytes it puts and gets stay right, with and without the native module."""
from __future__ import annotations

import asyncio
import os
import threading

import pytest

from procs import run_json
from kvservice import KVServer, SyncKVClient
from kvservice import pool as pool_module

MiB = 1 << 20
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pool_probe.py")
POOL = 256 * MiB
#: what a client may map after its puts: the blocks, the windows around them and those ahead
WRITE_SLACK = (pool_module._AHEAD + 2) * pool_module._WINDOW


async def probe(url: str, native: bool, head_start: int) -> dict:
    """Run tests/pool_probe.py against a 256 MiB pool; its figures."""
    env = dict(os.environ, KVSERVICE_CONNECT_PREFAULT=str(head_start))
    env.pop("CXLRPC_NO_NATIVE", None)
    if not native:
        env["CXLRPC_NO_NATIVE"] = "1"
    async with KVServer(url, pool_size=POOL):
        got = await run_json([PROBE, url], 30, env)
    assert got["native"] is native
    assert got["same"] == {"k0": True, "k1": True, "k2": True}
    return got


@pytest.mark.parametrize("native", [True, False], ids=["native", "no-native"])
async def test_client_maps_only_what_it_writes(url, native):
    """Without the connect head start, a client process connecting to a 256 MiB pool maps
    (RssShmem) and faults almost none of it; after three ~1 MiB puts (one filled in place) and
    their gets, what it maps is bounded by what it wrote plus a few windows, and every get
    returns the bytes put."""
    got = await probe(url, native, head_start=0)
    assert got["connect"]["shmem"] < 4 * MiB, got  # before: the whole pool, 256 MiB
    assert got["connect"]["minflt"] < 2000, got  # before: 65,000 (one per 4 KiB page)
    assert got["after_puts"]["shmem"] <= got["written"] + WRITE_SLACK, got


async def test_connect_head_start_is_bounded(url):
    """A process's first connection maps the pool's first KVSERVICE_CONNECT_PREFAULT bytes in
    the background (here 32 of 256 MiB), no more; a second connection in the same process maps
    none; puts into that head start map nothing more than their windows ahead."""
    head = 32 * MiB
    got = await probe(url, True, head_start=head)
    assert head - 2 * MiB <= got["connect"]["shmem"] <= head + 4 * MiB, got
    assert got["second_connect"]["shmem"] < 4 * MiB, got
    assert got["after_puts"]["shmem"] <= head + got["written"] + WRITE_SLACK, got


def test_close_ends_the_prefault_thread(url, monkeypatch):
    """The background thread a put starts ends with the client (close joins it)."""
    monkeypatch.setenv("KVSERVICE_CONNECT_PREFAULT", "0")
    def threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "kvservice-pool-prefault"]

    async def serve(ready: threading.Event, stop: asyncio.Event) -> None:
        async with KVServer(url, pool_size=64 * MiB):
            ready.set()
            await stop.wait()

    assert not threads()
    loop = asyncio.new_event_loop()
    ready, stop = threading.Event(), asyncio.Event()
    server = threading.Thread(target=loop.run_until_complete, args=(serve(ready, stop),))
    server.start()
    try:
        assert ready.wait(30)
        kv = SyncKVClient.connect(url)
        try:
            kv.put("k", os.urandom(MiB))
            assert len(threads()) == 1
            assert kv.get_bytes("k") is not None
        finally:
            kv.close()
        assert not threads()
    finally:
        loop.call_soon_threadsafe(stop.set)
        server.join(30)
        loop.close()


async def test_puts_without_populate_still_right(url, monkeypatch):
    """Where the kernel refuses MADV_POPULATE_WRITE (before 5.14), a put's pages fault on first
    touch instead: puts and gets still return the right bytes, and no thread is started."""
    monkeypatch.setattr(pool_module, "_POPULATE_WRITE", 0x7fff)  # an advice no kernel knows
    monkeypatch.setenv("KVSERVICE_CONNECT_PREFAULT", "0")
    from kvservice import KVClient

    values = {f"k{i}": os.urandom(MiB + 512 * i) for i in range(3)}
    async with KVServer(url, pool_size=16 * MiB), KVClient.connect(url) as kv:
        for key, value in values.items():
            await kv.put(key, value)
        for key, value in values.items():
            assert await kv.get_bytes(key) == value
        assert kv.pool._prefaulter._unsupported
        assert kv.pool._prefaulter._thread is None
