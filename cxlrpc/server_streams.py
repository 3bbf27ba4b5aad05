"""The server's stream engine: a streaming call's set-up, its request items (bounded by the
caller's credit and the connection's ``max_stream_bytes``), its replies sent as the caller's
credit allows, and their ends. The caller's side is ``cxlrpc.streams``."""
from __future__ import annotations

import asyncio
import collections.abc
import functools
from typing import Any, Awaitable

from . import frame as fr
from .bounds import Limits
from .errors import Internal, InvalidArgument, ResourceExhausted, RpcError, StatusCode
from .heap import OFFSET
from .server_bodies import Bodies
from .server_context import CallKey, HandlerContext, ServerInterceptor
from .server_methods import _Method
from .server_replies import Replies
from .server_tasks import (_FAILED, _NO_ARG, _STREAMED, _SUSPENDED, _UNDECODED, Calls, _cancel,
                           _handler_context, _intercepted, _ready)
from .streams import STREAM_WINDOW, RequestStream
from .transport import ServerTransport


class StreamEngine:
    """Streaming calls on the server: request streams fed, reply streams driven by credit."""

    def __init__(self, limits: Limits, interceptors: tuple[ServerInterceptor, ...], replies: Replies,
                 bodies: Bodies, tasks: dict[CallKey, asyncio.Task[Any]],
                 cancelled_with: dict[CallKey, RpcError]) -> None:
        self.limits = limits
        self._interceptors = interceptors
        self._replies, self._bodies = replies, bodies
        self._tasks, self._cancelled_with = tasks, cancelled_with
        self.calls: Calls  # (wired by the dispatch room, which sits above this one)
        self._chan: ServerTransport
        self.credits: dict[CallKey, list[Any]] = {}  # per stream: [credit left, event set on credit]
        self.inbound: dict[CallKey, RequestStream] = {}  # request streams being read, per call
        self.stream_bytes: dict[tuple[int, int], int] = {}  # their items' bytes waiting, per connection

    def attach(self, chan: ServerTransport) -> None:
        """Serve ``chan`` (start())."""
        self._chan = chan

    def dispatch(self, m: _Method, f: fr.Frame, call: HandlerContext) -> None:
        """A call to a streaming method: its request stream set up (or its request decoded),
        then the handler run in a task (a client stream's inline up to its first suspension)
        that sends the replies as the caller's credit allows."""
        error, calls = self._replies.error, self.calls
        if f.call_id == fr.NO_REPLY:
            error(f, StatusCode.INVALID_ARGUMENT, "a streaming call needs a caller to read it")
            return
        if bool(f.flags & fr.STREAM) != m.requests:
            error(f, StatusCode.INVALID_ARGUMENT,
                  f"method {f.method!r} takes a stream of requests: call it with open_stream()"
                  if m.requests else f"method {f.method!r} takes one request, not a stream: "
                  f"call it with {'stream()' if m.streaming else 'call()'}")
            return
        key = (f.slot, f.gen, f.call_id)
        if key in self._tasks:
            calls._drop()  # a second request under a call id in use: garbage
            return
        intercepted = bool(self._interceptors)
        arg: Any
        if m.requests:
            arg = self.inbound[key] = RequestStream(f.method, m.arg_type,
                                                    functools.partial(self._grant, key),
                                                    functools.partial(self._account, key[:2]))
        elif not m.takes_arg:
            arg = _NO_ARG
        elif intercepted:
            arg = _UNDECODED
        else:
            try:
                arg = fr.decode_body(f.flags, f.body, m.arg_type)
            except Exception as exc:  # DecodeError, ValidationError, RecursionError
                error(f, StatusCode.INVALID_ARGUMENT, f"bad request for {f.method!r}: {exc}")
                return
        ctx = _handler_context(call)
        if m.streaming:
            self.credits[key] = [STREAM_WINDOW, asyncio.Event()]
            replies = (_intercepted(self._interceptors, m, f, call, arg) if intercepted
                       else _ready(ctx.run(m.fn) if arg is _NO_ARG else ctx.run(m.fn, arg)))
            calls._track(f, f.slot, lambda key: ctx.run(asyncio.get_running_loop().create_task,
                                                        calls._finish(self._stream(replies, f, key), f, key)))
            return
        coro = _intercepted(self._interceptors, m, f, call, arg) if intercepted else m.fn(arg)
        result = calls._run_eagerly(coro, f, f.slot, call, ctx=ctx)
        if result is _SUSPENDED:
            return
        self.end_inbound(key)
        if result is not _FAILED:
            calls._reply(f, result)

    def request_item(self, f: fr.Frame) -> None:
        """A request item (or END) of a streaming call, for the handler's RequestStream; of a
        call that ended meanwhile, dropped (its heap extent freed)."""
        stream = self.inbound.get((f.slot, f.gen, f.call_id))
        if f.flags & fr.HEAP:
            if not self._bodies.item_body(f):
                self.calls._drop()
                if stream is not None:
                    stream.fail(InvalidArgument("a request item's body is not in a heap extent of its own"))
                return
        if stream is None:
            return
        if f.kind == fr.ITEM and self._held(f.slot, f.gen) + len(f.body) > self.limits.max_stream_bytes:
            limit = self.limits.max_stream_bytes
            self._end_stream(stream, f, ResourceExhausted(
                f"the request streams of this connection hold {limit} bytes their handlers have "
                f"not taken yet (max_stream_bytes={limit})"))
        elif not stream.put(f):  # past its credit: a broken caller
            self._end_stream(stream, f, InvalidArgument(
                f"the caller of {stream.method!r} sent request items beyond its credit of "
                f"{STREAM_WINDOW}"))

    def _held(self, slot: int, gen: int) -> int:
        """Bytes of request-stream items this connection sent that its handlers have not taken."""
        return self.stream_bytes.get((slot, gen), 0)

    def _account(self, peer: tuple[int, int], delta: int) -> None:
        held = self.stream_bytes.get(peer, 0) + delta
        if held:
            self.stream_bytes[peer] = held
        else:
            self.stream_bytes.pop(peer, None)

    def end_inbound(self, key: CallKey) -> None:
        """A streaming call ended: forget its request stream (and the bytes it still held)."""
        stream = self.inbound.pop(key, None)
        if stream is not None:
            stream.release()

    def _end_stream(self, stream: RequestStream, f: fr.Frame, exc: RpcError) -> None:
        """Fail a request stream and end its call with ``exc`` (the caller broke a bound)."""
        stream.fail(exc)  # (its handler may still take the items before the error)
        key = (f.slot, f.gen, f.call_id)
        task = self._tasks.get(key)
        if task is not None:
            self._cancelled_with[key] = exc
            _cancel(task)

    def _grant(self, key: CallKey, count: int) -> None:
        """The handler took ``count`` request items: the caller may send that many more."""
        slot, gen, call_id = key
        self._replies.send(slot, gen, fr.header(fr.CREDIT, fr.RAW, 0, slot, gen, call_id, 0.0, b""),
                           OFFSET.pack(count))

    async def _stream(self, replies: Awaitable[Any], f: fr.Frame, key: CallKey) -> Any:
        """Drive a stream handler: each item waits for credit and for room in the ring (a slow
        reader slows the writer; nothing is dropped). ``replies``: awaited, the handler's
        async iterator (an interceptor may have wrapped it)."""
        slot, gen, call_id = key
        credit = self.credits[key]
        chan, out = self._chan, self._replies
        agen = None
        try:
            agen = await replies
            if not isinstance(agen, collections.abc.AsyncIterator):
                raise Internal(f"the stream handler of {f.method!r} gave {type(agen).__name__}, "
                               f"not an async iterator")
            async for item in agen:
                while credit[0] <= 0:
                    credit[1].clear()
                    await credit[1].wait()
                credit[0] -= 1
                try:
                    flags, body = fr.encode_body(item)
                except RpcError as exc:
                    raise Internal(f"cannot encode a stream item: {exc.message}") from None
                head = fr.header(fr.ITEM, flags, 0, slot, gen, call_id, 0.0, b"")
                if len(head) + len(body) > chan.responses[slot].max_payload and (
                        self._bodies.heap is None or len(body) > out.body_limit):
                    raise ResourceExhausted(f"stream item of {len(body)} bytes exceeds "
                                            f"{out.limit_setting()}")
                pause = 0.0
                while not out.push(slot, gen, chan.responses[slot], head, body):
                    if chan.slot_generation(slot) != gen:
                        return _STREAMED  # the caller left: nobody to send to
                    await asyncio.sleep(pause)
                    pause = min(0.001, pause * 2 + 1e-5)
                chan.ring_client(slot, gen)
        finally:
            self.credits.pop(key, None)
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                await aclose()
        out.send(slot, gen, fr.header(fr.END, fr.RAW, 0, slot, gen, call_id, 0.0, b""), b"")
        return _STREAMED

    def credit(self, f: fr.Frame) -> None:
        """The caller of a stream took items: it may be sent that many more."""
        if len(f.body) != OFFSET.size:
            self.calls._drop()  # garbage
            return
        credit = self.credits.get((f.slot, f.gen, f.call_id))
        if credit is None:
            return  # the stream ended meanwhile
        credit[0] = min(credit[0] + OFFSET.unpack(f.body)[0], STREAM_WINDOW)
        credit[1].set()
