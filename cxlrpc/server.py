"""The asyncio server: one reader task drains the request ring and dispatches to handlers.

Plain-function handlers run inline (no task, no extra loop iteration). Coroutine handlers
start inline too and get a task only if they suspend, so that they can be cancelled by a
CANCEL frame, a deadline, or their client dying; one that never awaits anything pending costs
what a plain handler costs. A handler learns about its call (deadline, peer, metadata) from
:func:`context`; interceptors wrap every call to the user's methods.
"""
from __future__ import annotations

import asyncio
import collections.abc
import contextvars
import functools
import inspect
import itertools
import logging
import os
import sys
import threading
import time
from asyncio import current_task as _current_task
from asyncio.tasks import _enter_task, _leave_task
from contextvars import ContextVar
from types import CoroutineType
from typing import Any, Awaitable, Callable, Mapping, NamedTuple, NoReturn, Sequence

import msgspec

from . import frame as fr
from .bounds import HELD, SHED, HeldReplies, Limits, PerConnection
from .channel import KIND_RPC, Departure, FlushServerChannel, ServerChannel, layout, server_channel
from .doorbell import WaitStrategy, resolve
from .fencing import Fences
from .errors import (ERRORS, DeadlineExceeded, Internal, InvalidArgument, ResourceExhausted, RpcError,
                     StatusCode, Unimplemented)
from .heap import (EXTENT, FOLLOW_HEADER, FOLLOW_IDLE_MAX_S, FOLLOW_MIN, FOLLOW_SPIN_S, FOLLOW_STALL_S,
                   FOLLOW_STEP_S, GRANT, OFFSET, SPARE_SHARE, HeapAccess, ServerHeap)
from .service import add_service, stream_item
from .streams import STREAM_WINDOW, RequestStream
from .memory import ACQ_REL, FOLLOW_CHUNK
from .memory import HARDWARE
from .process_heap import keep_freed_heap
from .region import Region, RegionError, coherence_for, parse_url
from .size_guard import TruncationWatch

Handler = Callable[..., Any]
try:  # the common request shape dispatched in C (CXLRPC_NO_NATIVE=1: the reference only)
    from ._dispatch import Dispatcher as _Dispatcher
except ImportError:
    _Dispatcher = None
if os.environ.get("CXLRPC_NO_NATIVE"):
    _Dispatcher = None
#: Mode bits of a method's entry in the native dispatcher's table (see _dispatch.c).
_TAKES_ARG, _IS_ASYNC, _RAW_ARG, _VIEW_ARG = 1, 2, 4, 8

_NO_ARG = object()
_UNDECODED = object()  # an intercepted call's request is decoded inside the chain
_SUSPENDED, _FAILED = object(), object()  # what _run_eagerly returns instead of a result
_RETURNED = object()  # what _first_step returns when the handler returned
_STREAMED = object()  # what a stream's task returns: its items and END are already sent
#: How long a server with no call in a task watches its empty request ring before it gives the
#: loop a turn between looks (within the strategy's spin phase); other callbacks wait at most
#: this long.
_HOT_SPIN_S = 10e-6
#: How long a server that has nothing but its request ring to serve goes on serving batches
#: without giving the loop a turn (other callbacks wait at most about this long under load).
#: At 50 us a big call (a 1 MiB echo, ~110 us) was followed by a turn every time, on the path
#: of its client's next request (1 MiB async echo p50, 1 ms against 50 us in one pair, five
#: runs: 1-7 us less, p99 lower in each).
_TURN_EVERY_S = 1e-3
#: The most requests one batch takes. Each batch takes as many as the one before handled in
#: _TURN_EVERY_S, and natively ends at the first request handled after the turn falls due:
#: slow handlers (20 us each) in batches of 256 kept the loop from its turn for 6 ms of CPU
#: between turns, and 100 ms on a slower machine, under a flood of one-way calls.
_BATCH_MAX = 256
#: A followed request whose writer paused is looked at (without a spin) this many loop turns in
#: a row before its looks back off to timers (a writer that only started late loses no time).
_FOLLOW_HOT_LOOKS = 3
logger = logging.getLogger("cxlrpc.server")


def _batch_fitting(handled: int, took: float) -> int:
    """The next batch's size: the requests that fit in _TURN_EVERY_S at ``handled`` per
    ``took`` seconds, 1 to _BATCH_MAX (the native dispatcher's ``fitting``)."""
    if took <= 0.0:
        return _BATCH_MAX
    return max(1, min(_BATCH_MAX, int(_TURN_EVERY_S * handled / took)))


class Peer(NamedTuple):
    """Identifies one client connection: its slot and the slot's generation at attach."""

    slot: int
    gen: int


class PeerInfo(NamedTuple):
    """What a client published about itself in its slot: PID and host identity are None when
    it wrote none (or left); its PID names a process here only when ``same_host``."""

    slot: int
    gen: int
    pid: int | None
    host: int | None
    same_host: bool


class HandlerContext(msgspec.Struct, frozen=True, gc=False):
    """The call a handler (or interceptor) serves, as grpc.aio's ServicerContext: its method,
    read-only metadata, peer and deadline (on the ``time.monotonic()`` clock, or None)."""

    # gc=False: none of its fields can lead back to it (str, a read-only mapping of str,
    # ints, the channel), so it is never part of a cycle; untracked, it costs no GC passes.

    method: str
    metadata: Mapping[str, str]
    peer: Peer
    deadline: float | None
    _chan: Any

    def time_remaining(self) -> float | None:
        """Seconds left before the caller's deadline (0 once it passed), or None without one."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def peer_info(self) -> PeerInfo:
        """The peer's slot and generation with the PID and host identity it published."""
        slot, gen = self.peer
        chan = self._chan
        info = None if chan.region.closed else chan.peer_info(slot)
        if info is None or info[0] != gen:  # the client left meanwhile (or the server closed)
            return PeerInfo(slot, gen, None, None, False)
        pid, host = info[1] or None, info[2] or None
        return PeerInfo(slot, gen, pid, host, host == chan.identity)

    def abort(self, code: StatusCode | int, details: str = "") -> NoReturn:
        """End the call with status ``code`` (not OK) and ``details``: raises the RpcError the
        caller gets, so code after it does not run."""
        status = StatusCode(code)
        if status is StatusCode.OK:
            raise ValueError("abort() takes an error status, not OK")
        raise ERRORS[status](details)

    def __repr__(self) -> str:
        return (f"HandlerContext(method={self.method!r}, metadata={dict(self.metadata)!r}, "
                f"peer={self.peer!r}, deadline={self.deadline!r})")


#: A server interceptor: ``await interceptor(call, next)`` runs the rest of the chain and the
#: handler when it awaits ``next()``; it may raise instead, or return another result.
ServerInterceptor = Callable[[HandlerContext, Callable[[], Awaitable[Any]]], Awaitable[Any]]

_current_call: ContextVar[HandlerContext] = ContextVar("cxlrpc_call")


def context() -> HandlerContext:
    """The call the running handler serves (LookupError outside a handler)."""
    return _current_call.get()


def current_peer() -> Peer:
    """The client whose request the running handler serves (LookupError outside a handler)."""
    return _current_call.get().peer


class _Method:
    """A registered handler with its calling convention and request decoding decided once,
    at registration (a handler that cannot be served is refused there, not on every call)."""

    __slots__ = ("fn", "is_async", "streaming", "requests", "streams", "blocking", "arg_type",
                 "raw_arg", "takes_arg", "view_arg", "decode")

    def __init__(self, name: str, fn: Handler, blocking: bool = False,
                 requests: bool | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"handler for {name!r} is not callable: {fn!r}")
        self.fn = fn
        target = inspect.unwrap(fn)
        while isinstance(target, functools.partial):
            target = inspect.unwrap(target.func)
        # a plain wrapper of a coroutine function (functools.wraps, partial) is served as one
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(target)
        #: An async generator: a server stream, each value it yields one item to the caller.
        self.streaming = inspect.isasyncgenfunction(fn) or inspect.isasyncgenfunction(target)
        if blocking and (self.is_async or self.streaming):
            raise ValueError(f"handler for {name!r} is a coroutine function: blocking=True is "
                             f"for plain functions that block (they run in a thread)")
        self.blocking = blocking
        params = list(inspect.signature(fn).parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        required = [p.name for p in positional if p.default is p.empty]
        required += [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
        if len(required) > 1:
            raise TypeError(f"handler for {name!r} must take at most one argument (the request); "
                            f"it requires {', '.join(required)}")
        keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
        if keyword_only:
            raise TypeError(f"handler for {name!r} must take the request as a positional "
                            f"parameter, not keyword-only {keyword_only[0]!r}")
        first = positional[0] if positional else None
        self.takes_arg = first is not None or any(p.kind is p.VAR_POSITIONAL for p in params)
        self.arg_type: Any = None
        if first is not None:
            ann = first.annotation
            if ann is not inspect.Parameter.empty and not isinstance(ann, str):
                self.arg_type = ann
            elif isinstance(ann, str):
                hints = inspect.get_annotations(fn, eval_str=True)
                self.arg_type = hints.get(first.name)
        #: The request is a stream (its parameter is an ``AsyncIterator[T]``; a typed
        #: service's contract may say so instead): the handler gets a RequestStream of T.
        stream_of, item_type = stream_item(self.arg_type)
        self.requests = stream_of if requests is None else requests
        if self.requests:
            if not self.takes_arg or not (self.is_async or self.streaming):
                raise TypeError(f"handler for {name!r} reads a stream of requests: it must be an "
                                f"`async def` (or an async generator) taking it as its argument")
            self.arg_type = item_type if stream_of else None
        self.streams = self.streaming or self.requests
        #: The request is a read-only ``memoryview`` of the body (``arg: memoryview``), where
        #: it lies when the handler's shape allows (see :attr:`lends`).
        self.view_arg = self.arg_type is memoryview
        #: A raw (bytes-like) body is the argument itself: no decoding to do.
        self.raw_arg = (self.arg_type is None or self.arg_type is bytes or self.arg_type is Any
                        or self.view_arg)
        #: Decodes a MessagePack body into the argument (validated as its annotation says).
        self.decode = fr.decoder(self.arg_type)

    @property
    def lends(self) -> bool:
        """Whether the body may be lent to the handler, in place: it takes a memoryview and
        runs in the loop (a plain function reads the ring record before it is reused; a
        coroutine, which may outlive the record, gets a copy of it but keeps a heap extent)."""
        return self.view_arg and not (self.blocking or self.streams)


class Server:
    """An RPC server on a shared region (``shm://NAME``, ``file:///PATH``, or a range of a file
    or device: ``file:///PATH?offset=&size=``).

    Ring capacities are powers of two and a frame may fill half a ring (2 MiB with the 4 MiB
    default). Bigger rings cost cache locality: a 1 MiB echo measured 156 us of CPU with 4 MiB
    rings against 276 us with 8 MiB ones here, so raise them only for bigger payloads.
    ``poll_interval`` bounds how long the idle server sleeps between looks at its request
    ring while a client on another host (which cannot wake it) is attached.

    ``coherence="flush"`` is for memory shared by hosts without cache coherence (most CXL
    pools today; ``sim://`` regions always): every client gets its own request ring of
    ``request_capacity`` (default 1 MiB, else one shared 4 MiB ring), nobody rings anybody's
    doorbell (both sides poll, backing off to ``poll_interval``), and every line published is
    written back, every line read from a peer invalidated first.

    ``shutdown_grace`` is the grace ``async with`` gives calls in flight when it closes the
    server (see :meth:`close`; None: cancel them at once).

    ``interceptors`` wrap every call to the user's methods, the first outermost (see
    :data:`ServerInterceptor`); the reserved ``cxlrpc.*`` methods bypass them.

    ``fence_timeout``: a client reaped for a stale heartbeat (``client_timeout``) may only be
    frozen; what it held (its heap extents) is handed to others only once it is *fenced*
    (:meth:`on_fenced`): when its process exits (same host), or ``fence_timeout`` seconds
    after it was reaped when it runs on another host (or its PID cannot be watched).

    What one client may make the server hold is bounded per connection, each overflow answered
    RESOURCE_EXHAUSTED to that client alone (see :class:`cxlrpc.bounds.Limits`): replies held
    for a client that reads slower than it calls (``max_backlog_bytes``, ``max_backlog_replies``),
    ALLOCs waiting for heap room (``max_alloc_waiters``; one without a deadline waits
    ``alloc_timeout`` s at most) and followed requests being written (``max_followed_requests``).
    """

    def __init__(self, url: str, *, slots: int = 16, request_capacity: int | None = None,
                 response_capacity: int = 4 << 20, doorbell: WaitStrategy | str | None = None,
                 client_timeout: float = 1.0, heartbeat_interval: float = 0.1,
                 poll_interval: float = 1e-3, size: int | None = None, mode: int = 0o600,
                 error_details: bool = True, coherence: str = HARDWARE,
                 max_message_size: int = 64 << 20, heap_size: int | None = None,
                 shutdown_grace: float | None = 1.0,
                 interceptors: Sequence[ServerInterceptor] = (), fence_timeout: float = 10.0,
                 max_backlog_bytes: int | None = None,
                 max_backlog_replies: int = Limits.max_backlog_replies,
                 max_alloc_waiters: int = Limits.max_alloc_waiters,
                 alloc_timeout: float = Limits.alloc_timeout,
                 max_followed_requests: int = Limits.max_followed_requests,
                 max_stream_bytes: int | None = None) -> None:
        parse_url(url)  # fail fast on a malformed URL
        self._fences = Fences(fence_timeout)  # (validates it)
        self._on_fenced: list[Callable[[Peer], None]] = []
        if max_backlog_bytes is None:  # two bodies of max_message_size at least (the first always fits)
            max_backlog_bytes = max(Limits.max_backlog_bytes, max_message_size)
        #: What one connection may make the server hold (validated: ValueError)
        if max_stream_bytes is None:  # two items of max_message_size at least
            max_stream_bytes = max(Limits.max_stream_bytes, 2 * max_message_size)
        self.limits = Limits(max_backlog_bytes, max_backlog_replies, max_alloc_waiters, alloc_timeout,
                             max_followed_requests, max_stream_bytes)
        if not poll_interval > 0:
            raise ValueError("poll_interval must be > 0 seconds")
        for interceptor in interceptors:
            if not callable(interceptor):
                raise TypeError(f"interceptor is not callable: {interceptor!r}")
        self._interceptors = tuple(interceptors)
        self.url = url
        #: "hardware" (one host, or coherent CXL) or "flush" (hosts without cache coherence:
        #: a single-writer layout, every published line written back); sim:// is "flush".
        self.coherence = coherence_for(url, coherence)
        if request_capacity is None:  # one shared ring, or (flush) one per client
            request_capacity = 4 << 20 if self.coherence == HARDWARE else 1 << 20
        #: Largest request or response body; bodies too big for a ring go through the heap
        #: (``heap_size`` bytes, by default ``max_message_size``: one such body at a time,
        #: plus, with coherence, an eighth more for clients' spare extents: cxlrpc.heap).
        self.max_message_size = max_message_size
        if heap_size is None:
            heap_size = max_message_size + (max_message_size // SPARE_SHARE if self.coherence == HARDWARE else 0)
        #: the largest body through the heap: max_message_size, or a smaller heap's size
        self._body_limit = max_message_size
        self.geometry = layout(slots, request_capacity, response_capacity, self.coherence,
                               heap_size, max_message_size)
        self.size = max(size or 0, self.geometry.size)
        self.strategy = resolve(doorbell)
        self.client_timeout = client_timeout
        self.heartbeat_interval = heartbeat_interval
        self.poll_interval = poll_interval
        self.mode = mode
        #: Whether clients see a failing handler's exception text (False: a generic message;
        #: the server logs the traceback either way).
        self.error_details = error_details
        #: Seconds ``async with`` lets calls in flight finish when it closes the server.
        self.shutdown_grace = shutdown_grace
        self._methods: dict[str, _Method] = {
            fr.HEALTH: _Method(fr.HEALTH, self._health),
            fr.LIST_METHODS: _Method(fr.LIST_METHODS, self._list_methods),
        }
        #: Methods whose request bodies are lent to the handler as views (None: no such method)
        self._lend: frozenset[str] | None = None
        self._on_disconnect: list[Callable[[Peer], None]] = []
        self._region: Region | None = None
        self._chan: ServerChannel | FlushServerChannel | None = None
        self._reader: asyncio.Task | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None  # the loop that serves
        self._tasks: dict[tuple[int, int, int], asyncio.Task] = {}
        #: Calls the server cancelled (their deadline passed, their caller broke the stream
        #: protocol), with the error their caller gets.
        self._cancelled_with: dict[tuple[int, int, int], RpcError] = {}
        #: replies held back per slot while its response ring is full (bounded: self.limits)
        self._backlog: dict[int, HeldReplies] = {}
        #: replies dropped past a connection's backlog limits (their calls end at their deadline)
        self.shed_replies = 0
        self._heap: ServerHeap | None = None
        #: replies of this many bytes and more are followed (cxlrpc.heap); never without a heap
        #: or on memory without coherence, where each chunk would need a write-back
        self._follow_min = sys.maxsize
        self._credits: dict[tuple, list] = {}  # per stream: [credit left, event set on credit]
        self._inbound: dict[tuple, RequestStream] = {}  # request streams being read, per call
        self._stream_bytes: dict[tuple[int, int], int] = {}  # their items' bytes waiting, per connection
        #: ALLOCs the full heap could not serve yet (changed in place: the native dispatcher holds it)
        self._heap_waiting: list[tuple] = []
        #: followed requests whose bodies their clients are still writing, per call
        self._following: dict[tuple[int, int, int], _Following] = {}
        self._followed_by = PerConnection()  # how many of them each connection has
        self._hot_follows = 0  # how many of them are followed every loop turn (their writers write)
        self._oneway_ids = itertools.count(1)
        self._peers: dict[int, Peer] = {}  # per slot, so a request costs no Peer allocation
        #: method name's bytes -> (fn, mode, decode, name) for the native dispatcher
        self._fast_methods: dict[bytes, tuple] = {}
        self._fast: Any = None  # the native dispatcher, once serving (None: the reference only)
        self._polled_at = 0.0  # when the reader began its current batch of requests
        self._draining = False  # close() began: new calls are refused, health is NOT_SERVING
        self._grace_over = asyncio.Event()
        self._grace_timer: asyncio.TimerHandle | None = None
        self._closing = False  # the grace is over: calls left are being cancelled
        self._closed = asyncio.Event()
        self._beat_stop = threading.Event()
        self._beater: threading.Thread | None = None
        #: looks at the region files' sizes (set by start(); see cxlrpc.size_guard)
        self._cuts = TruncationWatch()
        self._failure: RegionError | None = None  # why the server stopped by itself
        self._cut_close: asyncio.Future | None = None  # the close that failure began
        self.dropped_frames = 0

    # ------------------------------------------------------------------ registration
    def method(self, name: str, *, blocking: bool = False) -> Callable[[Handler], Handler]:
        """Decorator: serve ``fn`` as ``name`` (plain or async; one argument, the request).

        Plain functions run inline in the server's loop: fast, for cheap work. One that blocks
        (I/O, sleeps, heavy compute) stalls every client meanwhile: register it with
        ``blocking=True`` to run it in a thread (a deadline then ends the call, not the thread).
        Streams: an async generator streams its replies (``client.stream``); a parameter
        annotated ``AsyncIterator[T]`` receives a stream of requests (``client.open_stream``).
        A parameter annotated ``memoryview`` is a read-only view of the request body in place
        (the ring record for a plain function, the heap extent for it and ``async def``), lent
        until the handler is done; otherwise it is a view of a copy.
        """
        def register(fn: Handler) -> Handler:
            self.add_method(name, fn, blocking=blocking)
            return fn
        return register

    def add_method(self, name: str, fn: Handler, *, blocking: bool = False,
                   requests: bool | None = None) -> None:
        """Serve ``fn`` as ``name`` (see :meth:`method`); names under ``cxlrpc.`` are reserved.
        ``requests``: whether ``fn`` reads a stream of requests (None: it does when its
        parameter is annotated ``AsyncIterator[T]``)."""
        fr.method_bytes(name)
        if name.startswith(fr.RESERVED_PREFIX):
            raise ValueError(f"method {name!r}: names starting with {fr.RESERVED_PREFIX!r} are "
                             f"reserved for the methods every server answers")
        if name in self._methods:
            raise ValueError(f"method {name!r} is already registered")
        m = self._methods[name] = _Method(name, fn, blocking, requests)
        if not (m.blocking or m.streams):  # the shapes the native dispatch takes
            mode = ((_TAKES_ARG * m.takes_arg) | (_IS_ASYNC * m.is_async) | (_RAW_ARG * m.raw_arg)
                    | (_VIEW_ARG * m.view_arg))
            self._fast_methods[fr.method_bytes(name)] = (fn, mode, m.decode, name)
        lend = frozenset(n for n, m in self._methods.items() if m.lends)
        self._lend = lend if lend and not self._interceptors else None

    def add_service(self, service: type, impl: object, prefix: str | None = None) -> None:
        """Serve ``impl``'s methods under the names the typed ``service`` declares
        (``"Service.method"`` unless ``prefix`` says otherwise; see :mod:`cxlrpc.service`)."""
        add_service(self, service, impl, prefix)

    def on_disconnect(self, callback: Callable[[Peer], None]) -> None:
        """Call ``callback(peer)`` when a client detaches or is reaped (to drop what it held)."""
        self._on_disconnect.append(callback)

    def on_fenced(self, callback: Callable[[Peer], None]) -> None:
        """Call ``callback(peer)`` once per departed client, after its on_disconnect callbacks,
        once it can no longer write into the region (to free what it could still write into):
        at once when it detached or its process is gone (same host); for a client reaped on a
        stale heartbeat whose process still runs here (frozen), when that process exits; for
        one on another host, ``fence_timeout`` seconds after it was reaped. Fences still
        pending when the server closes are dropped, without calls (the region goes too)."""
        self._on_fenced.append(callback)

    # ------------------------------------------------------------------ lifetime
    async def start(self) -> None:
        """Create the region (replacing a stale one left by a dead server) and start serving."""
        if self._region is not None:
            raise RuntimeError("server already started")
        keep_freed_heap()  # big requests land in fresh bytes objects: no page faults for them
        try:
            self._region = Region.acquire(self.url, self.size, KIND_RPC, self.mode,
                                          self.client_timeout + 1.0, self.coherence)
        except RegionError as exc:
            if "never resized" not in str(exc):
                raise
            g = self.geometry
            raise RegionError(f"{exc}: {g.slots} slots x response_capacity={g.response_capacity} "
                              f"+ request_capacity={g.request_capacity} + heap_size={g.heap_size} "
                              f"(max_message_size={g.max_message_size}); lower slots=, the "
                              f"capacities or heap_size= to fit") from exc
        loop = asyncio.get_running_loop()
        self._cuts.on_cut = lambda message: loop.call_soon_threadsafe(self._region_cut, message)
        self._cuts.add(self._region.size_guard)
        # beat from the start: a racing server sees this region being created, not abandoned
        self._beater = threading.Thread(target=self._beat, name="cxlrpc-server-heartbeat", daemon=True)
        self._beater.start()
        try:
            self._chan = server_channel(self._region, self.geometry, self.poll_interval)
            geo = self.geometry
            if geo.heap_size:
                following = not self._region.mem.flushing
                # spares take what the heap has beyond one body of max_message_size
                self._heap = ServerHeap(HeapAccess(self._region.buf, self._region.mem, geo.heap,
                                                   geo.heap_size),
                                        max(0, geo.heap_size - self.max_message_size) if following else 0)
                self._body_limit = min(self.max_message_size, geo.heap_size)
                if following:
                    self._follow_min = FOLLOW_MIN
        except BaseException:
            self._stop_beating()
            self._region.mark_closed()
            self._region.unlink()
            self._region.close()
            self._region = None
            raise
        self._region.publish()
        self._event_loop = asyncio.get_running_loop()
        self._fast = self._dispatcher()
        self._reader = self._event_loop.create_task(self._serve())

    async def close(self, grace: float | None = None) -> None:
        """Stop serving, first letting calls in flight finish for up to ``grace`` seconds
        (gRPC's ``stop(grace)``; None or 0: cancel them at once); the shm region is unlinked.

        From the start new calls get UNAVAILABLE and ``cxlrpc.health`` says NOT_SERVING, while
        replies still go out; calls left when the grace ends are cancelled (their callers get
        UNAVAILABLE). A later close() may shorten the grace, never lengthen it; every close()
        returns once the server is closed, and a cancelled one still closes it."""
        if grace is not None and grace < 0:
            raise ValueError("grace must be >= 0 seconds, or None")
        if self._region is None or self._closed.is_set():
            return
        self._end_grace_within(grace)
        if self._draining:
            await self._closed.wait()
            return
        self._draining = True
        if self._fast is not None:
            self._fast.enabled = 0  # new calls are refused: the reference says so
        try:
            self._note_drained()
            await self._grace_over.wait()
        finally:
            await self._stop()

    def _end_grace_within(self, grace: float | None) -> None:
        """Make the grace end ``grace`` seconds from now (None or 0: now) unless it ends sooner."""
        if self._grace_over.is_set():
            return
        if not grace:
            self._grace_over.set()
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        timer = self._grace_timer
        if timer is None or end < timer.when():
            if timer is not None:
                timer.cancel()
            self._grace_timer = loop.call_at(end, self._grace_over.set)

    def _note_drained(self) -> None:
        """While draining: end the grace early once no call runs and no reply waits for room."""
        if not self._tasks and not self._backlog and not self._following:
            self._grace_over.set()

    async def _stop(self) -> None:
        """Close at once: state CLOSED (clients see UNAVAILABLE), the reader and every call
        left cancelled, then the region released (even if this is cancelled meanwhile)."""
        self._closing = True
        self._grace_over.set()  # also when close() was cancelled in its grace
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        self._chan.close()  # state CLOSED + wake every client
        self._fences.close()  # pending fences dropped: the region goes with the server
        self._reader.cancel()
        self._following.clear()  # their steps find nothing to do
        self._followed_by.clear()
        self._hot_follows = 0
        tasks = list(self._tasks.values())
        for t in tasks:
            _cancel(t)
        try:
            await asyncio.gather(self._reader, *tasks, return_exceptions=True)
        finally:
            self._stop_beating()
            self._region.mark_closed()
            self._region.unlink()
            self._region.close()
            self._closed.set()

    async def serve_forever(self) -> None:
        """Wait until :meth:`close` is called (by a handler, a signal handler or another task);
        RegionError when the server stopped by itself (its region's file was truncated)."""
        await self._closed.wait()
        if self._failure is not None:
            raise self._failure

    def guard_region(self, region: Region) -> None:
        """Also look at ``region``'s file (e.g. kvservice's pool) as at the server's own: a
        truncation found is undone and stops the server (see :mod:`cxlrpc.size_guard`)."""
        self._cuts.add(region.size_guard)

    def _region_cut(self, message: str) -> None:
        """A region's file was found truncated (and grown back): stop, with that error."""
        if self._failure is None and not self._draining:
            self._failure = RegionError(message)
            self._cut_close = asyncio.ensure_future(self.close())

    async def __aenter__(self) -> "Server":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close(self.shutdown_grace)

    def _stop_beating(self) -> None:
        self._beat_stop.set()
        if self._beater is not None:
            self._beater.join()

    def _beat(self) -> None:
        region, cuts = self._region, self._cuts
        while not self._beat_stop.wait(self.heartbeat_interval):
            if cuts.check():  # grown back, not touched: the server stops
                return
            region.beat()

    # ------------------------------------------------------------------ data path
    async def _serve(self) -> None:
        chan = self._chan
        ring = chan.requests
        poll, poll_within = ring.poll, ring.poll_within
        hot_s = min(self.strategy.spin_s, _HOT_SPIN_S)  # the ring's own look, before the wait's
        fast = self._fast
        on_request = self._on_request  # the reference's handler (natively, the dispatcher polls)
        housekeeping_every = min(0.1, self.client_timeout / 4)
        next_housekeeping = time.monotonic() + housekeeping_every
        stuck_at: int | None = None  # head position housekeeping found blocked
        idle = False
        turned = served = time.monotonic()  # when the loop last had a turn, a batch was served
        batch = _BATCH_MAX  # the reference's batch size (natively, the dispatcher's own)
        strategy = self.strategy
        yield_cpu = chan.bell.shared_cpu.yield_cpu
        while True:
            # one clock reading a batch: its requests' deadlines count from it
            self._polled_at = now = time.monotonic()
            if now >= next_housekeeping:
                self._cuts.check()  # a truncated file grown back before the ring is touched
            if fast is not None:
                until = min(turned + _TURN_EVERY_S, next_housekeeping)  # the turn, or housekeeping
                n = fast.poll(ring, now, until)
            else:
                n = poll(on_request, batch)
                if n:  # the next batch from this one's pace; the turn's due from its end
                    done = time.monotonic()
                    batch = _batch_fitting(n, done - now)
                    now = done
            # nothing else of ours to run (no call in a task, no body being written that is
            # followed every turn, no client in this process, which needs the loop to run):
            # the next request is looked for a moment longer without loop turns, by the ring
            # itself (its requests' deadlines then count from the clock reading above, at most
            # that moment early); natively, batch after batch until one of them needs the loop
            # or its turn is due. Replies held back are retried between batches, and idle
            # followed bodies are looked at by timers: neither takes the hot path from others.
            lone = not (self._tasks or self._hot_follows or chan.peers_in_process)
            if lone and hot_s and not (idle and self.strategy.park):
                if fast is not None:
                    n += fast.serve(ring, hot_s, until)
                    self._polled_at = now = fast.polled_at
                elif not n:
                    n = poll_within(on_request, batch, hot_s)
            if self._backlog:
                self._flush_backlog()
            if now >= next_housekeeping:
                next_housekeeping = now + housekeeping_every
                stuck_at = self._housekeeping(now)
            if self._draining:  # replies flushed, departed clients' calls cancelled: done?
                self._note_drained()
            if n:
                idle = False
                served = now
                # Nothing else of ours needs the loop: look for the next request at once (a loop
                # turn costs an epoll_wait, on the next call's path), yet turn it at least
                # every _TURN_EVERY_S of serving.
                if (self._tasks or self._hot_follows or chan.peers_in_process
                        or now - turned >= _TURN_EVERY_S):
                    await asyncio.sleep(0)
                    turned = time.monotonic()
            elif ring.readable():
                # The head record is claimed but not committed: its producer is mid-write, or
                # dead (housekeeping then unblocks it). Poll gently once it is known stuck.
                await asyncio.sleep(0.001 if stuck_at == ring.head_position else 0)
                turned = time.monotonic()
            elif lone and hot_s and now - served < strategy.spin_s + strategy.yield_s:
                # the strategy's spin and yield phases: the ring looked at natively for hot_s
                # (above) between loop turns, not once a turn (a request that came while its
                # client computed, e.g. after copying out 1 MiB, was seen ~3 us later)
                if now - served >= strategy.spin_s:
                    yield_cpu()
                await asyncio.sleep(0)
                turned = time.monotonic()
            else:
                # replies waiting for a full response ring, bodies being followed: come back
                # soon to retry them; a lone server past its spin and yield phases parks at once
                wait = 0.0005 if self._backlog or self._hot_follows else housekeeping_every
                idle = not await chan.bell.wait_async(ring.readable, strategy, wait,
                                                      idle or bool(lone and hot_s))
                turned = time.monotonic()

    def _housekeeping(self, now: float) -> int | None:
        """Reclaim dead clients' slots, put back the words only the server writes, and unblock
        records their producers never committed (a live one's after client_timeout without
        progress: see MpscRing.unblock).

        Returns the head position when the request ring is blocked by a live producer."""
        self._cuts.check()  # (a truncated file grown back before the slots are read)
        chan = self._chan
        for gone in chan.reap(self.client_timeout, now):
            self._departed(gone)
        for slot, gen in self._fences.due(now):
            self._fenced(Peer(slot, gen))
        if self._heap_waiting:
            self._expire_heap_waiters(now)
        if self._heap is not None and self._heap.abandoned and self._heap.free_abandoned():
            self._heap_freed()
        self._republish()
        ring = chan.requests
        if ring.blocked_producer() is None or ring.unblock(chan.producer_dead, chan.live_claims,
                                                          self.client_timeout, chan.revoke_claims):
            return None
        return ring.head_position

    def _republish(self) -> None:
        """Put back owner, state and geometry words a stray write changed (clients would
        otherwise see a closed or dead server, or a wrong geometry, for good)."""
        restored = self._chan.republish()
        if restored:
            logger.warning("put back %d word(s) of %s's header or control block that were written "
                           "over", restored, self.url)

    def _departed(self, gone: Departure) -> None:
        """A slot's holder left (detached, reaped, or replaced by a new holder): cancel its
        handlers, drop its replies, quarantine its heap extents, tell the on_disconnect
        callbacks; then fence it, at once or once it can no longer write (:meth:`on_fenced`)."""
        slot, gen = gone.slot, gone.gen
        if self._heap is not None:
            self._heap.quarantine(slot, gen)
            self._heap_waiting[:] = [w for w in self._heap_waiting if w[1:3] != (slot, gen)]
            for key in [k for k in self._following if k[:2] == (slot, gen)]:
                self._end_following(key)
        queue = self._backlog.get(slot)
        if queue:
            queue.drop_gen(gen)
            if not queue:
                del self._backlog[slot]
        for key, task in list(self._tasks.items()):
            if key[0] == slot and key[1] == gen:
                _cancel(task)
        peer = Peer(slot, gen)
        for callback in self._on_disconnect:
            try:
                callback(peer)
            except Exception:
                logger.exception("on_disconnect callback failed for %s", peer)
        if self._fences.depart(gone, time.monotonic()):
            self._fenced(peer)

    def _fenced(self, peer: Peer) -> None:
        """A departed holder can no longer write into the region: free what it held, then
        tell the on_fenced callbacks."""
        if self._heap is not None and self._heap.release_owner(peer.slot, peer.gen):
            self._heap_freed()
        for callback in self._on_fenced:
            try:
                callback(peer)
            except Exception:
                logger.exception("on_fenced callback failed for %s", peer)

    def _dispatcher(self) -> Any:
        """The native dispatcher of this server's request ring, or None where it is not built
        or cannot serve (memory without coherence: its channel is the reference's alone)."""
        chan = self._chan
        if _Dispatcher is None or not isinstance(chan, ServerChannel):
            return None
        fast = _Dispatcher(self, self._region.buf, list(chan.slot_state_at), chan.seen, self._peers,
                           self._backlog, self._fast_methods, chan.responses, chan, HandlerContext,
                           fr.NO_METADATA, _current_call, chan.ring_client, fr.encode_body,
                           self._event_loop, _current_task, _enter_task, _leave_task, _EagerTask,
                           asyncio.CancelledError, self._reply_limit(chan), fr.Frame,
                           _current_tasks(), *chan.client_bell_words(), self._heap,
                           self._heap_waiting, self.geometry.heap, self.geometry.heap_size,
                           self._follow_min, self._body_limit, FOLLOW_CHUNK, fr.encode_msgpack)
        fast.enabled = 0 if self._interceptors or self._draining else 1
        return fast

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
                self._departed(chan.departure(slot, seen))
        if f.flags & fr.FOLLOW:  # a unary request's body, or a response's
            if f.kind == fr.REQUEST and f.flags & fr.HEAP and not f.flags & fr.STREAM:
                self._follow_request(f)
            else:
                self._drop()
            return
        if f.kind != fr.REQUEST:
            if f.kind == fr.CANCEL:
                key = (slot, f.gen, f.call_id)
                task = self._tasks.get(key)
                if task is not None:
                    _cancel(task)
                elif key in self._following:
                    self._end_following(key)
                elif self._heap_waiting:
                    self._heap_waiting[:] = [w for w in self._heap_waiting
                                          if w[1:4] != (slot, f.gen, f.call_id)]
            elif f.kind == fr.CREDIT:
                self._credit(f)
            elif f.kind == fr.ITEM or f.kind == fr.END:
                self._request_item(f)
            elif f.kind == fr.ALLOC:
                self._alloc(f)
            elif f.kind == fr.FREE:
                self._free(f)
            else:
                self._drop()
            return
        if not f.flags & fr.HEAP:
            self._dispatch_request(f)
            return
        extent = self._take_body(f)
        if extent is None:
            return
        carried = False
        try:
            carried = self._dispatch_request(f, extent)
        finally:
            if extent >= 0 and not carried:  # a lent body: the handler is done with it
                self._give_back(extent, f.body)

    def _dispatch_request(self, f: fr.Frame, extent: int = -1) -> bool | None:
        """A request whose body is at hand: run its handler (inline when plain) and reply.
        ``extent``: the heap extent its body is a lent view of (-1: none); True when a task
        that goes on reading it took it over."""
        chan = self._chan
        slot = f.slot
        if self._draining and not f.method.startswith(fr.RESERVED_PREFIX):
            self._error(f, StatusCode.UNAVAILABLE, "server is shutting down")
            return
        held = self._backlog.get(slot)
        if held is not None and f.call_id != fr.NO_REPLY and held.full(self.limits):
            self._error(f, StatusCode.RESOURCE_EXHAUSTED, held.why(self.limits))
            return
        m = self._methods.get(f.method)
        peer = self._peers.get(slot)
        if peer is None or peer.gen != f.gen:
            peer = self._peers[slot] = Peer(slot, f.gen)
        call = HandlerContext(f.method, f.metadata, peer,
                              self._polled_at + f.timeout if f.timeout else None, chan)
        if m is not None and (m.streams or f.flags & fr.STREAM):
            self._dispatch_stream(m, f, call)
            return
        if self._interceptors and not f.method.startswith(fr.RESERVED_PREFIX):
            self._dispatch_intercepted(m, f, call)
            return
        if m is None:
            self._error(f, StatusCode.UNIMPLEMENTED, f"unknown method {f.method!r}")
            return
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
                return
        if m.is_async:
            if type(f.body) is memoryview and extent < 0:
                arg = memoryview(bytes(arg))  # lent by the ring, which reuses it once we return
            try:
                coro = m.fn() if arg is _NO_ARG else m.fn(arg)
            except Exception as exc:
                self._fail(f, exc)
                return
            result = self._run_eagerly(coro, f, slot, call, extent)
            if result is _SUSPENDED:
                return extent >= 0
        elif m.blocking:
            ctx = _handler_context(call)
            run = functools.partial(ctx.run, m.fn) if arg is _NO_ARG else functools.partial(ctx.run, m.fn, arg)
            self._in_thread(asyncio.get_running_loop().run_in_executor(None, run), f, slot)
            return
        else:
            token = _current_call.set(call)
            try:
                result = m.fn() if arg is _NO_ARG else m.fn(arg)
            except Exception as exc:
                self._fail(f, exc)
                if type(arg) is memoryview:
                    _take_back(arg)
                return
            finally:
                _current_call.reset(token)
            if type(arg) is memoryview and m.view_arg:  # the body was lent: answer, then take it back
                self._lent_reply(f, arg, result, fr.IN_PLACE if extent >= 0 and f.flags & fr.FOLLOW else 0)
                return
            if type(result) is CoroutineType:  # a plain function that returned a coroutine
                self._eager_reply(f, result, call)
                return
        if result is not _FAILED:
            self._reply(f, result, held=True)  # the slot was checked above, nothing ran since

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
                      eager: "_EagerTask") -> None:
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
        result = self._run_eagerly(self._intercepted(m, f, call), f, f.slot, call)
        if result is not _SUSPENDED and result is not _FAILED:
            self._reply(f, result)

    async def _intercepted(self, m: _Method | None, f: fr.Frame, call: HandlerContext,
                           arg: Any = _UNDECODED) -> Any:
        """The interceptors, first outermost, around the handler."""
        chain = self._interceptors

        def next_at(i: int) -> Awaitable[Any]:
            if i == len(chain):
                return self._handle(m, f, arg)
            return chain[i](call, lambda: next_at(i + 1))

        return await next_at(0)

    async def _handle(self, m: _Method | None, f: fr.Frame, arg: Any) -> Any:
        """The innermost step of an intercepted call: decode the request (unless ``arg`` is
        it already) and run the handler; a failure is raised, so that the interceptors see
        it. A stream handler's result is its stream of replies, not yet iterated."""
        if m is None:
            raise Unimplemented(f"unknown method {f.method!r}")
        if arg is not _UNDECODED:
            args: tuple = () if arg is _NO_ARG else (arg,)
        else:
            try:
                args = (fr.decode_body(f.flags, f.body, m.arg_type),) if m.takes_arg else ()
            except Exception as exc:  # DecodeError, ValidationError, RecursionError on deep nesting
                raise InvalidArgument(f"bad request for {f.method!r}: {exc}") from None
        if m.streaming:
            return m.fn(*args)
        if m.blocking:
            run = functools.partial(contextvars.copy_context().run, m.fn, *args)
            return await asyncio.get_running_loop().run_in_executor(None, run)
        result = m.fn(*args)
        if inspect.iscoroutine(result):
            result = await result
        return result

    def _bad_metadata(self, f: fr.Frame, message: str) -> None:
        """A frame whose metadata block is garbage: counted as dropped, and if it is a request
        from its slot's holder, answered INVALID_ARGUMENT."""
        self._drop()
        if f.kind == fr.REQUEST and self._chan.slot_generation(f.slot) == f.gen:
            self._error(f, StatusCode.INVALID_ARGUMENT, f"bad request metadata: {message}")

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
            self._heap.lend(extent)
            eager.task.add_done_callback(functools.partial(self._give_back, extent, f.body))
        return _SUSPENDED

    def _give_back(self, extent: int, view: memoryview, _: asyncio.Task | None = None) -> None:
        """A handler (or the task that finished it) that read its body in the heap is done:
        end its view and free the extent."""
        _take_back(view)
        if self._heap.give_back(extent):
            self._heap_freed()

    def _suspended(self, coro: Any, step: Any, f: fr.Frame, slot: int, ctx: contextvars.Context,
                   eager: "_EagerTask") -> None:
        """A coroutine handler suspended: finish it in a task (in its own context, where
        ``current_peer()`` holds), cancellable by CANCEL frames, its deadline and departure."""
        eager.task = self._track(f, slot, lambda key: ctx.run(
            asyncio.get_running_loop().create_task, self._finish(_Resumed(coro, step), f, key)))

    def _in_thread(self, running: asyncio.Future, f: fr.Frame, slot: int) -> None:
        """A blocking handler runs in the loop's executor; its call ends like a task's."""
        self._track(f, slot, lambda key: asyncio.get_running_loop().create_task(
            self._finish(running, f, key)))

    def _track(self, f: fr.Frame, slot: int, start: Callable[[tuple], asyncio.Task]) -> asyncio.Task:
        """Register the task that finishes a call, with its deadline as a timer."""
        # one-way calls share call id 0: give each its own (negative) task key
        key = (slot, f.gen, f.call_id or -next(self._oneway_ids))
        task = start(key)
        self._tasks[key] = task
        if f.timeout > 0:
            timer = asyncio.get_running_loop().call_later(f.timeout, self._expire_call, key)
            task.add_done_callback(lambda _: timer.cancel())
        return task

    def _expire_call(self, key: tuple) -> None:
        task = self._tasks.get(key)
        if task is not None:
            self._cancelled_with[key] = DeadlineExceeded("deadline exceeded in handler")
            _cancel(task)

    # ------------------------------------------------------------------ streams
    def _dispatch_stream(self, m: _Method, f: fr.Frame, call: HandlerContext) -> None:
        """A call to a streaming method: its request stream set up (or its request decoded),
        then the handler run in a task (a client stream's inline up to its first suspension)
        that sends the replies as the caller's credit allows."""
        if f.call_id == fr.NO_REPLY:
            self._error(f, StatusCode.INVALID_ARGUMENT, "a streaming call needs a caller to read it")
            return
        if bool(f.flags & fr.STREAM) != m.requests:
            self._error(f, StatusCode.INVALID_ARGUMENT,
                        f"method {f.method!r} takes a stream of requests: call it with open_stream()"
                        if m.requests else f"method {f.method!r} takes one request, not a stream: "
                        f"call it with {'stream()' if m.streaming else 'call()'}")
            return
        key = (f.slot, f.gen, f.call_id)
        if key in self._tasks:
            self._drop()  # a second request under a call id in use: garbage
            return
        intercepted = bool(self._interceptors)
        arg: Any
        if m.requests:
            arg = self._inbound[key] = RequestStream(f.method, m.arg_type,
                                                     functools.partial(self._grant, key),
                                                     functools.partial(self._account_stream, key[:2]))
        elif not m.takes_arg:
            arg = _NO_ARG
        elif intercepted:
            arg = _UNDECODED
        else:
            try:
                arg = fr.decode_body(f.flags, f.body, m.arg_type)
            except Exception as exc:  # DecodeError, ValidationError, RecursionError
                self._error(f, StatusCode.INVALID_ARGUMENT, f"bad request for {f.method!r}: {exc}")
                return
        ctx = _handler_context(call)
        if m.streaming:
            self._credits[key] = [STREAM_WINDOW, asyncio.Event()]
            replies = (self._intercepted(m, f, call, arg) if intercepted
                       else _ready(ctx.run(m.fn) if arg is _NO_ARG else ctx.run(m.fn, arg)))
            self._track(f, f.slot, lambda key: ctx.run(asyncio.get_running_loop().create_task,
                                                       self._finish(self._stream(replies, f, key), f, key)))
            return
        coro = self._intercepted(m, f, call, arg) if intercepted else m.fn(arg)
        result = self._run_eagerly(coro, f, f.slot, call, ctx=ctx)
        if result is _SUSPENDED:
            return
        self._end_inbound(key)
        if result is not _FAILED:
            self._reply(f, result)

    def _request_item(self, f: fr.Frame) -> None:
        """A request item (or END) of a streaming call, for the handler's RequestStream; of a
        call that ended meanwhile, dropped (its heap extent freed)."""
        stream = self._inbound.get((f.slot, f.gen, f.call_id))
        if f.flags & fr.HEAP:
            if not self._item_body(f):
                self._drop()
                if stream is not None:
                    stream.fail(InvalidArgument("a request item's body is not in a heap extent of its own"))
                return
        if stream is None:
            return
        if f.kind == fr.ITEM and self._stream_held(f.slot, f.gen) + len(f.body) > self.limits.max_stream_bytes:
            limit = self.limits.max_stream_bytes
            self._end_stream(stream, f, ResourceExhausted(
                f"the request streams of this connection hold {limit} bytes their handlers have "
                f"not taken yet (max_stream_bytes={limit})"))
        elif not stream.put(f):  # past its credit: a broken caller
            self._end_stream(stream, f, InvalidArgument(
                f"the caller of {stream.method!r} sent request items beyond its credit of "
                f"{STREAM_WINDOW}"))

    def _stream_held(self, slot: int, gen: int) -> int:
        """Bytes of request-stream items this connection sent that its handlers have not taken."""
        return self._stream_bytes.get((slot, gen), 0)

    def _account_stream(self, peer: tuple[int, int], delta: int) -> None:
        held = self._stream_bytes.get(peer, 0) + delta
        if held:
            self._stream_bytes[peer] = held
        else:
            self._stream_bytes.pop(peer, None)

    def _end_inbound(self, key: tuple) -> None:
        """A streaming call ended: forget its request stream (and the bytes it still held)."""
        stream = self._inbound.pop(key, None)
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

    def _item_body(self, f: fr.Frame) -> bool:
        """Replace an out-of-line item's extent by its bytes and free the extent; False when
        the extent is not the sender's."""
        heap = self._heap
        if heap is None or len(f.body) != EXTENT.size:
            return False
        offset, length = EXTENT.unpack(f.body)
        if not heap.owned(offset, length, f.slot, f.gen):
            return False
        f.body = heap.access.read(offset, length)
        f.flags &= ~fr.HEAP
        heap.free(offset, f.slot, f.gen)
        self._heap_freed()
        return True

    def _grant(self, key: tuple, count: int) -> None:
        """The handler took ``count`` request items: the caller may send that many more."""
        slot, gen, call_id = key
        self._send(slot, gen, fr.header(fr.CREDIT, fr.RAW, 0, slot, gen, call_id, 0.0, b""),
                   OFFSET.pack(count))

    async def _stream(self, replies: Any, f: fr.Frame, key: tuple) -> Any:
        """Drive a stream handler: each item waits for credit and for room in the ring (a slow
        reader slows the writer; nothing is dropped). ``replies``: awaited, the handler's
        async iterator (an interceptor may have wrapped it)."""
        slot, gen, call_id = key
        credit = self._credits[key]
        chan = self._chan
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
                        self._heap is None or len(body) > self._body_limit):
                    raise ResourceExhausted(f"stream item of {len(body)} bytes exceeds "
                                            f"{self._limit_setting()}")
                pause = 0.0
                while not self._push_reply(slot, gen, chan.responses[slot], head, body):
                    if chan.slot_generation(slot) != gen:
                        return _STREAMED  # the caller left: nobody to send to
                    await asyncio.sleep(pause)
                    pause = min(0.001, pause * 2 + 1e-5)
                chan.ring_client(slot, gen)
        finally:
            self._credits.pop(key, None)
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                await aclose()
        self._send(slot, gen, fr.header(fr.END, fr.RAW, 0, slot, gen, call_id, 0.0, b""), b"")
        return _STREAMED

    def _credit(self, f: fr.Frame) -> None:
        """The caller of a stream took items: it may be sent that many more."""
        if len(f.body) != OFFSET.size:
            self._drop()  # garbage
            return
        credit = self._credits.get((f.slot, f.gen, f.call_id))
        if credit is None:
            return  # the stream ended meanwhile
        credit[0] = min(credit[0] + OFFSET.unpack(f.body)[0], STREAM_WINDOW)
        credit[1].set()

    async def _finish(self, handler: Any, f: fr.Frame, key: tuple) -> None:
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
                self._end_inbound(key)
            if self._draining:
                self._note_drained()

    def _fail(self, f: fr.Frame, exc: BaseException) -> None:
        if isinstance(exc, asyncio.CancelledError):
            self._error(f, StatusCode.CANCELLED, "cancelled")
        elif isinstance(exc, RpcError):
            self._error(f, exc.code, exc.message)
        else:  # a bug in the handler: the server's log gets the traceback
            logger.error("handler of %r raised", f.method, exc_info=exc)
            detail = f"{type(exc).__name__}: {exc}" if self.error_details else "the handler failed"
            self._error(f, StatusCode.INTERNAL, detail)

    def _reply(self, f: fr.Frame, result: Any, held: bool = False, hint: int = 0) -> None:
        """Answer ``f`` with ``result``: straight into the ring when it fits and nothing waits
        ahead of it, else through :meth:`_send`. ``held``: the caller knows the slot is still
        the sender's (a plain handler just ran inline); ``hint``: flags for the caller."""
        if f.call_id == fr.NO_REPLY:
            return
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

    def _error(self, f: fr.Frame, code: int, message: str) -> None:
        if f.call_id == fr.NO_REPLY:
            if code == StatusCode.INTERNAL:
                logger.warning("one-way call %r failed: %s", f.method, message)
            return
        head = fr.header(fr.ERROR, fr.RAW, int(code), f.slot, f.gen, f.call_id, 0.0, b"")
        self._send(f.slot, f.gen, head, message.encode()[:4096])

    def _send(self, slot: int, gen: int, head: bytes, body: bytes | memoryview) -> bool:
        """Send a frame to a client: into its ring, else held for it (False: refused instead,
        its backlog is full; see _hold)."""
        chan = self._chan
        if chan.slot_generation(slot) != gen:
            return True  # the client left or died: nobody to answer
        ring = chan.responses[slot]
        if len(head) + len(body) > ring.max_payload and (self._heap is None
                                                         or len(body) > self._body_limit):
            code = int(StatusCode.RESOURCE_EXHAUSTED)
            limit = (self._limit_setting() if self._heap is not None
                     else f"the ring's limit {ring.max_payload} (this server has no heap)")
            msg = f"response of {len(body)} bytes exceeds {limit}".encode()
            call_id = fr.HEADER.unpack_from(head)[5]
            head, body = fr.header(fr.ERROR, fr.RAW, code, slot, gen, call_id, 0.0, b""), msg
        # a small reply need not wait behind replies that wait for the heap (it may be the
        # ALLOC grant whose request frees the heap for them)
        inline = len(head) + len(body) <= ring.max_payload
        sent = True
        if (slot in self._backlog and not inline) or not self._push_reply(slot, gen, ring, head, body):
            sent = self._hold(slot, gen, head, body)
        chan.ring_client(slot, gen)
        return sent

    def _push_reply(self, slot: int, gen: int, ring: Any, head: bytes, body: bytes | memoryview) -> bool:
        """Push a reply, through the heap when it is too big for the ring or big enough to be
        followed; False while the ring (or the heap) is full."""
        if len(body) >= self._follow_min:
            pushed = self._push_followed(slot, gen, ring, head, body)
            if pushed is not None:
                return pushed
        if len(head) + len(body) <= ring.max_payload:
            return ring.try_push_parts((head, body))
        if self._chan.slot_generation(slot) != gen:
            return True  # the caller left (its extents were freed): nobody would free this one
        heap = self._heap
        offset = heap.alloc(slot, gen, len(body))
        if offset is None:
            return False
        heap.access.write(offset, (body,))
        if ring.try_push_parts((fr.out_of_line(head), EXTENT.pack(offset, len(body)))):
            return True
        heap.free(offset, slot, gen)
        return False

    def _reply_limit(self, chan: ServerChannel | FlushServerChannel) -> int:
        """The longest reply record pushed straight into a response ring (bigger ones are
        followed, or go through the heap)."""
        return min(chan.responses[0].max_payload, fr.HEADER_SIZE + self._follow_min - 1)

    def _push_followed(self, slot: int, gen: int, ring: Any, head: bytes,
                       body: bytes | memoryview) -> bool | None:
        """Send a big reply's frame first, then write its body into the heap while the client
        copies it out (:mod:`cxlrpc.heap`); False while the ring is full, None when it goes
        the plain way: the heap has no room for it now, or ALLOCs wait for the heap (a reply
        can take the ring instead, a big request cannot), or the body is not one contiguous
        run of bytes."""
        if self._chan.slot_generation(slot) != gen:
            return True  # the caller left: nobody to answer
        heap = self._heap
        try:
            body = memoryview(body).cast("B")
        except TypeError:
            return None
        size = FOLLOW_HEADER + len(body)
        if self._heap_waiting or size > heap.access.size:
            return None
        offset = heap.alloc_reply(slot, gen, size)
        if offset is None:
            return None
        heap.access.begin_publish(offset)
        if not ring.try_push_parts((fr.out_of_line(head, follow=True), EXTENT.pack(offset, len(body)))):
            heap.free(offset, slot, gen)
            return False
        self._chan.ring_client(slot, gen)
        # the copy runs here, on the loop: the extent's FREE, or its owner's departure, is
        # handled only after it ends
        heap.access.publish(offset, body)
        return True

    # ------------------------------------------------------------------ heap
    def _alloc(self, f: fr.Frame) -> None:
        """A client asks for a heap extent to write a big request into."""
        if len(f.body) != GRANT.size or self._heap is None:
            self._error(f, StatusCode.RESOURCE_EXHAUSTED if self._heap is None
                        else StatusCode.INVALID_ARGUMENT,
                        "this server has no heap (heap_size=0)" if self._heap is None
                        else "bad ALLOC frame")
            return
        size, keep = GRANT.unpack(f.body)
        if not 0 < size <= self._body_limit:
            self._error(f, StatusCode.RESOURCE_EXHAUSTED, f"request of {size} bytes exceeds the "
                        f"server's {self._limit_setting()}")
            return
        peer, limit = (f.slot, f.gen), self.limits.max_alloc_waiters
        if sum(1 for w in self._heap_waiting if w[1:3] == peer) >= limit:
            self._error(f, StatusCode.RESOURCE_EXHAUSTED, f"{limit} ALLOCs of this connection wait for "
                        f"room in the heap already (max_alloc_waiters={limit})")
            return
        # (one without a deadline waits alloc_timeout at most: True at the end says so)
        default = not f.timeout > 0
        deadline = time.monotonic() + (self.limits.alloc_timeout if default else f.timeout)
        self._heap_waiting.append((deadline, f.slot, f.gen, f.call_id, size, keep, default))
        self._heap_freed()

    def _limit_setting(self) -> str:
        """The setting that bounds a body through the heap, to name in errors."""
        if self._body_limit < self.max_message_size:
            return f"heap_size={self._body_limit} (below max_message_size={self.max_message_size})"
        return f"max_message_size={self.max_message_size}"

    def _free(self, f: fr.Frame) -> None:
        """A client is done with a response body we put in the heap."""
        if len(f.body) != OFFSET.size:
            self._drop()
            return
        self._free_extent(OFFSET.unpack(f.body)[0], f.slot, f.gen)

    def _free_extent(self, offset: int, slot: int, gen: int) -> None:
        """The heap extent at ``offset`` comes back from the client in ``slot``/``gen`` (a FREE;
        the native dispatcher calls this with its checks of the header and the sender done)."""
        if self._heap is None or not self._heap.free(offset, slot, gen):
            self._drop()
            return
        self._heap_freed()

    def _heap_freed(self) -> None:
        """Heap space came back: replies waiting for it go first (finishing calls frees more),
        then waiting ALLOCs in order while they fit (the first that does not, waits on)."""
        if self._backlog:
            self._flush_backlog()
        heap, waiting = self._heap, self._heap_waiting
        while waiting:
            slot, gen, call_id, size, keep = waiting[0][1:6]
            offset = heap.alloc(slot, gen, size, keep == 1)
            if offset is None:
                return
            waiting.pop(0)
            if not self._send(slot, gen, fr.header(fr.RESPONSE, fr.RAW, 0, slot, gen, call_id, 0.0, b""),
                              GRANT.pack(offset, heap.is_spare(offset))):
                heap.free(offset, slot, gen)  # the grant was refused (its client's backlog is full)

    def _expire_heap_waiters(self, now: float) -> None:
        expired = [w for w in self._heap_waiting if w[0] is not None and w[0] <= now]
        if not expired:
            return
        self._heap_waiting[:] = [w for w in self._heap_waiting if w not in expired]
        for w in expired:
            slot, gen, call_id, size = w[1:5]
            if len(w) > 6 and w[6]:  # it had no deadline: alloc_timeout's
                code = StatusCode.RESOURCE_EXHAUSTED
                why = (f"the heap had no room for {size} bytes within "
                       f"alloc_timeout={self.limits.alloc_timeout} s")
            else:
                code = StatusCode.DEADLINE_EXCEEDED
                why = f"the heap had no room for {size} bytes before the deadline"
            self._send(slot, gen, fr.header(fr.ERROR, fr.RAW, int(code), slot, gen, call_id, 0.0, b""),
                       why.encode())

    def _take_body(self, f: fr.Frame) -> int | None:
        """Replace an out-of-line request's extent by its bytes and free the extent (-1), or,
        for a method that lends its body (the frame's body is a view), by a read-only view of
        the extent, kept until the handler is done (its offset); None (the request answered or
        dropped) when the extent is not the sender's."""
        heap = self._heap
        if heap is not None and len(f.body) == EXTENT.size:
            offset, length = EXTENT.unpack(f.body)
            if heap.owned(offset, length, f.slot, f.gen):
                f.flags &= ~fr.HEAP
                if type(f.body) is memoryview:
                    f.body = heap.access.view(offset, length)
                    return offset
                f.body = heap.access.read(offset, length)
                heap.free(offset, f.slot, f.gen)
                self._heap_freed()
                return -1
        self._drop()
        self._error(f, StatusCode.INVALID_ARGUMENT, "request body is not in a heap extent of its own")
        return None

    def _follow_request(self, f: fr.Frame) -> None:
        """A request whose body its client writes into the heap after sending the frame:
        followed a step at a time between the server's other work (never waiting long for
        one client), then dispatched with its bytes (or, to a method that lends its body, a
        view of the complete extent). Its extent is kept until then, even if its owner leaves;
        after, a spare is the client's again (to write its next such request into, or to
        FREE), any other extent is freed."""
        heap = self._heap
        if heap is not None and self._follow_min != sys.maxsize and len(f.body) == EXTENT.size:
            offset, length = EXTENT.unpack(f.body)
            key = (f.slot, f.gen, f.call_id)
            if heap.owned(offset, FOLLOW_HEADER + length, f.slot, f.gen) and key not in self._following:
                lends = type(f.body) is memoryview
                f.body = b""  # (a view of the ring's record, which is reused once we return)
                heap.lend(offset)
                if self._followed_by[key[:2]] >= self.limits.max_followed_requests:
                    self._refuse_following(f, offset, length)
                    return
                self._followed_by.add(key[:2])
                self._following[key] = _Following(f, offset, length, lends, self._polled_at,
                                                  heap.access.follower(offset, length, copy=not lends))
                self._follow_step(key)
                return
        self._drop()
        self._error(f, StatusCode.INVALID_ARGUMENT, "request body is not in a heap extent of its own")

    def _follow_step(self, key: tuple[int, int, int]) -> None:
        """Take what the client has written of a followed request (following on while it
        writes, for up to FOLLOW_STEP_S); dispatch it once whole, else come back next turn."""
        following = self._following.get(key)
        if following is None or self._closing:
            return  # cancelled, its client departed, or the server closed
        self._cool(following)
        f, offset, length = following.frame, following.offset, following.length
        try:
            try:  # (one idle at its last look is looked at, not waited for)
                whole = following.body.step(0.0 if following.idle else FOLLOW_SPIN_S, FOLLOW_STEP_S)
            except ValueError as exc:  # garbage, or the client gave up writing
                self._end_following(key, StatusCode.INVALID_ARGUMENT,
                                    f"the request body was not written whole: {exc}")
                return
            now = time.monotonic()
            deadline = following.arrived + f.timeout if f.timeout else None
            if not whole:
                if following.body.done > following.done:
                    following.done, following.since, following.idle = following.body.done, now, 0
                else:
                    following.idle += 1
                if deadline is not None and now >= deadline:
                    self._end_following(key, StatusCode.DEADLINE_EXCEEDED,
                                        "the deadline passed while the request body was written")
                elif now - following.since > FOLLOW_STALL_S:
                    self._end_following(key, StatusCode.UNAVAILABLE,
                                        f"the client stopped writing its request body for {FOLLOW_STALL_S} s")
                elif following.idle > _FOLLOW_HOT_LOOKS:  # back off: turns go to writers that write
                    doubled = 1 << min(following.idle - _FOLLOW_HOT_LOOKS, 16)
                    pause = min(FOLLOW_IDLE_MAX_S, FOLLOW_SPIN_S * doubled)
                    self._event_loop.call_later(pause, self._follow_step, key)
                else:
                    following.soon = True
                    self._hot_follows += 1
                    self._event_loop.call_soon(self._follow_step, key)
                return
            del self._following[key]
            self._followed_by.remove(key[:2])
            if not following.lends:
                f.body = following.body.take()
                if self._heap.give_back(offset):  # (else it is the client's again)
                    self._heap_freed()
                fast = self._fast
                if fast is not None and not f.metadata:  # natively, as a record in the ring is
                    # (its deadline counted from the request's arrival, as any other's)
                    timeout = 0.0 if deadline is None else deadline - fast.polled_at
                    if ((deadline is None or timeout > 0)
                            and fast.dispatch_body(f.slot, f.gen, f.call_id, f.flags & fr.RAW, timeout,
                                                   fr.method_bytes(f.method), f.body)):
                        return
            if deadline is not None:  # counted from the request's arrival, as any other's
                f.timeout = deadline - self._polled_at
            f.flags &= ~fr.HEAP  # (FOLLOW stays: a lent body's reply says IN_PLACE)
            if not following.lends:
                self._dispatch_request(f)
                return
            f.body = self._heap.access.followed_view(offset, length)
            carried = False
            try:
                carried = self._dispatch_request(f, offset)
            finally:
                if not carried:  # the handler is done with the lent body
                    self._give_back(offset, f.body)
        except Exception as exc:  # nothing a peer sends may stop the server
            self._broken(exc)

    def _end_following(self, key: tuple[int, int, int], code: int = 0, message: str = "") -> None:
        """Stop following a request and give its extent back (a spare is its client's again;
        another is freed once its writer stopped: ServerHeap.abandon); answer ``code`` (0: no
        answer, the caller gave up or left)."""
        following = self._following.pop(key)
        self._followed_by.remove(key[:2])
        self._cool(following)
        if self._heap.abandon(following.offset, following.length):
            self._heap_freed()
        if code:
            self._error(following.frame, code, message)

    def _cool(self, following: "_Following") -> None:
        """A followed request's step that was due next turn ran (or it ended)."""
        if following.soon:
            following.soon = False
            self._hot_follows -= 1

    def _refuse_following(self, f: fr.Frame, offset: int, length: int) -> None:
        """A followed request past its connection's max_followed_requests: RESOURCE_EXHAUSTED at
        once, its extent kept from reuse until its client is done writing it (abandoned)."""
        limit = self.limits.max_followed_requests
        if self._heap.abandon(offset, length):
            self._heap_freed()
        self._error(f, StatusCode.RESOURCE_EXHAUSTED, f"{limit} followed requests of this connection "
                    f"are being written already (max_followed_requests={limit})")

    def _hold(self, slot: int, gen: int, head: bytes, body: bytes | memoryview) -> bool:
        """Hold a reply until its client's ring has room; False: refused instead (its backlog
        is full; a RESOURCE_EXHAUSTED error is held for the call, or past twice the limit
        nothing, counted in ``shed_replies``)."""
        queue = self._backlog.get(slot)
        if queue is None:
            queue = self._backlog[slot] = HeldReplies()
        held = queue.hold(slot, gen, head, body, self.limits)
        if held == SHED:
            self.shed_replies += 1
        return held == HELD

    def _flush_backlog(self) -> None:
        """Retry responses that met a full response ring (backpressure; bounded: _hold)."""
        chan = self._chan
        for slot in list(self._backlog):
            queue = self._backlog[slot]
            ring = chan.responses[slot]
            holder = chan.slot_generation(slot)
            while queue:
                gen, head, body = queue.first()
                if holder != gen:
                    queue.pop()
                    continue
                if not self._push_reply(slot, gen, ring, head, body):
                    break
                queue.pop()
            if holder >= 0:
                chan.ring_client(slot, holder)
            if not queue:
                del self._backlog[slot]

    def _drop(self) -> None:
        self.dropped_frames += 1
        self._chan.dropped.fetch_add(1, ACQ_REL)

    # ------------------------------------------------------------------ reserved methods
    def _health(self) -> dict[str, str]:
        """``cxlrpc.health``: SERVING, or NOT_SERVING once close() began (gRPC health's names)."""
        return {"status": "NOT_SERVING" if self._draining else "SERVING"}

    def _list_methods(self) -> list[str]:
        """``cxlrpc.methods``: the user's method names, sorted (not the reserved ones)."""
        return sorted(name for name in self._methods if not name.startswith(fr.RESERVED_PREFIX))



class _Following:
    """A followed request in progress: its frame, extent, and how far its body has come."""

    __slots__ = ("frame", "offset", "length", "lends", "arrived", "body", "done", "since", "idle", "soon")

    def __init__(self, frame: fr.Frame, offset: int, length: int, lends: bool, arrived: float,
                 body: Any) -> None:
        self.frame, self.offset, self.length, self.lends = frame, offset, length, lends
        self.arrived = self.since = arrived  # the clock reading of the poll that found it
        self.body = body  # a memory.FollowedBody
        self.done = 0
        self.idle = 0  # looks in a row that found no progress (they come ever less often)
        self.soon = False  # its next step is due next loop turn (Server._hot_follows counts it)


class _Resumed:
    """Awaiting it goes on driving a coroutine that already ran up to ``step`` (its first
    suspension): what it yields goes to the task, what the task sends or throws goes back."""

    __slots__ = ("_coro", "_step")

    def __init__(self, coro: Any, step: Any) -> None:
        self._coro, self._step = coro, step

    def __await__(self):
        coro, step = self._coro, self._step
        while True:
            try:
                value = yield step
            except BaseException as exc:  # cancellation (or close) of the task
                try:
                    step = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    step = coro.send(value)
                except StopIteration as done:
                    return done.value


class _EagerTask:
    """The current task while a coroutine handler runs its first step inline: what it hands
    to ``asyncio.timeout`` or a TaskGroup there (cancel, cancelling, uncancel) goes to the
    task that carries the handler on once it suspends. (Slots only: the native dispatcher
    reuses one that no handler kept a reference to, so nothing of a call stays on it.)"""

    __slots__ = ("task", "value", "__weakref__")

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None  # carries the handler on, once it suspends
        self.value: Any = None  # the handler's result, when its first step returned

    def cancel(self, msg: Any = None) -> bool:
        return self.task.cancel(msg) if self.task is not None else False

    def cancelling(self) -> int:
        return self.task.cancelling() if self.task is not None else 0

    def uncancel(self) -> int:
        return self.task.uncancel() if self.task is not None else 0

    def done(self) -> bool:
        return False

    def get_name(self) -> str:
        return self.task.get_name() if self.task is not None else "cxlrpc-handler"

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()


def _take_back(view: memoryview) -> None:
    """End a lent body's view once its handler returned: a handler that kept it gets an error
    on use, not bytes of a later request (views it derived stay its own to drop)."""
    try:
        view.release()
    except BufferError:  # the handler still exports it (say, np.frombuffer): it must not
        pass


def _cancel(task: asyncio.Task) -> None:
    """Cancel a call's task once it has started: a task cancelled before its first step never
    runs its body, so its handler's cleanup and the call's bookkeeping would be skipped (a
    CANCEL frame can come in the same batch as its request)."""
    task.get_loop().call_soon(task.cancel)


async def _ready(value: Any) -> Any:
    """An awaitable of ``value`` (a stream handler's replies, when no interceptor makes them)."""
    return value


def _handler_context(call: HandlerContext) -> contextvars.Context:
    """A context of the handler's own (as a task would have), where ``context()`` holds."""
    ctx = contextvars.copy_context()
    ctx.run(_current_call.set, call)
    return ctx


def _current_tasks() -> dict | None:
    """asyncio's dict of each loop's current task, when ``current_task``, ``_enter_task`` and
    ``_leave_task`` all read and write that one dict (the C accelerator of Python 3.10-3.13):
    the native dispatcher then swaps tasks in it directly. None elsewhere (it calls them)."""
    try:
        import _asyncio
    except ImportError:
        return None
    tasks = getattr(_asyncio, "_current_tasks", None)
    if (type(tasks) is dict and tasks is getattr(asyncio.tasks, "_current_tasks", None)
            and _enter_task is getattr(_asyncio, "_enter_task", None)
            and _leave_task is getattr(_asyncio, "_leave_task", None)):
        return tasks
    return None


def _first_step(coro: Any, eager: _EagerTask, loop: asyncio.AbstractEventLoop,
                call: HandlerContext) -> Any:
    """In the handler's context, where ``context()`` becomes ``call``: ``coro.send(None)``
    with ``eager`` as ``loop``'s current task (the reader's, if any, restored): what it yields, or
    _RETURNED with its result in ``eager.value`` (caught here, the StopIteration costs no
    traceback through the callers' frames)."""
    _current_call.set(call)
    reader = _current_task(loop)  # None in a loop callback (a followed request's last step)
    if reader is not None:
        _leave_task(loop, reader)
    _enter_task(loop, eager)
    try:
        return coro.send(None)
    except StopIteration as done:
        eager.value = done.value
        return _RETURNED
    finally:
        _leave_task(loop, eager)
        if reader is not None:
            _enter_task(loop, reader)
