"""The server's native dispatch (cxlrpc/_dispatch.c) against its Python reference
(``Dispatch._on_request``): every call shape gives the same outcome on both, the common shapes
never reach the reference, garbage frames are dropped by both, and the RPC suites run again
with ``CXLRPC_NO_NATIVE=1`` so the reference stays tested on coherent memory too."""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Iterator

import msgspec
import pytest

import cxlrpc
from cxlrpc import frame as fr
from cxlrpc import server_dispatch, server_loop
from cxlrpc.ring import SpscRing
from ring_env import Env

pytestmark = pytest.mark.timeout(120)
native = pytest.mark.skipif(server_dispatch._Dispatcher is None, reason="cxlrpc._dispatch is not built")
TESTS = Path(__file__).parent


class Point(msgspec.Struct):
    x: int
    y: int


class Unencodable:
    pass


def make_server(url: str) -> cxlrpc.Server:
    server = cxlrpc.Server(url)

    @server.method("echo")
    def echo(payload: bytes) -> bytes:
        return payload

    @server.method("aecho")
    async def aecho(payload: bytes) -> bytes:
        return payload

    @server.method("anyecho")
    def anyecho(payload):
        return payload

    @server.method("asleep")
    async def asleep(payload: bytes) -> bytes:
        await asyncio.sleep(0)  # suspends: a task carries it on
        return payload[::-1]

    @server.method("norm")
    def norm(p: Point) -> int:
        return p.x * p.x + p.y * p.y

    @server.method("swap")
    async def swap(p: Point) -> Point:
        return Point(p.y, p.x)

    @server.method("nothing")
    def nothing() -> None:
        return None

    @server.method("anothing")
    async def anothing() -> str:
        return "none taken"

    @server.method("boom")
    def boom(payload: bytes) -> bytes:
        raise ValueError(f"bad payload {payload!r}")

    @server.method("aboom")
    async def aboom(payload: bytes) -> bytes:
        raise KeyError("async")

    @server.method("denied")
    async def denied(payload: bytes) -> bytes:
        raise cxlrpc.PermissionDenied("not yours")

    @server.method("acancel")
    async def acancel(payload: bytes) -> bytes:
        raise asyncio.CancelledError()

    @server.method("wrapped")
    def wrapped(payload: bytes) -> Any:
        return aecho(payload)  # a plain function returning a coroutine

    @server.method("odd")
    def odd(payload: bytes) -> Any:
        return Unencodable()

    @server.method("big")
    def big(n: int) -> bytes:
        return b"z" * n  # past the ring: through the heap

    @server.method("ctx")
    async def ctx(payload: bytes) -> list:
        c = cxlrpc.context()
        remaining = c.time_remaining()
        return [c.method, c.peer.slot, remaining is not None and 0 < remaining <= 5.0,
                type(asyncio.current_task()).__name__]

    @server.method("pctx")
    def pctx(payload: bytes) -> list:
        c = cxlrpc.context()
        return [c.method, c.peer.slot, c.time_remaining()]

    kept: list = []

    @server.method("view")
    def view(payload: memoryview) -> memoryview:  # lent in place: the reply copies it out
        return payload

    @server.method("aview")
    async def aview(payload: memoryview) -> bytes:  # a coroutine: a view of a copy
        await asyncio.sleep(0)
        return bytes(payload[::-1])

    @server.method("viewkeep")
    def viewkeep(payload: memoryview) -> int:
        kept.append(payload)
        return len(payload)

    @server.method("kept")
    def kept_view() -> bytes:  # the view kept past its call was taken back: reading it fails
        return bytes(kept[-1])

    @server.method("viewcoro")
    def viewcoro(payload: memoryview) -> Any:  # refused: the coroutine could read it later
        return aecho(b"")

    @server.method("forge")
    def forge(call_id: int) -> bytes:
        """Before its reply, records that look like it but no correct peer would write: a NaN
        timeout, a method name longer than the record, one that is not UTF-8."""
        slot, gen = cxlrpc.context().peer
        ring = server._chan.responses[slot]
        for timeout, mlen, rest in ((float("nan"), 0, b"forged"), (0.0, 200, b"forged"),
                                    (0.0, 2, b"\xff\xfeforged")):
            head = fr.HEADER.pack(fr.RESPONSE, fr.RAW, 0, slot, gen, call_id, timeout, mlen)
            ring.try_push_parts((head, rest))
        return b"real"

    @server.method("doze")
    def doze(seconds: float) -> float:  # holds the loop: a waiting client parks meanwhile
        time.sleep(seconds)
        return seconds

    @server.method("nap")
    async def nap(seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds

    return server


def _serve_main(url: str, ready: Any) -> None:
    """A child process serving make_server's methods until SIGTERM."""
    from procs import _serve_until_sigterm
    asyncio.run(_serve_until_sigterm(make_server(url), ready))


class CountingCaller:
    """Stands in for a client's native caller and counts what its calls returned."""

    def __init__(self, real: Any) -> None:
        self.real, self.returned = real, []

    def call(self, *args: Any) -> Any:
        got = self.real.call(*args)
        self.returned.append(type(got).__name__)
        return got


# (method, argument, timeout): every outcome branch of the native path and of its slow paths
CALLS = [
    ("echo", b"x" * 64, None), ("echo", b"", None), ("aecho", b"y" * 100, None),
    ("asleep", b"abc", None), ("norm", Point(3, 4), None), ("swap", Point(1, 2), None),
    ("norm", {"x": "not an int", "y": 1}, None), ("norm", b"raw bytes for a Struct", None),
    ("nothing", None, None), ("anothing", None, None), ("boom", b"q", None), ("aboom", b"q", None),
    ("denied", b"q", None), ("acancel", b"q", None), ("wrapped", b"w", None), ("odd", b"", None),
    ("big", 3 << 20, None), ("ctx", b"", 5.0), ("pctx", b"", None), ("missing", b"", None),
    ("echo", "a str", None), ("echo", {"k": [1, 2]}, None), ("anyecho", [1, "a", {"b": 2.5}], None),
    ("view", b"v" * 300, None), ("view", b"", None), ("view", {"typed": 1}, None), ("aview", b"abc", None),
    ("viewkeep", b"kk", None), ("kept", None, None), ("viewcoro", b"c", None),
]
#: (method, argument, timeout, response_type): typed replies, which the native caller decodes
#: itself when they decode (TYPED_DECODED of them), and their failures
TYPED = [
    ("swap", Point(1, 2), None, Point), ("norm", Point(3, 4), None, int), ("anyecho", [1, 2], None, list[int]),
    ("anyecho", {"x": 5, "y": 6}, None, Point), ("nothing", None, None, type(None)),
    ("norm", Point(3, 4), None, str), ("swap", Point(1, 2), None, list[int]), ("anyecho", [1, 2], None, Unencodable),
    ("echo", b"raw", None, bytes), ("echo", b"raw", None, int), ("boom", b"q", None, Point),
    ("missing", b"", None, int), ("echo", Unencodable(), None, None), ("echo", Unencodable(), None, int),
]
TYPED_DECODED = 5


async def outcomes(client: cxlrpc.Client, calls: list = CALLS) -> list:
    got = []
    for method, arg, timeout, *typed in calls:
        try:
            got.append(("ok", method, await client.call(method, arg, timeout=timeout,
                                                        response_type=typed[0] if typed else None)))
        except cxlrpc.RpcError as exc:
            got.append(("error", method, type(exc).__name__, exc.code, exc.message))
    return got


def sync_outcomes(client: cxlrpc.SyncClient, calls: list = CALLS) -> list:
    got = []
    for method, arg, timeout, *typed in calls:
        try:
            got.append(("ok", method, client.call(method, arg, timeout=timeout,
                                                  response_type=typed[0] if typed else None)))
        except cxlrpc.RpcError as exc:
            got.append(("error", method, type(exc).__name__, exc.code, exc.message))
    return got


@native
async def test_every_call_shape_answers_as_the_reference_does(name: str) -> None:
    """The same calls through the native dispatch and through the reference (the dispatcher
    switched off) get identical results and errors."""
    server = make_server(f"shm://{name}")
    async with server:
        assert server._calls._fast is not None and server._calls._fast.enabled
        async with cxlrpc.connect(f"shm://{name}") as client:
            native_run = await outcomes(client)
            server._calls._fast.enabled = 0
            reference_run = await outcomes(client)
    assert native_run == reference_run
    by_method = {o[1]: o for o in native_run}
    assert by_method["boom"][2:4] == ("Internal", cxlrpc.StatusCode.INTERNAL)
    assert by_method["denied"][2] == "PermissionDenied"
    assert by_method["acancel"][2] == "Cancelled"
    assert by_method["norm"][2] == "InvalidArgument"  # the last norm call: raw bytes for a Struct
    assert by_method["odd"][2] == "Internal" and "cannot encode" in by_method["odd"][4]
    assert by_method["big"] == ("ok", "big", b"z" * (3 << 20))
    assert by_method["ctx"][2] == ["ctx", by_method["pctx"][2][1], True, "_EagerTask"]
    assert by_method["asleep"][2] == b"cba"
    assert by_method["wrapped"][2] == b"w"
    at = {call[:2] if isinstance(call[1], bytes) else call[0]: i for i, call in enumerate(CALLS)}
    assert native_run[at["view", b"v" * 300]] == ("ok", "view", b"v" * 300)
    assert native_run[at["view", b""]] == ("ok", "view", b"")
    assert by_method["aview"] == ("ok", "aview", b"cba")
    assert by_method["viewkeep"] == ("ok", "viewkeep", 2)
    assert by_method["kept"][2] == "Internal"  # the kept view was released
    assert by_method["viewcoro"][2] == "Internal" and "takes a memoryview" in by_method["viewcoro"][4]


@native
async def test_task_swaps_through_asyncios_dict_answer_as_the_calls_do(name: str, monkeypatch) -> None:
    """Where asyncio keeps each loop's current task in a dict its functions share, the native
    dispatcher swaps the stand-in in that dict; the outcomes equal those of the swap through
    asyncio's functions (forced here), and the serving task is current again afterwards."""
    tasks = server_dispatch._current_tasks()
    if tasks is not None:  # the dict is the one current_task() reads
        assert tasks.get(asyncio.get_running_loop()) is asyncio.current_task()
    runs = []
    for mode in ("as built", "functions"):
        if mode == "functions":
            monkeypatch.setattr(server_dispatch, "_current_tasks", lambda: None)
        server = make_server(f"shm://{name}{len(runs)}")
        async with server:
            serving = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            async with cxlrpc.connect(f"shm://{name}{len(runs)}") as client:
                runs.append(await outcomes(client))
                assert [await client.call("ctx", b"", timeout=5) for _ in range(3)][-1][3] == "_EagerTask"
            assert all(not t.done() for t in serving)  # no task was left broken by a swap
    assert runs[0] == runs[1]


def watch_reference(server: cxlrpc.Server) -> list:
    """The methods of the requests the reference dispatches from now on (in order)."""
    seen: list = []
    original = server._calls._on_request
    server._calls._on_request = lambda view: (seen.append(fr.decode(view).method), original(view))
    return seen


@contextlib.contextmanager
def served_elsewhere(url: str) -> Iterator[None]:
    """make_server's methods served at ``url`` by a child process, stopped on exit."""
    from procs import CTX, stop
    ready = CTX.Event()
    proc = CTX.Process(target=_serve_main, args=(url, ready), daemon=True)
    proc.start()
    try:
        assert ready.wait(30), "server did not start"
        yield
    finally:
        stop(proc)


@native
async def test_parked_peers_are_woken_by_the_native_paths(name: str) -> None:
    """The native caller rings a server parked on this host, and the native dispatcher a
    client parked waiting for its reply (each looks at the peer's doorbell word itself): no
    call waits for a park to time out."""
    url = f"shm://{name}"
    with served_elsewhere(url):
        async with cxlrpc.connect(url) as client:
            assert await client.call("echo", b"warm", timeout=10) == b"warm"
            for _ in range(5):
                await asyncio.sleep(0.3)  # the server parks (its park lasts up to 0.1 s unrung)
                t0 = time.monotonic()
                assert await client.call("echo", b"x", timeout=10) == b"x"
                took = time.monotonic() - t0
                assert took < 0.02, f"a call to a parked server took {took * 1e3:.1f} ms"
            # the client parks in 0.1 s steps within the 0.25 s doze: unrung, it would see the
            # reply at its next step (~0.30 s)
            t0 = time.monotonic()
            assert await client.call("doze", 0.25, timeout=30) == 0.25
            took = time.monotonic() - t0
            assert took < 0.28, f"a parked client's reply took {took * 1e3:.0f} ms"


@native
async def test_unsound_raw_replies_are_not_taken_for_the_call(name: str) -> None:
    """Records with a call's slot, generation and id but an unsound header (NaN timeout,
    method name past the record or not UTF-8) are dropped as garbage by the native caller's raw-reply
    shortcut, as by the decode it stands for; the call gets its real reply."""
    url = f"shm://{name}"
    with served_elsewhere(url):
        async with cxlrpc.connect(url) as client:
            assert await client.call("echo", b"warm", timeout=10) == b"warm"
            client._conn.hot_s = 5.0  # the replies are polled in the hot wait
            for _ in range(3):
                call_id = next(client._conn.ids) + 1  # the id the next call gets
                assert await client.call("forge", call_id, timeout=10) == b"real"
        with cxlrpc.connect_sync(url) as sync:
            sync._conn.hot_s = 5.0
            call_id = next(sync._conn.ids) + 1
            assert sync.call("forge", call_id, timeout=10) == b"real"


@native
async def test_common_shapes_never_reach_the_reference(name: str) -> None:
    """After a holder's first request (the reference records it as seen), plain and async
    handlers, typed, raw or taking a view, one-way calls and deadlines all stay in the native
    path."""
    server = make_server(f"shm://{name}")
    async with server:
        reference = watch_reference(server)
        async with cxlrpc.connect(f"shm://{name}") as client:
            assert await client.call("echo", b"first") == b"first"
            assert reference == ["echo"]  # a new holder: the reference records it
            for i in range(50):
                assert await client.call("echo", b"%d" % i) == b"%d" % i
                assert await client.call("aecho", b"a", timeout=2.0) == b"a"
                assert await client.call("swap", Point(i, 1), response_type=Point) == Point(1, i)
                assert await client.call("anothing") == "none taken"
                assert await client.call("view", b"in place %d" % i) == b"in place %d" % i
                assert await client.call("aview", b"ab") == b"ba"
                with pytest.raises(cxlrpc.Internal):
                    await client.call("boom", b"")
            client.send_nowait("echo", b"one way")
            assert await client.call("echo", b"after") == b"after"
    assert reference == ["echo"]


@native
async def test_unknown_methods_and_fresh_holders_go_to_the_reference(name: str) -> None:
    """The reference takes what the native path cannot vouch for: an unknown method, a holder
    it has not seen yet, and everything once the server is draining."""
    server = make_server(f"shm://{name}")
    async with server:
        reference = watch_reference(server)
        async with cxlrpc.connect(f"shm://{name}") as a:
            await a.call("echo", b"")
            with pytest.raises(cxlrpc.Unimplemented):
                await a.call("missing", b"")
            async with cxlrpc.connect(f"shm://{name}") as b:
                assert await b.call("echo", b"b") == b"b"
                assert await b.call("echo", b"b") == b"b"
            assert reference == ["echo", "missing", "echo"]
    assert server._calls._fast.enabled == 0  # closed: draining switched it off


@native
async def test_garbage_requests_are_dropped_and_the_server_goes_on(name: str) -> None:
    """Records no correct client writes (a slot out of range, another holder's generation,
    NaN or infinite timeouts, unknown flags, a method longer than the record) are dropped and
    counted, as the reference drops them, and the next call is answered."""
    server = make_server(f"shm://{name}")
    async with server:
        async with cxlrpc.connect(f"shm://{name}") as client:
            await client.call("echo", b"")
            chan = client._conn.chan
            good = fr.HEADER.pack(fr.REQUEST, fr.RAW, 0, chan.slot, chan.gen, 7, 0.0, 4) + b"echo"
            bad = [
                fr.HEADER.pack(fr.REQUEST, fr.RAW, 0, 999, chan.gen, 7, 0.0, 4) + b"echo",
                fr.HEADER.pack(fr.REQUEST, fr.RAW, 0, chan.slot, chan.gen + 1, 7, 0.0, 4) + b"echo",
                fr.HEADER.pack(fr.REQUEST, fr.RAW, 0, chan.slot, chan.gen, 7, float("nan"), 4) + b"echo",
                fr.HEADER.pack(fr.REQUEST, 0x80 | fr.RAW, 0, chan.slot, chan.gen, 7, 0.0, 4) + b"echo",
                fr.HEADER.pack(fr.REQUEST, fr.RAW, 0, chan.slot, chan.gen, 7, 0.0, 200) + b"echo",
                good[:20],
            ]
            dropped = server._chan.dropped.load(0)
            for record in bad:
                assert client._conn.push((record,))
            chan.server_bell.ring()
            assert await client.call("echo", b"still here", timeout=5.0) == b"still here"
            assert server._chan.dropped.load(0) - dropped == len(bad)


@native
async def test_the_native_caller_answers_as_the_reference_across_processes(name: str) -> None:
    """Against a server in another process (where a lone caller polls for its reply in
    place): replies taken in the hot wait, replies taken after it, and the reference client
    give identical results and errors for every call shape."""
    url = f"shm://{name}"
    with served_elsewhere(url):
        async with cxlrpc.connect(url) as client:
            await outcomes(client)  # every method name encoded once (the reference does it)
            counting = client._conn.caller = CountingCaller(client._conn.caller)
            client._conn.hot_s = 5.0  # every reply comes within the hot wait (its yield phase)
            hot = await outcomes(client)
            in_place = counting.returned.count("Frame") + counting.returned.count("bytes")
            raw_in_place = counting.returned.count("bytes")  # raw replies: their bytes, no Frame
            client._conn.hot_spin_s = 5.0  # (its spin phase)
            counting.returned.clear()
            assert await outcomes(client) == hot
            assert counting.returned.count("Frame") + counting.returned.count("bytes") >= len(CALLS) - 2
            client._conn.hot_spin_s = 0.0
            client._conn.hot_s = 0.0  # none does: each is awaited as the reference awaits it
            counting.returned.clear()
            later = await outcomes(client)
            assert counting.returned.count("NoneType") >= len(CALLS) - 2  # big and a str arg: heap
            client._conn.caller = None
            reference = await outcomes(client)
        with cxlrpc.connect_sync(url) as sync:  # the server is another process: blocking is fine
            sync_outcomes(sync)
            counting = sync._conn.caller = CountingCaller(sync._conn.caller)
            sync._conn.hot_s = 5.0
            sync_hot = sync_outcomes(sync)
            in_place_sync = counting.returned.count("Frame") + counting.returned.count("bytes")
            sync._conn.hot_s = 0.0
            sync_later = sync_outcomes(sync)
            sync._conn.caller = None
            sync_reference = sync_outcomes(sync)
    assert hot == later == reference
    assert sync_hot == sync_later == sync_reference
    assert in_place_sync >= len(CALLS) - 2
    slotless = lambda runs: [o for o in runs if o[1] not in ("ctx", "pctx")]  # noqa: E731
    assert slotless(sync_hot) == slotless(hot)  # (each connection may hold another slot)
    assert in_place >= len(CALLS) - 2
    assert raw_in_place >= 5  # the echoes, asleep, wrapped (raw bytes back)
    assert ("ok", "echo", b"x" * 64) in hot


@native
async def test_typed_replies_decoded_natively_answer_as_the_reference(name: str) -> None:
    """Calls with a response_type, and arguments the native caller encodes itself: the replies
    it decodes in its hot wait (a value in a list, no Frame), those it leaves to the client
    (types that do not match, errors, raw bodies), and the reference client give identical
    results and errors, asyncio and blocking alike."""
    url = f"shm://{name}"
    with served_elsewhere(url):
        async with cxlrpc.connect(url) as client:
            await outcomes(client, TYPED)  # every method name encoded once
            counting = client._conn.caller = CountingCaller(client._conn.caller)
            client._conn.hot_s = 5.0
            hot = await outcomes(client, TYPED)
            decoded = counting.returned.count("list")
            client._conn.hot_s = 0.0  # replies awaited as the reference awaits them
            later = await outcomes(client, TYPED)
            client._conn.caller = None
            reference = await outcomes(client, TYPED)
        with cxlrpc.connect_sync(url) as sync:
            sync_outcomes(sync, TYPED)
            counting = sync._conn.caller = CountingCaller(sync._conn.caller)
            sync._conn.hot_s = 5.0
            sync_hot = sync_outcomes(sync, TYPED)
            sync_decoded = counting.returned.count("list")
            sync._conn.caller = None
            sync_reference = sync_outcomes(sync, TYPED)
    assert hot == later == reference == sync_hot == sync_reference
    assert decoded == sync_decoded == TYPED_DECODED
    assert hot[:TYPED_DECODED] == [("ok", "swap", Point(2, 1)), ("ok", "norm", 25), ("ok", "anyecho", [1, 2]),
                                   ("ok", "anyecho", Point(5, 6)), ("ok", "nothing", None)]
    failed = {o[1:3] for o in hot[TYPED_DECODED:] if o[0] == "error"}
    assert failed == {("norm", "InvalidArgument"), ("swap", "InvalidArgument"), ("anyecho", "InvalidArgument"),
                      ("echo", "InvalidArgument"), ("boom", "Internal"), ("missing", "Unimplemented")}
    assert ("ok", "echo", b"raw") in hot


@native
async def test_a_late_reply_polled_in_the_hot_wait_reaches_its_callback(name: str) -> None:
    """A reply to an abandoned call (on_late_reply) that the native caller polls while it
    waits for its own goes to that callback; the caller gets its own reply."""
    from procs import until
    url = f"shm://{name}"
    late: list = []
    with served_elsewhere(url):
        async with cxlrpc.connect(url) as client:
            await client.call("nap", 0.0)
            abandoned = asyncio.ensure_future(client.call("nap", 0.3, on_late_reply=late.append))
            await asyncio.sleep(0.05)
            abandoned.cancel()  # the server goes on with it: its reply is owed to the callback
            with pytest.raises(asyncio.CancelledError):
                await abandoned
            client._conn.hot_s = 5.0
            counting = client._conn.caller = CountingCaller(client._conn.caller)
            assert await client.call("nap", 0.6) == 0.6  # the late reply comes meanwhile
            assert counting.returned == ["Frame"]
            assert await until(lambda: late, 5.0)  # handed over by the loop (call_soon)
            assert late == [0.3]


@native
async def test_a_failing_handlers_log_record_sees_its_call_context(name: str, caplog) -> None:
    """A plain handler's exception is logged while ``context()`` is still its call (a log
    filter may tag records with it), on the native path as on the reference."""
    import logging

    seen: list = []

    class Tag(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            try:
                seen.append(cxlrpc.context().method)
            except LookupError:
                seen.append(None)
            return True

    server = make_server(f"shm://{name}")
    log = logging.getLogger("cxlrpc.server")
    tag = Tag()
    log.addFilter(tag)
    try:
        async with server:
            async with cxlrpc.connect(f"shm://{name}") as client:
                await client.call("echo", b"")
                for enabled in (1, 0):
                    server._calls._fast.enabled = enabled
                    with pytest.raises(cxlrpc.Internal):
                        await client.call("boom", b"")
    finally:
        log.removeFilter(tag)
    assert seen == ["boom", "boom"]


@native
async def test_method_names_of_a_str_subclass_and_big_typed_requests(name: str) -> None:
    """A method named by a str subclass (an enum member) and a typed request too big for the
    ring leave the native caller for the reference, which sends them (the big one as encoded)."""
    import enum

    class M(str, enum.Enum):
        ECHO = "echo"

    server = make_server(f"shm://{name}")
    async with server:
        async with cxlrpc.connect(f"shm://{name}") as client:
            assert await client.call(M.ECHO, b"enum") == b"enum"
            assert await client.call(M.ECHO, b"again") == b"again"
            big = list(range(600_000))  # ~2.7 MB of MessagePack: through the heap
            assert await client.call("anyecho", big) == big
            assert await client.call("anyecho", big) == big


@native
async def test_serve_polls_batch_after_batch_until_the_loop_is_needed(name: str) -> None:
    """The native hot loop (Dispatcher.serve) polls the ring with itself as the handler (through
    the rings' C API, or here a ring's Python poll_within) until a poll finds nothing, a request
    took the server's own code (it may have left work for the loop), the dispatcher is off, or
    the loop's turn is due; each poll reads the clock first."""
    server = make_server(f"shm://{name}")
    async with server:
        fast = server._calls._fast
        polls: list = []

        class Ring:  # a ring without the rings' C API: its Python poll_within is called
            def __init__(self, *counts: int, poll: Any = None) -> None:
                self.left, self.poll = list(counts), poll

            def poll_within(self, handler: Any, limit: int, seconds: float) -> int:
                polls.append((handler, limit, seconds, fast.polled_at))
                if self.poll is not None:
                    return self.poll(handler)
                return self.left.pop(0)

        start = time.monotonic()
        assert fast.serve(Ring(2, 3, 0, 5), 1e-5, start + 60.0) == 5  # up to the quiet poll
        assert [(p[0], p[2]) for p in polls] == [(fast, 1e-5)] * 3
        # the first batch is the most a batch takes; the next ones are sized by the pace of the
        # one before (fewer when this process was preempted meanwhile, as on a loaded machine)
        assert polls[0][1] == 256 and all(1 <= p[1] <= 256 for p in polls)
        assert start <= polls[0][3] <= polls[1][3] <= polls[2][3] <= time.monotonic()

        polls.clear()
        garbage = memoryview(bytes(fr.HEADER_SIZE + 8))  # not a request: the reference drops it

        def detour(handler: Any) -> int:
            handler(garbage)
            return 1
        assert fast.serve(Ring(poll=detour), 1e-5, time.monotonic() + 5.0) == 1
        assert [p[0] for p in polls] == [fast]  # the reference ran: the loop gets its turn

        polls.clear()
        before = time.monotonic()
        assert fast.serve(Ring(1), 1e-5, before - 1.0) == 0  # its turn is due: no poll
        assert polls == [] and fast.polled_at >= before
        fast.enabled = 0
        try:
            assert fast.serve(Ring(1), 1e-5, time.monotonic() + 60.0) == 0
        finally:
            fast.enabled = 1
        assert polls == []
        with pytest.raises(TypeError):
            fast.serve(Ring(1), 1, 2.0)  # seconds and until are floats
        async with cxlrpc.connect(f"shm://{name}") as client:  # the server goes on serving
            assert await client.call("aecho", b"after") == b"after"


@native
async def test_batches_are_sized_to_the_handlers_pace_and_end_by_the_loops_turn(name: str) -> None:
    """Each batch takes the requests that fit in a loop turn's span (1 ms) at the pace of the one
    before, fewer when the turn is due sooner; through the rings' C API a batch also ends at the
    first request handled after the turn falls due (the rest stay in the ring for the next)."""
    server = make_server(f"shm://{name}")
    async with server:
        fast = server._calls._fast
        limits: list[int] = []

        class Ring:  # a ring without the rings' C API; its records take 50 us each
            def poll_within(self, handler: Any, limit: int, seconds: float) -> int:
                limits.append(limit)
                end = time.perf_counter() + limit * 50e-6
                while time.perf_counter() < end:
                    pass
                return limit

        first = fast.batch
        assert fast.serve(Ring(), 1e-5, time.monotonic() + 0.03) > first
        assert limits[0] == first and len(limits) >= 2
        assert all(1 <= n <= 20 for n in limits[1:]), limits  # 1 ms at 50 us a record, or fewer
        assert 1 <= fast.batch <= 20
        limits.clear()
        fast.serve(Ring(), 1e-5, time.monotonic() + 0.0004)  # a turn due in 0.4 ms: 8 at most
        assert limits and all(1 <= n <= 8 for n in limits), limits

        ring = Env(SpscRing, 4096).ring  # a native ring: its records go to the dispatcher in C
        garbage = bytes(fr.HEADER_SIZE + 8)  # not requests: the reference drops them
        for _ in range(5):
            assert ring.try_push(garbage)
        now = time.monotonic()
        assert fast.poll(ring, now, now - 1.0) == 1  # the turn is due: one record, then no more
        assert fast.polled_at == now
        assert fast.poll(ring, now, time.monotonic() + 60.0) == 4
        assert fast.poll(ring, now, time.monotonic() + 60.0) == 0
        with pytest.raises(TypeError):
            fast.poll(ring, now)  # when the turn is due is an argument
        async with cxlrpc.connect(f"shm://{name}") as client:  # the server goes on serving
            assert await client.call("aecho", b"after") == b"after"


def test_the_reference_sizes_its_batches_to_the_handlers_pace() -> None:
    """The reference reader's batch: the requests that fit in a loop turn's span at the last
    batch's pace, 1 to 256 (the native dispatcher's sizing)."""
    fitting = server_loop._batch_fitting
    assert fitting(256, 256 * 50e-6) == 20  # 50 us a request: 20 in 1 ms
    assert fitting(10, 1e-6) == server_loop._BATCH_MAX  # fast handlers: the whole batch
    assert fitting(1, 0.5) == 1  # slower than the span: one at a time, never none
    assert fitting(3, 0.0) == server_loop._BATCH_MAX  # no time measured: no bound from it


@native
async def test_the_native_caller_leaves_calls_to_the_reference_while_others_are_in_flight(
        name: str) -> None:
    """While a client has calls in flight (or replies handed over whose callers have not run,
    callers giving way to them, or extents to give back), its native caller sends nothing and
    answers NotImplemented: the reference keeps their order."""
    server = make_server(f"shm://{name}")
    async with server:
        async with cxlrpc.connect(f"shm://{name}") as client:
            assert await client.call("echo", b"warm") == b"warm"
            caller = client._conn.caller
            for busy in (client._replies.pending, client._woken, client._yielding, client._bodies.frees):
                if isinstance(busy, dict):
                    busy[-1] = None
                elif isinstance(busy, set):
                    busy.add(-1)
                else:
                    busy.append(-1)
                try:
                    assert caller.call("echo", b"x", 0.0, next(client._conn.ids), 0.0, True) is NotImplemented
                    # once the call has given the loop its turn, only calls in flight hold it back
                    went = caller.call("echo", b"x", 0.0, next(client._conn.ids), 0.0, True, 0.0, True)
                    assert (went is NotImplemented) == (busy is client._replies.pending or busy is client._bodies.frees)
                finally:
                    busy.clear()
            got = caller.call("echo", b"y", 0.0, next(client._conn.ids), 1e-3, True)
            assert got == b"y" or got is None  # out (polled in place, or left to the reader)
            calls = [client.call("aecho", b"%d" % i) for i in range(8)]  # concurrent: the reference
            assert await asyncio.gather(*calls) == [b"%d" % i for i in range(8)]


@native
async def test_tasks_sharing_a_client_call_natively_after_their_turn(name: str) -> None:
    """Tasks calling in a loop on one client take turns (each call gives the loop a turn while
    others are owed one); after its turn a call with nothing else in flight goes through the
    native caller, not the reference (which made 8 tasks' calls/s a fifth of one task's)."""
    from procs import echo_server

    url = f"shm://{name}"
    with echo_server(url):  # another process: replies are polled for in place
        async with cxlrpc.connect(url) as client:
            assert await client.call("echo", b"warm", timeout=10) == b"warm"
            started = [0]
            reference = client._start

            def counted(*args: Any, **kwargs: Any) -> Any:
                started[0] += 1
                return reference(*args, **kwargs)

            client._start = counted
            counts = [0] * 8
            stop = time.monotonic() + 1.0

            async def caller(i: int) -> None:
                while time.monotonic() < stop:
                    assert await client.call("echo", b"%d" % i, timeout=10) == b"%d" % i
                    counts[i] += 1

            await asyncio.gather(*(caller(i) for i in range(8)))
    total = sum(counts)
    assert total > 800 and min(counts) >= 0.5 * total / 8, counts
    assert started[0] <= 0.1 * total, f"{started[0]} of {total} calls went through the reference"


@native
async def test_a_stand_in_task_a_handler_kept_is_not_lent_to_the_next_call(name: str) -> None:
    """The native dispatcher reuses the current-task stand-in of a coroutine handler that
    returned, unless the handler kept it (a reference, or a weak one as anyio's task states
    keep): a later call never sees an earlier call's task."""
    server = make_server(f"shm://{name}")
    strong: list = []
    weak: list = []

    @server.method("keep")
    async def keep() -> int:
        strong.append(asyncio.current_task())
        return len(strong)

    @server.method("weak")
    async def weak_keep() -> int:
        weak.append(weakref.ref(asyncio.current_task()))
        return len(weak)

    @server.method("plain")
    async def plain() -> str:
        return type(asyncio.current_task()).__name__

    async with server:
        async with cxlrpc.connect(f"shm://{name}") as client:
            for i in range(3):
                assert await client.call("plain") == "_EagerTask"
                assert await client.call("keep") == i + 1
            for i in range(3):
                assert await client.call("weak") == i + 1
    assert len({id(t) for t in strong}) == 3
    alive = [r() for r in weak]
    assert all(t is None or alive.count(t) == 1 for t in alive)  # never the same live stand-in


def test_native_types_refuse_use_before_init_and_keywords() -> None:
    """Made without __init__ (or called with keywords), the native types raise; they never
    dereference what they were not given."""
    from cxlrpc._dispatch import Caller, Dispatcher
    view = memoryview(bytes(64))
    with pytest.raises(RuntimeError):
        Dispatcher.__new__(Dispatcher)(view)
    with pytest.raises(RuntimeError):
        Caller.__new__(Caller)(view)
    with pytest.raises(RuntimeError):
        Caller.__new__(Caller).call("echo", b"", 0.0, 1, 0.0, True)
    with pytest.raises(TypeError):
        Dispatcher.__new__(Dispatcher)(view=view)
    with pytest.raises(TypeError):
        Caller.__new__(Caller)(view=view)


@native
async def test_flush_mode_servers_dispatch_natively(name: str) -> None:
    """Memory without coherence (here its simulator) is served by the native dispatcher too,
    over the granted slots' request rings (tests/test_flush_native_ring.py holds it to the
    reference across processes)."""
    server = cxlrpc.Server(f"sim://{name}", request_capacity=256 << 10, response_capacity=256 << 10,
                           max_message_size=1 << 20)

    @server.method("echo")
    def echo(payload: bytes) -> bytes:
        return payload

    async with server:
        assert server._calls._fast is not None
        assert server._calls._fast_requests is server._chan.requests.active  # type: ignore[union-attr]
        async with cxlrpc.connect(f"sim://{name}") as client:
            assert client._conn.caller is not None
            assert await client.call("echo", b"sim") == b"sim"


@native
def test_native_dispatch_is_built_where_a_compiler_is() -> None:
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    assert server_dispatch._Dispatcher is not None, "cxlrpc._dispatch did not build: run pip install -e ."


@native
@pytest.mark.timeout(600)
def test_reference_dispatch_passes_the_rpc_suites() -> None:
    """The RPC and handler-context suites on coherent memory, with the reference alone."""
    import cxlrpc as package
    root = str(Path(package.__file__).resolve().parents[1])
    env = {**os.environ, "CXLRPC_NO_NATIVE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    check = "import cxlrpc.server_dispatch as s; assert s._Dispatcher is None"
    assert subprocess.run([sys.executable, "-c", check], env=env, timeout=60).returncode == 0
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "-k", "shm", "test_rpc.py", "test_context.py"],
                          cwd=TESTS, env=env, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
