"""Fuzz, seeded: garbage written into each area of a live server region while clients check every
byte they get (issue 40).

A server runs in a child process (a crash is that child dying), two checking clients in
another (one asyncio, one blocking in a thread; bodies from a few bytes in the rings to followed heap bodies
of a few MiB, each derived from its call's number and compared byte for byte), and the test
process writes garbage into one area (tests/region_garbage.py says what and why). Properties:
no reply that differs from its request is ever returned as a success (a call may fail with an
RpcError), no call outlives its timeout, the server never dies, and once the garbage stops a
new client connects and its calls succeed within RECOVERY_S.

Replay or run longer: ``CXLRPC_FUZZ_SEED=N`` (printed by each case) and
``CXLRPC_FUZZ_SECONDS=S`` (the fuzz phase of each case; default ~1.5 s of DEFAULT_OPS bursts).
"""
from __future__ import annotations

import os
import random
import threading
import time
import zlib

import pytest

import cxlrpc
from cxlrpc import frame as fr
from cxlrpc.channel import read_geometry
from cxlrpc.memory import ACQUIRE, RELEASE
from cxlrpc.region import Region
from cxlrpc.ring import SpscRing
from cxlrpc.ring.record import HEADER_SIZE, TAIL_OFFSET
from fuzz_checker import Checkers, payload
from procs import report, sized_for, start_fault_server, stop, wait_for
from region_garbage import DROPPED, RegionFuzzer, run
from ring_env import GUARD, Env

DEFAULT_OPS = 250  # a fixed count by default: the same seed leaves the same final garbage
PACE = 0.003  # seconds between bursts
CALL_TIMEOUT = 0.5
RECOVERY_S = 5.0
MIB = 1 << 20


class NotRecovered(Exception):
    """No new client got its answers within RECOVERY_S after the garbage stopped."""


CASES = [
    pytest.param("request-ring", "native", "shm", id="request-ring"),
    pytest.param("reply-ring", "native", "shm", id="reply-ring"),
    pytest.param("slots", "native", "shm", id="slots"),
    pytest.param("slot-owner", "native", "shm", id="slot-owner"),
    pytest.param("heap", "native", "shm", id="heap"),
    pytest.param("claim", "native", "shm", id="claim"),
    pytest.param("owner", "native", "shm", id="owner"),
    pytest.param("geometry", "native", "shm", id="geometry"),
    pytest.param("request-ring", "reference", "shm", id="request-ring-reference"),
    pytest.param("reply-ring", "reference", "shm", id="reply-ring-reference"),
    pytest.param("heap", "reference", "shm", id="heap-reference"),
    pytest.param("request-ring", "native", "sim", id="request-ring-flush"),
    pytest.param("reply-ring", "native", "sim", id="reply-ring-flush"),
]


def _setup(scheme: str, area: str) -> tuple[dict, list, list, list]:
    """Server options, the asyncio and the blocking client's size bands, the fresh client's sizes."""
    if scheme == "sim":  # memory without coherence (flush mode): no followed bodies, small rings
        opts = sized_for("sim://x", {"slots": 6})
        return (opts, [(1, 256), (1024, 24 << 10), (150 << 10, 300 << 10)],
                [(1, 256), (4 << 10, 32 << 10), (140 << 10, 200 << 10)], [64, 20_000, 200_000])
    opts = {"slots": 6, "request_capacity": 1 << 16, "response_capacity": 1 << 16,
            "max_message_size": 4 * MIB, "heap_size": 16 * MIB}
    return (opts, [(1, 256), (1024, 24 << 10), (40 << 10, 200 << 10), (300 << 10, 3 * MIB)],
            [(1, 256), (2048, 16 << 10), (64 << 10, 128 << 10), (256 << 10, MIB)],
            [64, 20_000, 100_000, MIB])


def _probe(url: str, sizes: list[int]) -> dict:
    """:func:`_fresh_client` in a thread (bounded: a connect or call that hangs fails the test)."""
    out: dict = {}
    probe = threading.Thread(target=_fresh_client, args=(url, sizes, RECOVERY_S, out), daemon=True)
    probe.start()
    probe.join(RECOVERY_S + 30)
    assert not probe.is_alive(), "a new client's connect or call hung"
    return out


def _fresh_client(url: str, sizes: list[int], within: float, out: dict) -> None:
    """Connect new blocking clients until one gets every size echoed back, for ``within`` s:
    ``out["seconds"]`` it took (None: never), wrong replies, what failed meanwhile."""
    out.update(seconds=None, wrong=[], failures={})
    t0 = time.monotonic()
    attempt = 0
    while time.monotonic() - t0 < within:
        attempt += 1
        try:
            with cxlrpc.connect_sync(url) as client:
                for i, size in enumerate(sizes):
                    sent = payload(f"fresh:{attempt}:{i}", size)
                    if client.call("echo", sent, timeout=1.0) != sent:
                        out["wrong"].append((attempt, size))
                out["seconds"] = time.monotonic() - t0
                return
        except Exception as exc:  # noqa: BLE001 - any failure is retried; what it was is reported
            name = type(exc).__name__
            out["failures"][name] = out["failures"].get(name, 0) + 1
            time.sleep(0.05)


@pytest.mark.timeout(120 + 3 * float(os.environ.get("CXLRPC_FUZZ_SECONDS") or 0))
@pytest.mark.parametrize("area, build, scheme", CASES)
def test_fuzz_region(area, build, scheme, name, monkeypatch, capsys):
    """Garbage in one area of a live region: no wrong byte returned, no hang, no server crash,
    and a new client served again within RECOVERY_S once the garbage stops."""
    seed = int(os.environ.get("CXLRPC_FUZZ_SEED") or zlib.crc32(f"{area}/{build}/{scheme}".encode()))
    seconds = os.environ.get("CXLRPC_FUZZ_SECONDS")
    ops = int(float(seconds) / (PACE + 0.001)) if seconds else DEFAULT_OPS
    with capsys.disabled():
        print(f"\n[fuzz] {area} {build} {scheme}: CXLRPC_FUZZ_SEED={seed}, {ops} bursts")
    if build == "reference":
        monkeypatch.setenv("CXLRPC_NO_NATIVE", "1")  # the children's environment
    url = f"{scheme}://{name}"
    opts, async_bands, sync_bands, fresh_sizes = _setup(scheme, area)
    checkers = server = region = None
    t_start = time.monotonic()
    try:
        checkers = Checkers(url, async_bands, sync_bands, CALL_TIMEOUT)
        server = start_fault_server(url, client_timeout=1.0, **opts)
        warm = wait_for(lambda: min(checkers.progress) >= 4 or not checkers.alive(), 40)
        assert warm and checkers.alive(), f"the checking clients did not get going: {list(checkers.progress)}"
        t_warm = time.monotonic()
        region = Region.open(url)
        geo = read_geometry(region)
        dropped = region.mem.load(DROPPED, ACQUIRE)
        fuzzer = RegionFuzzer(region, geo, area, random.Random(seed))
        before = list(checkers.progress)
        took = run(fuzzer, ops, PACE)
        during = [b - a for a, b in zip(before, checkers.progress)]
        fuzz_end = time.monotonic()
        alive_after_fuzz = server.is_alive()
        # a new client beside the clients the garbage hit (bodies in the rings), then alone
        # (bodies through the heap too: a connection holds its extents until it leaves)
        beside = _probe(url, [s for s in fresh_sizes if s < geo.request_capacity // 2])
        served = list(checkers.progress)
        stats = checkers.stop()
        alone = _probe(url, fresh_sizes) if beside["seconds"] is not None else {"skipped": True}
        dropped = region.mem.load(DROPPED, ACQUIRE) - dropped
        alive_at_end = server.is_alive()
        t_probed = time.monotonic()
    finally:
        if checkers is not None:
            checkers.close()
        if region is not None:
            region.close()
        if server is not None:
            stop(server)

    report(f"fuzz {area} {build} {scheme}", seed=seed, bursts=ops, fuzz_s=round(took, 2),
           start_s=round(t_warm - t_start, 2), probes_s=round(t_probed - t_warm - took, 2),
           stop_s=round(time.monotonic() - t_probed, 2), calls_ok=served, calls_ok_during_fuzz=during,
           errors=[s.get("errors") for s in stats],
           last_error_after_fuzz_s=[round(max(s.get("last_error_at", 0) - fuzz_end, 0), 2) for s in stats],
           dropped=dropped, heap_progress_words=fuzzer.heap_writes,
           new_client_beside_s=beside.get("seconds"), new_client_alone_s=alone.get("seconds"),
           new_client_failures=[beside.get("failures"), alone.get("failures")])
    assert alive_after_fuzz and alive_at_end, f"seed {seed}: the server died (exit {server.exitcode})"
    assert server.exitcode == 0, f"seed {seed}: the server ended with {server.exitcode}, not a clean close"
    for s in stats:
        assert not s.get("exceptions"), f"seed {seed}: {s['exceptions'][:5]}"
        assert not s["wrong"], f"seed {seed}: {len(s['wrong'])} wrong replies returned as successes: {s['wrong'][:5]}"
        assert s["late"] == 0, f"seed {seed}: {s['late']} calls outlived their timeout (slowest {s['slowest']:.1f} s)"
    for probe in (beside, alone):
        assert not probe.get("wrong"), f"seed {seed}: a new client got wrong replies {probe['wrong']}"
    for probe, when in ((beside, "beside the clients the garbage hit"), (alone, "once they left")):
        if probe.get("seconds", 0) is None:
            raise NotRecovered(f"seed {seed}: no new client was served {when} within {RECOVERY_S} s "
                               f"({probe['failures']})")


# ----------------------------------------------------------------------------- what the fuzz found
@pytest.mark.xfail(strict=True, raises=cxlrpc.DeadlineExceeded,
                   reason="fuzz finding: a heap request lost in the ring keeps its extent for the connection's life")
async def test_a_heap_request_lost_in_the_ring_does_not_keep_its_extent(url):
    """A request whose record garbage destroyed after its body went into a heap extent: the
    extent comes back once the call ended, so a bystander's big call gets heap room while the
    victim lives on (found by the flush-mode request-ring fuzz: a 1 MiB heap full of such
    extents, every new client's heap call timed out until the victims left)."""
    server = cxlrpc.Server(url, slots=3, request_capacity=1 << 16, response_capacity=1 << 16,
                           max_message_size=MIB, heap_size=MIB)
    server.add_method("echo", lambda payload: payload)
    async with server, cxlrpc.connect(url) as victim, cxlrpc.connect(url) as bystander:
        real = victim._conn.push

        def lossy(parts: tuple) -> bool:  # the first heap request's record never reaches the server
            kind, flags = fr.HEADER.unpack_from(parts[0])[:2]
            if kind == fr.REQUEST and flags & fr.HEAP:
                victim._conn.push = real
                return True
            return real(parts)

        victim._conn.push = lossy
        with pytest.raises(cxlrpc.DeadlineExceeded):
            await victim.call("echo", b"v" * (600 << 10), timeout=0.5)
        assert victim._conn.push is real, "the heap request did not go through the lossy push"
        sent = b"b" * (600 << 10)
        assert await bystander.call("echo", sent, timeout=3) == sent
        assert await victim.call("echo", b"still", timeout=3) == b"still"


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="fuzz finding: an SPSC record is committed by the tail alone (its header is written first)")
def test_a_garbage_tail_never_shows_an_spsc_record_being_written():
    """One plausible garbage word over an SPSC ring's tail, while its producer is copying a
    record: the consumer must not take the half-copied record for a whole one (the reply
    rings' producer, the server, writes the committed header first and publishes with the
    tail; a tail run ahead shows the record early, which is why the fuzz writes none)."""
    env = Env(SpscRing, 1 << 12)
    producer = env.ring
    consumer = SpscRing(env.buf, env.mem, GUARD, env.cap)
    consumer.attach()
    body = bytes(range(256)) * 2
    end = producer._reserve(producer._tail_local, len(body))  # the producer's header is out...
    start = env.data + HEADER_SIZE
    env.buf[start:start + 100] = body[:100]  # ...and it is still copying
    env.mem.store(GUARD + TAIL_OFFSET, end, RELEASE)  # garbage: the tail it will publish
    got: list[bytes] = []
    consumer.poll(lambda view: got.append(bytes(view)))
    assert all(record == body for record in got), f"read a record being written: {[len(r) for r in got]}"
