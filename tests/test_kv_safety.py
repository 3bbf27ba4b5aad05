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
