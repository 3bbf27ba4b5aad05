"""The server's dispatch: the method table, and a request's way from its record to its reply.

Plain-function handlers run inline (no task, no extra loop iteration). Coroutine handlers
start inline too and get a task only if they suspend, so that they can be cancelled by a
CANCEL frame, a deadline, or their client dying. Frames that are not requests go to the room
that owns them: streams (``cxlrpc.server_streams``), heap extents and followed bodies
(``cxlrpc.server_bodies``). The common request shape is dispatched in C
(``cxlrpc._dispatch.Dispatcher``), which calls back into this room by name for the rest.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import itertools
import logging
import os
import sys
from asyncio import current_task as _current_task
from asyncio.tasks import _enter_task, _leave_task
from types import CoroutineType
from typing import Any, Callable, Mapping, cast

from . import frame as fr
from .bounds import Limits
from .errors import DeadlineExceeded, RpcError, StatusCode
from .heap import OFFSET, ServerHeap
from .memory import ACQ_REL, FOLLOW_CHUNK, BytesLike
from .server_bodies import Bodies
from .server_context import CallKey, Handler, HandlerContext, Peer, ServerInterceptor, _current_call
from .server_methods import _Method
from .server_peers import Departures
from .server_replies import Replies
from .server_streams import StreamEngine
from .server_tasks import (_FAILED, _NO_ARG, _RETURNED, _STREAMED, _SUSPENDED, NativeDispatcher,
                           _cancel, _current_tasks, _EagerTask, _first_step, _handler_context,
                           _intercepted, _Resumed, _take_back)
from .transport import ServerTransport

_Dispatcher: type[Dispatcher] | None
try:  # the common request shape dispatched in C (CXLRPC_NO_NATIVE=1: the reference only)
    from ._dispatch import Dispatcher
    _Dispatcher = None if os.environ.get("CXLRPC_NO_NATIVE") else Dispatcher
except ImportError:
    _Dispatcher = None
logger = logging.getLogger("cxlrpc.server")


class Dispatch:
    """Serves requests: decoded, routed, their handlers run (inline, then in a task if they
    suspend), answered. The native dispatcher calls ``_on_request``, ``_fail``, ``_reply``,
    ``_send``, ``_broken``, ``_bad_request``, ``_eager_reply``, ``_suspended_at``,
    ``_lent_reply`` and ``_free_extent`` on it, and sets ``_polled_at``."""

    def __init__(self, limits: Limits, interceptors: tuple[ServerInterceptor, ...], replies: Replies,
                 bodies: Bodies, streams: StreamEngine, departures: Departures,
                 tasks: dict[CallKey, asyncio.Task[Any]], cancelled_with: dict[CallKey, RpcError],
                 note_drained: Callable[[], None], reserved: Mapping[str, Handler]) -> None:
        self.limits = limits
        self._interceptors = interceptors
        self._replies, self._bodies, self._streams, self._departures = replies, bodies, streams, departures
        bodies.calls = streams.calls = self  # (the rooms below call back up through Calls)
        self._tasks = tasks
        #: Calls the server cancelled (their deadline passed, their caller broke the stream
        #: protocol), with the error their caller gets.
        self._cancelled_with = cancelled_with
        self._note_drained = note_drained  # (the server's: while draining, a call ended)
        self._methods = {name: _Method(name, fn) for name, fn in reserved.items()}  # (not native)
        #: Methods whose request bodies are lent to the handler as views (None: no such method)
        self._lend: frozenset[str] | None = None
        #: method name's bytes -> (fn, mode, decode, name) for the native dispatcher
        self._fast_methods: dict[bytes, tuple[Handler, int, Callable[[Any], Any], str]] = {}
        self._backlog = replies.backlog
        self._inbound = streams.inbound
        self._heap_waiting = bodies.heap_waiting
        self._oneway_ids = itertools.count(1)
        self._peers: dict[int, Peer] = {}  # per slot, so a request costs no Peer allocation
        self._fast: NativeDispatcher | None = None  # the native dispatcher, once serving
        self._fast_requests: Any = None  # what it polls (the transport's requests, or a list of rings)
        self._polled_at = 0.0  # when the reader began its current batch of requests
        self._draining = False  # close() began: new calls are refused, health is NOT_SERVING
        self._closing = False  # the grace is over: calls left are being cancelled
        self.dropped_frames = 0
        # the other rooms' methods the native dispatcher (and the slow paths here) call by name
        self._send = replies.send
        self._error = replies.error
        self._fail = replies.fail
        self._free_extent = bodies.free_extent
        self._chan: ServerTransport
        self._event_loop: asyncio.AbstractEventLoop
        self._heap: ServerHeap | None = None
        self._follow_min = sys.maxsize

    # ------------------------------------------------------------------ the method table
    def register(self, name: str, fn: Handler, blocking: bool = False,
                 requests: bool | None = None) -> None:
        """Serve ``fn`` as ``name`` (Server.add_method checks the name first)."""
        if name in self._methods:
            raise ValueError(f"method {name!r} is already registered")
        m = self._methods[name] = _Method(name, fn, blocking, requests)
        mode = m.native_mode
        if mode is not None:  # the shapes the native dispatch takes
            self._fast_methods[fr.method_bytes(name)] = (fn, mode, m.decode, name)
        lend = frozenset(n for n, m in self._methods.items() if m.lends)
        self._lend = lend if lend and not self._interceptors else None

    def attach(self, chan: ServerTransport, heap: ServerHeap | None, heap_span: tuple[int, int],
               follow_min: int, body_limit: int, loop: asyncio.AbstractEventLoop) -> None:
        """Serve ``chan`` from ``loop``, natively where it can (start())."""
        self._chan, self._heap, self._follow_min, self._event_loop = chan, heap, follow_min, loop
        self._fast = self._dispatcher(heap_span, body_limit)

    def _dispatcher(self, heap_span: tuple[int, int], body_limit: int) -> NativeDispatcher | None:
        """The native dispatcher of this server's request ring, or None where it is not built
        or cannot serve (a transport without a native path)."""
        if _Dispatcher is None:
            return None
        chan = self._chan
        heap = self._heap
        # it follows replies without write-backs: without coherence they go to Replies.push
        follow_min = self._follow_min if heap is None or not heap.access.mem.flushing else sys.maxsize
        rings = chan.native_rings()
        if rings is None:
            return None
        fast: NativeDispatcher = _Dispatcher(
            self, rings.buf, list(rings.slot_state_at), chan.seen, self._peers, self._backlog,
            self._fast_methods, rings.responses, chan, HandlerContext, fr.NO_METADATA, _current_call,
            chan.ring_client, fr.encode_body, self._event_loop, _current_task, _enter_task, _leave_task,
            _EagerTask, asyncio.CancelledError, self._replies.reply_limit(), fr.Frame, _current_tasks(),
            rings.parked_at, rings.host, self._heap, self._heap_waiting, *heap_span,
            follow_min, body_limit, FOLLOW_CHUNK, fr.encode_msgpack, rings.gen_mask)
        fast.enabled = 0 if self._interceptors or self._draining else 1
        self._fast_requests = chan.requests if rings.requests is None else rings.requests
        return fast

    # ------------------------------------------------------------------ records in
    def _on_request(self, view: memoryview) -> None:
        """One request record; nothing a peer sends may stop the reader."""
        try:
            self._dispatch(view)
        except Exception as exc:
            self._broken(exc)

    def _broken(self, exc: Exception) -> None:
        """A request broke dispatch (the native dispatcher's too): logged, counted, dropped."""
        logger.error("dropped a request that broke dispatch", exc_info=exc)
        self._drop()

    def _drop(self) -> None:
        self.dropped_frames += 1
        self._chan.dropped.fetch_add(1, ACQ_REL)

    def _dispatch(self, view: memoryview) -> None:
        """Decode, check the sender still holds its slot, run the handler (inline when plain)."""
        try:
            f = fr.decode(view, self._lend)
        except fr.BadMetadata as exc:
            self._bad_metadata(exc.frame, str(exc))
            return
        except fr.FrameError:
            self._drop()
            return
        chan = self._chan
        slot = f.slot
        if chan.slot_generation(slot) != f.gen:
            self._drop()  # garbage, or a request from the slot's previous holder
            return
        seen = chan.seen[slot]
        if seen != f.gen:
            chan.seen[slot] = f.gen
            if seen is not None:  # a new holder already: its predecessor left unseen
                self._departures.departed(chan.departure(slot, seen))
        if f.flags & fr.FOLLOW:  # a unary request's body, or a response's
            if f.kind == fr.REQUEST and f.flags & fr.HEAP and not f.flags & fr.STREAM:
                self._bodies.follow_request(f)
            else:
                self._drop()
            return
        if f.kind != fr.REQUEST:
            if f.kind == fr.CANCEL:
                key = (slot, f.gen, f.call_id)
                task = self._tasks.get(key)
                if task is not None:
                    _cancel(task)
                else:
                    self._bodies.cancel(key)
            elif f.kind == fr.CREDIT:
                self._streams.credit(f)
            elif f.kind == fr.ITEM or f.kind == fr.END:
                self._streams.request_item(f)
            elif f.kind == fr.ALLOC:
                self._bodies.alloc(f)
            elif f.kind == fr.FREE:
                self._free(f)
            else:
                self._drop()
            return
        if not f.flags & fr.HEAP:
            self._dispatch_request(f)
            return
        extent = self._bodies.take_body(f)
        if extent is None:
            return
        carried: bool | None = False
        try:
            carried = self._dispatch_request(f, extent)
        finally:
            if extent >= 0 and not carried:  # a lent body (take_body made it a view): the
                self._bodies.give_back(extent, cast(memoryview, f.body))  # handler is done with it

    def _free(self, f: fr.Frame) -> None:
        """A client is done with a response body we put in the heap."""
        if len(f.body) != OFFSET.size:
            self._drop()
            return
        self._free_extent(OFFSET.unpack(f.body)[0], f.slot, f.gen)

    def _bad_metadata(self, f: fr.Frame, message: str) -> None:
        """A frame whose metadata block is garbage: counted as dropped, and if it is a request
        from its slot's holder, answered INVALID_ARGUMENT."""
        self._drop()
        if f.kind == fr.REQUEST and self._chan.slot_generation(f.slot) == f.gen:
            self._error(f, StatusCode.INVALID_ARGUMENT, f"bad request metadata: {message}")

    def _dispatch_request(self, f: fr.Frame, extent: int = -1) -> bool | None:
        """A request whose body is at hand: run its handler (inline when plain) and reply.
        ``extent``: the heap extent its body is a lent view of (-1: none); True when a task
        that goes on reading it took it over."""
        chan = self._chan
        slot = f.slot
        if self._draining and not f.method.startswith(fr.RESERVED_PREFIX):
            self._error(f, StatusCode.UNAVAILABLE, "server is shutting down")
            return None
        held = self._backlog.get(slot)
        if held is not None and f.call_id != fr.NO_REPLY and held.full(self.limits):
            self._error(f, StatusCode.RESOURCE_EXHAUSTED, held.why(self.limits))
            return None
        m = self._methods.get(f.method)
        peer = self._peers.get(slot)
        if peer is None or peer.gen != f.gen:
            peer = self._peers[slot] = Peer(slot, f.gen)
        call = HandlerContext(f.method, f.metadata, peer,
                              self._polled_at + f.timeout if f.timeout else None, chan)
        if m is not None and (m.streams or f.flags & fr.STREAM):
            self._streams.dispatch(m, f, call)
            return None
        if self._interceptors and not f.method.startswith(fr.RESERVED_PREFIX):
            self._dispatch_intercepted(m, f, call)
            return None
        if m is None:
            self._error(f, StatusCode.UNIMPLEMENTED, f"unknown method {f.method!r}")
            return None
        arg: Any
        if not m.takes_arg:
            arg = _NO_ARG
        elif f.flags & fr.RAW and m.raw_arg:
            arg = f.body
            if m.view_arg and type(arg) is bytes:  # not lent (the handler may outlive the record)
                arg = memoryview(arg)
        else:
            try:
                arg = fr.decode_body(f.flags, f.body, m.arg_type) if f.flags & fr.RAW else m.decode(f.body)
            except Exception as exc:  # DecodeError, ValidationError, RecursionError on deep nesting
                self._bad_request(f, exc)
                return None
        if m.is_async:
            if type(f.body) is memoryview and extent < 0:
                arg = memoryview(bytes(arg))  # lent by the ring, which reuses it once we return
            try:
                coro = m.fn() if arg is _NO_ARG else m.fn(arg)
            except Exception as exc:
                self._fail(f, exc)
                return None
            result = self._run_eagerly(coro, f, slot, call, extent)
            if result is _SUSPENDED:
                return extent >= 0
        elif m.blocking:
            ctx = _handler_context(call)
            run = functools.partial(ctx.run, m.fn) if arg is _NO_ARG else functools.partial(ctx.run, m.fn, arg)
            self._in_thread(asyncio.get_running_loop().run_in_executor(None, run), f, slot)
            return None
        else:
            token = _current_call.set(call)
            try:
                result = m.fn() if arg is _NO_ARG else m.fn(arg)
            except Exception as exc:
                self._fail(f, exc)
                if type(arg) is memoryview:
                    _take_back(arg)
                return None
            finally:
                _current_call.reset(token)
            if type(arg) is memoryview and m.view_arg:  # the body was lent: answer, then take it back
                self._lent_reply(f, arg, result, fr.IN_PLACE if extent >= 0 and f.flags & fr.FOLLOW else 0)
                return None
            if type(result) is CoroutineType:  # a plain function that returned a coroutine
                self._eager_reply(f, result, call)
                return None
        if result is not _FAILED:
            self._reply(f, result, held=True)  # the slot was checked above, nothing ran since
        return None

    # The native dispatcher calls these too (and _fail, _reply, _broken), with ``f`` made from
    # the fields it validated.
    def _bad_request(self, f: fr.Frame, exc: Exception) -> None:
        """A request body that does not decode into the handler's argument."""
        self._error(f, StatusCode.INVALID_ARGUMENT, f"bad request for {f.method!r}: {exc}")

    def _eager_reply(self, f: fr.Frame, coro: Any, call: HandlerContext) -> None:
        """A plain handler returned a coroutine: run it as an async handler's, and reply."""
        result = self._run_eagerly(coro, f, f.slot, call)
        if result is not _SUSPENDED and result is not _FAILED:
            self._reply(f, result, held=True)

    def _suspended_at(self, f: fr.Frame, coro: Any, step: Any, ctx: contextvars.Context,
                      eager: _EagerTask) -> None:
        """The native dispatcher's async handler suspended (see _suspended)."""
        self._suspended(coro, step, f, f.slot, ctx, eager)

    def _lent_reply(self, f: fr.Frame, body: memoryview, result: Any, hint: int = 0) -> None:
        """Reply to a call whose handler read its body in place, then end the handler's view.
        ``hint``: IN_PLACE, for a followed request (see frame.IN_PLACE)."""
        try:
            if inspect.iscoroutine(result):  # it could go on reading the body after we reuse it
                result.close()
                raise TypeError(f"handler for {f.method!r} takes a memoryview (lent only while "
                                f"a plain function runs) but returned a coroutine: make it an "
                                f"`async def` (it then gets a copy)")
            self._reply(f, result, held=True, hint=hint)  # a view of the body is copied out here
        except Exception as exc:
            self._fail(f, exc)
        finally:
            _take_back(body)

    def _dispatch_intercepted(self, m: _Method | None, f: fr.Frame, call: HandlerContext) -> None:
        """Run a call through the interceptors, inline up to its first suspension as a
        coroutine handler is, and reply with what the chain returns."""
        result = self._run_eagerly(_intercepted(self._interceptors, m, f, call), f, f.slot, call)
        if result is not _SUSPENDED and result is not _FAILED:
            self._reply(f, result)

    # ------------------------------------------------------------------ a handler's run
    def _run_eagerly(self, coro: Any, f: fr.Frame, slot: int, call: HandlerContext,
                     extent: int = -1, ctx: contextvars.Context | None = None) -> Any:
        """Run a handler's coroutine inline up to its first suspension, in its own context
        (``ctx``, else a copy of ours; ``context()`` is ``call`` there) and with a stand-in as
        the current task (what 3.12's eager tasks do): one that never suspends costs no task
        and no loop iteration. Its result, or _SUSPENDED (a task carries it on, and the heap
        extent ``f.body`` is a lent view of, if any), or _FAILED (the error was sent)."""
        eager = _EagerTask()
        if ctx is None:
            ctx = contextvars.copy_context()
        try:
            step = ctx.run(_first_step, coro, eager, self._event_loop, call)
        except (Exception, asyncio.CancelledError) as exc:
            self._fail(f, exc)
            return _FAILED
        if step is _RETURNED:
            return eager.value
        self._suspended(coro, step, f, slot, ctx, eager)
        if extent >= 0:
            self._heap.lend(extent)  # type: ignore[union-attr]  # (an extent: a heap)
            eager.task.add_done_callback(  # type: ignore[union-attr]  # (_suspended set it)
                functools.partial(self._bodies.give_back, extent, f.body))  # type: ignore[arg-type]
        return _SUSPENDED

    def _suspended(self, coro: Any, step: Any, f: fr.Frame, slot: int, ctx: contextvars.Context,
                   eager: _EagerTask) -> None:
        """A coroutine handler suspended: finish it in a task (in its own context, where
        ``current_peer()`` holds), cancellable by CANCEL frames, its deadline and departure."""
        eager.task = self._track(f, slot, lambda key: ctx.run(
            asyncio.get_running_loop().create_task, self._finish(_Resumed(coro, step), f, key)))

    def _in_thread(self, running: asyncio.Future[Any], f: fr.Frame, slot: int) -> None:
        """A blocking handler runs in the loop's executor; its call ends like a task's."""
        self._track(f, slot, lambda key: asyncio.get_running_loop().create_task(
            self._finish(running, f, key)))

    def _track(self, f: fr.Frame, slot: int,
               start: Callable[[CallKey], asyncio.Task[Any]]) -> asyncio.Task[Any]:
        """Register the task that finishes a call, with its deadline as a timer."""
        # one-way calls share call id 0: give each its own (negative) task key
        key = (slot, f.gen, f.call_id or -next(self._oneway_ids))
        task = start(key)
        self._tasks[key] = task
        if f.timeout > 0:
            timer = asyncio.get_running_loop().call_later(f.timeout, self._expire_call, key)
            task.add_done_callback(lambda _: timer.cancel())
        return task

    def _expire_call(self, key: CallKey) -> None:
        task = self._tasks.get(key)
        if task is not None:
            self._cancelled_with[key] = DeadlineExceeded("deadline exceeded in handler")
            _cancel(task)

    async def _finish(self, handler: Any, f: fr.Frame, key: CallKey) -> None:
        try:
            result = await handler
        except asyncio.CancelledError:
            why = self._cancelled_with.get(key)
            if why is not None:
                self._error(f, why.code, why.message)
            elif self._closing:
                raise
            else:
                self._error(f, StatusCode.CANCELLED, "cancelled")
        except Exception as exc:
            self._fail(f, exc)
        else:
            if result is not _STREAMED:
                self._reply(f, result)
        finally:
            self._tasks.pop(key, None)
            self._cancelled_with.pop(key, None)
            if self._inbound:
                self._streams.end_inbound(key)
            if self._draining:
                self._note_drained()

    # ------------------------------------------------------------------ the reply
    def _reply(self, f: fr.Frame, result: Any, held: bool = False, hint: int = 0) -> None:
        """Answer ``f`` with ``result``: straight into the ring when it fits and nothing waits
        ahead of it, else through the replies room's send. ``held``: the caller knows the slot
        is still the sender's (a plain handler just ran inline); ``hint``: flags for the caller."""
        if f.call_id == fr.NO_REPLY:
            return
        body: BytesLike
        if type(result) is bytes:
            flags, body = fr.RAW, result
        else:
            try:
                flags, body = fr.encode_body(result)
            except RpcError as exc:
                self._error(f, StatusCode.INTERNAL, f"cannot encode the result: {exc.message}")
                return
        chan, slot = self._chan, f.slot
        head = fr.HEADER.pack(fr.RESPONSE, flags | hint, 0, slot, f.gen, f.call_id, 0.0, 0)
        if slot not in self._backlog and (held or chan.slot_generation(slot) == f.gen):
            ring = chan.responses[slot]
            if (fr.HEADER_SIZE + len(body) <= ring.max_payload and len(body) < self._follow_min
                    and ring.try_push_parts((head, body))):
                chan.ring_client(slot, f.gen)
                return
        self._send(slot, f.gen, head, body)  # the heap, the backlog, or nobody left to answer
