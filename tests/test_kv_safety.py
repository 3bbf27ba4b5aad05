"""kvservice data safety: nothing a client held or reserved outlives it, whatever the timing."""
from __future__ import annotations

import asyncio

import pytest

from kvservice import KVClient, KVServer

MiB = 1 << 20
pytestmark = pytest.mark.timeout(60)


async def until(cond, timeout: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def test_closed_clients_leases_end_when_a_new_client_takes_the_slot_at_once(url):
    """A client closes holding leases and the next client claims its slot immediately: the
    server still sees the first one leave and drops its leases (not after their expiry)."""
    async with KVServer(url, pool_size=8 * MiB, slots=1, default_lease_s=60.0) as server:
        async with KVClient.connect(url) as kv:
            await kv.put(b"k", b"v" * 100_000)
        for _ in range(5):
            first = await KVClient.connect(url)
            held = [await first.get(b"k") for _ in range(3)]  # never released by the user
            assert server.stats()["leases"] == 3
            await first.close()
            async with KVClient.connect(url) as second:  # the same slot, its next generation
                assert await second.exists(b"k")
                assert await until(lambda: server.stats()["leases"] == 0, 2.0), server.stats()
            del held


@pytest.mark.parametrize("size", [1000, 1 * MiB], ids=["inline", "two-phase"])
async def test_cancelled_puts_leave_nothing_behind_and_never_commit(url, size):
    """Puts abandoned by asyncio.wait_for at every point of their flight (before the request,
    during begin, during commit): once the dust settles no reservation is left and no key of
    theirs exists, so the whole pool is free for the next put."""
    async with KVServer(url, pool_size=16 * MiB, put_timeout_s=60.0) as server:
        async with KVClient.connect(url) as kv:
            timeouts = [0.0, 1e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3] * 4
            cancelled = 0
            for i, timeout in enumerate(timeouts):
                try:
                    if timeout:
                        await asyncio.wait_for(kv.put(b"k%d" % i, bytes([i]) * size), timeout)
                    else:
                        task = asyncio.ensure_future(kv.put(b"k%d" % i, bytes([i]) * size))
                        await asyncio.sleep(0)
                        task.cancel()
                        await task
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    cancelled += 1
            assert cancelled >= len(timeouts) // 4, "too few puts were cancelled to test anything"
            await kv.exists(b"sync")  # one round trip after the undo messages
            assert await until(lambda: server.stats()["pending_puts"] == 0, 3.0), server.stats()
            present = [i for i in range(len(timeouts)) if await kv.exists(b"k%d" % i)]
            # only puts whose caller saw them succeed may remain
            stats = server.stats()
            assert stats["entries"] == len(present)
            assert stats["entries"] == len(timeouts) - cancelled, (present, cancelled)
            await kv.put(b"big", b"x" * (12 * MiB))  # the pool is not pinned by abandoned puts
            assert (await kv.get_bytes(b"big"))[:1] == b"x"
