"""Slot ownership across a holder's death and a server's replacement: a new holder is never
reaped for its predecessor's dead PID, and clients of a server that a file region's next
server replaced never share a (slot, generation) with that server's clients; a flush-mode
claimant whose grant was withdrawn before it looked knocks again."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cxlrpc.channel as channel
from cxlrpc.channel import KIND_RPC, client_channel, layout, server_channel
from cxlrpc.region import Region

pytestmark = pytest.mark.timeout(60)

CHILD = """
import sys
from cxlrpc.region import Region, parse_url
from cxlrpc.channel import client_channel
r = Region.open(sys.argv[1])
c = client_channel(r)
print(c.slot, c.gen, flush=True)
sys.stdin.read()
"""


def _server(url, slots=1, coherence="hardware"):
    geo = layout(slots, 1024, 1024, coherence)
    region = Region.create(url, geo.size, KIND_RPC, coherence=coherence)
    chan = server_channel(region, geo)
    region.publish()
    return region, chan


def _killed_local_client(url):
    """A client process of this host that claims a slot and is SIGKILLed (no release)."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, url], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        slot, gen = map(int, proc.stdout.readline().split())
    finally:
        proc.kill()
        proc.wait(10)
    return slot, gen


def test_new_holder_is_not_reaped_for_its_predecessors_dead_pid(url):
    """A client that has won a slot's CAS but not yet written its PID/identity line (it binds
    its wake-up socket first) must not be reaped because the line still names the slot's
    previous holder, a dead process of this host."""
    region, server = _server(url)
    try:
        slot, gen = _killed_local_client(url)
        deadline = time.monotonic() + 5
        while server.slot_generation(slot) == gen:  # reaped by its dead PID
            assert time.monotonic() < deadline
            server.reap(30.0, time.monotonic())
        # The next claimant: the server looks at the slot table right after its CAS, while it
        # binds its wake-up socket (before it writes its own PID and identity).
        real = channel.DoorbellReceiver
        reaped = []

        def slow_bind(*args, **kwargs):
            reaped.extend(server.reap(30.0, time.monotonic()))
            return real(*args, **kwargs)

        channel.DoorbellReceiver = slow_bind
        try:
            region2 = Region.open(url)
            client = client_channel(region2)
        finally:
            channel.DoorbellReceiver = real
        try:
            assert client.slot == slot
            assert (slot, client.gen) not in [gone[:2] for gone in reaped], "a live new holder was reaped"
            assert client.holds_slot(), "the new holder lost its slot to its predecessor's dead PID"
        finally:
            client.detach()
            region2.close()
    finally:
        server.close()
        region.close()
        region.unlink()


def test_client_of_a_replaced_server_does_not_share_its_slot_with_the_next_client(tmp_path):
    """A file region (a DAX device) is taken over in place: had the new server restarted the
    slot generations, the next client would claim slot 0 at generation 1 again, the very
    (slot, gen) a client of the previous server still holds. That client must learn it holds
    no slot of the new server, not go on as the co-holder of the new client's slot."""
    url = f"file://{tmp_path}/region"
    geo = layout(2, 1024, 1024, "hardware")
    a = Region.acquire(url, geo.size, KIND_RPC)
    server_a = server_channel(a, geo)
    a.publish()
    rx = Region.open(url)
    x = client_channel(rx)
    # server A closes cleanly; server B takes the region over at once (a restart)
    server_a.close()
    a.mark_closed()
    a.close()
    b = Region.acquire(url, geo.size, KIND_RPC)
    server_b = server_channel(b, geo)
    b.publish()
    ry = Region.open(url)
    y = client_channel(ry)
    try:
        assert (y.slot, y.gen) != (x.slot, x.gen)  # generations go on from server A's
        server_b.reap(5.0, time.monotonic())
        assert y.acknowledged()
        # the old client's monitor: does it still see a live server and a slot of its own?
        gone = x.server_gone(5.0)
        assert gone is not None or not x.holds_slot(), (
            f"client of the replaced server still holds slot {x.slot} gen {x.gen}, the new "
            f"client's, and sees its server alive (server_gone={gone!r}, acknowledged="
            f"{x.acknowledged()})")
    finally:
        x.detach()
        y.detach()
        server_b.close()
        for r in (rx, ry, b):
            r.close()


async def test_restarted_file_region_server_does_not_cross_replies_between_clients(tmp_path):
    """End to end: server A on a file region closes, server B takes the region over at once,
    client Y connects. Client X (A's) must not go on as co-holder of Y's slot: each caller
    must get its own reply."""
    import asyncio

    import cxlrpc

    url = f"file://{tmp_path}/region"

    def make():
        server = cxlrpc.Server(url, slots=2)

        @server.method("echo")
        def echo(payload):
            return payload

        return server

    a = make()
    await a.start()
    x = y = b = None
    try:
        x = await cxlrpc.connect(url).__aenter__()
        assert await x.call("echo", "x", timeout=5) == "x"
        await a.close()
        b = make()
        await b.start()
        y = await cxlrpc.connect(url).__aenter__()
        assert await y.call("echo", "y", timeout=5) == "y"
        got = await asyncio.gather(x.call("echo", "x", timeout=2), y.call("echo", "y", timeout=2),
                                   return_exceptions=True)
        assert got[1] == "y", f"client Y got {got[1]!r} (X got {got[0]!r})"
    finally:
        for c in (x, y):
            if c is not None:
                await c.close()
        if b is not None:
            await b.close()
        await a.close()



def test_flush_claimant_whose_grant_was_withdrawn_gets_a_slot_again(name):
    """Flush mode: the server grants a knock, then frees the slot because no heartbeat came
    within client_timeout (the claimant was slow to look: a loaded host). The claimant then
    reads its own nonce in a grant word that is not held, takes it for "not looked yet" and
    waits for ever -- the server never grants the same knock twice -- although the server is
    alive and the slot is free. It must knock again (and be granted) instead, once the slot is
    out of quarantine: a grant reaped unanswered is fenced like any reaped holder (its claimant
    may be frozen between reading the grant and writing the slot's lines)."""
    url = f"sim://{name}"
    region, server = _server(url, slots=1, coherence="flush")
    try:
        rc = Region.open(url)
        client = client_channel(rc)
        t = time.monotonic()
        server.reap(1.0, t)  # grants the knock
        gen = server.slot_generation(0)
        assert gen > 0
        server.reap(1.0, t + 0.5)
        server.reap(1.0, t + 2.0)  # no beat for client_timeout: freed
        assert server.slot_generation(0) < 0
        client.acknowledged()  # sees the grant withdrawn: knocks anew, on no slot yet
        server.reap(1.0, time.monotonic())
        assert server.slot_generation(0) < 0, "a quarantined slot was granted before its fence"
        server.fenced(0, gen)  # (the server's fencing layer, after fence_timeout)
        deadline = time.monotonic() + 3
        ok = False
        while time.monotonic() < deadline:
            server.reap(1.0, time.monotonic())
            if client.acknowledged():
                ok = True
                break
            time.sleep(0.01)
        assert ok, (f"claimant never acknowledged; server holds slot gen "
                    f"{server.slot_generation(0)} (free: -1)")
        assert client.holds_slot()
        client.detach()
        rc.close()
    finally:
        server.close()
        region.close()
        region.unlink()
