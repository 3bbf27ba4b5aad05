"""The dead writer of tests/test_flush_dead_writers.py: a client of a ``sim://`` server (run
with ``CXLRPC_SIM_LIMBO`` set, so its dirty lines outlive it) that is killed in the middle of
publishing something, its data copied into shared memory but not yet written back.

``python dead_writer_peer.py ring|heap|kv URL SIZE``: connects, makes one good call (its slot
is granted and working), then sends a SIZE-byte payload of 0xEE bytes (``ring``: an RPC whose
request fits the request ring; ``heap``: one whose body goes through the server's heap;
``kv``: a put into a pool block) and stops at the write-back of those bytes: it prints
``ready`` and waits there to be killed (SIGKILL), its cache holding them dirty.
"""
from __future__ import annotations

import asyncio
import sys
import time

import cxlrpc
import cxlrpc.simulator
from cxlrpc.memory import AtomicMemory

#: Write-backs from this size up are the payload's (a heartbeat's or a grant's are a line)
PAYLOAD_MIN = 4096
FILL = 0xEE


def stop_at_the_payloads_write_back() -> None:
    """From now on, the first write-back of PAYLOAD_MIN bytes or more never happens: say so,
    then wait to be killed (the copy it follows stays dirty in this process's cache). Taken
    where AtomicMemory.writeback is called and where the native paths' Lines call the
    simulator's hook (a heap body's Lines.write_body): _armed, below."""
    def writeback(self: AtomicMemory, offset: int, length: int) -> None:
        if length < PAYLOAD_MIN:
            return original(self, offset, length)
        _stop()

    original = AtomicMemory.writeback
    AtomicMemory.writeback = writeback  # type: ignore[method-assign]
    _armed.append(True)


def _stop() -> None:
    print("ready", flush=True)
    time.sleep(3600)


_armed: list[bool] = []


def _arm_the_simulators_hook() -> None:
    """Before any region is mapped (its Lines binds the hook then): the simulator's write-back
    stops too, once armed, at PAYLOAD_MIN bytes or more."""
    original = cxlrpc.simulator.CacheSim.writeback

    def writeback(self: cxlrpc.simulator.CacheSim, offset: int, length: int) -> None:
        if _armed and length >= PAYLOAD_MIN:
            _stop()
        original(self, offset, length)

    cxlrpc.simulator.CacheSim.writeback = writeback  # type: ignore[method-assign]


async def rpc(url: str, size: int) -> None:
    async with cxlrpc.connect(url) as client:
        await client.call("digest", b"hello", timeout=10)
        stop_at_the_payloads_write_back()
        await client.call("digest", bytes([FILL]) * size, timeout=3600)


async def kv(url: str, size: int) -> None:
    from kvservice import KVClient

    async with KVClient.connect(url) as client:
        await client.put("first", b"x" * 100)
        stop_at_the_payloads_write_back()
        await client.put("dead", bytes([FILL]) * size)


def main(argv: list[str]) -> int:
    role, url, size = argv[0], argv[1], int(argv[2])
    cxlrpc.simulator.EVICTION_RATE = 0.0  # the payload's lines stay dirty until it is killed
    _arm_the_simulators_hook()
    asyncio.run(kv(url, size) if role == "kv" else rpc(url, size))
    return 1  # (never reached: killed while it waits)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
