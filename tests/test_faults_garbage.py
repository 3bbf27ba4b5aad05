"""Fault suite, hostile bytes: garbage written into a live server's region, committed garbage
frames (dropped and counted), fuzzed frame decoding, bad input through the API.

The server runs in a child process; the test process maps the same region and scribbles on it
while its own clients and a client process keep calling.  Properties: the server process never
dies and answers again within a bounded number of retries; no call hangs past its timeout; no
caller ever receives a reply that is not the answer to its own request.
"""
from __future__ import annotations

import asyncio
import os
import random
import struct
import threading
import time

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import cxlrpc
from cxlrpc import frame as fr
from cxlrpc.channel import CONTROL, KIND_RPC, SLOT_STRIDE, geometry_sum, read_geometry
from cxlrpc.memory import ACQUIRE, RELEASE
from cxlrpc.region import Region, pid_alive
from cxlrpc.ring import MpscRing
from cxlrpc.ring.record import CONTROL_SIZE, HEAD_OFFSET, TAIL_OFFSET
from procs import (Pump, fault_server, open_counting, report, start_fault_server, start_load_clients, stop,
                   until)
from region_garbage import DROPPED
CALL_TIMEOUT = 1.0
SLACK = 1.0  # a call may end this much after its timeout (two busy cores) and still not "hang"
# Garbage that lands inside a committed request can turn its method or body into something else:
# the caller then gets that status instead of a reply, which is the contract (a reply or an RpcError).
GARBAGE_ERRORS = {"DeadlineExceeded", "Unimplemented", "InvalidArgument", "Internal"}


class TolerantPump(Pump):
    """A Pump whose calls may fail (garbage can lose a request or reply) but never hang and
    never return someone else's answer."""

    def __init__(self, client, tag: str, inflight: int = 4) -> None:
        super().__init__(client, tag, inflight, timeout=CALL_TIMEOUT)
        self.slowest = 0.0
        self.ok_times: list[float] = []

    async def _worker(self, w: int) -> None:
        seq = 0
        while not self._stopping:
            payload = f"{self.tag}:{w}:{seq}:".encode() + os.urandom(24)
            seq += 1
            self.sent += 1
            t0 = time.monotonic()
            try:
                reply = await self.client.call("echo", payload, timeout=self.timeout)
            except cxlrpc.RpcError as exc:
                self.errors.append(type(exc).__name__)
                await asyncio.sleep(0.001)  # an error may come back at once: never starve the loop
            else:
                if reply == payload:
                    self.ok += 1
                    self.ok_times.append(time.monotonic())
                else:
                    self.mismatched += 1
            self.slowest = max(self.slowest, time.monotonic() - t0)

    def ok_after(self, t: float) -> int:
        return sum(1 for x in self.ok_times if x > t)

    def check_no_hang_no_wrong_reply(self) -> None:
        assert self.mismatched == 0, f"{self.tag}: {self.mismatched} wrong replies delivered"
        assert self.slowest <= self.timeout + SLACK, f"{self.tag}: a call took {self.slowest:.2f} s"
        assert set(self.errors) <= GARBAGE_ERRORS, set(self.errors)
        assert self.client.duplicates() == 0 and self.client.foreign == 0


def fresh_client_answers(url: str, attempts: int = 20) -> int | None:
    """Connect a new blocking client and call until it gets its echo; the attempt number or None."""
    for i in range(1, attempts + 1):
        try:
            with cxlrpc.connect_sync(url) as c:
                payload = os.urandom(32)
                if c.call("echo", payload, timeout=0.5) == payload:
                    return i
        except (cxlrpc.DeadlineExceeded, cxlrpc.ResourceExhausted):
            pass
    return None


def scribble(region: Region, geo, target: str, victim_slot: int, free_slots: list[int],
             rng: random.Random) -> None:
    """One burst of garbage on ``target``."""
    buf, mem = region.buf, region.mem
    if target == "request-data":
        data = geo.request_ring + CONTROL_SIZE
        buf[data:data + geo.request_capacity] = rng.randbytes(geo.request_capacity)
    elif target == "response-ring":
        data = geo.response_ring(victim_slot) + CONTROL_SIZE
        buf[data:data + geo.response_capacity] = rng.randbytes(geo.response_capacity)
    elif target == "free-slots":
        for i in free_slots:
            base = geo.slot(i)
            buf[base:base + SLOT_STRIDE] = rng.randbytes(SLOT_STRIDE)
    elif target == "counters":  # any u64: misaligned, huge, behind, ahead
        for off in (TAIL_OFFSET, HEAD_OFFSET):
            mem.store(geo.request_ring + off, rng.getrandbits(64), RELEASE)
        # the response ring's tail: see test_garbage_response_tail_does_not_freeze_the_client_loop
        mem.store(geo.response_ring(victim_slot) + HEAD_OFFSET, rng.getrandbits(64), RELEASE)
    else:
        raise AssertionError(target)


# ----------------------------------------------------------------------------- garbage, live
@pytest.mark.parametrize("target", ["request-data", "response-ring", "free-slots", "counters"])
async def test_garbage_in_live_region_server_survives_clients_never_hang(url, target):
    """Random bytes over a live region's request ring, a client's response ring, free slot entries or ring counters: the server stays up and answers again, no call outlives its timeout, no wrong reply is delivered."""
    slots = 6
    server = start_fault_server(url, slots=slots, client_timeout=0.5, request_capacity=1 << 16,
                                response_capacity=1 << 16)
    region = None
    clients = []
    load = None
    try:
        load = start_load_clients(url, 1, seconds=4.5, inflight=8, max_len=256, call_timeout=CALL_TIMEOUT)
        victim = await open_counting(url)
        witness = await open_counting(url)
        clients += [victim, witness]
        pumps = [TolerantPump(victim, "victim").start(), TolerantPump(witness, "witness").start()]
        procs, progress, results = load
        assert await until(lambda: progress.value >= 200 and all(p.ok >= 50 for p in pumps), 20)
        region = Region.open(url)
        geo = read_geometry(region)
        free = [i for i in range(slots) if not region.mem.load(geo.slot(i), ACQUIRE) & 1]
        assert len(free) == slots - 3
        rng = random.Random(target)
        for _ in range(5):  # bursts while calls are in flight
            scribble(region, geo, target, victim._conn.chan.slot, free, rng)
            await asyncio.sleep(0.02)
        t_garbage = time.monotonic()
        assert server.is_alive() and pid_alive(server.pid)
        attempts = await asyncio.to_thread(fresh_client_answers, url)
        assert attempts is not None, "the server never answered a fresh client after the garbage"
        recovered = await until(lambda: all(p.ok_after(t_garbage + CALL_TIMEOUT + SLACK) >= 20 for p in pumps), 10)
        if target == "free-slots":  # every garbage slot entry is reclaimed for new clients
            extra = []
            try:
                deadline = time.monotonic() + 5
                while len(extra) < len(free) - 1 and time.monotonic() < deadline:
                    try:
                        extra.append(await open_counting(url))
                    except cxlrpc.ResourceExhausted:
                        await asyncio.sleep(0.02)
                assert len(extra) == len(free) - 1, f"only {len(extra)} of {len(free) - 1} garbage slots came back"
                for c in extra:
                    assert await c.call("echo", b"slot back", timeout=5) == b"slot back"
            finally:
                for c in extra:
                    await c.close()
        for p in pumps:
            await p.stop()
        for p in pumps:
            p.check_no_hang_no_wrong_reply()
        stats = [results.get(timeout=30) for _ in procs]
        for s in stats:
            assert "crash" not in s, s
            assert s["mismatched"] == 0 and s["late"] == 0 and s["foreign"] == 0 and s["duplicates"] == 0, s
            assert set(s["errors"]) <= GARBAGE_ERRORS, s
        assert server.is_alive()
        assert recovered, "live clients did not get answers again within 10 s of the garbage"
        report(f"garbage {target}", fresh_client_attempts=attempts,
               victim_errors=len(pumps[0].errors), witness_errors=len(pumps[1].errors),
               load_errors=sum(sum(s["errors"].values()) for s in stats),
               dropped=region.mem.load(DROPPED, ACQUIRE))
    finally:
        for c in clients:
            await c.close()
        if load is not None:
            for p in load[0]:
                stop(p)
            load[2].close()
        if region is not None:
            region.close()
        stop(server)
    assert server.exitcode == 0, f"server ended with {server.exitcode} after the garbage (clean SIGTERM close expected)"


async def test_misaligned_counters_do_not_kill_either_reader(url):
    """Unaligned garbage over the request ring's or a client's response ring's head or tail: the server and that client get answers again within bounded retries."""
    with fault_server(url, slots=1, client_timeout=0.5, request_capacity=1 << 16,
                      response_capacity=1 << 16) as server:
        async with cxlrpc.connect(url) as client:
            region = Region.open(url)
            try:
                geo = read_geometry(region)
                for ring_name, ring in (("request", geo.request_ring), ("response", geo.response_ring(0))):
                    for counter in (HEAD_OFFSET, TAIL_OFFSET):
                        value = await _counter_after_an_echo(client, region, ring + counter)
                        # not 8-byte aligned, and within a lap (so it is not simply resynced away)
                        region.mem.store(ring + counter, value - 5, RELEASE)
                        what = f"{ring_name} ring {'head' if counter == HEAD_OFFSET else 'tail'}"
                        assert await until(lambda: _echo_ok(client), 5), f"no answer after a misaligned {what}"
                        assert server.is_alive()
            finally:
                region.close()


@pytest.mark.parametrize("garbage", ["misaligned", "behind-head", "laps-ahead"])
async def test_garbage_response_tail_does_not_freeze_the_client_loop(url, garbage):
    """Garbage over an idle async client's response-ring tail never stops its event loop (a 50 ms sleep returns within 1 s; a watchdog thread repairs the tail after 3 s to bound a frozen loop)."""
    with fault_server(url, slots=1, request_capacity=1 << 16, response_capacity=1 << 16):
        async with cxlrpc.connect(url) as client:
            assert await client.call("echo", b"before", timeout=5) == b"before"
            await asyncio.sleep(0.2)  # pacing: let the reader go idle (parked) before the garbage
            region = Region.open(url)
            try:
                tail_at = read_geometry(region).response_ring(0) + TAIL_OFFSET
                real = region.mem.load(tail_at, ACQUIRE)
                bad = {"misaligned": real + 3, "behind-head": max(real - 64, 0) if real >= 64 else 0,
                       "laps-ahead": real + (1 << 40)}[garbage]
                assert bad != real
                repaired = threading.Event()

                def watchdog() -> None:  # bounds the test: put the real tail back after 3 s
                    if not stop_watchdog.wait(3.0):
                        region.mem.store(tail_at, real, RELEASE)
                        repaired.set()

                stop_watchdog = threading.Event()
                guard = threading.Thread(target=watchdog, daemon=True)
                guard.start()
                region.mem.store(tail_at, bad, RELEASE)
                t0 = time.monotonic()
                await asyncio.sleep(0.05)
                stalled = time.monotonic() - t0
                stop_watchdog.set()
                guard.join()
                if not repaired.is_set():
                    region.mem.store(tail_at, real, RELEASE)
                assert await client.call("echo", b"after", timeout=5) == b"after"
            finally:
                region.close()
            assert stalled < 1.0, f"the client's event loop stood still for {stalled:.2f} s"


async def _echo_ok(client) -> bool:
    try:
        return await client.call("echo", b"probe", timeout=0.3) == b"probe"
    except cxlrpc.DeadlineExceeded:
        return False


async def _counter_after_an_echo(client, region: Region, at: int) -> int:
    """A ring counter once an echo went through it (at least one record: >= 8). A server that
    reclaimed the slot meanwhile (its 0.5 s client_timeout passes when a loaded machine stalls
    the client's heartbeat) starts the slot's rings over at 0: echo again, on the new slot."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        try:
            assert await client.call("echo", b"before", timeout=5) == b"before"
        except cxlrpc.Unavailable:  # reclaimed: the next call reconnects
            pass
        value = region.mem.load(at, ACQUIRE)
        if value >= 8:
            return value
        assert asyncio.get_running_loop().time() < deadline, f"counter still {value} after echoes"


# ----------------------------------------------------------------------------- drops counted
async def test_committed_garbage_frames_are_dropped_and_counted(url):
    """Committed records that are not valid requests (random bytes, foreign slot or generation, wrong kind, bad fields) are each dropped and counted once in the control block; live clients are unaffected."""
    slots = 4
    with fault_server(url, slots=slots, client_timeout=0.5, request_capacity=1 << 16,
                      response_capacity=1 << 16) as server:
        live = await open_counting(url)
        region = None
        try:
            pump = Pump(live, "live").start()
            assert await until(lambda: pump.ok >= 50, 10)
            region = Region.open(url)
            geo = read_geometry(region)
            ring = MpscRing(region.buf, region.mem, geo.request_ring, geo.request_capacity)
            unused = slots - 1
            slot, gen = live._conn.chan.slot, live._conn.chan.gen
            rng = random.Random(7)

            def hdr(kind=fr.REQUEST, flags=0, slot_=slot, gen_=gen, timeout=1.0, method=b"echo"):
                return struct.pack("<BBHHIQdH", kind, flags, 0, slot_, gen_ & 0xFFFFFFFF,
                                   rng.getrandbits(63), timeout, len(method)) + method

            frames = [rng.randbytes(rng.randrange(0, 300)) for _ in range(100)]
            frames += [
                hdr(slot_=unused, gen_=0) + b"\xc4\x01x",        # a slot nobody holds
                hdr(slot_=slots + 7) + b"x",                      # a slot beyond the table
                hdr(gen_=gen + 1) + b"x",                         # the live slot, wrong generation
                hdr(kind=fr.RESPONSE) + b"x",                     # not a request
                hdr(kind=fr.ERROR) + b"x",
                hdr(kind=200) + b"x",                             # unknown kind
                hdr(kind=fr.CREDIT) + b"x",                       # a credit that is no count
                hdr(flags=0x80) + b"x",                           # unknown flag
                hdr(timeout=-1.0) + b"x",                         # negative deadline
                hdr(timeout=float("nan")) + b"x",
                hdr(method=b"\xff\xfe") + b"x",                   # method not UTF-8
                hdr()[:fr.HEADER_SIZE - 1],                       # truncated header
                struct.pack("<BBHHIQdH", fr.REQUEST, 0, 0, slot, gen, 1, 1.0, 200) + b"ec",  # method past end
                b"",
            ]
            before = region.mem.load(DROPPED, ACQUIRE)
            for f in frames:
                assert await until(lambda: ring.try_push(f, unused), 5)
            counted = await until(lambda: region.mem.load(DROPPED, ACQUIRE) - before >= len(frames), 5)
            dropped = region.mem.load(DROPPED, ACQUIRE) - before
            mark = pump.ok
            assert await until(lambda: pump.ok >= mark + 100, 10)
            await pump.stop()
            pump.check()
            assert server.is_alive()
            assert counted and dropped == len(frames), f"{len(frames)} garbage frames, {dropped} counted"
            report("committed garbage frames", pushed=len(frames), dropped_counted=dropped)
        finally:
            await live.close()
            if region is not None:
                region.close()


# ----------------------------------------------------------------------------- fuzz
FUZZ = settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _outcome(decode, data: bytes):
    try:
        return decode(memoryview(data))
    except fr.FrameError as exc:
        return type(exc), str(exc)


def _check_decoded(data: bytes) -> None:
    """Whatever the bytes, decode (native where built) does what the Python reference does,
    and a frame it returns has every field in range."""
    f = _outcome(fr.decode, data)
    assert f == _outcome(fr._decode_py, data)
    if not isinstance(f, fr.Frame):
        return
    kind, flags, status, slot, gen, call_id, timeout, mlen = fr.HEADER.unpack_from(data)
    assert f.kind in fr._KINDS
    assert not f.flags & ~(fr.RAW | fr.HEAP | fr.META | fr.STREAM | fr.FOLLOW | fr.IN_PLACE)
    assert len(f.method.encode()) == mlen <= fr.MAX_METHOD
    assert f.timeout >= 0
    body = fr.HEADER_SIZE + mlen
    if f.flags & fr.META:  # a metadata block that decoded: in range, and the body follows it
        assert len(f.metadata) <= fr.MAX_METADATA_PAIRS
        body += 2 + int.from_bytes(data[body:body + 2], "little")
    assert f.body == data[body:]


@FUZZ
@given(st.binary(max_size=600))
@example(b"")
@example(bytes(fr.HEADER_SIZE))
def test_decode_random_bytes_raises_only_frame_error(data):
    """fr.decode on arbitrary bytes either returns a frame whose fields are all in range or raises
    FrameError, as the Python reference does."""
    _check_decoded(data)


@FUZZ
@given(kind=st.integers(0, 255), flags=st.integers(0, 255), status=st.integers(0, 65535),
       slot=st.integers(0, 65535), gen=st.integers(0, 2**32 - 1), call_id=st.integers(0, 2**64 - 1),
       timeout=st.floats(allow_nan=True, allow_infinity=True),
       mlen=st.one_of(st.integers(0, 300), st.integers(0, 65535)), method=st.binary(max_size=300),
       body=st.binary(max_size=200))
def test_decode_plausible_headers_raises_only_frame_error(kind, flags, status, slot, gen, call_id,
                                                          timeout, mlen, method, body):
    """fr.decode on well-formed headers with out-of-range fields and bad method bytes raises only
    FrameError, as the Python reference does."""
    _check_decoded(fr.HEADER.pack(kind, flags, status, slot, gen, call_id, timeout, mlen) + method + body)


@FUZZ
@given(kind=st.sampled_from(sorted(fr._KINDS)), flags=st.integers(0, 15), status=st.integers(0, 65535),
       slot=st.integers(0, 65535), gen=st.integers(0, 2**32 - 1), call_id=st.integers(0, 2**64 - 1),
       timeout=st.floats(min_value=0, allow_infinity=True),
       method=st.one_of(st.text(max_size=80).map(str.encode), st.binary(max_size=80)),
       metadata=st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=4),
       body=st.binary(max_size=200))
def test_decode_sound_frames_matches_the_reference(kind, flags, status, slot, gen, call_id, timeout,
                                                    method, metadata, body):
    """Frames a peer could well write (any method bytes, metadata when flagged) decode to the
    same Frame, or the same FrameError, natively and in the reference."""
    block = fr.encode_metadata(metadata) if flags & fr.META and metadata else b""
    data = fr.HEADER.pack(kind, flags, status, slot, gen, call_id, timeout, len(method)) + method + block + body
    _check_decoded(data)


@FUZZ
@given(code=st.integers(0, 65535), message=st.binary(max_size=64))
def test_error_frames_with_any_status_become_rpc_errors(code, message):
    """Any status code in an ERROR frame surfaces as an RpcError subclass, never another exception."""
    exc = cxlrpc.errors.error_for(code, message.decode(errors="replace"))
    assert isinstance(exc, cxlrpc.RpcError)


# ----------------------------------------------------------------------------- bad input via the API
@pytest.mark.parametrize("raw", [b"\xc1", b"\x92\x01", b"\x01\x02", b"\xd9\x05ab"],
                         ids=["bad-opcode", "short-array", "trailing", "short-str"])
async def test_undecodable_arguments_are_invalid_argument(url, raw):
    """A request body that is not valid MessagePack is answered with INVALID_ARGUMENT; the connection keeps working."""
    with fault_server(url, slots=2):
        async with cxlrpc.connect(url) as client:
            with pytest.raises(cxlrpc.InvalidArgument, match="bad request"):
                await client.call("echo", msgspec.Raw(raw), timeout=5)
            assert await client.call("echo", b"after", timeout=5) == b"after"


async def test_deeply_nested_arguments_are_invalid_argument_not_fatal(url):
    """A 1 KB request of nested arrays is answered with INVALID_ARGUMENT and the server keeps serving others."""
    with fault_server(url, slots=2) as server:
        async with cxlrpc.connect(url) as bad, cxlrpc.connect(url) as bystander:
            try:
                await bad.call("echo", msgspec.Raw(b"\x91" * 1000 + b"\x00"), timeout=1)
            except cxlrpc.RpcError as exc:
                outcome = type(exc).__name__
            else:
                outcome = "reply"
            answered = await until(lambda: _echo_ok(bystander), 2)
            assert server.is_alive()
            assert answered, "the server stopped answering everyone after one nested request"
            assert outcome == "InvalidArgument", outcome


async def test_unknown_method_and_bad_method_names(url):
    """Unknown methods are UNIMPLEMENTED (as in gRPC) from another process too; empty or >255-byte names are refused client-side."""
    with fault_server(url, slots=2):
        async with cxlrpc.connect(url) as client:
            with pytest.raises(cxlrpc.Unimplemented, match="no_such"):
                await client.call("no_such", 1, timeout=5)
            with pytest.raises(cxlrpc.InvalidArgument):
                await client.call("m" * 256, 1, timeout=5)
            with pytest.raises(cxlrpc.InvalidArgument):
                await client.call("", 1, timeout=5)
            with cxlrpc.connect_sync(url) as sync:
                with pytest.raises(cxlrpc.Unimplemented):
                    sync.call("no_such", timeout=5)
            assert await client.call("echo", b"ok", timeout=5) == b"ok"


async def test_oversize_payloads_through_the_blocking_client(url):
    """Without a heap, requests beyond the request ring's limit are RESOURCE_EXHAUSTED in the blocking client, nothing is sent, the client keeps working."""
    with fault_server(url, slots=2, request_capacity=1 << 15, response_capacity=1 << 14, heap_size=0):
        with cxlrpc.connect_sync(url) as client:
            limit = client._conn.chan.requests.max_payload
            with pytest.raises(cxlrpc.ResourceExhausted, match="exceeds"):
                client.call("echo", b"x" * limit, timeout=5)
            # a reply too big for the (smaller) response ring is an error frame, not a stall
            with pytest.raises(cxlrpc.ResourceExhausted, match="response"):
                client.call("echo", b"y" * 10_000, timeout=5)
            assert client.call("echo", b"z" * 1000, timeout=5) == b"z" * 1000


async def test_second_server_from_another_process_on_a_live_name_is_refused(url):
    """While a server in another process is alive, starting a second on its name raises FileExistsError and leaves the first serving."""
    with fault_server(url, slots=2):
        second = cxlrpc.Server(url)
        with pytest.raises(FileExistsError, match="in use"):
            await second.start()
        async with cxlrpc.connect(url) as client:
            assert await client.call("echo", b"still first", timeout=5) == b"still first"


def test_region_too_small_for_its_geometry_is_unavailable(url):
    """A published RPC region whose control block promises more rings than the region holds is refused with Unavailable, async and blocking."""
    region = Region.create(url, 1 << 16, kind=KIND_RPC)
    try:
        region.mem.store(CONTROL + 8, 16, RELEASE)        # slots
        region.mem.store(CONTROL + 16, 8 << 20, RELEASE)  # request capacity
        region.mem.store(CONTROL + 24, 8 << 20, RELEASE)  # response capacity
        region.mem.store(CONTROL, 1, RELEASE)             # "running"
        # as a server writes it: with its checksum (without one, clients refuse it sooner)
        region.mem.store(CONTROL + 48, geometry_sum((16, 8 << 20, 8 << 20, 0, 0), region.coherence), RELEASE)
        region.publish()
        with pytest.raises(cxlrpc.Unavailable, match="geometry needs"):
            cxlrpc.connect_sync(url)
        with pytest.raises(cxlrpc.Unavailable, match="geometry needs"):
            cxlrpc.run(_connect(url))
    finally:
        region.unlink()
        region.close()


def test_region_of_another_layout_version_refused_by_async_client(url):
    """An RPC region of another layout version is refused by the asyncio client with Unavailable."""
    region = Region.create(url, 1 << 16, kind=KIND_RPC)
    try:
        region.mem.store(8, 77, RELEASE)  # layout version field
        region.publish()
        with pytest.raises(cxlrpc.Unavailable, match="layout version 77"):
            cxlrpc.run(_connect(url))
    finally:
        region.unlink()
        region.close()


async def _connect(url: str) -> None:
    client = await cxlrpc.connect(url)
    await client.close()


async def test_a_frame_naming_a_slot_past_the_table_is_dropped_quietly(url, caplog):
    """A request whose slot field is past the slot table is garbage: dropped and counted, with
    no traceback in the server's log, and the server goes on serving."""
    server = cxlrpc.Server(url, slots=2, request_capacity=1 << 16, response_capacity=1 << 16)
    server.add_method("echo", lambda payload: payload)
    async with server, cxlrpc.connect(url) as client:
        chan = client._conn.chan
        head = fr.HEADER.pack(fr.REQUEST, fr.RAW, 0, 999, chan.gen, 77, 0.0, 4)
        assert chan.push((head, b"echo", b"x"))
        chan.server_bell.ring()
        deadline = asyncio.get_running_loop().time() + 5
        while not server.dropped_frames and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        assert server.dropped_frames == 1
        assert await client.call("echo", b"still", timeout=5) == b"still"
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
