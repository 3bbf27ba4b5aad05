"""Flush mode on the native hot path (cxlrpc/_ring.c, the Dispatcher, the Caller): held to the
Python reference across processes under the simulator (each process its own cache), its
write-backs, invalidates and fences per unary call counted against what the protocol needs, and
each of its flush sites (RING_*, CALL_GRANT) removed in turn, caught by a scenario."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import cxlrpc
from cxlrpc.memory import _native as _flush
from cxlrpc.ring.base import NATIVE
from cxlrpc.server_dispatch import _Dispatcher

from nc_native_peer import CAPACITY, snapshot
from test_noncoherent import COUNT, PEER as RING_PEER, _ring_region

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(_flush is None or not NATIVE or _Dispatcher is None,
                                 reason="the native modules were not built")]
PEER = str(Path(__file__).with_name("nc_native_peer.py"))
NATIVE_ENV = {k: v for k, v in os.environ.items() if k != "CXLRPC_NO_NATIVE"}
REFERENCE_ENV = {**NATIVE_ENV, "CXLRPC_NO_NATIVE": "1"}
SITES = {name: number for number, (name, _) in enumerate(_flush.sites())} if _flush is not None else {}


def _scenario(url: str, scenario: str, eviction: float = 0.0, skip_server: int = 0, skip_client: int = 0,
              native_server: bool = True, native_client: bool = True) -> tuple[str, str]:
    """A server process and a client process run ``scenario``: (how the server dispatches,
    what the client printed)."""
    server = subprocess.Popen([sys.executable, PEER, "serve", url, str(eviction), str(skip_server)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=NATIVE_ENV if native_server else REFERENCE_ENV)
    try:
        ready = server.stdout.readline().split()  # type: ignore[union-attr]
        assert ready[:1] == ["ready"], ready
        client = subprocess.run([sys.executable, PEER, "call", url, str(eviction), str(skip_client), scenario],
                                capture_output=True, text=True, timeout=120,
                                env=NATIVE_ENV if native_client else REFERENCE_ENV)
        assert not client.stderr, client.stderr[-3000:]
        return ready[1], client.stdout.strip()
    finally:
        err = _stop(server)
        assert not err, err[-3000:]


def _stop(server: subprocess.Popen[str]) -> str:
    """End a ``serve`` peer (its input closed: it closes its server) and what it wrote to stderr."""
    server.stdin.close()  # type: ignore[union-attr]
    try:
        server.wait(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return server.stderr.read()  # type: ignore[union-attr]


# ---------------------------------------------------------------------- native vs reference
@pytest.mark.parametrize("eviction", [0.05, 0.0])
@pytest.mark.parametrize("producer", ["native", "reference"])
def test_native_and_reference_rings_interoperate_under_the_simulator(name, eviction, producer):
    """One SPSC ring pair, one side native and the other the reference (each its own cache):
    both write and read the same protocol, lock-step, single pushes and batches."""
    region = _ring_region(f"sim://{name}")
    try:
        args = [region.url, "4096", str(COUNT), str(eviction), "0"]
        envs = (NATIVE_ENV, REFERENCE_ENV) if producer == "native" else (REFERENCE_ENV, NATIVE_ENV)
        peers = [subprocess.Popen([sys.executable, RING_PEER, role, *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
                 for role, env in zip(("send", "echo"), envs)]
        try:
            outs = [p.communicate(timeout=120) for p in peers]
        finally:
            for p in peers:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert [out.strip() for out, _ in outs] == [f"ok {COUNT}"] * 2, outs
    finally:
        region.unlink()
        region.close()


@pytest.mark.parametrize("eviction", [0.05, 0.0])
@pytest.mark.parametrize("server_side,client_side", [("native", "native"), ("native", "reference"),
                                                     ("reference", "native"), ("reference", "reference")])
def test_calls_across_processes_natively_and_on_the_reference(name, eviction, server_side, client_side):
    """Calls of many sizes (the rings wrap every few calls, bodies too big for them go through
    the heap) between a server and a client process, each native or the reference: every reply
    exact, whichever side runs which."""
    served, out = _scenario(f"sim://{name}", "echo", eviction, native_server=server_side == "native",
                            native_client=client_side == "native")
    assert (served, out) == (server_side, f"ok 60 {client_side}")


@pytest.mark.parametrize("side", ["native", "reference"])
@pytest.mark.parametrize("scenario", ["repair", "revoke"])
def test_repair_and_revocation_scenarios_pass(name, scenario, side):
    """The scenarios the sites RING_REPAIR and CALL_GRANT are removed in pass as they are, on
    either path: a garbage tail republished by a full producer; a frozen client's slot freed,
    its next push refused."""
    served, out = _scenario(f"sim://{name}", scenario, native_server=side == "native",
                            native_client=side == "native")
    assert served == side and out.startswith("ok") and out.endswith(side), out
    if scenario == "revoke":
        assert out.split()[1] == "ClaimRevoked", out


def test_a_blocking_client_calls_natively_in_flush_mode(name):
    """The blocking client's calls go through the native caller too (its grant checked before
    each push), against a native server process."""
    url = f"sim://{name}"
    server = subprocess.Popen([sys.executable, PEER, "serve", url, "0.05", "0"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=NATIVE_ENV)
    try:
        assert server.stdout.readline().split() == ["ready", "native"]  # type: ignore[union-attr]
        with cxlrpc.connect_sync(url) as client:
            assert client._conn.caller is not None
            for i in range(40):
                body = bytes([i]) * (i * 97)
                assert client.call("echo", body, timeout=10) == body
    finally:
        err = _stop(server)
        assert not err, err[-3000:]


def test_memory_that_flushes_without_lines_keeps_to_the_reference():
    """Flushing memory without the native Lines (the flush module absent: use_flushes then
    calls its hooks as they are) is served by the rings' Python reference, which calls them."""
    import mmap

    from cxlrpc.memory import AtomicMemory
    from cxlrpc.ring import SpscRing

    region = mmap.mmap(-1, 8192)
    mem = AtomicMemory(region)
    calls: list[tuple[str, int, int]] = []
    mem._writeback = lambda offset, n: calls.append(("writeback", offset, n))
    mem._invalidate = lambda offset, n: calls.append(("invalidate", offset, n))
    mem.flushing = True  # (what use_flushes leaves where cxlrpc._flush is not built)
    view = memoryview(region)
    ring = SpscRing(view, mem, 0, 4096)
    try:
        ring.reset()
        calls.clear()
        assert ring.try_push(b"through the reference")
        assert ("writeback", 256, 32) in calls and ("writeback", 0, 8) in calls  # record, tail
        calls.clear()
        assert ring.readable() and ring.pop() == b"through the reference"
        assert ("invalidate", 0, 8) in calls and ("invalidate", 256, 32) in calls  # tail, record
        assert ("writeback", 128, 8) in calls  # the released head
    finally:
        del ring
        view.release()
        mem.close()
        region.close()


# ---------------------------------------------------------------------- the flush count
#: What one unary call needs of each side's native sites, (calls, fences), from the protocol:
#: the client checks its grant (an invalidate, a full fence), pushes (the record's lines written
#: back, one store fence, the tail's line written back) and polls the reply (the tail's line
#: invalidated at each look, k >= 1, each with a full fence; then the record's lines, one full
#: fence) and releases it (the head's line written back). The server polls the request as the
#: client polls the reply, and pushes the reply as the client pushes the request.
#: Client per call: 3 write-backs, 2 + k invalidates, 3 + k fences; server: 3, 1 + k', 2 + k'.
PER_CALL = {
    "client": {"CALL_GRANT": (1, 1), "RING_PUSH_DATA": (1, 1), "RING_PUSH_TAIL": (1, 0),
               "RING_POLL_DATA": (1, 1), "RING_RELEASE_HEAD": (1, 0)},
    "server": {"RING_POLL_DATA": (1, 1), "RING_RELEASE_HEAD": (1, 0), "RING_PUSH_DATA": (1, 1),
               "RING_PUSH_TAIL": (1, 0)},
}
CALLS = 1000


def _check_counts(side: str, counts: dict[str, tuple[int, int]], totals: dict[str, int],
                  extra: dict[str, int]) -> None:
    """``counts`` (site -> (calls, fences)) over CALLS calls are PER_CALL's, ``extra`` added
    (the calls around the counted ones, per site); each look at a tail costs one invalidate and
    one fence; the Python sites (PY: heartbeats, reaping) are not per call; and nothing flushes
    or fences but through a site (``totals``: Lines.counts())."""
    assert totals["fences"] == sum(f for _, f in counts.values()), (side, totals, counts)
    assert totals["writebacks"] + totals["invalidates"] == sum(c for c, _ in counts.values()), (side, totals)
    want = {site: (CALLS * c + extra.get(site, 0), CALLS * f + extra.get(site, 0) * (f > 0))
            for site, (c, f) in PER_CALL[side].items()}
    looks, look_fences = counts.pop("RING_POLL_TAIL", (0, 0))
    python = counts.pop("PY", (0, 0))[0]
    assert counts == want, f"{side}: {counts} != {want}"
    assert looks >= CALLS and look_fences == looks, (side, looks, look_fences)
    assert python < CALLS / 10, f"{side}: {python} Python flushes in {CALLS} calls"


async def test_a_unary_call_costs_the_flushes_the_protocol_needs(name):
    """CALLS 64-byte echo calls between processes on a flush-mode shm:// region, natively: the
    write-backs, invalidates and fences per call of each side, site by site (a count that
    rises fails)."""
    url = f"shm://{name}"
    server = subprocess.Popen([sys.executable, PEER, "serve", url, "0", "0", str(1 << 20)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=NATIVE_ENV)
    try:
        assert server.stdout.readline().split() == ["ready", "native"]  # type: ignore[union-attr]
        async with cxlrpc.connect(url) as client:
            assert client._conn.caller is not None
            lines = client._conn.chan.region.mem.lines
            body = bytes(range(64))
            for _ in range(20):
                assert await client.call("echo", body, timeout=10) == body
            await client.call("reset", timeout=10)  # the server's counts start in that handler
            lines.reset()
            for _ in range(CALLS):
                assert await client.call("echo", body, timeout=10) == body
            mine, my_totals = snapshot(lines)
            sites, totals = await client.call("counts", timeout=10)
            theirs = {site: tuple(pair) for site, pair in sites.items()}
        _check_counts("client", mine, my_totals, {})
        # the server's counts run from within the reset handler to within the counts handler:
        # reset's reply pushed and its record released, counts' request read
        _check_counts("server", theirs, totals, {"RING_PUSH_DATA": 1, "RING_PUSH_TAIL": 1, "RING_RELEASE_HEAD": 1,
                                         "RING_POLL_DATA": 1})
    finally:
        err = _stop(server)
        assert not err, err[-3000:]


# ---------------------------------------------------------------------- the mutation test
#: Each native site, the scenario that shows its removal, and the processes it is removed in:
#: the ring sites run in both (each side produces one ring and consumes the other).
MUTATIONS = [(site, "echo", where) for site in ("RING_PUSH_DATA", "RING_PUSH_TAIL", "RING_FULL_HEAD",
                                                "RING_POLL_TAIL", "RING_POLL_DATA", "RING_RELEASE_HEAD")
             for where in ("client", "server")]
MUTATIONS += [("RING_REPAIR", "repair", "client"), ("CALL_GRANT", "revoke", "client")]


def test_the_mutation_test_sees_every_native_site_of_this_path():
    ours = sorted(site for site in SITES if site.startswith(("RING_", "CALL_")))
    assert sorted({site for site, _, _ in MUTATIONS}) == ours, ours
    assert CAPACITY <= 8192  # the echo scenario laps its rings (RING_FULL_HEAD, RING_RELEASE_HEAD)


@pytest.mark.mutations
@pytest.mark.parametrize("site,scenario,where", MUTATIONS, ids=[f"{s}-{w}" for s, _, w in MUTATIONS])
def test_removing_a_native_flush_site_breaks_its_scenario(name, site, scenario, where):
    """With that one site made a no-op in that process (no random evictions, which would
    publish a forgotten line sooner or later), the scenario fails: a reply wrong or missing, a
    ring that stays full, or a push into a slot the server freed."""
    number = SITES[site]
    served, out = _scenario(f"sim://{name}", scenario, skip_server=number if where == "server" else 0,
                            skip_client=number if where == "client" else 0)
    assert served == "native" and out.startswith("fail") and out.endswith("native"), \
        f"removing {site} in the {where} went unnoticed: {out}"
