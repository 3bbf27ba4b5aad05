"""What a grpc.aio user expects: the handler context (deadline, peer, metadata, abort), call
metadata from both clients, every gRPC status code, and interceptors on both sides; on
coherent shared memory (shm://) and on the simulator of memory without coherence (sim://)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Mapping

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

import cxlrpc
from cxlrpc import frame as fr
from cxlrpc.errors import ERRORS, error_for
from cxlrpc.identity import host_identity
from procs import sized_for

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parent.parent

GRPC_CODES = {
    "OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5, "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9, "ABORTED": 10, "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12,
    "INTERNAL": 13, "UNAVAILABLE": 14, "DATA_LOSS": 15, "UNAUTHENTICATED": 16,
}
ERROR_CODES = [code for code in cxlrpc.StatusCode if code is not cxlrpc.StatusCode.OK]


MEMORIES = ("shm", "sim")  # every test here runs on coherent memory and on the simulator


class Point(msgspec.Struct):
    x: int
    y: int


def make_server(url: str, **opts) -> cxlrpc.Server:
    """A server with methods that report what their context holds."""
    server = cxlrpc.Server(url, **sized_for(url, opts))
    server.ran = []  # names of the handlers that ran

    @server.method("echo")
    def echo(payload):
        server.ran.append("echo")
        return payload

    @server.method("metadata")
    def metadata() -> dict:
        return dict(cxlrpc.context().metadata)

    @server.method("ametadata")
    async def ametadata(payload: bytes) -> list:
        await asyncio.sleep(0)
        return [len(payload), dict(cxlrpc.context().metadata)]

    @server.method("bmetadata", blocking=True)
    def bmetadata() -> list:
        return [threading.current_thread() is not threading.main_thread(),
                dict(cxlrpc.context().metadata)]

    @server.method("remaining")
    async def remaining(pause: float) -> list:
        ctx = cxlrpc.context()
        first = ctx.time_remaining()
        await asyncio.sleep(pause)
        return [first, ctx.time_remaining(), ctx.deadline is not None]

    @server.method("whoami")
    def whoami() -> list:
        ctx = cxlrpc.context()
        assert ctx.peer == cxlrpc.current_peer() and ctx.method == "whoami"
        return list(ctx.peer_info())

    @server.method("abort")
    def abort(req: list) -> None:
        cxlrpc.context().abort(req[0], req[1])
        server.ran.append("after abort")

    @server.method("raise")
    def raise_(code: int) -> None:
        raise ERRORS[code](f"raised {code}")

    @server.method("boom")
    def boom() -> None:
        raise ValueError("boom")

    @server.method("norm")
    def norm(p: Point) -> int:
        return p.x * p.x + p.y * p.y

    @server.method("slow")
    async def slow(seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds

    return server


# ----------------------------------------------------------------------------- metadata
def full_metadata() -> dict[str, str]:
    """64 pairs, near the 4 KiB limit."""
    return {f"k{i:02}": f"{i:02}" * 25 for i in range(fr.MAX_METADATA_PAIRS)}


async def test_metadata_reaches_every_kind_of_handler_from_both_clients(url):
    """Metadata arrives read-only as sent (plain, async, blocking handlers; a body through the
    heap keeps its metadata in the frame); a call without metadata sees an empty mapping."""
    big = full_metadata()
    assert len(fr.encode_metadata(big)) > 3500
    async with make_server(url), cxlrpc.connect(url) as client:
        assert await client.call("metadata", timeout=5) == {}
        assert await client.call("metadata", timeout=5, metadata={}) == {}
        assert await client.call("metadata", timeout=5, metadata={"trace-id": "t1"}) == {"trace-id": "t1"}
        assert await client.call("metadata", timeout=5, metadata=big) == big
        assert await client.call("ametadata", b"x", timeout=5, metadata={"a": "1"}) == [1, {"a": "1"}]
        assert await client.call("bmetadata", timeout=5, metadata={"b": "2"}) == [True, {"b": "2"}]
        # too big for the request ring: the body goes through the heap, the metadata in the frame
        body = b"h" * ((300 << 10) if url.startswith("sim://") else (2400 << 10))
        assert len(body) + fr.HEADER_SIZE > client._conn.chan.requests.max_payload
        assert await client.call("ametadata", body, timeout=10, metadata=big) == [len(body), big]

        def sync_calls() -> list:
            with cxlrpc.connect_sync(url) as sync_client:
                return [sync_client.call("metadata", timeout=5),
                        sync_client.call("metadata", timeout=5, metadata={"sync": "yes"}),
                        sync_client.call("ametadata", body, timeout=10, metadata=big)]
        assert await asyncio.to_thread(sync_calls) == [{}, {"sync": "yes"}, [len(body), big]]


async def test_calls_without_metadata_carry_no_metadata_block(url):
    """No metadata (or an empty mapping): no META flag and no extra bytes in the request."""
    async with make_server(url), cxlrpc.connect(url) as client:
        plain = client._codec.request(1, "echo", b"x", 1.0)
        assert client._codec.request(1, "echo", b"x", 1.0, {}) == plain
        assert len(plain) == 3 and not fr.HEADER.unpack_from(plain[0])[1] & fr.META
        assert plain[1:] == (b"echo", b"x")
        with_meta = client._codec.request(1, "echo", b"x", 1.0, {"a": "b"})
        assert fr.HEADER.unpack_from(with_meta[0])[1] & fr.META
        assert with_meta[1:] == (b"echo" + fr.encode_metadata({"a": "b"}), b"x")


@pytest.mark.parametrize("bad", [
    {f"k{i}": "v" for i in range(fr.MAX_METADATA_PAIRS + 1)},
    {"k": "v" * fr.MAX_METADATA_BYTES},
    {"": "empty key"},
    {1: "int key"},
    {"k": 1},
    {"k": b"bytes"},
    {"k": "\ud800"},
    [("k", "v")],
], ids=["65-pairs", "over-4KiB", "empty-key", "int-key", "int-value", "bytes-value", "surrogate", "not-a-mapping"])
async def test_bad_metadata_is_refused_before_sending(url, bad):
    """Metadata over the limits or not str->str is InvalidArgument on both clients; nothing is
    sent and the connection keeps working."""
    async with make_server(url) as server, cxlrpc.connect(url) as client:
        with pytest.raises(cxlrpc.InvalidArgument, match="metadata"):
            await client.call("echo", b"x", timeout=5, metadata=bad)

        def sync_call() -> bytes:
            with cxlrpc.connect_sync(url) as sync_client:
                with pytest.raises(cxlrpc.InvalidArgument, match="metadata"):
                    sync_client.call("echo", b"x", timeout=5, metadata=bad)
                return sync_client.call("echo", b"sync", timeout=5)
        assert await asyncio.to_thread(sync_call) == b"sync"
        assert await client.call("echo", b"ok", timeout=5) == b"ok"
        assert server.ran == ["echo", "echo"] and server.dropped_frames == 0


@settings(max_examples=200, deadline=None, database=None)
@given(st.dictionaries(st.text(min_size=1, max_size=12), st.text(max_size=40), max_size=fr.MAX_METADATA_PAIRS))
def test_metadata_round_trips_through_a_frame(metadata):
    """Any metadata within the limits decodes to an equal, read-only mapping; the body follows."""
    try:
        block = fr.encode_metadata(metadata)
    except cxlrpc.InvalidArgument:
        assert len(msgspec.msgpack.encode(metadata)) > fr.MAX_METADATA_BYTES
        return
    head = fr.header(fr.REQUEST, fr.RAW | fr.META, 0, 1, 2, 3, 1.0, b"m")
    f = fr.decode(memoryview(head + b"m" + block + b"body"))
    assert f.metadata == metadata and f.body == b"body"
    with pytest.raises(TypeError):
        f.metadata["new"] = "pair"  # type: ignore[index]


@settings(max_examples=400, deadline=None, database=None)
@given(st.binary(max_size=300))
def test_any_metadata_block_decodes_in_range_or_raises_bad_metadata(block):
    """Garbage after the method of a META frame: a mapping within the limits, or BadMetadata
    carrying the header's fields (so the request can be answered)."""
    head = fr.header(fr.REQUEST, fr.META, 0, 1, 2, 77, 1.0, b"m")
    try:
        f = fr.decode(memoryview(head + b"m" + block))
    except fr.BadMetadata as exc:
        assert (exc.frame.kind, exc.frame.slot, exc.frame.gen, exc.frame.call_id) == (fr.REQUEST, 1, 2, 77)
        return
    assert isinstance(f.metadata, Mapping) and len(f.metadata) <= fr.MAX_METADATA_PAIRS
    assert all(isinstance(k, str) and k and isinstance(v, str) for k, v in f.metadata.items())


def _msgpack(value) -> bytes:
    return msgspec.msgpack.encode(value)


def _block(payload: bytes) -> bytes:
    return len(payload).to_bytes(2, "little") + payload


GARBAGE_BLOCKS = {
    "no-length": b"",
    "half-length": b"\x01",
    "zero-length": _block(b""),
    "over-4KiB": _block(_msgpack({"k": "v" * 5000})),
    "past-the-frame": (40).to_bytes(2, "little") + b"\x80",
    "not-a-map": _block(_msgpack(7)),
    "int-value": _block(_msgpack({"k": 1})),
    "nested": _block(_msgpack({"k": {"n": "v"}})),
    "empty-key": _block(_msgpack({"": "v"})),
    "65-pairs": _block(_msgpack({f"k{i}": "" for i in range(65)})),
    "bad-utf8": _block(b"\x81\xa1\xff\xa1v"),
    "trailing-bytes": _block(b"\x80\x00"),
    "bad-opcode": _block(b"\xc1"),
}


async def test_garbage_metadata_in_raw_frames_is_answered_or_dropped(url):
    """Requests whose metadata block is garbage are answered INVALID_ARGUMENT and counted as
    dropped; one-way and non-request frames with one are dropped; the reader never stops."""
    async with make_server(url) as server, cxlrpc.connect(url) as client:
        chan, loop = client._conn.chan, asyncio.get_running_loop()
        futures = {}
        for i, (case, block) in enumerate(GARBAGE_BLOCKS.items()):
            call_id = (1 << 40) + i
            head = fr.HEADER.pack(fr.REQUEST, fr.RAW | fr.META, 0, chan.slot, chan.gen, call_id, 5.0, 4)
            futures[case] = client._replies.pending[call_id] = (loop.create_future(), None)
            assert chan.push((head, b"echo", block, b"body"))
        one_way = fr.HEADER.pack(fr.REQUEST, fr.RAW | fr.META, 0, chan.slot, chan.gen, fr.NO_REPLY, 0.0, 4)
        cancel = fr.HEADER.pack(fr.CANCEL, fr.RAW | fr.META, 0, chan.slot, chan.gen, 1 << 41, 0.0, 0)
        assert chan.push((one_way, b"echo", b"\x01")) and chan.push((cancel, b"\x05\x00"))
        chan.server_bell.ring()
        for case, (fut, _) in futures.items():
            with pytest.raises(cxlrpc.InvalidArgument, match="bad request metadata"):
                await asyncio.wait_for(fut, 5)
        deadline = loop.time() + 5
        while server.dropped_frames < len(GARBAGE_BLOCKS) + 2 and loop.time() < deadline:
            await asyncio.sleep(0.005)
        assert server.dropped_frames == len(GARBAGE_BLOCKS) + 2
        assert server.ran == [] and not server._reader.done()
        assert await client.call("metadata", timeout=5, metadata={"after": "garbage"}) == {"after": "garbage"}


# ----------------------------------------------------------------------------- context
async def test_context_reports_deadline_peer_and_method(url):
    """time_remaining shrinks as the handler waits (None without a deadline); the peer is the
    caller's slot and generation, with its PID and host identity; LookupError outside."""
    async with make_server(url), cxlrpc.connect(url) as client:
        first, second, has_deadline = await client.call("remaining", 0.1, timeout=5)
        assert has_deadline and 4.0 < first <= 5.0 and first - second >= 0.09
        assert await client.call("remaining", 0.0) == [None, None, False]
        chan = client._conn.chan
        assert await client.call("whoami", timeout=5) == [chan.slot, chan.gen, os.getpid(),
                                                          host_identity(), True]

        def sync_whoami() -> tuple:
            with cxlrpc.connect_sync(url) as sync_client:
                return sync_client.call("whoami", timeout=5), sync_client._conn.chan.slot, sync_client._conn.chan.gen
        info, slot, gen = await asyncio.to_thread(sync_whoami)
        assert info == [slot, gen, os.getpid(), host_identity(), True] and slot != chan.slot
    with pytest.raises(LookupError):
        cxlrpc.context()


async def test_peer_info_after_the_peer_or_the_server_left_has_no_pid(url):
    """A context kept past its client's departure (or its server's close) names the peer but
    no PID or host."""
    server = make_server(url)
    kept = []

    @server.method("keep")
    def keep() -> None:
        kept.append(cxlrpc.context())

    async with server:
        async with cxlrpc.connect(url) as client:
            await client.call("keep", timeout=5)
            slot, gen = client._conn.chan.slot, client._conn.chan.gen
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while server._chan.slot_generation(slot) == gen and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert kept[0].peer_info() == cxlrpc.PeerInfo(slot, gen, None, None, False)
    assert kept[0].peer_info() == cxlrpc.PeerInfo(slot, gen, None, None, False)


async def test_abort_ends_the_call_with_any_code_and_details(url):
    """abort(code, details) reaches the caller as that code's class with the details, for every
    error code (StatusCode or int); the handler stops there; abort(OK) is a handler bug."""
    async with make_server(url) as server, cxlrpc.connect(url) as client:
        for code in ERROR_CODES:
            with pytest.raises(ERRORS[code], match=f"details of {code.name}") as ei:
                await client.call("abort", [int(code), f"details of {code.name}"], timeout=5)
            assert ei.value.code is code and ei.value.message == f"details of {code.name}"
        with pytest.raises(cxlrpc.Internal, match="not OK"):
            await client.call("abort", [0, "fine"], timeout=5)
        with pytest.raises(cxlrpc.Internal, match="ValueError"):
            await client.call("abort", [99, "no such code"], timeout=5)
        assert "after abort" not in server.ran


async def test_every_status_code_raised_by_a_handler_reaches_the_caller_as_its_class(url):
    async with make_server(url), cxlrpc.connect(url) as client:
        for code in ERROR_CODES:
            with pytest.raises(cxlrpc.RpcError, match=f"raised {int(code)}") as ei:
                await client.call("raise", int(code), timeout=5)
            assert type(ei.value) is ERRORS[code] and ei.value.code is code


def test_status_codes_are_grpcs_and_each_has_its_class():
    """StatusCode has gRPC's 17 codes and numbers; error_for maps each error code to its own
    class (exported by cxlrpc under gRPC's name); OK and unknown numbers become Unknown."""
    assert {c.name: c.value for c in cxlrpc.StatusCode} == GRPC_CODES
    for code in ERROR_CODES:
        exc = error_for(int(code), "msg")
        camel = "".join(part.capitalize() for part in code.name.split("_"))
        assert type(exc) is getattr(cxlrpc, camel) and exc.code is code and exc.message == "msg"
        assert isinstance(exc, cxlrpc.RpcError) and str(exc) == f"{code.name}: msg"
    assert len({type(error_for(int(c), "")) for c in ERROR_CODES}) == 16
    for code in (0, 17, 1000, 65535):
        exc = error_for(code, "what")
        assert type(exc) is cxlrpc.Unknown and exc.message == f"status {code}: what"


# ----------------------------------------------------------------------------- server interceptors
def recorder(name: str, log: list):
    """A server interceptor logging entry, exit and what it saw raised."""
    async def interceptor(call: cxlrpc.HandlerContext, next):
        log.append(f"{name}>{call.method}")
        try:
            return await next()
        except Exception as exc:
            log.append(f"{name}!{type(exc).__name__}")
            raise
        finally:
            log.append(f"<{name}")
    return interceptor


async def test_server_interceptors_wrap_calls_in_order_and_see_the_call(url):
    """The first interceptor is outermost; call details are the handler's context (method,
    metadata, peer, deadline); the reserved methods bypass them."""
    log: list[str] = []
    seen: list[cxlrpc.HandlerContext] = []

    async def details(call, next):
        seen.append(call)
        result = await next()
        assert cxlrpc.context() is call  # the chain runs in the handler's context
        return result

    server = make_server(url, interceptors=[recorder("a", log), recorder("b", log), details])
    async with server, cxlrpc.connect(url) as client:
        assert await client.call("echo", b"x", timeout=5, metadata={"k": "v"}) == b"x"
        assert log == ["a>echo", "b>echo", "<b", "<a"] and server.ran == ["echo"]
        call = seen[0]
        assert (call.method, dict(call.metadata)) == ("echo", {"k": "v"})
        assert tuple(call.peer) == (client._conn.chan.slot, client._conn.chan.gen)
        assert call.deadline is not None and 0 < call.time_remaining() <= 5
        log.clear()
        assert await client.health() == "SERVING" and await client.methods()
        assert log == []
        first, second, _ = await client.call("remaining", 0.05, timeout=5)  # suspends in the chain
        assert first - second >= 0.04 and log == ["a>remaining", "b>remaining", "<b", "<a"]
        client.send_nowait("echo", b"one-way", metadata={"k": "one-way"})
        assert await client.call("bmetadata", timeout=5, metadata={"t": "1"}) == [True, {"t": "1"}]
        assert "a>echo" in log and server.ran == ["echo", "echo"]
        assert [dict(c.metadata) for c in seen if c.method == "echo"][-1] == {"k": "one-way"}


async def test_server_interceptors_short_circuit_and_see_errors(url):
    """An interceptor may refuse a call (the handler does not run), answer it itself, or turn
    an error into another; interceptors see handler errors, unknown methods and bad requests."""
    log: list[str] = []

    async def auth(call, next):
        if call.metadata.get("token") != "good":
            raise cxlrpc.Unauthenticated("no token")
        return await next()

    async def cached(call, next):
        if call.method == "slow":
            return -1.0  # never calls the handler
        try:
            return await next()
        except ValueError as exc:
            raise cxlrpc.FailedPrecondition(f"translated {exc}") from exc

    server = make_server(url, interceptors=[recorder("log", log), auth, cached])
    async with server, cxlrpc.connect(url) as client:
        with pytest.raises(cxlrpc.Unauthenticated, match="no token"):
            await client.call("echo", b"x", timeout=5)
        assert server.ran == [] and log == ["log>echo", "log!Unauthenticated", "<log"]
        good = {"token": "good"}
        assert await client.call("slow", 30.0, timeout=5, metadata=good) == -1.0
        with pytest.raises(cxlrpc.FailedPrecondition, match="translated boom"):
            await client.call("boom", timeout=5, metadata=good)
        with pytest.raises(cxlrpc.Unimplemented):
            await client.call("missing", timeout=5, metadata=good)
        with pytest.raises(cxlrpc.InvalidArgument, match="bad request"):
            await client.call("norm", {"x": "no"}, timeout=5, metadata=good)
        with pytest.raises(cxlrpc.Aborted, match="stop"):
            await client.call("abort", [int(cxlrpc.StatusCode.ABORTED), "stop"], timeout=5, metadata=good)
        errors = [entry.split("!")[1] for entry in log if "!" in entry]
        assert errors == ["Unauthenticated", "FailedPrecondition", "Unimplemented", "InvalidArgument", "Aborted"]
        assert await client.call("echo", b"ok", timeout=5, metadata=good) == b"ok"


async def test_slow_interceptors_meet_the_deadline(url):
    """A call whose interceptor and handler outlast the deadline ends DEADLINE_EXCEEDED and
    its task is cancelled; the next call is served."""
    entered = []

    async def pause(call, next):
        entered.append(call.method)
        await asyncio.sleep(0.01)
        return await next()

    server = make_server(url, interceptors=[pause])
    async with server, cxlrpc.connect(url) as client:
        with pytest.raises(cxlrpc.DeadlineExceeded):
            await client.call("slow", 10.0, timeout=0.2)
        assert await client.call("echo", b"after", timeout=5) == b"after"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while server._tasks and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert not server._tasks and entered == ["slow", "echo"]


def test_interceptors_must_be_callable(url):
    with pytest.raises(TypeError, match="not callable"):
        cxlrpc.Server(url, interceptors=["log"])
    with pytest.raises(TypeError, match="not callable"):
        cxlrpc.connect(url, interceptors=[None])
    with pytest.raises(TypeError, match="not callable"):
        cxlrpc.connect_sync(url, interceptors=[42])


# ----------------------------------------------------------------------------- client interceptors
async def test_client_interceptors_wrap_calls_in_order_and_may_change_metadata(url):
    """The first interceptor is outermost; each may add metadata (the caller's mapping stays as
    it was) and sees the result or the error."""
    log: list[str] = []

    def tagger(name: str):
        async def interceptor(method, arg, metadata, next):
            log.append(f"{name}>{method}")
            metadata["via"] = metadata.get("via", "") + name
            try:
                return await next(method, arg, metadata)
            except cxlrpc.RpcError as exc:
                log.append(f"{name}!{type(exc).__name__}")
                raise
            finally:
                log.append(f"<{name}")
        return interceptor

    caller_metadata = {"caller": "me"}
    async with make_server(url), cxlrpc.connect(url, interceptors=[tagger("a"), tagger("b")]) as client:
        assert await client.call("metadata", timeout=5, metadata=caller_metadata) == {"caller": "me", "via": "ab"}
        assert caller_metadata == {"caller": "me"}
        assert log == ["a>metadata", "b>metadata", "<b", "<a"]
        log.clear()
        with pytest.raises(cxlrpc.PermissionDenied):
            await client.call("raise", int(cxlrpc.StatusCode.PERMISSION_DENIED), timeout=5)
        assert log == ["a>raise", "b>raise", "b!PermissionDenied", "<b", "a!PermissionDenied", "<a"]
        with pytest.raises(cxlrpc.InvalidArgument, match="metadata"):
            await client.call("metadata", timeout=5, metadata=[("not", "a mapping")])


async def test_client_interceptors_short_circuit_and_retarget(url):
    """An interceptor may answer without calling (nothing is sent), or call another method."""
    async def cache(method, arg, metadata, next):
        if method == "cached":
            return "from cache"
        if method == "old-name":
            return await next("echo", arg, metadata)
        return await next(method, arg, metadata)

    async with make_server(url) as server, cxlrpc.connect(url, interceptors=[cache]) as client:
        assert await client.call("cached", timeout=5) == "from cache"
        assert server.ran == []
        assert await client.call("old-name", b"renamed", timeout=5) == b"renamed"
        assert server.ran == ["echo"]


async def test_sync_client_interceptors(url):
    """SyncClient takes plain-function interceptors: order, metadata, short-circuit, errors."""
    log: list[str] = []

    def token(method, arg, metadata, next):
        log.append(f"token>{method}")
        metadata["token"] = "t"
        return next(method, arg, metadata)

    def guard(method, arg, metadata, next):
        log.append(f"guard>{method}")
        if method == "forbidden":
            raise cxlrpc.PermissionDenied("not from here")
        try:
            return next(method, arg, metadata)
        except cxlrpc.RpcError as exc:
            log.append(f"guard!{type(exc).__name__}")
            raise

    def calls() -> list:
        with cxlrpc.connect_sync(url, interceptors=[token, guard]) as client:
            out = [client.call("metadata", timeout=5, metadata={"m": "1"})]
            with pytest.raises(cxlrpc.PermissionDenied):
                client.call("forbidden", timeout=5)
            with pytest.raises(cxlrpc.DataLoss):
                client.call("raise", int(cxlrpc.StatusCode.DATA_LOSS), timeout=5)
            return out

    async with make_server(url):
        assert await asyncio.to_thread(calls) == [{"m": "1", "token": "t"}]
    assert log == ["token>metadata", "guard>metadata", "token>forbidden", "guard>forbidden",
                   "token>raise", "guard>raise", "guard!DataLoss"]


# ----------------------------------------------------------------------------- the example
def test_interceptors_example_runs(name):
    """examples/interceptors.py serves, lets the right token in, keeps the wrong one out, exits 0."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "interceptors.py"), f"shm://{name}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "client: greet('ada') -> 'hello ada (trace t-1)'" in done.stdout
    assert "server: greet from slot 0 -> UNAUTHENTICATED (missing or wrong token)" in done.stdout
