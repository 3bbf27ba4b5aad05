"""The asyncio server: one reader task drains the request ring and dispatches to handlers.

Plain-function handlers run inline (no task, no extra loop iteration). Coroutine handlers
start inline too and get a task only if they suspend, so that they can be cancelled by a
CANCEL frame, a deadline, or their client dying; one that never awaits anything pending costs
what a plain handler costs. A handler learns about its call (deadline, peer, metadata) from
``context``; interceptors wrap every call to the user's methods.

``Server`` is the lifecycle (start, close and its grace, the heartbeat); it owns one
room per concern, each over the transport seam (``cxlrpc.transport``): the serve loop
(``cxlrpc.server_loop``), dispatch (``cxlrpc.server_dispatch``: the method table, a
request's way to its reply, eager tasks, interceptors), streams (``cxlrpc.server_streams``),
replies and their backlog (``cxlrpc.server_replies``), out-of-line bodies
(``cxlrpc.server_bodies``) and departures with their fencing (``cxlrpc.server_peers``).
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Sequence

from . import frame as fr
from .bounds import Limits
from .channel import KIND_RPC, FlushServerChannel, Geometry, ServerChannel, layout, server_channel
from .doorbell import WaitStrategy, resolve
from .errors import RpcError
from .fencing import Fences
from .heap import FOLLOW_MIN, SPARE_SHARE, HeapAccess, ServerHeap
from .memory import HARDWARE
from .process_heap import keep_freed_heap
from .region import Region, RegionError, coherence_for, parse_url
from .server_bodies import Bodies
from .server_context import (CallKey, Handler, HandlerContext, Peer, PeerInfo, ServerInterceptor,
                             context, current_peer)
from .server_dispatch import Dispatch
from .server_loop import ServeLoop
from .server_peers import Departures
from .server_replies import Replies
from .server_streams import StreamEngine
from .server_tasks import _cancel
from .service import add_service
from .size_guard import TruncationWatch
from .streams import STREAM_WINDOW
from .transport import ServerTransport

__all__ = ["Server", "Peer", "PeerInfo", "HandlerContext", "ServerInterceptor", "Handler", "context",
           "current_peer", "STREAM_WINDOW"]


def _transport(region: Region, geo: Geometry, poll_interval: float) -> ServerTransport:
    """The server's side of the region's layout, as the transport the rooms serve."""
    chan: ServerChannel | FlushServerChannel = server_channel(region, geo, poll_interval)
    return chan


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
    server (see ``close``; None: cancel them at once).

    ``interceptors`` wrap every call to the user's methods, the first outermost (see
    ``ServerInterceptor``); the reserved ``cxlrpc.*`` methods bypass them.

    ``fence_timeout``: a client reaped for a stale heartbeat (``client_timeout``) may only be
    frozen; what it held (its heap extents; in flush mode its slot too) is handed to others
    only once it is *fenced* (``on_fenced``): when its process exits (same host), or
    ``fence_timeout`` seconds after it was reaped when it runs on another host (or its PID
    cannot be watched).

    What one client may make the server hold is bounded per connection, each overflow answered
    RESOURCE_EXHAUSTED to that client alone (see ``cxlrpc.bounds.Limits``): replies held
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
        fences = Fences(fence_timeout)  # (validates it)
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
        interceptors = tuple(interceptors)
        self.url = url
        #: "hardware" (one host, or coherent CXL) or "flush" (hosts without cache coherence:
        #: a single-writer layout, every published line written back); sim:// is "flush".
        self.coherence = coherence_for(url, coherence)
        if request_capacity is None:  # one shared ring, or (flush) one per client
            request_capacity = 4 << 20 if self.coherence == HARDWARE else 1 << 20
        #: Largest request or response body; bodies too big for a ring go through the heap
        #: (``heap_size`` bytes, by default ``max_message_size``: one such body at a time,
        #: plus an eighth more for clients' spare extents: cxlrpc.heap).
        self.max_message_size = max_message_size
        if heap_size is None:
            heap_size = max_message_size + max_message_size // SPARE_SHARE
        self.geometry = layout(slots, request_capacity, response_capacity, self.coherence,
                               heap_size, max_message_size)
        self.size = max(size or 0, self.geometry.size)
        self.strategy = resolve(doorbell)
        self.client_timeout = client_timeout
        self.heartbeat_interval = heartbeat_interval
        self.poll_interval = poll_interval
        self.mode = mode
        #: Seconds ``async with`` lets calls in flight finish when it closes the server.
        self.shutdown_grace = shutdown_grace
        # the rooms, each over the transport once start() made it (shared tables: one object)
        self._tasks: dict[CallKey, asyncio.Task[Any]] = {}  # calls carried on by tasks
        cancelled_with: dict[CallKey, RpcError] = {}
        heap_waiting: list[tuple[Any, ...]] = []
        self._replies = Replies(self.limits, max_message_size, heap_waiting, error_details)
        self._bodies = Bodies(self.limits, self._replies, heap_waiting)
        self._streams = StreamEngine(self.limits, interceptors, self._replies, self._bodies, self._tasks,
                                     cancelled_with)
        self._departures = Departures(fences, self._tasks, self._replies, self._bodies)
        self._calls = Dispatch(self.limits, interceptors, self._replies, self._bodies,
                               self._streams, self._departures, self._tasks, cancelled_with,
                               self._note_drained, {fr.HEALTH: self._health,
                                                    fr.LIST_METHODS: self._list_methods})
        #: the method table the dispatch room serves (cxlrpc.service reads and prunes it too)
        self._methods = self._calls._methods
        self._region: Region | None = None
        self._chan: ServerTransport
        self._reader: asyncio.Task[None] | None = None
        self._grace_over = asyncio.Event()
        self._grace_timer: asyncio.TimerHandle | None = None
        self._closed = asyncio.Event()
        self._beat_stop = threading.Event()
        self._beater: threading.Thread | None = None
        #: looks at the region files' sizes (set by start(); see cxlrpc.size_guard)
        self._cuts = TruncationWatch()
        self._failure: RegionError | None = None  # why the server stopped by itself
        self._cut_close: asyncio.Future[None] | None = None  # the close that failure began

    @property
    def error_details(self) -> bool:
        """Whether clients see a failing handler's exception text (False: a generic message;
        the server logs the traceback either way)."""
        return self._replies.error_details

    @error_details.setter
    def error_details(self, value: bool) -> None:
        self._replies.error_details = value

    @property
    def dropped_frames(self) -> int:
        """Frames dropped: garbage, or from a slot's departed holder."""
        return self._calls.dropped_frames

    @property
    def shed_replies(self) -> int:
        """Replies dropped past a connection's backlog limits (their calls end at their deadline)."""
        return self._replies.shed_replies

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
        """Serve ``fn`` as ``name`` (see ``method``); names under ``cxlrpc.`` are reserved.
        ``requests``: whether ``fn`` reads a stream of requests (None: it does when its
        parameter is annotated ``AsyncIterator[T]``)."""
        fr.method_bytes(name)
        if name.startswith(fr.RESERVED_PREFIX):
            raise ValueError(f"method {name!r}: names starting with {fr.RESERVED_PREFIX!r} are "
                             f"reserved for the methods every server answers")
        self._calls.register(name, fn, blocking, requests)

    def add_service(self, service: type, impl: object, prefix: str | None = None) -> None:
        """Serve ``impl``'s methods under the names the typed ``service`` declares
        (``"Service.method"`` unless ``prefix`` says otherwise; see ``cxlrpc.service``)."""
        add_service(self, service, impl, prefix)

    def on_disconnect(self, callback: Callable[[Peer], None]) -> None:
        """Call ``callback(peer)`` when a client detaches or is reaped (to drop what it held)."""
        self._departures.on_disconnect.append(callback)

    def on_fenced(self, callback: Callable[[Peer], None]) -> None:
        """Call ``callback(peer)`` once per departed client, after its on_disconnect callbacks,
        once it can no longer write into the region (to free what it could still write into):
        at once when it detached or its process is gone (same host); for a client reaped on a
        stale heartbeat whose process still runs here (frozen), when that process exits; for
        one on another host, ``fence_timeout`` seconds after it was reaped. Fences still
        pending when the server closes are dropped, without calls (the region goes too)."""
        self._departures.on_fenced.append(callback)

    # ------------------------------------------------------------------ lifetime
    async def start(self) -> None:
        """Create the region (replacing a stale one left by a dead server) and start serving."""
        if self._region is not None:
            raise RuntimeError("server already started")
        keep_freed_heap()  # big requests land in fresh bytes objects: no page faults for them
        try:
            self._region = region = Region.acquire(self.url, self.size, KIND_RPC, self.mode,
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

        def on_cut(message: str) -> None:  # (from the heartbeat's thread)
            loop.call_soon_threadsafe(self._region_cut, message)

        self._cuts.on_cut = on_cut
        self._cuts.add(region.size_guard)
        # beat from the start: a racing server sees this region being created, not abandoned
        self._beater = threading.Thread(target=self._beat, name="cxlrpc-server-heartbeat", daemon=True)
        self._beater.start()
        geo = self.geometry
        heap, follow_min, body_limit = None, self._replies.follow_min, self.max_message_size
        try:
            self._chan = chan = _transport(region, geo, self.poll_interval)
            if geo.heap_size:
                # spares take what the heap has beyond one body of max_message_size
                heap = ServerHeap(HeapAccess(region.buf, region.mem, geo.heap, geo.heap_size),
                                  max(0, geo.heap_size - self.max_message_size))
                body_limit = min(self.max_message_size, geo.heap_size)
                if not region.mem.flushing or region.mem.lines is not None:
                    follow_min = FOLLOW_MIN  # (without coherence through the native module's flushed copies)
        except BaseException:
            self._stop_beating()
            region.mark_closed()
            region.unlink()
            region.close()
            self._region = None
            raise
        region.publish()
        self._replies.attach(chan, heap, follow_min, body_limit)
        self._bodies.attach(heap, follow_min, loop)
        self._streams.attach(chan)
        self._departures.attach(chan)
        self._calls.attach(chan, heap, (geo.heap, geo.heap_size), follow_min, body_limit, loop)
        self._reader = loop.create_task(ServeLoop(
            chan, self.strategy, self.client_timeout, self.url, self._cuts, self._calls, self._replies,
            self._bodies, self._departures, self._tasks, self._note_drained).run())

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
        calls = self._calls
        if calls._draining:
            await self._closed.wait()
            return
        calls._draining = True
        if calls._fast is not None:
            calls._fast.enabled = 0  # new calls are refused: the reference says so
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
        if not self._tasks and not self._replies.backlog and not self._bodies.following:
            self._grace_over.set()

    async def _stop(self) -> None:
        """Close at once: state CLOSED (clients see UNAVAILABLE), the reader and every call
        left cancelled, then the region released (even if this is cancelled meanwhile)."""
        self._calls._closing = True
        self._grace_over.set()  # also when close() was cancelled in its grace
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        self._chan.close()  # state CLOSED + wake every client
        self._departures.fences.close()  # pending fences dropped: the region goes with the server
        reader, region = self._reader, self._region
        assert reader is not None and region is not None  # (started)
        reader.cancel()
        self._bodies.stop()  # followed requests' steps find nothing to do
        tasks = list(self._tasks.values())
        for t in tasks:
            _cancel(t)
        try:
            await asyncio.gather(reader, *tasks, return_exceptions=True)
        finally:
            self._stop_beating()
            region.mark_closed()
            region.unlink()
            region.close()
            self._closed.set()

    async def serve_forever(self) -> None:
        """Wait until ``close`` is called (by a handler, a signal handler or another task);
        RegionError when the server stopped by itself (its region's file was truncated)."""
        await self._closed.wait()
        if self._failure is not None:
            raise self._failure

    def guard_region(self, region: Region) -> None:
        """Also look at ``region``'s file (e.g. kvservice's pool) as at the server's own: a
        truncation found is undone and stops the server (see ``cxlrpc.size_guard``)."""
        self._cuts.add(region.size_guard)

    def _region_cut(self, message: str) -> None:
        """A region's file was found truncated (and grown back): stop, with that error."""
        if self._failure is None and not self._calls._draining:
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
        assert region is not None  # (start() begins the beat once the region is acquired)
        while not self._beat_stop.wait(self.heartbeat_interval):
            if cuts.check():  # grown back, not touched: the server stops
                return
            region.beat()

    # ------------------------------------------------------------------ reserved methods
    def _health(self) -> dict[str, str]:
        """``cxlrpc.health``: SERVING, or NOT_SERVING once close() began (gRPC health's names)."""
        return {"status": "NOT_SERVING" if self._calls._draining else "SERVING"}

    def _list_methods(self) -> list[str]:
        """``cxlrpc.methods``: the user's method names, sorted (not the reserved ones)."""
        return sorted(name for name in self._methods if not name.startswith(fr.RESERVED_PREFIX))
