"""kvservice's leased block in flush mode, in C (kvservice._block given the pool's Lines): held to
the Python reference by a differential run (writers and a reader in processes of their own over
sim://, with random evictions and without), every BLOCK_* site's removal caught (the simulator
at eviction rate 0, the site skipped in the process that owns it), and the flushes a get, a copy
out and a put make counted on real flush-mode memory (shm:// with coherence="flush")."""
from __future__ import annotations

import asyncio
import os
from contextlib import contextmanager
from typing import Any, Iterator

import pytest

import cxlrpc.simulator
import kvservice.pool as kvpool
from cxlrpc import _flush
from flush_kv_peer import digest, peer_main, value
from kvservice import KVClient, KVServer
from kvservice.pool import CLAIM_CHECK_EVERY, FlushBlock
from procs import CTX, stop

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(kvpool._native is None, reason="kvservice._block is not built")]
KiB, MiB = 1 << 10, 1 << 20
LINE, CHUNK = 64, 64 * KiB  # a cache line; what a copy out invalidates and copies at a time
#: Every site of kvservice._block, and the peer that owns it in the scenario below.
OWNERS = {"BLOCK_READ": "R", "BLOCK_VERSION": "R", "BLOCK_STREAM": "W", "BLOCK_WRITE": "X",
          "BLOCK_GIVEN_BACK": "W"}


@contextmanager
def environment(**env: str) -> Iterator[None]:
    """``os.environ`` with ``env`` set (what a process started meanwhile inherits)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Peer:
    """A client process running peer_main's commands (tests/flush_kv_peer.py)."""

    def __init__(self, url: str, reference: bool, eviction: float | None, skip: str | None) -> None:
        self.commands, self.results = CTX.Queue(), CTX.Queue()
        self.proc = CTX.Process(target=peer_main, args=(url, eviction, skip, self.commands, self.results),
                                daemon=True)
        with environment(**({"CXLRPC_NO_NATIVE": "1"} if reference else {})):
            self.proc.start()

    async def started(self) -> bool:
        """Whether the peer reads through the reference's leased (its first answer)."""
        return bool(await asyncio.to_thread(self.results.get, True, 120))

    async def __call__(self, *command: Any) -> Any:
        self.commands.put(command)
        return await asyncio.to_thread(self.results.get, True, 120)

    def close(self) -> None:
        if self.proc.is_alive():
            self.commands.put(("stop",))
            self.proc.join(20)
        stop(self.proc)


SIZES = (100, 4 * KiB, 64 * KiB + 8, MiB, CLAIM_CHECK_EVERY + 4 * KiB)  # the big: two stretches
BIG = tuple(s for s in SIZES if s > 32 * KiB)  # put in two phases (the smaller ones go inline)
HOWS = ("view", "bytes", "into", "array")


async def scenario(url: str, server: KVServer, w: Peer, x: Peer, r: Peer) -> list[tuple[str, Any]]:
    """Writers W and X and reader R (each a process) through puts (copied, filled in place,
    given back), reads of every kind (again: of a version R invalidated already), a lapsed
    lease, the issue's given-back block and a block R read reused for a new value: what each
    step returned, beside what the protocol says it must (the steps' labels name them)."""
    got: list[tuple[str, Any]] = []

    async def step(label: str, peer: Peer, *command: Any, expect: Any) -> None:
        got.append((label, await peer(*command), expect))

    for size in SIZES:
        await step(f"put {size}", w, "put", f"k{size}", size, size, expect=True)
    for i, size in enumerate(SIZES):
        for how in HOWS[i % 2:] if size < MiB else HOWS[i % 4:i % 4 + 2]:
            await step(f"read {size} {how}", r, "read", f"k{size}", how, expect=digest(value(size, size)))
    await step("fill", x, "fill", "inplace", 7, 64 * KiB, expect="ok")
    await step("read filled", r, "read", "inplace", "bytes", expect=digest(value(7, 64 * KiB)))
    # issue 42's given-back block: W's lines must not land over the block's next value
    await step("abort", w, "abort", "w", 0xAA, 64 * KiB, expect="ok")
    await step("put victim", x, "put", "victim", 8, 64 * KiB, expect=True)
    for label, peer, how in (("R", r, "into"), ("W", w, "view"), ("R again", r, "bytes"), ("X", x, "bytes")):
        await step(f"victim by {label}", peer, "read", "victim", how, expect=digest(value(8, 64 * KiB)))
    # a lapsed lease whose block was reused: the copy's check refuses it
    await step("put lapse", x, "put", "lapse", 9, 64 * KiB, expect=True)
    await step("hold", r, "hold", "lapse", 0.2, expect="ok")
    deadline = asyncio.get_running_loop().time() + 30
    while server.stats()["leases"] and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    await step("remove lapse", x, "remove", "lapse", expect=True)
    await step("reuse", x, "put", "reused", 10, 64 * KiB, expect=True)
    await step("read lapsed", r, "read_held", "lapse", "into", expect="LeaseExpired")
    await step("read reused", r, "read", "reused", "view", expect=digest(value(10, 64 * KiB)))
    # a block R read, freed and reused for a new version: R's lines of the old one are stale
    await step("put cycle", x, "put", "cycle", 11, 64 * KiB, expect=True)
    await step("read cycle", r, "read", "cycle", "view", expect=digest(value(11, 64 * KiB)))
    await step("release", r, "remove", "absent", expect=False)  # (sends R's queued releases)
    while server.stats()["leases"] and asyncio.get_running_loop().time() < deadline + 30:
        await asyncio.sleep(0.02)
    await step("remove cycle", x, "remove", "cycle", expect=True)
    await step("put cycle again", x, "put", "cycle2", 12, 64 * KiB, expect=True)
    for how in ("view", "into"):
        await step(f"read cycle again {how}", r, "read", "cycle2", how, expect=digest(value(12, 64 * KiB)))
    return got


async def run(url: str, reference: bool = False, eviction: float | None = None,
              skip: str | None = None) -> list[tuple[str, Any, Any]]:
    """The scenario with its own server (this process) and peers; ``skip`` (a site) in the
    peer that owns it."""
    async with KVServer(url, pool_size=24 * MiB, expire_interval=0.05) as server:
        peers = {name: Peer(url, reference, eviction, skip if skip and OWNERS[skip] == name else None)
                 for name in "WXR"}
        try:
            for peer in peers.values():
                assert await peer.started() == reference  # the paths under test are the ones in use
            return await scenario(url, server, peers["W"], peers["X"], peers["R"])
        finally:
            for peer in peers.values():
                peer.close()


def wrong(got: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    return [step for step in got if step[1] != step[2]]


@pytest.mark.parametrize("eviction", [None, 0.0], ids=["evictions", "no-evictions"])
async def test_native_flush_block_matches_the_reference_across_processes(name, eviction, monkeypatch):
    """The same scenario through the reference (CXLRPC_NO_NATIVE=1 in the peers) and through
    kvservice._block's flush mode: both read every value right (every kind of read, the
    issue's given-back block, a lapsed lease refused), step for step the same."""
    if eviction is not None:
        monkeypatch.setattr(cxlrpc.simulator, "EVICTION_RATE", eviction)
    reference = await run(f"sim://{name}r", reference=True, eviction=eviction)
    native = await run(f"sim://{name}n", eviction=eviction)
    assert wrong(reference) == [] and wrong(native) == []
    assert [s[1] for s in native] == [s[1] for s in reference]


@pytest.mark.parametrize("site", [None, *(pytest.param(s, marks=pytest.mark.mutations) for s in OWNERS)])
async def test_every_block_site_removed_is_caught(name, site, monkeypatch):
    """Mutations: with each BLOCK_* site skipped in the process that owns it (and no random
    eviction to hide it), some step of the scenario reads wrong bytes or refuses a good read;
    skipping nothing, every step is right. Every BLOCK_* site is in the table."""
    blocks = {s for s, _ in _flush.sites() if s.startswith("BLOCK_")}
    assert blocks == set(OWNERS)
    monkeypatch.setattr(cxlrpc.simulator, "EVICTION_RATE", 0.0)
    got = await run(f"sim://{name}", eviction=0.0, skip=site)
    if site is None:
        assert wrong(got) == []
    else:
        assert wrong(got), f"{site} skipped and nothing read wrong"


# ---- flush counts: real flush-mode memory (the CPU's instructions), counted by the pool's Lines

def lines(offset: int, size: int) -> int:
    return (offset % LINE + size + LINE - 1) // LINE


def chunks(size: int) -> int:
    return -(-size // CHUNK)


def counts(writebacks: int = 0, invalidates: int = 0, fences: int = 0, lines: int = 0) -> dict[str, int]:
    return {"writebacks": writebacks, "invalidates": invalidates, "fences": fences, "lines": lines}


@pytest.mark.parametrize("size", [100, 4 * KiB, 64 * KiB, MiB, MiB + 100])
async def test_flushes_per_get_copy_and_put(name, size):
    """What the protocol allows and no more. A zero-copy get: the block's lines invalidated
    once and the version's line, one fence, before the view is handed out; each check one more
    invalidate and fence. A copy out (get_into, bytes): each chunk invalidated with a fence
    right before it is copied, and the version after. A read of a version this mapping
    invalidated already: the version's line only (what it cached since is that version's). A
    copied put: the claim's line
    invalidated, the value streamed (nothing written back), one store fence. A put filled in
    place: its claim checked when the view is given, one write-back and one fence at commit
    (or at an abort, before the block is given back)."""
    url = f"shm://{name}"
    async with KVServer(url, pool_size=8 * MiB, coherence="flush", inline_limit=0) as server, \
            KVClient.connect(url) as kv:
        counter = kv.pool.region.mem.lines
        data = value(size, size)

        async def measured(op: Any) -> dict[str, int]:
            counter.reset()
            await op()
            return counter.counts()

        async def zero_copy() -> None:
            with await kv.get("k") as block:
                assert isinstance(block, FlushBlock) and bytes(block.view()) == data
                block.check()

        async def into() -> None:
            out = bytearray(size)
            assert await kv.get_into("k", out) == size and out == data

        async def as_bytes() -> None:
            assert await kv.get_bytes("k") == data

        async def in_place() -> None:
            pending = await kv.begin_put("p", size)
            pending.view()[:] = data
            await pending.commit()

        put = counts(invalidates=1, fences=2, lines=1)
        copy_out = counts(invalidates=chunks(size) + 1, fences=chunks(size) + 1, lines=lines(0, size) + 1)
        for read, first, again in ((zero_copy, counts(invalidates=3, fences=2, lines=lines(0, size) + 2),
                                    counts(invalidates=2, fences=2, lines=2)),
                                   (into, copy_out, counts(invalidates=1, fences=1, lines=1)),
                                   (as_bytes, copy_out, counts(invalidates=1, fences=1, lines=1))):
            assert await measured(lambda: kv.put("k", data)) == put  # a new version
            assert await measured(read) == first
            assert await measured(read) == again
        assert await measured(in_place) == counts(writebacks=1, invalidates=1, fences=2,
                                                  lines=lines(0, size) + 1)
        assert await kv.get_bytes("p") == data

        async def given_back() -> None:
            pending = await kv.begin_put("a", size)
            pending.view()[:] = data
            await pending.abort()

        assert await measured(given_back) == counts(writebacks=1, invalidates=1, fences=2,
                                                    lines=lines(0, size) + 1)
        assert server.stats()["pending_puts"] == 0
