"""Clients that freeze themselves (SIGSTOP) at a chosen moment of a followed body, run in child
processes by tests/test_frozen_clients.py. Kept free of top-level cxlrpc imports: a child
chooses its paths (the reference writer and reader, whose stores and loads it can watch)
before cxlrpc is imported."""
from __future__ import annotations

import asyncio
import os
import signal
import time


class _Freezing:
    """A heap's AtomicMemory that stops this process at the first store of a followed body's
    progress past zero (``on="store"``: mid-write, one chunk written) or at its first load
    (``on="load"``: about to follow a reply), and after the resume slows every store by
    ``pace`` seconds (a writer whose stores go on while the others' traffic reuses the heap)."""

    def __init__(self, mem, on: str, pace: float) -> None:
        self._mem, self._on, self._pace, self._frozen = mem, on, pace, False

    def __getattr__(self, name: str):
        return getattr(self._mem, name)

    def store(self, at: int, value: int, order: int) -> None:
        if self._frozen and self._pace:
            time.sleep(self._pace)
        self._mem.store(at, value, order)
        if self._on == "store" and value and not self._frozen:
            self._freeze()

    def load(self, at: int, order: int) -> int:
        if self._on == "load" and not self._frozen:
            self._freeze()
        return self._mem.load(at, order)

    def _freeze(self) -> None:
        self._frozen = True
        os.kill(os.getpid(), signal.SIGSTOP)


def frozen_client_main(url: str, how: str, size: int, seed: int, results) -> None:
    """Connect; ``how="write"``: echo a followed request of ``size`` bytes, frozen after its
    first chunk; ``how="read"``: ask ``make`` for a followed reply, frozen as it begins to
    follow it. Send the outcome to ``results`` (("ok", body) or ("error", name, message)),
    then wait to be killed (never detaching: a detach would end the quarantine at once)."""
    os.environ["CXLRPC_NO_NATIVE"] = "1"
    import cxlrpc
    from cxlrpc import memory
    from procs import made

    memory._native = None  # the reference copies: each progress word stored or loaded by Python

    async def main() -> None:
        client = await cxlrpc.connect(url)
        heap = client._bodies.heap
        heap.mem = _Freezing(heap.mem, "store" if how == "write" else "load", 0.005)
        try:
            if how == "write":
                got = await client.call("echo", made(size, seed), timeout=60)
            else:
                got = await client.call("make", [size, seed], timeout=60)
            results.send(("ok", bytes(got)))
        except Exception as exc:  # (what the test asserts on)
            results.send(("error", type(exc).__name__, str(exc)))
        while True:
            await asyncio.sleep(3600)

    asyncio.run(main())


def zombie_holder_main(url: str, conn) -> None:
    """A flush-mode holder frozen between its checks and its stores: attach, beat, and on
    ``"freeze"`` from ``conn`` push a request whose grant check passes, then stop (SIGSTOP)
    before the ring is written; once resumed (SIGCONT), beat -- its heartbeat thread had
    found the slot still its own -- and finish the push. Reports ("held", slot, gen) once
    granted and ("resumed", pushed, holds) after; then waits to be killed (no detach)."""
    os.environ["CXLRPC_NO_NATIVE"] = "1"
    from cxlrpc.channel import client_channel
    from cxlrpc.region import Region
    from cxlrpc.ring.mpsc import ClaimRevoked

    chan = client_channel(Region.open(url))
    while not chan.acknowledged():
        time.sleep(0.002)
    conn.send(("held", chan.slot, chan.gen))
    while not conn.poll(0.05):
        chan.beat()
    conn.recv()
    ring = chan.requests
    push = ring.try_push_parts

    def checked_then_frozen(parts) -> bool:
        os.kill(os.getpid(), signal.SIGSTOP)  # (the grant check passed: reaped while stopped)
        chan.beat()
        return push(parts)

    ring.try_push_parts = checked_then_frozen
    try:
        pushed = chan.push([b"zombie!!" * 8])
    except ClaimRevoked:
        pushed = None
    conn.send(("resumed", pushed, chan.holds_slot()))
    while True:
        time.sleep(3600)


def holder_main(url: str, conn) -> None:
    """A flush-mode holder: attach, report ("held", slot, gen) once granted, then wait to be
    killed (no detach, no beat: the server learns of its death by its PID)."""
    from cxlrpc.channel import client_channel
    from cxlrpc.region import Region

    chan = client_channel(Region.open(url))
    while not chan.acknowledged():
        time.sleep(0.002)
    conn.send(("held", chan.slot, chan.gen))
    while True:
        time.sleep(3600)
