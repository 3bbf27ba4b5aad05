"""Clients: the asyncio :class:`Client` (primary) and the blocking :class:`SyncClient`.

Both claim a slot in the server's region, push request frames into the shared MPSC ring,
and read replies from their own SPSC ring.  A monitor thread beats the slot's heartbeat
and watches the server's, so a dead server surfaces as ``Unavailable`` within
``server_timeout`` instead of a hang.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from typing import Any, Awaitable, Callable, Mapping, NamedTuple, Sequence

import msgspec

from . import frame as fr
from .channel import KIND_RPC, ClientChannel, FlushClientChannel, client_channel
from .doorbell import WaitStrategy, resolve
from .errors import (DeadlineExceeded, InvalidArgument, ResourceExhausted, RpcError,
                     Unavailable, error_for)
from .heap import EXTENT, OFFSET, HeapAccess
from .region import Region, RegionError
from .ring import ClaimRevoked

_BEAT_INTERVAL = 0.1


#: A client interceptor: ``await interceptor(method, arg, metadata, next)`` makes the call
#: when it awaits ``next(method, arg, metadata)`` (``metadata``: a dict of its own to change);
#: it may raise instead, or return another result. SyncClient's are plain functions.
ClientInterceptor = Callable[[str, Any, dict, Callable[[str, Any, dict], Any]], Any]


class _Large(NamedTuple):
    """A request too big for the ring: its body goes through the server's heap (its metadata
    block stays in the frame)."""

    flags: int
    method_len: int
    prefix: bytes  # the method name, then the metadata block if any
    body: bytes | memoryview


def _chained(interceptors: tuple, last: Callable[[str, Any, dict], Any]) -> Callable[[str, Any, dict], Any]:
    """``last`` wrapped in the interceptors, the first outermost."""
    def wrap(interceptor: ClientInterceptor, inner: Callable) -> Callable[[str, Any, dict], Any]:
        return lambda method, arg, metadata: interceptor(method, arg, metadata, inner)

    call = last
    for interceptor in reversed(interceptors):
        call = wrap(interceptor, call)
    return call


def _checked(interceptors: Sequence[ClientInterceptor]) -> tuple:
    """The interceptors as a tuple (empty: the call path skips them), each callable."""
    for interceptor in interceptors:
        if not callable(interceptor):
            raise TypeError(f"interceptor is not callable: {interceptor!r}")
    return tuple(interceptors)


def _own_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """A copy of the caller's metadata for the interceptors to change ({} for None)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidArgument(f"metadata must be a mapping of str to str, not {type(metadata).__name__}")
    return dict(metadata)


class _Health(msgspec.Struct):
    """The reply of ``cxlrpc.health``."""

    status: str


def _attach(url: str, poll_interval: float) -> ClientChannel | FlushClientChannel:
    try:
        region = Region.open(url, kind=KIND_RPC)
    except FileNotFoundError as exc:
        raise Unavailable(f"no server at {url}") from exc
    except RegionError as exc:
        raise Unavailable(f"cannot use {url}: {exc}") from exc
    try:
        return client_channel(region, poll_interval)
    except (ConnectionRefusedError, RegionError) as exc:
        region.close()
        raise Unavailable(str(exc)) from exc
    except BlockingIOError as exc:
        region.close()
        raise ResourceExhausted(str(exc)) from exc
    except OSError as exc:
        region.close()
        raise Unavailable(f"cannot attach to {url}: {exc}") from exc
    except BaseException:
        region.close()
        raise


class _Base:
    """What both clients share: the channel, request encoding, the monitor thread."""

    def __init__(self, url: str, doorbell: WaitStrategy | str | None, server_timeout: float,
                 poll_interval: float) -> None:
        if not poll_interval > 0:
            raise ValueError("poll_interval must be > 0 seconds")
        self.url = url
        self.strategy = resolve(doorbell)
        self.server_timeout = server_timeout
        self.poll_interval = poll_interval
        self._chan: ClientChannel | FlushClientChannel | None = None
        self._ids = itertools.count(1)
        self._methods: dict[str, bytes] = {}
        self._gone: str | None = None
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._heap: HeapAccess | None = None
        self._frees: list[int] = []  # heap extents of replies read, to give back
        self._allocs: set[int] = set()  # call ids of ALLOCs whose reply may still come

    def _open(self) -> None:
        self._chan = _attach(self.url, self.poll_interval)
        geo, region = self._chan.geo, self._chan.region
        self._heap = HeapAccess(region.buf, region.mem, geo.heap, geo.heap_size)
        self._monitor = threading.Thread(target=self._watch, name="cxlrpc-client-monitor", daemon=True)
        self._monitor.start()

    def _shutdown(self) -> None:
        self._stop.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join()
        if self._chan is not None:
            self._chan.detach()
            self._chan.region.close()
            self._chan = None

    def _watch(self) -> None:
        chan = self._chan
        while not self._stop.wait(_BEAT_INTERVAL):
            if self._gone is None:
                reason = chan.server_gone(self.server_timeout)
                if reason is not None:
                    self._set_gone(reason)
            if chan.holds_slot():
                chan.beat()  # a reaped client stops writing its old slot's words

    def _set_gone(self, reason: str) -> None:
        if self._gone is None:
            self._gone = reason
            self._on_gone()

    def _on_gone(self) -> None:
        """Called once the server is judged gone (from the monitor thread, or a caller)."""

    def _acknowledge_timeout(self) -> float | None:
        """Seconds to wait for the server to acknowledge us, or None when it need not: a
        server on another host must see our slot before it polls for our requests."""
        return None if self._chan.server_local else self.server_timeout + 2 * _BEAT_INTERVAL

    def _acknowledged(self) -> bool:
        """Has the server seen us yet? ResourceExhausted (detached) when every slot is taken."""
        try:
            return self._chan.acknowledged()
        except BlockingIOError as exc:
            self._shutdown()
            raise ResourceExhausted(str(exc)) from exc

    def _unacknowledged(self, waited: float) -> Unavailable:
        self._shutdown()
        return Unavailable(f"the server at {self.url} did not acknowledge this connection within "
                           f"{waited:.1f} s")

    def _push(self, parts: tuple) -> bool:
        """Push a request as our slot's producer; Unavailable if the server reclaimed the slot."""
        try:
            return self._chan.push(parts)
        except ClaimRevoked as exc:
            self._set_gone(f"the server reclaimed this client's slot ({exc}); connect again")
            raise Unavailable(self._gone) from exc

    def _request(self, call_id: int, method: str, arg: Any, timeout: float,
                 metadata: Mapping[str, str] | None = None) -> tuple:
        """The parts of a request record: header, method name (then the metadata block, if
        any), body."""
        mb = self._methods.get(method)
        if mb is None:
            mb = fr.method_bytes(method)
            if len(self._methods) < 4096:
                self._methods[method] = mb
        flags, body = fr.encode_body(arg)
        prefix = mb
        if metadata:
            prefix = mb + fr.encode_metadata(metadata)
            flags |= fr.META
        chan = self._chan
        head = fr.HEADER.pack(fr.REQUEST, flags, 0, chan.slot, chan.gen, call_id, timeout, len(mb))
        size = len(head) + len(prefix) + len(body)
        if size > chan.requests.max_payload:
            limit = chan.geo.max_message_size
            if not chan.geo.heap_size:
                raise ResourceExhausted(f"request of {len(body)} bytes exceeds the request ring's "
                                        f"limit {chan.requests.max_payload} (the server has no heap)")
            if len(body) > limit:
                raise ResourceExhausted(f"request of {len(body)} bytes exceeds the server's "
                                        f"max_message_size={limit}")
            if len(head) + len(prefix) + EXTENT.size > chan.requests.max_payload:
                raise ResourceExhausted(f"request metadata of {len(prefix) - len(mb)} bytes does "
                                        f"not fit the request ring's limit {chan.requests.max_payload}")
            return _Large(flags, len(mb), prefix, body)
        return head, prefix, body

    def _alloc_request(self, size: int, timeout: float) -> tuple[int, tuple]:
        """An ALLOC frame asking the server for ``size`` bytes of heap: (its call id, parts)."""
        chan = self._chan
        alloc_id = next(self._ids)
        self._allocs.add(alloc_id)
        head = fr.header(fr.ALLOC, fr.RAW, 0, chan.slot, chan.gen, alloc_id, timeout, b"")
        return alloc_id, (head, OFFSET.pack(size))

    def _staged(self, large: _Large, reply: bytes, call_id: int, timeout: float) -> tuple[tuple, int]:
        """Write the body into the extent the server granted; the request's parts and the
        extent's offset (to give back if the request is never sent)."""
        chan = self._chan
        (offset,) = OFFSET.unpack(reply)
        try:
            self._heap.write(offset, (large.body,))
        except ValueError as exc:
            raise InvalidArgument(f"the server granted a bad heap extent: {exc}") from exc
        head = fr.HEADER.pack(fr.REQUEST, large.flags | fr.HEAP, 0, chan.slot, chan.gen, call_id,
                              timeout, large.method_len)
        return (head, large.prefix, EXTENT.pack(offset, len(large.body))), offset

    def _heap_body(self, f: fr.Frame, wanted: bool) -> bool:
        """An out-of-line reply: copy its body out (if ``wanted``) and give the extent back;
        False when the extent is garbage."""
        if len(f.body) != EXTENT.size:
            return False
        offset, length = EXTENT.unpack(f.body)
        try:
            body = self._heap.read(offset, length) if wanted else b""
        except ValueError:
            return False
        f.body, f.flags = body, f.flags & ~fr.HEAP
        self._give_back(offset)
        return True

    def _granted_late(self, f: fr.Frame) -> None:
        """A reply nobody waits for: if it grants an extent (its ALLOC was abandoned), give
        the extent back; if it carries one, too."""
        if f.call_id in self._allocs:
            self._allocs.discard(f.call_id)
            if f.kind == fr.RESPONSE and len(f.body) == OFFSET.size:
                self._give_back(OFFSET.unpack(f.body)[0])
        elif f.flags & fr.HEAP:
            self._heap_body(f, wanted=False)

    def _give_back(self, offset: int) -> None:
        """Queue a FREE of a heap extent and send what the ring takes now."""
        self._frees.append(offset)
        self._send_frees()

    def _send_frees(self) -> None:
        chan = self._chan
        if chan is None or self._gone is not None:
            return
        sent = 0
        try:
            while self._frees:
                head = fr.header(fr.FREE, fr.RAW, 0, chan.slot, chan.gen, fr.NO_REPLY, 0.0, b"")
                if not chan.push((head, OFFSET.pack(self._frees[0]))):
                    break  # the ring is full: the next call sends the rest
                self._frees.pop(0)
                sent += 1
        except ClaimRevoked:
            return
        if sent:
            chan.server_bell.ring()

    def send_nowait(self, method: str, arg: Any = None) -> None:
        """One-way call: queue ``method(arg)`` without waiting and without a reply (ordered
        with this client's other calls). ``ResourceExhausted`` if the request ring is full."""
        chan = self._chan
        if chan is None:
            raise Unavailable("client is closed")
        if self._gone is not None:
            raise Unavailable(self._gone)
        parts = self._request(fr.NO_REPLY, method, arg, 0.0)
        if type(parts) is _Large:
            raise ResourceExhausted(f"a one-way call carries at most the request ring's "
                                    f"{self._chan.requests.max_payload} bytes")
        if not self._push(parts):
            raise ResourceExhausted("request ring is full")
        chan.server_bell.ring()

    def _send_cancel(self, call_id: int) -> None:
        """Best effort: tell the server to cancel ``call_id`` (dropped if the ring is full)."""
        chan = self._chan
        if chan is None or self._gone is not None:
            return
        head = fr.header(fr.CANCEL, fr.RAW, 0, chan.slot, chan.gen, call_id, 0.0, b"")
        try:
            if self._push((head,)):
                chan.server_bell.ring()
        except Unavailable:
            pass

    def _decode_reply(self, f: fr.Frame, response_type: Any) -> Any:
        if f.kind == fr.ERROR:
            raise error_for(f.status, f.body.decode(errors="replace"))
        try:
            return fr.decode_body(f.flags, f.body, response_type)
        except Exception as exc:
            raise InvalidArgument(f"reply does not decode as {response_type}: {exc}") from exc


class Client(_Base):
    """asyncio client. Many calls may be in flight at once; use ``async with connect(...)``."""

    def __init__(self, url: str, *, doorbell: WaitStrategy | str | None = None,
                 server_timeout: float = 1.0, poll_interval: float = 1e-3,
                 interceptors: Sequence[ClientInterceptor] = ()) -> None:
        super().__init__(url, doorbell, server_timeout, poll_interval)
        self._interceptors = _checked(interceptors)
        self._pending: dict[int, tuple[asyncio.Future, Any]] = {}
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._direct = False  # a caller is polling the reply ring itself
        self._reader_wake: asyncio.Future | None = None
        self._direct_exhausted = False  # the direct poll spent the spin and yield budget

    async def open(self) -> "Client":
        self._loop = asyncio.get_running_loop()
        self._open()
        wait = self._acknowledge_timeout()
        if wait is not None:
            deadline = self._loop.time() + wait
            try:
                while not self._acknowledged():
                    if self._loop.time() >= deadline:
                        raise self._unacknowledged(wait)
                    await asyncio.sleep(0.002)
            except asyncio.CancelledError:
                self._shutdown()
                raise
        self._reader = self._loop.create_task(self._read())
        return self

    async def close(self) -> None:
        """Detach from the server; calls still waiting fail with ``Unavailable``."""
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._fail_all(Unavailable("client closed"))
        self._shutdown()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(self, method: str, arg: Any = None, *, timeout: float | None = None,
                   metadata: Mapping[str, str] | None = None, response_type: Any = None) -> Any:
        """Call ``method`` with ``arg`` and optional ``metadata`` (small str pairs the handler
        reads from its context); raises an :class:`RpcError` subclass on failure."""
        if self._interceptors:
            return await _chained(self._interceptors, lambda method, arg, metadata: self._start(
                method, arg, timeout, metadata, response_type))(method, arg, _own_metadata(metadata))
        return await self._start(method, arg, timeout, metadata, response_type)

    def _start(self, method: str, arg: Any, timeout: float | None,
               metadata: Mapping[str, str] | None, response_type: Any) -> Awaitable[Any]:
        """Check and encode a call; the awaitable of its round trip."""
        if self._closed or self._chan is None:
            raise Unavailable("client is closed")
        if self._gone is not None:
            raise Unavailable(self._gone)
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded("timeout must be positive")
        call_id = next(self._ids)
        parts = self._request(call_id, method, arg, timeout or 0.0, metadata)
        deadline = None if timeout is None else self._loop.time() + timeout
        if type(parts) is _Large:
            return self._call_large(call_id, parts, timeout or 0.0, deadline, response_type)
        return self._roundtrip(call_id, parts, deadline, response_type)

    async def _call_large(self, call_id: int, large: _Large, timeout: float,
                          deadline: float | None, response_type: Any) -> Any:
        """A request through the heap: ALLOC an extent, write the body there, then call."""
        alloc_id, alloc = self._alloc_request(len(large.body), timeout)
        try:
            reply = await self._roundtrip(alloc_id, alloc, deadline, None)
        finally:
            self._allocs.discard(alloc_id)
        parts, offset = self._staged(large, reply, call_id, timeout)
        return await self._roundtrip(call_id, parts, deadline, response_type, unsent=offset)

    async def _roundtrip(self, call_id: int, parts: tuple, deadline: float | None,
                         response_type: Any, unsent: int | None = None) -> Any:
        """Push a request and await its reply. ``unsent``: a heap extent to give back if the
        request never left."""
        loop = self._loop
        fut = loop.create_future()
        self._pending[call_id] = (fut, response_type)
        timer = None
        pushed = False
        try:
            chan = self._chan
            if self._frees:
                self._send_frees()
            if self._push(parts):
                chan.server_bell.ring()
            else:
                await self._push_slow(parts, deadline)
            pushed = True
            if deadline is not None:
                timer = loop.call_at(deadline, _expire, fut)
            if not self._direct and len(self._pending) == 1:
                await self._poll_directly(fut)
            return await fut
        except asyncio.CancelledError:
            self._send_cancel(call_id)
            raise
        except DeadlineExceeded:
            self._send_cancel(call_id)
            raise
        finally:
            self._pending.pop(call_id, None)
            if timer is not None:
                timer.cancel()
            if unsent is not None and not pushed:
                self._give_back(unsent)

    async def health(self, *, timeout: float | None = None) -> str:
        """The server's status (``cxlrpc.health``): "SERVING", or "NOT_SERVING" while it shuts down."""
        return (await self.call(fr.HEALTH, timeout=timeout, response_type=_Health)).status

    async def methods(self, *, timeout: float | None = None) -> list[str]:
        """The names of the server's methods, sorted (``cxlrpc.methods``; reserved ones left out)."""
        return await self.call(fr.LIST_METHODS, timeout=timeout, response_type=list[str])

    async def _push_slow(self, parts: tuple, deadline: float | None) -> None:
        """Backpressure: retry while the request ring is full, until the deadline."""
        chan = self._chan
        backoff = 0.0
        while not self._push(parts):
            if self._gone is not None:
                raise Unavailable(self._gone)
            if deadline is not None and self._loop.time() >= deadline:
                raise DeadlineExceeded("request ring stayed full until the deadline")
            chan.server_bell.ring()
            await asyncio.sleep(backoff)
            backoff = min(0.001, backoff * 2 + 1e-5)
        chan.server_bell.ring()

    async def _poll_directly(self, fut: asyncio.Future) -> None:
        """The only caller in flight polls the reply ring itself through the spin and yield
        phases of the wait strategy; the reader task parks meanwhile.

        This saves the hop through the reader task (one loop iteration and a task switch per
        call); it still yields to other tasks between polls.  Replies to other calls that
        arrive meanwhile are dispatched as usual.
        """
        self._direct = True
        try:
            poll, on_reply = self._chan.responses.poll, self._on_reply
            now = time.perf_counter
            spin_end = now() + self.strategy.spin_s
            yield_end = spin_end + self.strategy.yield_s
            while not fut.done():
                if not poll(on_reply, 1024):
                    if self._gone is not None:
                        return
                    t = now()
                    if t > spin_end:
                        if t > yield_end:
                            self._direct_exhausted = True  # the reader should park at once
                            return
                        os.sched_yield()
                    await asyncio.sleep(0)
        finally:
            self._direct = False
            # Hand over to the reader only if calls remain (ours, if we gave up, or others'):
            # waking it after every call would cost a few task switches per round trip.
            wake = self._reader_wake
            if self._pending and wake is not None and not wake.done():
                wake.set_result(None)

    async def _read(self) -> None:
        chan = self._chan
        ring = chan.responses
        poll = ring.poll
        on_reply = self._on_reply
        ready = lambda: ring.readable() or self._gone is not None or self._direct
        idle = False
        loop = self._loop
        while True:
            if self._direct:  # a caller is polling for us; sleep until it stops
                self._reader_wake = loop.create_future()
                await self._reader_wake
                self._reader_wake = None
                idle, self._direct_exhausted = self._direct_exhausted, False
                continue
            if poll(on_reply, 1024):
                idle = False
                await asyncio.sleep(0)
                continue
            if self._gone is not None:
                self._fail_all(Unavailable(self._gone))
                return
            idle = not await chan.bell.wait_async(ready, self.strategy, _BEAT_INTERVAL, idle)

    def _on_reply(self, view: memoryview) -> None:
        chan = self._chan
        try:
            f = fr.decode(view)
        except fr.FrameError:
            chan.responses.dropped += 1
            return
        if f.gen != chan.gen or f.slot != chan.slot:
            return  # a reply meant for this slot's previous holder
        entry = self._pending.pop(f.call_id, None)
        if entry is None or entry[0].done():
            self._granted_late(f)  # the caller gave up (timeout, cancel)
            return
        fut, response_type = entry
        if f.flags & fr.HEAP and not self._heap_body(f, wanted=True):
            fut.set_exception(InvalidArgument("the reply's heap extent is not inside the heap"))
            return
        if f.kind == fr.RESPONSE and f.flags & fr.RAW and response_type is None:
            fut.set_result(f.body)  # raw bytes: nothing to decode
            return
        try:
            fut.set_result(self._decode_reply(f, response_type))
        except RpcError as exc:
            fut.set_exception(exc)

    def _fail_all(self, exc: RpcError) -> None:
        pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(exc)

    def _on_gone(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(lambda: None)  # wakes the loop; the reader sees _gone
            except RuntimeError:
                pass


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(DeadlineExceeded("deadline exceeded"))


class _Connecting:
    """What :func:`connect` returns: ``await`` it, or use it with ``async with``."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def __await__(self):
        return self._client.open().__await__()

    async def __aenter__(self) -> Client:
        return await self._client.open()

    async def __aexit__(self, *exc: object) -> None:
        await self._client.close()


def connect(url: str, *, doorbell: WaitStrategy | str | None = None,
            server_timeout: float = 1.0, poll_interval: float = 1e-3,
            interceptors: Sequence[ClientInterceptor] = ()) -> _Connecting:
    """Connect an asyncio client: ``async with cxlrpc.connect("shm://NAME") as client``.

    ``poll_interval`` bounds how long the idle client sleeps between looks at its reply ring
    when the server is on another host (which cannot wake it). ``interceptors`` (async, see
    :data:`ClientInterceptor`) wrap every call, the first outermost."""
    return _Connecting(Client(url, doorbell=doorbell, server_timeout=server_timeout,
                              poll_interval=poll_interval, interceptors=interceptors))


class SyncClient(_Base):
    """Blocking client for synchronous callers. Thread-safe; calls from several threads are
    serialised (open one client per thread for parallel calls)."""

    def __init__(self, url: str, *, doorbell: WaitStrategy | str | None = None,
                 server_timeout: float = 1.0, poll_interval: float = 1e-3,
                 interceptors: Sequence[ClientInterceptor] = ()) -> None:
        super().__init__(url, doorbell, server_timeout, poll_interval)
        self._interceptors = _checked(interceptors)
        self._lock = threading.Lock()
        self._open()
        wait = self._acknowledge_timeout()
        if wait is not None:
            deadline = time.monotonic() + wait
            while not self._acknowledged():
                if time.monotonic() >= deadline:
                    raise self._unacknowledged(wait)
                time.sleep(0.002)

    def close(self) -> None:
        with self._lock:
            self._shutdown()

    def __enter__(self) -> "SyncClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, method: str, arg: Any = None, *, timeout: float | None = None,
             metadata: Mapping[str, str] | None = None, response_type: Any = None) -> Any:
        """Call ``method`` with ``arg`` and optional ``metadata`` and wait for the reply (or
        raise an RpcError)."""
        if self._interceptors:
            return _chained(self._interceptors, lambda method, arg, metadata: self._call(
                method, arg, timeout, metadata, response_type))(method, arg, _own_metadata(metadata))
        return self._call(method, arg, timeout, metadata, response_type)

    def _call(self, method: str, arg: Any, timeout: float | None,
              metadata: Mapping[str, str] | None, response_type: Any) -> Any:
        with self._lock:
            chan = self._chan
            if chan is None:
                raise Unavailable("client is closed")
            if timeout is not None and timeout <= 0:
                raise DeadlineExceeded("timeout must be positive")
            call_id = next(self._ids)
            parts = self._request(call_id, method, arg, timeout or 0.0, metadata)
            deadline = None if timeout is None else time.monotonic() + timeout
            unsent = None
            if type(parts) is _Large:  # through the heap: ALLOC an extent, write the body there
                alloc_id, alloc = self._alloc_request(len(parts.body), timeout or 0.0)
                try:
                    reply = self._decode_reply(self._roundtrip(alloc_id, alloc, deadline), None)
                finally:
                    self._allocs.discard(alloc_id)
                parts, unsent = self._staged(parts, reply, call_id, timeout or 0.0)
            return self._decode_reply(self._roundtrip(call_id, parts, deadline, unsent), response_type)

    def _roundtrip(self, call_id: int, parts: tuple, deadline: float | None,
                   unsent: int | None = None) -> fr.Frame:
        """Push a request and wait for its reply frame. ``unsent``: a heap extent to give back
        if the request never left."""
        chan = self._chan
        if self._frees:
            self._send_frees()
        backoff = 0.0
        try:
            while not self._push(parts):
                self._check(deadline, call_id, sent=False)
                chan.server_bell.ring()
                time.sleep(backoff)  # backpressure: the server is draining a full ring
                backoff = min(0.001, backoff * 2 + 1e-5)
        except BaseException:
            if unsent is not None:
                self._give_back(unsent)
            raise
        chan.server_bell.ring()
        ring, bell, strategy = chan.responses, chan.bell, self.strategy
        got: list[fr.Frame] = []

        def on_reply(view: memoryview) -> None:
            try:
                f = fr.decode(view)
            except fr.FrameError:
                ring.dropped += 1
                return
            if f.gen != chan.gen or f.slot != chan.slot:
                return
            if f.call_id != call_id or got:
                self._granted_late(f)
            elif f.flags & fr.HEAP and not self._heap_body(f, wanted=True):
                ring.dropped += 1
            else:
                got.append(f)

        ready = lambda: ring.readable() or self._gone is not None
        idle = False
        while True:
            if ring.poll(on_reply):
                idle = False
            if got:
                return got[0]
            self._check(deadline, call_id, sent=True)
            wait = _BEAT_INTERVAL
            if deadline is not None:
                wait = min(wait, max(deadline - time.monotonic(), 0.0))
            idle = not bell.wait_sync(ready, strategy, wait, idle)

    def health(self, *, timeout: float | None = None) -> str:
        """The server's status (``cxlrpc.health``): "SERVING", or "NOT_SERVING" while it shuts down."""
        return self.call(fr.HEALTH, timeout=timeout, response_type=_Health).status

    def methods(self, *, timeout: float | None = None) -> list[str]:
        """The names of the server's methods, sorted (``cxlrpc.methods``; reserved ones left out)."""
        return self.call(fr.LIST_METHODS, timeout=timeout, response_type=list[str])

    def _check(self, deadline: float | None, call_id: int, sent: bool) -> None:
        if self._gone is not None:
            raise Unavailable(self._gone)
        if deadline is not None and time.monotonic() >= deadline:
            if sent:
                self._send_cancel(call_id)
            raise DeadlineExceeded("deadline exceeded")


def connect_sync(url: str, *, doorbell: WaitStrategy | str | None = None,
                 server_timeout: float = 1.0, poll_interval: float = 1e-3,
                 interceptors: Sequence[ClientInterceptor] = ()) -> SyncClient:
    """Connect a blocking client: ``with cxlrpc.connect_sync("shm://NAME") as client``
    (``interceptors``: plain functions, see :data:`ClientInterceptor`)."""
    return SyncClient(url, doorbell=doorbell, server_timeout=server_timeout,
                      poll_interval=poll_interval, interceptors=interceptors)
