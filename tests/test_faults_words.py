"""Fault suite, single words: one stray 8-byte write never stops a live server for good.

- a live client's claim word set to the request ring's head (and the tail moved by 8): the
  consumer takes that claim back and pads it once it made no progress for client_timeout;
  a producer that really was writing there learns it was revoked and commits nothing;
- the owner state, owner PID or control state word written over: the server's housekeeping
  puts it back, and clients do not give up on one word while the heartbeat moves;
- plausible but wrong geometry words: a checksum the server wrote makes new clients wait for
  the server to put them back (or fail clearly), never attach to the wrong layout.

Each RPC test counts replies byte for byte: 0 wrong bytes delivered, and recovery within a
stated bound.
"""
from __future__ import annotations

import asyncio
import os
import time

import pytest

import cxlrpc
from cxlrpc.channel import _SLOT_CLAIM, CONTROL, KIND_RPC, read_geometry
from cxlrpc.memory import ACQUIRE, RELEASE
from cxlrpc.region import Region, RegionError
from cxlrpc.ring.mpsc import NO_CLAIM
from cxlrpc.ring.record import HEAD_OFFSET, TAIL_OFFSET
from procs import open_counting, report, start_fault_server, stop, until
from ring_env import payload
from test_ring_claims import (LIVE, OTHER, TAG, Gate, Setup, assert_exact, assert_revoked_without_trace,
                              push_held)

pytestmark = pytest.mark.timeout(120)
MEMORIES = ("shm", "sim")  # the RPC tests that take ``url`` run on coherent memory and in flush mode
CLIENT_TIMEOUT = 0.5
#: Recovery bound the tests state: client_timeout, housekeeping's period and the clients' looks,
#: with room for a loaded two-core machine.
RECOVERY_S = 5.0
#: Longer than cxlrpc.channel.WORD_CONFIRM_S, the time a client waits before it believes one
#: word that says its server closed or died.
PAST_CONFIRM_S = 0.7


# ----------------------------------------------------------------------------- ring level
def _revoke(s: Setup):
    def revoke(positions) -> None:
        for c in s.claims.values():
            word = c.load(ACQUIRE)
            if word in positions:
                c.cas(word, NO_CLAIM, 0)
    return revoke


def _unblock_within(s: Setup, stall: float, timeout: float = 5.0) -> float:
    """Call unblock (with the stall bound) as housekeeping does until it pads; seconds taken."""
    t0 = time.monotonic()
    while not s.ring.unblock(s.producer_dead, s.live_claims, stall, _revoke(s)):
        assert time.monotonic() - t0 < timeout, "unblock never passed the stalled claim"
        time.sleep(0.005)
    return time.monotonic() - t0


@pytest.mark.parametrize("held", ["after-claim", "before-copy", "mid-copy"])
def test_stalled_live_claim_is_taken_back_and_its_producer_never_commits(held):
    """A live producer held at its claim, before its copy or inside it: unblock() leaves it
    alone for the stall bound, then takes the claim back and pads it; the producer, resumed,
    raises ClaimRevoked, commits nothing, leaves free space zero, and the ring goes on exactly."""
    s, gate = Setup(), Gate()
    rec = payload(3, 256)
    t, out = push_held(s, held, gate, rec, revoked=lambda: s.claims[LIVE].load(ACQUIRE) == NO_CLAIM)
    for _ in range(5):  # within the bound: left alone
        assert not s.ring.unblock(s.producer_dead, s.live_claims, 10.0, _revoke(s))
    took = _unblock_within(s, 0.05)
    assert took >= 0.05
    assert s.claims[LIVE].load(ACQUIRE) == NO_CLAIM  # taken back before the padding
    assert_revoked_without_trace(s, gate, t, out)
    assert s.env.guards_intact()
    s.claims[LIVE].store(NO_CLAIM, RELEASE)
    assert_exact(s, [payload(10 + i, 100 + 37 * i) for i in range(40)])
    assert s.ring.try_push_parts((b"again",), LIVE, TAG, s.claims[LIVE]) and s.ring.pop() == b"again"


def test_stray_claim_word_at_the_head_blocks_only_for_the_stall_bound():
    """A live producer's claim word set to the head, the tail moved by 8 (no producer writes
    there): records behind it wait for the stall bound, then arrive exactly; the victim's own
    next push works (its word was taken back to NO_CLAIM)."""
    s = Setup()
    head = s.ring.head_position
    s.claims[LIVE].store(head, RELEASE)
    assert s.ring._tail.cas(head, head + 8, 0) == head
    behind = [payload(20 + i, 40 + i) for i in range(5)]
    for r in behind:
        assert s.ring.try_push_parts((r,), OTHER, TAG, s.claims[OTHER])
    assert s.ring.pop_batch() == []  # blocked at the stray claim
    assert not s.ring.unblock(s.producer_dead, s.live_claims)  # without a bound: for ever (main's behaviour)
    _unblock_within(s, 0.05)
    assert s.ring.pop_batch() == behind
    assert s.claims[LIVE].load(ACQUIRE) == NO_CLAIM
    assert s.ring.try_push_parts((b"victim",), LIVE, TAG, s.claims[LIVE]) and s.ring.pop() == b"victim"


# ----------------------------------------------------------------------------- RPC: the claim word
async def _echo_until_ok(client, deadline: float, wrong: list) -> float | None:
    """Call echo until a reply comes back (each checked byte for byte); when, or None."""
    while time.monotonic() < deadline:
        payload_ = os.urandom(32)
        try:
            reply = await client.call("echo", payload_, timeout=0.5)
        except (cxlrpc.DeadlineExceeded, cxlrpc.Unavailable):
            await asyncio.sleep(0.01)
            continue
        if reply != payload_:
            wrong.append(reply)
            continue
        return time.monotonic()
    return None


@pytest.mark.parametrize("impl", ["native", "reference"])
async def test_stray_claim_word_on_a_live_client_stops_the_ring_for_a_bounded_time(name, impl, monkeypatch):
    """An idle live client's claim word set to the request ring's head, the tail moved by 8:
    every client's requests wait behind it for about client_timeout, not until the victim
    calls again; then the others' calls and the victim's succeed, 0 wrong bytes."""
    url = f"shm://{name}"  # the shared MPSC request ring: coherent memory only
    if impl == "reference":
        monkeypatch.setenv("CXLRPC_NO_NATIVE", "1")  # the server child runs the Python reference
    server = start_fault_server(url, slots=4, client_timeout=CLIENT_TIMEOUT, request_capacity=1 << 16,
                                response_capacity=1 << 16)
    monkeypatch.delenv("CXLRPC_NO_NATIVE", raising=False)
    region = None
    clients = []
    try:
        victim = await open_counting(url)
        witness = await open_counting(url)
        clients += [victim, witness]
        for c in clients:
            assert await c.call("echo", b"before", timeout=5) == b"before"
        region = Region.open(url)
        geo = read_geometry(region)
        mem = region.mem
        head_at, tail_at = geo.request_ring + HEAD_OFFSET, geo.request_ring + TAIL_OFFSET
        claim_at = geo.slot(victim._conn.chan.slot) + _SLOT_CLAIM
        deadline = time.monotonic() + 10
        while True:  # the stray words, while the ring is idle (head == tail)
            head = mem.load(head_at, ACQUIRE)
            if mem.load(tail_at, ACQUIRE) == head:
                mem.store(claim_at, head, RELEASE)
                if mem.cas(tail_at, head, head + 8, 0) == head:
                    break
            assert time.monotonic() < deadline
            await asyncio.sleep(0.001)
        t_stray = time.monotonic()
        wrong: list = []
        done = await _echo_until_ok(witness, t_stray + RECOVERY_S, wrong)
        assert done is not None, f"the request ring stayed blocked for {RECOVERY_S} s by one claim word"
        recovered = done - t_stray
        assert await _echo_until_ok(victim, time.monotonic() + RECOVERY_S, wrong) is not None
        for i in range(50):  # both go on exactly
            for c in clients:
                body = f"{i}".encode() + os.urandom(16)
                assert await c.call("echo", body, timeout=5) == body
        assert not wrong, f"{len(wrong)} wrong replies"
        for c in clients:
            assert c.duplicates() == 0 and c.foreign == 0
        assert server.is_alive()
        report(f"stray claim word ({impl})", recovered_s=round(recovered, 2), client_timeout=CLIENT_TIMEOUT)
    finally:
        for c in clients:
            await c.close()
        if region is not None:
            region.close()
        stop(server)


# ----------------------------------------------------------------------------- RPC: owner and state words
#: Values no server writes there: OWNER_CLOSED; a PID beyond Linux's pid_max (no such process);
#: STATE_CLOSED
STRAY_WORDS = {"owner-state": (256, 2), "owner-pid": (40, (1 << 22) + 7), "control-state": (CONTROL, 2)}


def _poke(region: Region, at: int, value: int) -> None:
    """One stray 8-byte write, as memory holds it (written back in flush mode)."""
    region.mem.store(at, value, RELEASE)
    region.mem.writeback(at, 8)


def _peek(region: Region, at: int) -> int:
    region.mem.invalidate(at, 8)
    return region.mem.load(at, ACQUIRE)


@pytest.mark.parametrize("word", sorted(STRAY_WORDS))
async def test_stray_owner_or_state_word_heals_and_clients_stay(url, word):
    """One 8-byte write over the owner state, owner PID or control state of a live server:
    the server puts the word back within a housekeeping period or so, the connected client
    never gives up (it waits WORD_CONFIRM_S before believing one word), new clients connect,
    and every reply is exact."""
    at, value = STRAY_WORDS[word]
    server = start_fault_server(url, slots=4, client_timeout=1.0)
    region = None
    witness = None
    try:
        witness = await open_counting(url)
        assert await witness.call("echo", b"before", timeout=5) == b"before"
        region = Region.open(url)
        before = _peek(region, at)
        assert before != value
        wrong: list = []
        errors: list[str] = []
        stop_pump = asyncio.Event()

        async def pump() -> None:
            while not stop_pump.is_set():
                body = os.urandom(24)
                try:
                    reply = await witness.call("echo", body, timeout=2)
                except cxlrpc.RpcError as exc:
                    errors.append(type(exc).__name__)
                    await asyncio.sleep(0.01)
                    continue
                if reply != body:
                    wrong.append(reply)
                await asyncio.sleep(0.002)

        task = asyncio.create_task(pump())
        await asyncio.sleep(0.1)
        _poke(region, at, value)
        t_stray = time.monotonic()
        healed = await until(lambda: _peek(region, at) == before, RECOVERY_S, 0.005)
        healed_s = time.monotonic() - t_stray
        await asyncio.sleep(PAST_CONFIRM_S)  # past the clients' confirmation: still connected?
        fresh_ok = False
        deadline = time.monotonic() + RECOVERY_S
        while not fresh_ok and time.monotonic() < deadline:
            try:
                async with cxlrpc.connect(url) as fresh:
                    fresh_ok = await fresh.call("echo", b"fresh", timeout=2) == b"fresh"
            except cxlrpc.RpcError:
                await asyncio.sleep(0.05)
        stop_pump.set()
        await task
        assert healed, f"the {word} word was not put back within {RECOVERY_S} s"
        assert fresh_ok, "no new client could connect after the stray write"
        assert not wrong, f"{len(wrong)} wrong replies"
        assert witness._conn.gone is None and "Unavailable" not in errors, \
            f"the connected client gave up on one stray word: {errors[:5]}"
        assert witness.duplicates() == 0 and witness.foreign == 0
        assert server.is_alive()
        report(f"stray {word} word", healed_s=round(healed_s, 3), witness_errors=len(errors))
    finally:
        if witness is not None:
            await witness.close()
        if region is not None:
            region.close()
        stop(server)


# ----------------------------------------------------------------------------- RPC: geometry
async def test_plausible_wrong_geometry_never_attaches_new_clients_to_it(url):
    """The request capacity word doubled (a plausible geometry that puts the slot table over the
    response rings): new clients wait for the server to put it back and then call exactly;
    none writes where the wrong geometry points (the connected client's replies stay exact)."""
    server = start_fault_server(url, slots=4, client_timeout=1.0, request_capacity=1 << 16,
                                response_capacity=1 << 16)
    region = None
    witness = None
    try:
        witness = await open_counting(url)
        assert await witness.call("echo", b"before", timeout=5) == b"before"
        region = Region.open(url)
        at = CONTROL + 16
        real = _peek(region, at)
        wrong: list = []
        ok = 0
        for i in range(10):
            _poke(region, at, real * 2)  # again before each client: each meets the stray word
            try:
                client = await asyncio.wait_for(open_counting(url), 5)
            except cxlrpc.Unavailable as exc:  # allowed: a clear error, if the server were slow
                assert "checksum" in str(exc)
                continue
            try:
                body = os.urandom(40)
                reply = await client.call("echo", body, timeout=2)
                ok += reply == body
                if reply != body:
                    wrong.append(reply)
            finally:
                await client.close()
            body = os.urandom(40)
            reply = await witness.call("echo", body, timeout=2)
            if reply != body:
                wrong.append(reply)
        assert await until(lambda: _peek(region, at) == real, RECOVERY_S, 0.005)
        assert not wrong, f"{len(wrong)} wrong replies"
        assert ok >= 8, f"only {ok} of 10 new clients got their echo"
        assert witness.duplicates() == 0 and witness.foreign == 0 and witness._conn.gone is None
        report("stray geometry word", new_clients_ok=ok)
    finally:
        if witness is not None:
            await witness.close()
        if region is not None:
            region.close()
        stop(server)


def test_control_block_failing_its_checksum_is_a_clear_error(url):
    """A region whose geometry carries no valid checksum (stray words nobody puts back, or a
    server of another build) is refused with Unavailable naming the checksum, after a short
    wait, and nothing is claimed in it."""
    region = Region.create(url, 1 << 20, kind=KIND_RPC)
    try:
        for off, value in ((8, 2), (16, 1 << 12), (24, 1 << 12)):  # a plausible small geometry
            region.mem.store(CONTROL + off, value, RELEASE)
        region.mem.store(CONTROL, 1, RELEASE)  # "running"
        region.publish()
        snapshot = bytes(region.buf[CONTROL:])
        t0 = time.monotonic()
        with pytest.raises(cxlrpc.Unavailable, match="checksum"):
            cxlrpc.connect_sync(url)
        assert time.monotonic() - t0 < 5
        with pytest.raises(RegionError, match="checksum"):
            read_geometry(region, patience=0)
        region.mem.invalidate(CONTROL, region.size - CONTROL)
        assert bytes(region.buf[CONTROL:]) == snapshot, "a client wrote into the region"
    finally:
        region.unlink()
        region.close()
