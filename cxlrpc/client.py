"""Clients: the asyncio ``Client`` (primary) and the blocking ``SyncClient``.

Both claim a slot in the server's region, push request frames into the shared MPSC ring,
and read replies from their own SPSC ring.  A monitor thread beats the slot's heartbeat
and watches the server's, so a dead server surfaces as ``Unavailable`` within
``server_timeout`` instead of a hang; the next call then reconnects.

Each client is put together from rooms: its connection lifecycle
(``cxlrpc.client_connection``, shared by both clients), its out-of-line bodies
(``cxlrpc.client_bodies``), request encoding and reply decoding
(``cxlrpc.client_base``); the asyncio client's round trips and reader
(``cxlrpc.client_replies``) and streaming calls (``cxlrpc.client_streams``). A client
dropped without ``close()`` is collected: its finalizer frees the slot and warns
(``ResourceWarning``), as sockets do.
"""
from __future__ import annotations

import asyncio
import weakref
from typing import Any, AsyncIterator, Awaitable, Callable, Generator, Mapping, Sequence, TypeVar, overload

from . import frame as fr
from .client_base import ClientInterceptor, Encoded, Health, _Base, chained, checked, native_decode, own_metadata
from .client_bodies import Large
from .client_connection import run_async, time_left
from .client_replies import LateReply, Replies, read
from .client_streams import ClientStreams
from .client_sync import SyncClient, connect_sync
from .doorbell import WaitStrategy
from .errors import DeadlineExceeded, RpcError, Unavailable
from .ring import ClaimRevoked
from .service import S, stub
from .streams import StreamCall

T = TypeVar("T")

__all__ = ["Client", "ClientInterceptor", "SyncClient", "connect", "connect_sync"]


class Client(_Base):
    """asyncio client. Many calls may be in flight at once; use ``async with connect(...)``.

    ``wait_for_ready``: connecting waits for a server to appear (True: without limit; a
    number: that many seconds) instead of raising ``Unavailable`` at once.

    It reconnects as a gRPC channel does: once it judged its server gone (closed, dead, or
    the server reclaimed its slot), calls in flight fail with ``Unavailable`` and the next
    call attaches anew (a new mapping and slot, one attempt shared by concurrent callers,
    waiting as ``wait_for_ready`` says), then proceeds. A client dropped unclosed frees its
    slot when collected, with a ``ResourceWarning``.
    """

    def __init__(self, url: str, *, doorbell: WaitStrategy | str | None = None,
                 server_timeout: float = 1.0, poll_interval: float = 1e-3,
                 wait_for_ready: float | bool = False,
                 interceptors: Sequence[ClientInterceptor] = ()) -> None:
        super().__init__(url, doorbell, server_timeout, poll_interval, wait_for_ready)
        self._interceptors = checked(interceptors)
        self._replies = replies = Replies(self._conn, self._bodies, self._codec)
        streams = ClientStreams(self._conn, self._bodies, self._codec, replies)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Task[None] | None = None  # the attempt callers share
        self._waiting = 0  # callers waiting for it
        # Bound once to the rooms' own methods and containers: the call path, the native
        # caller (``_on_reply``) and StreamCall (cxlrpc.streams.StreamClient) use them with
        # no frame of delegation.
        self._roundtrip = replies.roundtrip
        self._on_reply = replies.on_reply
        self._woken, self._yielding, self._streams = replies.woken, replies.yielding, replies.streams
        self._send_item, self._send_end = streams.send_item, streams.send_end
        self._send_credit, self._cancel_stream = streams.send_credit, streams.cancel
        self._decode_reply = self._codec.decode_reply
        self._streams_room = streams

    def _in_flight(self) -> tuple[Any, ...]:
        """Calls awaited and extents to give back: while any is there, calls go through the
        reference."""
        return (self._replies.pending, self._bodies.frees)

    def _owed_turns(self) -> tuple[Any, ...]:
        """Replies handed over to tasks not yet run, and callers giving way to them: a call
        gives the loop a turn first (see ``call``)."""
        return (self._woken, self._yielding)

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> Client:
        """Connect (waiting for a server as ``wait_for_ready`` says): what ``connect()`` awaits."""
        if self._loop is None:
            self._loop = self._replies.loop = loop = asyncio.get_running_loop()
            self._conn.on_gone = _waker(loop)
        await self._connected(None)
        return self

    async def close(self) -> None:
        """Detach from the server; calls still waiting fail with ``Unavailable``."""
        conn = self._conn
        if conn.closed:
            return
        conn.closed = True
        task = self._connecting
        if task is not None:
            task.cancel()
            await asyncio.wait((task,))
        conn.gone = "client closed"
        await self._drop_link()

    async def _connected(self, timeout: float | None) -> float | None:
        """Slow path of a call while not connected: reconnect (one attempt shared by the
        callers, each bounded by its own ``timeout`` too) or raise why not. Returns the time
        left of ``timeout``."""
        loop, conn = self._loop, self._conn
        if loop is None:
            raise Unavailable("client is not open: await it (or use async with) first")
        deadline = None if timeout is None else loop.time() + timeout
        while conn.gone is not None:
            conn.check_open()
            task = self._connecting
            if task is None:
                task = self._connecting = loop.create_task(self._connect())
                task.add_done_callback(self._connect_done)
            self._waiting += 1
            try:
                await asyncio.wait((task,), timeout=None if deadline is None else deadline - loop.time())
            finally:
                self._waiting -= 1
                if not self._waiting and not task.done():
                    task.cancel()  # nobody waits for this attempt any more: end it
                    await asyncio.wait((task,))
            if not task.done() or (task.cancelled() and deadline is not None
                                   and loop.time() >= deadline):
                raise DeadlineExceeded("deadline exceeded while connecting")
            if task.cancelled():
                continue  # its last caller left it just before we came: try anew
            exc = task.exception()
            if exc is not None:  # a copy per caller: they raise it concurrently
                if isinstance(exc, RpcError):
                    raise type(exc)(exc.message, exc.code) from exc.__cause__
                raise exc
            if conn.gone is not None:  # lost again at once: one reconnection per call
                raise Unavailable(conn.gone)
        return time_left(deadline, loop.time())

    def _connect_done(self, task: asyncio.Task[None]) -> None:
        if self._connecting is task:
            self._connecting = None
        if not task.cancelled():
            task.exception()  # its callers raise it; none may be left to

    async def _connect(self) -> None:
        """One connection attempt: end what is left of the last connection, then attach
        (looking for a server until ``wait_for_ready`` runs out) and start the reader."""
        await self._drop_link()
        loop, conn = self._loop, self._conn
        assert loop is not None
        link = await run_async(conn.attempt(loop.time))
        self._install(link)
        link.loop = loop
        link.reader = loop.create_task(read(weakref.ref(self._replies), link.chan, conn.strategy))
        conn.up()

    async def _drop_link(self) -> None:
        """End the connection: its calls fail with ``Unavailable(gone)``, its reader stops,
        then the slot is released and the region unmapped (even if this is cancelled)."""
        conn = self._conn
        if conn.link is None:
            return
        self._replies.fail_all(Unavailable(conn.gone or "client is not connected"))
        link = self._forget_link()
        assert link is not None
        reader = link.reader
        if reader is not None and not reader.done():
            reader.cancel()
            reader.add_done_callback(lambda _: link.close())  # also if we are cancelled meanwhile
            await asyncio.wait((reader,))
        link.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ unary calls
    @overload
    async def call(self, method: str, arg: Any = None, *, timeout: float | None = None,
                   metadata: Mapping[str, str] | None = None, response_type: type[T],
                   on_late_reply: Callable[[Any], None] | None = None) -> T: ...
    @overload
    async def call(self, method: str, arg: Any = None, *, timeout: float | None = None,
                   metadata: Mapping[str, str] | None = None, response_type: Any = None,
                   on_late_reply: Callable[[Any], None] | None = None) -> Any: ...

    async def call(self, method: str, arg: Any = None, *, timeout: float | None = None,
                   metadata: Mapping[str, str] | None = None, response_type: Any = None,
                   on_late_reply: Callable[[Any], None] | None = None) -> Any:
        """Call ``method`` with ``arg`` and optional ``metadata`` (small str pairs the handler
        reads from its context); raises an ``RpcError`` subclass on failure.

        ``on_late_reply``: should the caller give up (cancelled, or its timeout passed), the
        client does not cancel the call (the server still ends it at its deadline), and this
        is called once, from the loop, with the reply when it comes (the result, or the
        RpcError it carries; Unavailable if the connection is lost first), or with the
        caller's CancelledError or DeadlineExceeded if the request never left: what the call
        did can then be undone. No task is made for it.
        """
        conn = self._conn
        caller, turned = conn.caller, False
        if (caller is not None and on_late_reply is None and not metadata and not self._interceptors
                and conn.gone is None and (timeout is None or timeout > 0)):
            # the common shape, natively: out and, while no other call is in flight, its reply
            # polled for in place (no future, no loop turn) for the first microseconds
            call_id = next(conn.ids)
            deadline = None if timeout is None else self._loop.time() + timeout  # type: ignore[union-attr]
            bodies = self._bodies
            spare = None if bodies.spare is None else bodies.spare_for(arg)
            try:  # (see _dispatch.c: what each outcome means)
                decode = response_type is None or native_decode(response_type)
                got = caller.call(method, arg, timeout or 0.0, call_id, conn.hot_s, decode,
                                  conn.hot_spin_s, False, spare)
                if got is NotImplemented and (self._woken or self._yielding):
                    # other tasks are owed a turn: give it, then call natively if nothing else
                    # is in flight (tasks sharing a client take turns at native cost)
                    # (its timeout counts from there, as the reference's does)
                    turned = True
                    await self._replies.give_way()
                    caller = conn.caller
                    if caller is not None and conn.gone is None:
                        deadline = None if timeout is None else self._loop.time() + timeout  # type: ignore[union-attr]
                        spare = bodies.spare_for(arg)  # (another task may have taken it meanwhile)
                        got = caller.call(method, arg, timeout or 0.0, call_id, conn.hot_s, decode,
                                          conn.hot_spin_s, True, spare)
            except ClaimRevoked as exc:
                raise conn.revoked(exc) from exc
            except BaseException:
                if spare is not None and bodies.spare is spare:
                    # the native call raised, and may have sent it (the server reading it): FREE it
                    # (not one another task took while this one gave way)
                    bodies.spare = None
                    bodies.give_back(spare[0])
                raise
            if spare is not None and got is not NotImplemented and type(got) is not tuple:
                if type(got) is bytes:  # answered in place: the spare settled now, no coroutine
                    bodies.spare = None
                    bodies.settle(conn.chan, spare[0], spare[1], self._codec.methods[method], True)
                    return got
                return await self._replies.followed_out(call_id, self._codec.methods[method], spare, got,
                                                        deadline, response_type)
            if type(got) is bytes:
                return got
            if type(got) is list:  # decoded by response_type's decoder
                return got[0]
            if type(got) is fr.Frame:
                return self._codec.answer(got, response_type)
            if got is None:  # out; its reply comes later
                return await self._roundtrip(call_id, None, deadline, response_type)
            if type(got) is tuple:  # not out (a body for the heap, a full ring): the reference
                arg = Encoded(*got)
            # (NotImplemented: other calls in flight, a method name not yet encoded, or a str
            # subclass)
        return await self._call_reference(method, arg, timeout, metadata, response_type, on_late_reply,
                                          turned)

    async def _call_reference(self, method: str, arg: Any, timeout: float | None,
                              metadata: Mapping[str, str] | None, response_type: Any,
                              on_late_reply: Callable[[Any], None] | None, turned: bool = False) -> Any:
        """A call the native caller left to the reference (see ``call``); ``turned``: it has
        given way already."""
        if not turned and (self._woken or self._yielding):
            await self._replies.give_way()  # (before anything is sent)
        late = None if on_late_reply is None else LateReply(on_late_reply, response_type)
        try:
            if self._interceptors:
                return await chained(self._interceptors, lambda method, arg, metadata: self._start(
                    method, arg, timeout, metadata, response_type, late))(method, arg, own_metadata(metadata))
            return await self._start(method, arg, timeout, metadata, response_type, late)
        except (asyncio.CancelledError, DeadlineExceeded) as exc:
            if late is not None and not late.waiting:
                assert self._loop is not None
                self._loop.call_soon(late.callback, exc)
            raise

    def _start(self, method: str, arg: Any, timeout: float | None,
               metadata: Mapping[str, str] | None, response_type: Any,
               late: LateReply | None = None) -> Awaitable[Any]:
        """Check and encode a call; the awaitable of its round trip (of reconnecting first,
        when the server was judged gone)."""
        if self._conn.gone is not None:
            return self._start_connected(method, arg, timeout, metadata, response_type, late)
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded("timeout must be positive")
        assert self._loop is not None
        call_id = next(self._conn.ids)
        parts = self._codec.request(call_id, method, arg, timeout or 0.0, metadata, follow=True)
        deadline = None if timeout is None else self._loop.time() + timeout
        if type(parts) is Large:
            return self._replies.call_large(call_id, parts, timeout or 0.0, deadline, response_type, late)
        return self._roundtrip(call_id, parts, deadline, response_type, late=late)

    async def _start_connected(self, method: str, arg: Any, timeout: float | None,
                               metadata: Mapping[str, str] | None, response_type: Any,
                               late: LateReply | None) -> Any:
        """Slow path of a call while not connected: reconnect (or raise why not), then call."""
        timeout = await self._connected(timeout)
        return await self._start(method, arg, timeout, metadata, response_type, late)

    async def health(self, *, timeout: float | None = None) -> str:
        """The server's status (``cxlrpc.health``): "SERVING", or "NOT_SERVING" while it shuts down."""
        return (await self.call(fr.HEALTH, timeout=timeout, response_type=Health)).status

    async def methods(self, *, timeout: float | None = None) -> list[str]:
        """The names of the server's methods, sorted (``cxlrpc.methods``; reserved ones left out)."""
        return await self.call(fr.LIST_METHODS, timeout=timeout, response_type=list[str])

    # ------------------------------------------------------------------ streaming calls
    @overload
    def stream(self, method: str, arg: Any = None, *, timeout: float | None = None,
               metadata: Mapping[str, str] | None = None, response_type: type[T]) -> AsyncIterator[T]: ...
    @overload
    def stream(self, method: str, arg: Any = None, *, timeout: float | None = None,
               metadata: Mapping[str, str] | None = None, response_type: Any = None) -> AsyncIterator[Any]: ...

    async def stream(self, method: str, arg: Any = None, *, timeout: float | None = None,
                     metadata: Mapping[str, str] | None = None,
                     response_type: Any = None) -> AsyncIterator[Any]:
        """Call a server-streaming ``method`` (an async generator handler): ``async for item in
        client.stream("m", arg)``. Flow-controlled: the server sends at most a window of items
        ahead of what this loop took. Leaving the loop early (break, an exception, a
        cancellation) cancels the handler; ``timeout`` bounds the whole stream."""
        opened: StreamCall[Any] = StreamCall(self, method, arg, False, timeout, metadata, response_type)
        async with opened as call:
            async for item in call:
                yield item

    @overload
    def open_stream(self, method: str, *, timeout: float | None = None,
                    metadata: Mapping[str, str] | None = None, response_type: type[T]) -> StreamCall[T]: ...
    @overload
    def open_stream(self, method: str, *, timeout: float | None = None,
                    metadata: Mapping[str, str] | None = None, response_type: Any = None) -> StreamCall[Any]: ...

    def open_stream(self, method: str, *, timeout: float | None = None,
                    metadata: Mapping[str, str] | None = None,
                    response_type: Any = None) -> StreamCall[Any]:
        """A call whose requests are a stream: a client-streaming ``method`` (``async def``
        taking an ``AsyncIterator[T]``) or a bidirectional one (an async generator taking
        one). Use it with ``async with``; see ``cxlrpc.streams.StreamCall``."""
        return StreamCall(self, method, None, True, timeout, metadata, response_type)

    def stub(self, service: Callable[..., S], *, timeout: float | None = None,
             prefix: str | None = None) -> S:
        """The typed ``service``'s methods as calls to the server (see ``cxlrpc.service``):
        ``await client.stub(Greeter).norm(p)`` is checked by mypy, unlike ``call("norm", p)``."""
        return stub(self, service, timeout, prefix)

    async def _open_stream(self, call: StreamCall[Any]) -> None:
        """Send a streaming call's request, through the interceptors (``next`` returns the
        call): what opening the call awaits."""
        if self._interceptors:
            await chained(self._interceptors, lambda method, arg, metadata: self._push_open(
                call, method, arg, metadata))(call.method, call._arg, own_metadata(call._metadata))
        else:
            await self._push_open(call, call.method, call._arg, call._metadata)

    async def _push_open(self, call: StreamCall[Any], method: str, arg: Any,
                         metadata: Mapping[str, str] | None) -> StreamCall[Any]:
        timeout = call._timeout
        if self._conn.gone is not None:
            timeout = await self._connected(timeout)
        return await self._streams_room.open(call, method, arg, metadata, timeout)


def _waker(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """What the connection calls once it judged the server gone (from the monitor thread):
    wake ``loop``, whose reader then sees it."""
    def wake() -> None:
        if not loop.is_closed():
            try:
                loop.call_soon_threadsafe(lambda: None)
            except RuntimeError:
                pass
    return wake


class _Connecting:
    """What ``connect`` returns: ``await`` it, or use it with ``async with``."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def __await__(self) -> Generator[Any, None, Client]:
        return self._client.open().__await__()

    async def __aenter__(self) -> Client:
        return await self._client.open()

    async def __aexit__(self, *exc: object) -> None:
        await self._client.close()


def connect(url: str, *, doorbell: WaitStrategy | str | None = None,
            server_timeout: float = 1.0, poll_interval: float = 1e-3,
            wait_for_ready: float | bool = False,
            interceptors: Sequence[ClientInterceptor] = ()) -> _Connecting:
    """Connect an asyncio client: ``async with cxlrpc.connect("shm://NAME") as client``.

    ``poll_interval`` bounds how long the idle client sleeps between looks at its reply ring
    when the server is on another host (which cannot wake it). ``wait_for_ready``: wait for
    a server to appear (True: without limit; a number: that many seconds), else
    ``Unavailable`` at once. ``interceptors`` (async, see ``ClientInterceptor``) wrap
    every call, the first outermost."""
    return _Connecting(Client(url, doorbell=doorbell, server_timeout=server_timeout,
                              poll_interval=poll_interval, wait_for_ready=wait_for_ready,
                              interceptors=interceptors))
