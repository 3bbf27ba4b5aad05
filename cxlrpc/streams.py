"""Streams of a call, flow-controlled by credit: the handler's view of a request stream
(``RequestStream``) and the caller's side of a streaming call (``StreamCall``).

Either way the reader grants the writer ``CREDIT_EVERY`` more items each time it has taken as
many, and a writer never has more than ``STREAM_WINDOW`` items in flight: a slow reader slows
the writer and nothing is dropped. A writer that sends past its credit is a broken (or hostile)
peer; its call fails rather than growing the reader's queue.
"""
from __future__ import annotations

import asyncio
from collections import deque
import collections.abc
from typing import (Any, AsyncIterable, AsyncIterator, Awaitable, Callable, Coroutine, Generic, Iterable,
                    Mapping, MutableMapping, Protocol, TypeVar)

from . import frame as fr
from .errors import Cancelled, DeadlineExceeded, InvalidArgument, RpcError, error_for

#: Items a writer may have in flight before the reader's credit catches up.
STREAM_WINDOW = 32
#: A reader grants this many more items each time it has taken as many (half the window: a
#: writer never waits on a reader that keeps up).
CREDIT_EVERY = 16
_END = object()

T = TypeVar("T")


class StreamClient(Protocol):
    """What a ``StreamCall`` needs of its client (``cxlrpc.Client`` has it): its frames
    sent, its replies decoded, its registration dropped once it is over."""

    @property
    def _streams(self) -> MutableMapping[int, StreamCall[Any]]:
        """The streaming calls open, by call id."""
        ...

    def _open_stream(self, call: StreamCall[Any]) -> Coroutine[Any, Any, None]:
        """Send the call's request (through the client's interceptors)."""
        ...

    def _send_item(self, call: StreamCall[Any], item: Any) -> Awaitable[None]:
        """Send one request item."""
        ...

    def _send_end(self, call: StreamCall[Any]) -> Awaitable[None]:
        """Say no more request items follow."""
        ...

    def _send_credit(self, call: StreamCall[Any], count: int) -> None:
        """Grant the server ``count`` more items."""
        ...

    def _cancel_stream(self, call: StreamCall[Any]) -> None:
        """Tell the server to cancel the call."""
        ...

    def _decode_reply(self, f: fr.Frame, response_type: Any) -> Any:
        """A reply frame's value (or the RpcError it carries, raised)."""
        ...


class RequestStream:
    """The requests of a client-streaming or bidirectional call, as the handler's async
    iterator: each item decoded into the handler's annotated item type as it arrives; the
    loop ends when the caller is done writing."""

    __slots__ = ("method", "item_type", "_items", "_sizes", "_account", "_waiter", "_taken",
                 "_allowed", "_grant", "_closed")

    def __init__(self, method: str, item_type: Any, grant: Callable[[int], None],
                 account: Callable[[int], None] = lambda delta: None) -> None:
        self.method = method
        self.item_type = item_type
        self._items: deque[Any] = deque()  # decoded items, then _END or the error
        self._sizes: deque[int] = deque()  # each waiting item's bytes as it came
        self._account = account  # told each change of the bytes waiting (the server bounds them)
        self._waiter: asyncio.Future[None] | None = None
        self._taken = 0
        self._allowed = STREAM_WINDOW  # items the caller may still send
        self._grant = grant  # sends the caller a CREDIT frame
        self._closed = False  # END or an error is queued: later items are dropped

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Any:
        items = self._items
        while not items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = items[0]
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, RpcError):
            raise item
        items.popleft()
        self._account(-self._sizes.popleft())
        self._taken += 1
        if self._taken == CREDIT_EVERY:
            self._taken = 0
            self._allowed += CREDIT_EVERY
            self._grant(CREDIT_EVERY)
        return item

    def put(self, f: fr.Frame) -> bool:
        """An ITEM or END frame of this call from the caller (the server's reader); False if
        the item is past the caller's credit (the stream then fails: the call must end)."""
        if self._closed:
            return True
        if f.kind == fr.END:
            self._close(_END)
            return True
        if self._allowed <= 0:
            self._close(InvalidArgument(f"the caller of {self.method!r} sent request items "
                                        f"beyond its credit of {STREAM_WINDOW}"))
            return False
        self._allowed -= 1
        try:
            item = fr.decode_body(f.flags, f.body, self.item_type)
        except Exception as exc:  # DecodeError, ValidationError, RecursionError on deep nesting
            self._close(InvalidArgument(f"bad request item for {self.method!r}: {exc}"))
            return True
        self._items.append(item)
        self._sizes.append(len(f.body))
        self._account(len(f.body))
        self._wake()
        return True

    def release(self) -> None:
        """The call ended: the items it never took are no longer waiting."""
        if self._sizes:
            self._account(-sum(self._sizes))
            self._sizes.clear()

    def fail(self, exc: RpcError) -> None:
        """End the stream with ``exc`` (raised to the handler after the items before it)."""
        if not self._closed:
            self._close(exc)

    def _close(self, last: Any) -> None:
        self._closed = True
        self._items.append(last)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class StreamCall(Generic[T]):
    """A streaming call as the caller sees it, from ``Client.open_stream`` (client-streaming
    or bidirectional) or under ``Client.stream`` (server-streaming)::

        async with client.open_stream("sum", timeout=5) as call:
            for x in xs:
                await call.send(x)          # waits while the server's credit is spent
            total = await call.response()   # a client stream: the one reply
        async with client.open_stream("chat") as call:
            await call.send(msg)
            async for reply in call: ...    # a bidirectional one: the replies

    The call opens when first used. Leaving the ``async with`` block (or ``cancel``)
    before the reply came cancels the handler; ``timeout`` bounds the whole call. Its replies
    are decoded into ``response_type`` (``T``).
    """

    def __init__(self, client: StreamClient, method: str, arg: Any, requests: bool,
                 timeout: float | None, metadata: Mapping[str, str] | None,
                 response_type: Any) -> None:
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded("timeout must be positive")
        self.method = method
        self._client = client
        self._arg = arg
        self._requests = requests  # items follow the request (the STREAM flag)
        self._timeout = timeout
        self._metadata = metadata
        self._response_type = response_type
        self._opening: asyncio.Task[None] | None = None
        self._call_id = 0
        self._chan: Any = None  # the connection the call was opened on
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._replies: deque[fr.Frame] = deque()  # ITEM frames not taken yet
        self._final: fr.Frame | RpcError | None = None  # the END, RESPONSE or ERROR frame, or the RpcError that ended it
        self._seen_end = False  # the caller took the final frame: nothing to cancel
        self._credit = STREAM_WINDOW if requests else 0
        self._writing = requests
        self._taken = 0
        self._wake: asyncio.Future[None] | None = None  # a reader waiting for frames
        self._credit_wake: asyncio.Future[None] | None = None  # a writer waiting for credit
        self._closed = False

    # ------------------------------------------------------------------ the caller's API
    async def send(self, item: Any) -> None:
        """Send one request item (bytes raw, the rest MessagePack; big ones through the heap),
        waiting while the server's credit is spent. Raises the call's error if it failed, and
        ``asyncio.InvalidStateError`` after ``done_writing`` or once the call ended."""
        await self._open()
        if not self._writing:
            raise asyncio.InvalidStateError("send() after done_writing()")
        while self._credit <= 0:
            self._check_live()
            self._credit_wake = asyncio.get_running_loop().create_future()
            try:
                await self._credit_wake
            finally:
                self._credit_wake = None
        self._check_live()
        self._credit -= 1
        await self._client._send_item(self, item)

    async def done_writing(self) -> None:
        """Tell the server no more request items follow (its request loop then ends)."""
        await self._open()
        if not self._writing:
            return
        self._writing = False
        if self._final is None:
            await self._client._send_end(self)

    async def response(self) -> T:
        """The one reply of a client-streaming call (ending the requests first if still
        writing); raises the call's error."""
        if self._writing:
            await self.done_writing()
        else:
            await self._open()
        while self._final is None:
            if self._replies:
                raise asyncio.InvalidStateError(f"{self.method!r} streams its replies: iterate the call")
            await self._wait()
        if self._replies:
            raise asyncio.InvalidStateError(f"{self.method!r} streams its replies: iterate the call")
        f = self._take_final()
        if f.kind != fr.RESPONSE:
            raise asyncio.InvalidStateError(f"{self.method!r} streams its replies: iterate the call")
        result: T = self._client._decode_reply(f, self._response_type)
        return result

    def __aiter__(self) -> StreamCall[T]:
        return self

    async def __anext__(self) -> T:
        """The next reply item; the loop ends with the stream (raises the call's error)."""
        await self._open()
        replies = self._replies
        while not replies:
            if self._final is not None:
                f = self._take_final()
                if f.kind == fr.RESPONSE:
                    raise asyncio.InvalidStateError(f"{self.method!r} replies once: await call.response()")
                raise StopAsyncIteration
            await self._wait()
        f = replies.popleft()
        self._taken += 1
        if self._taken == CREDIT_EVERY:  # give the server room for as many as we took
            self._taken = 0
            self._client._send_credit(self, CREDIT_EVERY)
        item: T = self._client._decode_reply(f, self._response_type)
        return item

    def cancel(self) -> None:
        """Cancel the call: the handler is cancelled, waiting sends and reads raise Cancelled."""
        if self._call_id and not self._seen_end and self._final is None:
            self._client._cancel_stream(self)
        self._end(Cancelled("the call was cancelled by its caller"))
        self._seen_end = True
        self._finish()

    async def __aenter__(self) -> StreamCall[T]:
        await self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        """End the call: cancelled unless its final reply was already taken."""
        if not self._seen_end:
            self.cancel()

    # ------------------------------------------------------------------ the client's side
    def on_frame(self, f: fr.Frame) -> None:
        """A frame of this call from the server (the client's reader)."""
        if f.kind == fr.ITEM:
            self._replies.append(f)
            self._wake_reader()
        elif f.kind == fr.CREDIT:
            if len(f.body) == 8 and self._final is None:
                self._credit = min(self._credit + int.from_bytes(f.body, "little"), STREAM_WINDOW)
                waiter = self._credit_wake
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
        elif self._final is None:  # END, RESPONSE or ERROR
            self._end(f)

    def fail(self, exc: RpcError) -> None:
        """The connection was lost (or the deadline passed): the call ends with ``exc``."""
        self._end(exc)

    # ------------------------------------------------------------------ internals
    async def _open(self) -> None:
        if self._call_id:
            return
        if self._closed:
            raise asyncio.InvalidStateError("the call was closed")
        if self._opening is None:  # one opening, whichever of send / iterate comes first
            self._opening = asyncio.get_running_loop().create_task(self._client._open_stream(self))
        try:
            await asyncio.shield(self._opening)
        except asyncio.CancelledError:
            self.cancel()  # the caller left while it opened (``async with`` has no exit then)
            raise

    def _opened(self, call_id: int, chan: Any, deadline: float | None) -> None:
        loop = asyncio.get_running_loop()
        self._call_id, self._chan, self._deadline = call_id, chan, deadline
        if deadline is not None:
            self._timer = loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        if self._final is None:
            self._client._cancel_stream(self)
            self._end(DeadlineExceeded("deadline exceeded while streaming"))

    def _check_live(self) -> None:
        final = self._final
        if final is None:
            return
        if isinstance(final, RpcError):
            raise final
        if final.kind == fr.ERROR:
            raise error_for(final.status, bytes(final.body).decode(errors="replace"))
        raise asyncio.InvalidStateError(f"{self.method!r} already ended: its reply came")

    def _take_final(self) -> fr.Frame:
        """The final frame, taken: raises the call's error if it failed."""
        self._seen_end = True
        self._finish()
        final = self._final
        if isinstance(final, RpcError):
            raise final
        assert final is not None  # (taken once it came)
        if final.kind == fr.ERROR:
            raise error_for(final.status, bytes(final.body).decode(errors="replace"))
        return final

    async def _wait(self) -> None:
        self._wake = asyncio.get_running_loop().create_future()
        try:
            await self._wake
        finally:
            self._wake = None

    def _end(self, final: fr.Frame | RpcError) -> None:
        if self._final is None:
            self._final = final
        self._wake_reader()
        waiter = self._credit_wake
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_reader(self) -> None:
        waiter = self._wake
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _finish(self) -> None:
        """The call is over for its caller: its deadline timer and registration go (again, if
        it finished while still opening)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._call_id:
            self._client._streams.pop(self._call_id, None)


async def feed(call: StreamCall[Any], requests: AsyncIterable[Any] | Iterable[Any]) -> None:
    """Send every item of ``requests`` (async or not), then end the requests; stops early,
    quietly, if the call already ended with a reply."""
    try:
        if isinstance(requests, collections.abc.AsyncIterable):
            async for item in requests:
                await call.send(item)
        else:
            for item in requests:
                await call.send(item)
        await call.done_writing()
    except asyncio.InvalidStateError:
        if call._final is None:
            raise


async def bidi(call: StreamCall[T], requests: AsyncIterable[Any] | Iterable[Any]) -> AsyncIterator[T]:
    """Feed ``requests`` to a bidirectional call in a task of its own while yielding its
    replies; a failing request iterator cancels the call and its error is raised here."""
    def failed(writer: asyncio.Task[None]) -> BaseException | None:
        return None if writer.cancelled() else writer.exception()

    def written(writer: asyncio.Task[None]) -> None:
        if failed(writer) is not None:
            call.cancel()  # wakes the loop below, which raises the writer's error

    async with call:
        writer = asyncio.get_running_loop().create_task(feed(call, requests))
        writer.add_done_callback(written)
        try:
            async for reply in call:
                yield reply
            await writer
        except Cancelled:
            error = failed(writer) if writer.done() else None
            if error is not None:
                raise error from None
            raise
        finally:
            if not writer.done():
                writer.cancel()
                await asyncio.wait((writer,))
