"""Flush mode's slot table against holders that outlive their slot and knocks that outlive
their claimant (issue 42): a holder reaped while frozen (SIGSTOP) and resumed (SIGCONT)
finishes the stores it had checked for -- its heartbeat, its request ring's data and tail --
so its slot is granted to nobody until it is fenced; a knock made before the slot last changed
hands is never granted (it would hold the slot for nobody until client_timeout)."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import cxlrpc
from cxlrpc.channel import (_F_GEN, _F_HOLDER, _F_PID, KIND_RPC, FlushClientChannel, client_channel,
                            layout, server_channel)
from cxlrpc.memory import ACQUIRE
from cxlrpc.region import Region
from cxlrpc.ring.record import TAIL_OFFSET
from cxlrpc.transport import DEAD, DETACHED
from frozen_peers import holder_main, zombie_holder_main
from procs import CTX, stop, until

pytestmark = pytest.mark.timeout(120)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def _claimant(url: str, first: int) -> FlushClientChannel:
    """A claimant that tries slot ``first`` before the others (any claimant may: it starts
    at a random slot)."""

    class FirstTries(FlushClientChannel):
        def _scan(self) -> None:
            self._candidates = iter([(first + k) % self.geo.slots for k in range(self.geo.slots)])

    return FirstTries(Region.open(url))


def _let_go(chan: FlushClientChannel) -> None:
    chan.detach()
    chan.region.close()


async def test_a_holder_reaped_while_frozen_writes_nothing_into_its_slots_next_holder(name: str) -> None:
    url = f"sim://{name}"
    server = cxlrpc.Server(url, slots=2, coherence="flush", client_timeout=1.0, fence_timeout=60.0,
                           request_capacity=1 << 16, response_capacity=1 << 16)
    geo = server.geometry
    left: list[cxlrpc.Peer] = []
    fenced: list[cxlrpc.Peer] = []
    server.on_disconnect(left.append)
    server.on_fenced(fenced.append)
    async with server:
        here, there = CTX.Pipe()
        proc = CTX.Process(target=zombie_holder_main, args=(url, there), daemon=True)
        proc.start()
        watch = Region.open(url)  # an observer: its own cache, reads only what memory holds
        claimants: list[FlushClientChannel] = []
        try:
            assert await asyncio.to_thread(here.poll, 30), "the holder never got a slot"
            _, slot, gen = here.recv()
            here.send("freeze")
            assert await until(lambda: _stopped(proc.pid), 30), "the holder never froze"
            assert await until(lambda: left, 10), "the frozen holder was never reaped"
            claimants.append(new := _claimant(url, slot))
            assert await until(new.acknowledged, 5), "no slot granted to a new claimant"
            os.kill(proc.pid, signal.SIGCONT)
            assert await asyncio.to_thread(here.poll, 30), "the resumed holder never answered"
            _, _, holds = here.recv()
            assert holds is False
            # memory holds the new holder's line and its ring's tail, not the zombie's
            base = geo.slot(new.slot)
            watch.mem.invalidate(base + _F_HOLDER, 40)
            line = watch.mem.load(base + _F_GEN, ACQUIRE), watch.mem.load(base + _F_PID, ACQUIRE)
            assert line == (new.gen, os.getpid()), (
                f"slot {new.slot}'s holder line names {line}, its holder is {(new.gen, os.getpid())} "
                f"(the zombie: {(gen, proc.pid)})")
            tail_at = geo.client_request_ring(new.slot) + TAIL_OFFSET
            watch.mem.invalidate(tail_at, 8)
            assert watch.mem.load(tail_at, ACQUIRE) == new.requests._tail_local
            await asyncio.sleep(0.3)  # (the server polls its holders' rings meanwhile)
            assert server.dropped_frames == 0, "the zombie's request reached a polled ring"
            assert not fenced and new.slot != slot
            # the zombie's slot is granted once the zombie is fenced (here: its exit)
            os.kill(proc.pid, signal.SIGKILL)
            assert await until(lambda: fenced, 10), "the killed zombie was never fenced"
            claimants.append(again := _claimant(url, slot))
            assert await until(again.acknowledged, 5) and again.slot == slot
        finally:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            await asyncio.to_thread(stop, proc)
            for chan in claimants:
                _let_go(chan)
            watch.close()
            here.close()
            there.close()


@pytest.mark.parametrize("how", ["released", "killed"])
def test_a_released_or_dead_holders_slot_is_granted_at_once(name: str, how: str) -> None:
    """Quarantine is for reaped holders only: a slot released, or whose holder's process is
    gone (same host: its pidfd says so), goes to the next knock at once."""
    url = f"sim://{name}"
    geo = layout(1, 1024, 1024, "flush")
    region = Region.create(url, geo.size, KIND_RPC, coherence="flush")
    server = server_channel(region, geo)
    region.publish()
    here, there = CTX.Pipe()
    proc = CTX.Process(target=holder_main, args=(url, there), daemon=True)
    try:
        if how == "released":
            first = client_channel(Region.open(url))
            server.reap(1.0, 0.0)
            assert first.acknowledged()
            _let_go(first)
        else:
            proc.start()
            deadline = time.monotonic() + 30
            while not here.poll(0.01):  # (the grant comes at a reap)
                assert time.monotonic() < deadline, "the holder never got its grant"
                server.reap(1.0, 0.0)
            here.recv()
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
        gone = server.reap(1.0, 0.1)
        assert [d.how for d in gone] == [DETACHED if how == "released" else DEAD]
        second = client_channel(Region.open(url))
        server.reap(1.0, 0.2)
        assert second.acknowledged()
        _let_go(second)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        if proc.pid is not None:
            stop(proc)
        here.close()
        there.close()
        server.close()
        region.close()
        region.unlink()


def test_a_knock_made_before_the_slot_changed_hands_is_never_granted(name: str, monkeypatch) -> None:
    """A claimant reads the slot free, the server grants another's knock, then the claimant's
    knock lands; it sees the slot granted to another and moves on (here: gives up). Once the
    holder releases the slot, that knock must not be granted: nobody waits for it, and the
    slot would be held by nobody until client_timeout (then quarantined until fence_timeout)."""
    url = f"sim://{name}"
    geo = layout(1, 1024, 1024, "flush")
    region = Region.create(url, geo.size, KIND_RPC, coherence="flush")
    server = server_channel(region, geo)
    region.publish()
    try:
        holder = client_channel(Region.open(url))
        server.reap(1.0, 0.0)  # grants the holder's knock
        with monkeypatch.context() as patch:  # it read the grant word just before that grant
            patch.setattr(FlushClientChannel, "_grant", lambda self, slot: 0)
            late = client_channel(Region.open(url))
        assert not late.acknowledged()  # another's nonce granted: it moves on (no slot left)
        late.region.close()  # and gives up
        assert holder.acknowledged()
        _let_go(holder)
        server.reap(1.0, 0.1)  # frees the released slot
        server.reap(1.0, 0.2)
        assert server.slot_generation(0) < 0, "a stale knock was granted: the slot is held by nobody"
        fresh = client_channel(Region.open(url))
        server.reap(1.0, 0.3)
        assert fresh.acknowledged(), "a knock of the slot's current free period was not granted"
        _let_go(fresh)
    finally:
        server.close()
        region.close()
        region.unlink()
