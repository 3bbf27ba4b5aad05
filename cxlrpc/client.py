"""Clients: the asyncio :class:`Client` (primary) and the blocking :class:`SyncClient`.

Both claim a slot in the server's region, push request frames into the shared MPSC ring,
and read replies from their own SPSC ring.  A monitor thread beats the slot's heartbeat
and watches the server's, so a dead server surfaces as ``Unavailable`` within
``server_timeout`` instead of a hang; the next call then reconnects.

Neither the monitor thread nor the reader task holds the client (they keep a weak reference
and a :class:`_Link` of what they need), so a client dropped without ``close()`` is collected:
its finalizer frees the slot and warns (``ResourceWarning``), as sockets do.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import os
import sys
import threading
import time
import warnings
import weakref
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, NamedTuple, Sequence

import msgspec

from . import frame as fr
from .channel import KIND_RPC, ClientChannel, FlushClientChannel, client_channel
from .doorbell import WaitStrategy, resolve
from .errors import (DeadlineExceeded, InvalidArgument, ResourceExhausted, RpcError, StatusCode,
                     Unavailable, error_for)
from . import heap as heap_settings
from .heap import EXTENT, FOLLOW_HEADER, FOLLOW_MIN, GRANT, OFFSET, SEAL_BROKEN, HeapAccess, seal_word
from .memory import FOLLOW_CHUNK, SealBroken
from .process_heap import keep_freed_heap
from .service import S, stub
from .streams import StreamCall
from .region import Region, RegionError
from .size_guard import cut_message
from .ring import ClaimRevoked

try:  # calls of the common shape in C (CXLRPC_NO_NATIVE=1: the reference only)
    from ._dispatch import Caller as _Caller
except ImportError:
    _Caller = None
if os.environ.get("CXLRPC_NO_NATIVE"):
    _Caller = None

_BEAT_INTERVAL = 0.1
#: How soon a credit that met a full request ring is offered again.
_CREDIT_RETRY_S = 0.0005
#: Longest the sole caller in flight holds the event loop polling for its reply (within the
#: strategy's spin phase) once it waits on the awaited path; other tasks wait at most this long.
_HOT_SPIN_S = 20e-6
#: Longest a call waits for its reply in place (the native caller: no future, no loop turn),
#: through the strategy's spin phase and then its yield phase (the CPU is given up between
#: polls, the loop is not); other tasks wait at most this long. A kv get's reply comes 8-10 us
#: after it is sent: a 10 us window sent a quarter of them the slow way.
_HOT_WINDOW_S = 40e-6
#: Backoff between looks for a server while ``wait_for_ready`` lets a connection wait.
_RETRY_FIRST, _RETRY_MAX = 0.002, 0.1


#: A client interceptor: ``await interceptor(method, arg, metadata, next)`` makes the call
#: when it awaits ``next(method, arg, metadata)`` (``metadata``: a dict of its own to change);
#: it may raise instead, or return another result. SyncClient's are plain functions.
ClientInterceptor = Callable[[str, Any, dict, Callable[[str, Any, dict], Any]], Any]


class _LateReply:
    """Where the reply of a call whose caller gave up goes (``Client.call``'s ``on_late_reply``)."""

    __slots__ = ("callback", "response_type", "waiting")

    def __init__(self, callback: Callable[[Any], None], response_type: Any) -> None:
        self.callback = callback
        self.response_type = response_type
        self.waiting = False  # the request left: its reply will come to the callback


class _Encoded(NamedTuple):
    """A request body the native caller encoded but did not send (too big for the ring, or the
    ring was full): the reference sends it as it is, not encoding it again."""

    flags: int
    body: bytes | memoryview


class _Large(NamedTuple):
    """A request too big for the ring: its body goes through the server's heap (its metadata
    block stays in the frame)."""

    flags: int
    method_len: int
    prefix: bytes  # the method name, then the metadata block if any
    body: bytes | memoryview
    follow: bool = False  # written after its frame is sent, the server following (cxlrpc.heap)

    @property
    def extent_size(self) -> int:
        """The heap bytes to ALLOC: a followed body's progress word comes first."""
        return FOLLOW_HEADER + len(self.body) if self.follow else len(self.body)


def _grant(reply: bytes) -> tuple[int, bool]:
    """What an ALLOC's reply grants: the extent's offset, and whether it is a spare."""
    if len(reply) != GRANT.size:
        raise InvalidArgument(f"the server's heap grant is {len(reply)} bytes, not {GRANT.size}")
    offset, spare = GRANT.unpack(reply)
    return offset, spare == 1


def _native_decode(response_type: Any) -> Any:
    """What the native caller decodes a typed reply with: ``response_type``'s decode function,
    or False (a Frame back) for a type msgspec cannot decode into (``_answer`` says so)."""
    try:
        return fr.decoder(response_type)
    except Exception:
        return False


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


def _attach(url: str, poll_interval: float,
            stopped_beat: tuple[int, int] | None = None) -> ClientChannel | FlushClientChannel:
    """Claim a slot of the server at ``url``. ``stopped_beat``: the (epoch, heartbeat) of a
    server judged gone; a region still showing them has no server (a server on another host
    cannot unlink its region when it dies, nor acknowledge us)."""
    try:
        region = Region.open(url, kind=KIND_RPC)
    except FileNotFoundError as exc:
        raise Unavailable(f"no server at {url}") from exc
    except RegionError as exc:
        raise Unavailable(f"cannot use {url}: {exc}") from exc
    try:
        if region.owner_alive_locally() is False:  # a region left by a server that closed or died
            raise Unavailable(f"no server at {url} (its last server is gone)")
        if stopped_beat is not None and (region.epoch, region.heartbeat_value()) == stopped_beat:
            raise Unavailable(f"no server at {url} (its heartbeat has not moved since it stopped)")
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


class _Link:
    """One connection: its channel and the monitor thread beating its slot (and, for
    :class:`Client`, the loop and reader task). It holds nothing of the client, so a client
    dropped without ``close()`` is collected, and its finalizer ends the connection here."""

    def __init__(self, chan: ClientChannel | FlushClientChannel, client: "_Base") -> None:
        self.chan = chan
        self.stop = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.reader: asyncio.Task | None = None
        self._closed = False
        self.monitor = threading.Thread(target=_watch, name="cxlrpc-client-monitor", daemon=True,
                                        args=(weakref.ref(client), chan, self.stop, client.server_timeout))
        self.monitor.start()

    def close(self) -> None:
        """Stop the monitor, detach (wake-up socket closed, slot released) and unmap; only
        once the reader task, if any, has ended (it reads the mapping)."""
        if self._closed:
            return
        self._closed = True
        self.stop.set()
        if self.monitor is not threading.current_thread():
            self.monitor.join()
        self.chan.detach()
        self.chan.region.close()

    def abandon(self) -> None:
        """For a client collected unclosed (in whatever thread the collector runs): free the
        slot at once; the rest on the reader's loop once the reader has ended."""
        self.stop.set()
        loop = self.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._end_reader)
            except RuntimeError:
                pass  # the loop closed meanwhile: its tasks will never run again
            else:
                # The slot's next holder may take it before our parked word is cleared (the
                # reader's and the socket's last store): at worst it misses one wake-up and
                # looks at its ring 0.1 s later.
                self.chan.release()
                return
        self.close()

    def _end_reader(self) -> None:
        reader = self.reader
        if reader is None or reader.done():
            self.close()
        else:
            reader.cancel()
            reader.add_done_callback(lambda _: self.close())


def _watch(ref: "weakref.ref[_Base]", chan: ClientChannel | FlushClientChannel,
           stop: threading.Event, server_timeout: float) -> None:
    """The monitor thread: beat our slot's heartbeat and tell the client when its server is
    gone, or its region's file was truncated (looked at first: then the region is not touched,
    and calls fail with Unavailable). It holds the client only for a moment per beat."""
    while not stop.wait(_BEAT_INTERVAL):
        client = ref()
        if client is None:
            return
        cut = chan.region.size_guard.short()
        if client._gone is None and client._chan is chan:
            reason = cut_message(chan.region.url, cut) if cut is not None else chan.server_gone(server_timeout)
            if reason is not None:
                if cut is None:
                    client._stopped_beat = chan.stopped_beat
                client._set_gone(reason)
        del client  # the finalizer of a client dropped meanwhile may run here: it sets stop
        if stop.is_set():
            return
        if cut is None and chan.holds_slot():
            chan.beat()  # a reaped client stops writing its old slot's words


def _collected(link: _Link, what: str) -> None:
    """Finalizer of a client dropped without ``close()``: end its connection, and say so."""
    try:
        link.abandon()
    finally:
        warnings.warn(f"unclosed cxlrpc client {what}: its slot was freed when it was collected; "
                      f"close() it or use a with block", ResourceWarning)


def _wait_end(wait_for_ready: float | bool, now: float) -> float | None:
    """When a connection stops looking for a server: at once (False), never (True), or after
    ``wait_for_ready`` seconds."""
    return None if wait_for_ready is True else now + float(wait_for_ready)


def _lost(reason: str | None, exc: RpcError) -> RpcError:
    """The error of a failed attempt: a reconnection's is Unavailable and says why it was needed."""
    if reason is None:
        return exc
    return Unavailable(f"{reason}; reconnecting failed: {exc.message}")


class _Base:
    """What both clients share: the connection, request encoding, the monitor thread."""

    def __init__(self, url: str, doorbell: WaitStrategy | str | None, server_timeout: float,
                 poll_interval: float, wait_for_ready: float | bool) -> None:
        if not poll_interval > 0:
            raise ValueError("poll_interval must be > 0 seconds")
        if not (isinstance(wait_for_ready, bool) or wait_for_ready >= 0):
            raise ValueError("wait_for_ready must be a bool or >= 0 seconds")
        self.url = url
        self.strategy = resolve(doorbell)
        self.server_timeout = server_timeout
        self.poll_interval = poll_interval
        #: How long connecting (and reconnecting) waits for a server: not at all (False),
        #: that many seconds, or without limit (True).
        self.wait_for_ready = wait_for_ready
        self._chan: ClientChannel | FlushClientChannel | None = None
        self._link: _Link | None = None
        self._finalizer: weakref.finalize | None = None
        self._ids = itertools.count(1)
        self._methods: dict[str, bytes] = {}
        #: Why calls cannot go out now (None while connected): the one check on the hot path.
        self._gone: str | None = "client is not connected"
        self._closed = False
        self._connected_once = False  # a failed attempt after this is a failed reconnection
        self._heap: HeapAccess | None = None
        self._frees: list[int] = []  # heap extents of replies read, to give back
        self._allocs: set[int] = set()  # call ids of ALLOCs whose reply may still come
        self._stopped_beat: tuple[int, int] | None = None  # of the server last judged gone
        #: The connection's native caller (None: the reference only), and how long a lone
        #: caller polls for its reply without giving the loop a turn.
        self._caller: Any = None
        self._hot_s = self._hot_spin_s = 0.0  # the in-place wait, and its spin part
        #: unary requests with bodies in [_follow_min, _follow_max] are followed (cxlrpc.heap):
        #: on coherent memory with a heap only
        self._follow_min, self._follow_max = sys.maxsize, 0
        self._followed: dict[int, bytes] = {}  # call id -> method name, of followed calls out
        self._in_place: set[bytes] = set()  # methods that read their bodies in place: not followed
        #: an extent the server granted as a spare (cxlrpc.heap), kept for the next followed
        #: request (no ALLOC round trip then): (offset, size)
        self._spare: tuple[int, int] | None = None

    def _open(self) -> _Link:
        """Attach (claim a slot) and start the monitor: a connection not yet acknowledged."""
        keep_freed_heap()  # big replies land in fresh bytes objects: no page faults for them
        chan = _attach(self.url, self.poll_interval, self._stopped_beat)
        try:
            link = _Link(chan, self)
        except BaseException:
            chan.detach()
            chan.region.close()
            raise
        self._link, self._chan = link, chan
        # (no reply is polled for in place while the server shares this process: it could not
        # answer before the loop turns)
        strategy = self.strategy
        self._hot_s = 0.0 if chan.server_in_process else min(_HOT_WINDOW_S,
                                                              strategy.spin_s + strategy.yield_s)
        self._hot_spin_s = min(self._hot_s, strategy.spin_s)
        geo, region = chan.geo, chan.region
        following = geo.heap_size > FOLLOW_HEADER and not region.mem.flushing
        if following:
            self._follow_min = FOLLOW_MIN
            self._follow_max = min(geo.heap_size, geo.max_message_size) - FOLLOW_HEADER  # ALLOC's limit
        if _Caller is not None and isinstance(chan, ClientChannel):
            # through a proxy: the client stays collectable when dropped unclosed (the stall
            # after which it gives up a followed reply is read now)
            bell = chan.server_bell
            self._caller = _Caller(weakref.proxy(self), self._methods, chan.requests,
                                   chan.push_args(), bell.ring, chan.responses, fr.encode_body,
                                   fr.decode, chan.slot, chan.gen,
                                   min(chan.requests.max_payload, fr.HEADER_SIZE + self._follow_min - 1),
                                   chan.region.buf, bell.parked_at, bell.me, self._in_flight(),
                                   self._owed_turns(), self._in_place, geo.heap, geo.heap_size,
                                   FOLLOW_CHUNK, heap_settings.FOLLOW_STALL_S if following else 0.0,
                                   heap_settings.FOLLOW_MIN_RATE, fr.encode_msgpack)
        # (our followed extents hold this seal while they are ours: cxlrpc.heap)
        self._heap = HeapAccess(region.buf, region.mem, geo.heap, geo.heap_size, seal_word(chan.slot, chan.gen))
        self._finalizer = weakref.finalize(self, _collected, link, f"{type(self).__name__}({self.url!r})")
        self._finalizer.atexit = False  # at exit the server reclaims the slot by our PID
        return link

    def _in_flight(self) -> tuple:
        """The containers of work in flight that the native caller leaves to the reference
        while any holds something (heap extents of replies read, not yet given back)."""
        return (self._frees,)

    def _owed_turns(self) -> tuple:
        """The containers of tasks owed a loop turn before a call goes natively (none here)."""
        return ()

    def _forget_link(self) -> _Link | None:
        """Take the connection away from the client (the caller ends it); ``_gone`` is set."""
        link, self._link = self._link, None
        if link is not None:
            self._finalizer.detach()
            self._chan = self._heap = self._caller = None
            self._frees.clear()  # extents of that server's heap
            self._allocs.clear()
            self._spare = None
        return link

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
        """Has the server seen us yet? ResourceExhausted when every slot is taken."""
        try:
            return self._chan.acknowledged()
        except BlockingIOError as exc:
            raise ResourceExhausted(str(exc)) from exc

    def _unacknowledged(self, waited: float) -> Unavailable:
        return Unavailable(f"the server at {self.url} did not acknowledge this connection within "
                           f"{waited:.1f} s")

    def _push(self, parts: tuple) -> bool:
        """Push a request as our slot's producer; Unavailable if the server reclaimed the slot."""
        try:
            return self._chan.push(parts)
        except ClaimRevoked as exc:
            raise self._revoked(exc) from exc

    def _revoked(self, exc: ClaimRevoked) -> Unavailable:
        """The server reclaimed our slot (it judged us dead): the connection is gone."""
        self._set_gone(f"the server reclaimed this client's slot ({exc})")
        return Unavailable(self._gone)

    def _request(self, call_id: int, method: str, arg: Any, timeout: float,
                 metadata: Mapping[str, str] | None = None, flags: int = 0,
                 follow: bool = False) -> tuple | _Large:
        """The parts of a request record: header, method name (then the metadata block, if
        any), body; or the request to send through the heap (``follow``: a unary call's big
        body may be followed)."""
        mb = self._methods.get(method)
        if mb is None:
            mb = fr.method_bytes(method)
            if len(self._methods) < 4096:
                self._methods[method] = mb
        if type(arg) is bytes:
            flags |= fr.RAW
            body = arg
        elif type(arg) is _Encoded:
            flags |= arg.flags
            body = arg.body
        else:
            raw, body = fr.encode_body(arg)
            flags |= raw
        prefix = mb
        if metadata:
            prefix = mb + fr.encode_metadata(metadata)
            flags |= fr.META
        chan = self._chan
        head = fr.HEADER.pack(fr.REQUEST, flags, 0, chan.slot, chan.gen, call_id, timeout, len(mb))
        if follow and self._follow_min <= len(body) <= self._follow_max and mb not in self._in_place:
            if type(body) is not bytes:
                body = memoryview(body)
                body = body.cast("B") if body.c_contiguous else body.tobytes()
            if self._follow_min <= len(body) <= self._follow_max:  # its bytes, not its items
                large = self._out_of_line(flags, len(mb), prefix, body, "request")
                return large._replace(follow=True)
        if len(head) + len(prefix) + len(body) > chan.requests.max_payload:
            return self._out_of_line(flags, len(mb), prefix, body, "request")
        return head, prefix, body

    def _out_of_line(self, flags: int, method_len: int, prefix: bytes, body: bytes | memoryview,
                     what: str) -> _Large:
        """A body too big for the request ring, to go through the server's heap (or the
        ResourceExhausted naming the limit it breaks)."""
        chan = self._chan
        limit, ring_limit = chan.geo.max_message_size, chan.requests.max_payload
        if not chan.geo.heap_size:
            raise ResourceExhausted(f"{what} of {len(body)} bytes exceeds the request ring's "
                                    f"limit {ring_limit} (the server has no heap)")
        if len(body) > limit:
            raise ResourceExhausted(f"{what} of {len(body)} bytes exceeds the server's "
                                    f"max_message_size={limit}")
        if fr.HEADER_SIZE + len(prefix) + EXTENT.size > ring_limit:
            raise ResourceExhausted(f"request metadata of {len(prefix) - method_len} bytes does "
                                    f"not fit the request ring's limit {ring_limit}")
        return _Large(flags, method_len, prefix, body)

    def _alloc_request(self, size: int, timeout: float, spare: bool = False) -> tuple[int, tuple]:
        """An ALLOC frame asking the server for ``size`` bytes of heap (as a spare, for a
        followed request): (its call id, parts)."""
        chan = self._chan
        alloc_id = next(self._ids)
        self._allocs.add(alloc_id)
        head = fr.header(fr.ALLOC, fr.RAW, 0, chan.slot, chan.gen, alloc_id, timeout, b"")
        return alloc_id, (head, GRANT.pack(size, spare))

    def _take_spare(self, large: _Large) -> tuple[int, int] | None:
        """The spare extent for a followed request if it is big enough (one too small is
        given back): (offset, size); None to ALLOC one."""
        spare = self._spare
        if spare is None or not large.follow:
            return None
        self._spare = None
        if spare[1] >= large.extent_size:
            return spare
        self._give_back(spare[0])
        return None

    def _settle(self, chan: Any, offset: int, size: int, method: bytes, answered: bool) -> None:
        """A spare extent once its call ended: kept if the call was answered (the server has
        read the body) and no spare is kept yet, else given back (freed at once, or once the
        server has stopped reading it)."""
        if chan is not self._chan:
            return  # its server's heap is gone (and its extents freed) with the connection
        if answered and self._spare is None and method not in self._in_place:
            self._spare = (offset, size)
        else:
            self._give_back(offset)

    def _staged(self, large: _Large, offset: int, call_id: int, timeout: float,
                kind: int = fr.REQUEST) -> tuple:
        """Write the body into the extent at ``offset`` (a followed one: zero its progress
        word, the body comes after the frame); the record's parts."""
        chan = self._chan
        try:
            if large.follow:
                self._heap.check(offset, large.extent_size)
                self._heap.begin_publish(offset)
            else:
                self._heap.write(offset, (large.body,))
        except SealBroken:
            raise self._extent_revoked() from None
        except ValueError as exc:
            raise InvalidArgument(f"the server granted a bad heap extent: {exc}") from exc
        flags = large.flags | fr.HEAP | (fr.FOLLOW if large.follow else 0)
        head = fr.HEADER.pack(kind, flags, 0, chan.slot, chan.gen, call_id, timeout, large.method_len)
        return head, large.prefix, EXTENT.pack(offset, len(large.body))

    def _heap_body(self, f: fr.Frame, wanted: bool) -> bool:
        """An out-of-line reply: copy its body out (if ``wanted``; a followed one as the server
        writes it) and give the extent back; False when the extent is garbage. A followed body
        the server stopped writing, or whose progress is garbage, or whose extent's seal is no
        longer ours (we were reaped: never given back then), turns ``f`` into an error."""
        if len(f.body) != EXTENT.size:
            return False
        offset, length = EXTENT.unpack(f.body)
        ours = True
        try:
            if not wanted:
                body = b""
            elif f.flags & fr.FOLLOW:
                self._heap.check(offset, FOLLOW_HEADER + length)
                try:
                    body = self._heap.follow(offset, length)
                except SealBroken:
                    f.kind, f.status, f.flags = fr.ERROR, int(StatusCode.UNAVAILABLE), fr.RAW
                    body, ours = SEAL_BROKEN.encode(), False
                except (TimeoutError, ValueError) as exc:
                    f.kind, f.status, f.flags = fr.ERROR, int(StatusCode.UNAVAILABLE), fr.RAW
                    body = f"the server stopped writing the reply's body: {exc}".encode()
                    self._send_cancel(f.call_id)  # a stream's handler would go on sending
            else:
                body = self._heap.read(offset, length)
        except ValueError:
            return False
        f.body, f.flags = body, f.flags & ~(fr.HEAP | fr.FOLLOW)
        if ours:
            self._give_back(offset)
        return True

    def _publish_body(self, offset: int, body: bytes | memoryview) -> None:
        """Write a followed request's body into our extent at ``offset``, stopping (Unavailable)
        once its seal says it is not ours: the server reaped us (a frozen client resumed)."""
        try:
            self._heap.publish(offset, body)
        except SealBroken:
            raise self._extent_revoked() from None

    def _extent_revoked(self) -> Unavailable:
        """The error of a call whose followed request's extent was taken back (the native
        caller raises it too)."""
        return Unavailable(f"the request body was not written whole: {SEAL_BROKEN}")

    def _reply_unfollowed(self, call_id: int, offset: int, why: str | None) -> Unavailable:
        """The native caller's followed reply whose server stopped writing it (``why`` None) or
        whose progress is garbage: cancel the call, give the extent back, and the error to raise
        (as :meth:`_heap_body` makes it); or whose seal is not ours (``why`` SEAL_BROKEN): the
        error alone (the extent is not ours to give back)."""
        if why == SEAL_BROKEN:
            return Unavailable(SEAL_BROKEN)
        if why is None:
            why = (f"the writer stopped for {heap_settings.FOLLOW_STALL_S} s or was slower than "
                   f"{heap_settings.FOLLOW_MIN_RATE:.3g} B/s")
        self._send_cancel(call_id)
        self._give_back(offset)
        return Unavailable(f"the server stopped writing the reply's body: {why}")

    def _own_reply(self, view: memoryview) -> fr.Frame | None:
        """A reply record decoded, or None: garbage (counted dropped) or a reply meant for this
        slot's previous holder."""
        chan = self._chan
        try:
            f = fr.decode(view)
        except fr.FrameError:
            chan.responses.dropped += 1
            return None
        return f if f.gen == chan.gen and f.slot == chan.slot else None

    def _granted_late(self, f: fr.Frame) -> None:
        """A reply nobody waits for: if it grants an extent (its ALLOC was abandoned), give
        the extent back; if it carries one, too."""
        if f.call_id in self._allocs:
            self._allocs.discard(f.call_id)
            if f.kind == fr.RESPONSE and len(f.body) == GRANT.size:
                self._give_back(GRANT.unpack(f.body)[0])
        elif f.flags & fr.HEAP:
            self._heap_body(f, wanted=False)

    def _give_back(self, offset: int) -> None:
        """Queue a FREE of a heap extent and send what the ring takes now (none to a server
        that is gone: its heap went with it, or it freed our extents when it reaped us)."""
        if self._gone is None:
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

    def send_nowait(self, method: str, arg: Any = None, *,
                    metadata: Mapping[str, str] | None = None) -> None:
        """One-way call: queue ``method(arg)`` without waiting and without a reply (ordered
        with this client's other calls). ``ResourceExhausted`` if the request ring is full;
        ``Unavailable`` while the server is gone (the next :meth:`call` reconnects). It does
        not go through the client's interceptors (they are async): pass ``metadata`` here."""
        if self._gone is not None:
            raise Unavailable(self._gone)
        chan = self._chan
        parts = self._request(fr.NO_REPLY, method, arg, 0.0, metadata)
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

    def _answer(self, f: fr.Frame, response_type: Any) -> Any:
        """What a reply to a call carries: its result, or the RpcError it is (raised)."""
        if not f.flags and f.kind == fr.RESPONSE:  # a plain encoded result (a kv get's leases)
            try:
                return fr.decoder(response_type)(f.body)
            except Exception:
                pass  # the checks below say why not
        if f.flags & fr.HEAP and not self._heap_body(f, wanted=True):
            raise InvalidArgument("the reply's heap extent is not inside the heap")
        if f.kind == fr.RESPONSE and f.flags & fr.RAW and response_type is None:
            if f.flags & fr.IN_PLACE:
                self._read_in_place(f)
            return f.body  # raw bytes: nothing to decode
        return self._decode_reply(f, response_type)

    def _read_in_place(self, f: fr.Frame) -> None:
        """The reply's method reads its body in place: its calls stop following bodies."""
        method = self._followed.get(f.call_id)
        if method is not None and len(self._in_place) < 4096:
            self._in_place.add(method)

    def _decode_reply(self, f: fr.Frame, response_type: Any) -> Any:
        if f.flags & fr.IN_PLACE:
            self._read_in_place(f)
        if f.kind == fr.ERROR:
            raise error_for(f.status, f.body.decode(errors="replace"))
        try:
            return fr.decode_body(f.flags, f.body, response_type)
        except Exception as exc:
            raise InvalidArgument(f"reply does not decode as {response_type}: {exc}") from exc


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
        self._interceptors = _checked(interceptors)
        self._pending: dict[int, tuple[asyncio.Future, Any]] = {}
        #: calls whose callers gave up, by call id: their replies go to on_late_reply
        self._late: dict[int, _LateReply] = {}
        self._streams: dict[int, StreamCall] = {}  # streaming calls open, by call id
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Task | None = None  # the attempt callers share
        self._waiting = 0  # callers waiting for it
        self._direct = False  # a caller is polling the reply ring itself
        self._reader_wake: asyncio.Future | None = None
        self._direct_exhausted = False  # the direct poll spent the spin and yield budget
        #: calls whose reply this client handed over while their task has not run since
        self._woken: set[int] = set()
        #: callers that gave the loop a turn before calling and not yet resumed (one entry each)
        self._yielding: list[None] = []

    def _in_flight(self) -> tuple:
        """Calls awaited and extents to give back: while any is there, calls go through the
        reference."""
        return (self._pending, self._frees)

    def _owed_turns(self) -> tuple:
        """Replies handed over to tasks not yet run, and callers giving way to them: a call
        gives the loop a turn first (see ``call``)."""
        return (self._woken, self._yielding)

    async def open(self) -> "Client":
        """Connect (waiting for a server as ``wait_for_ready`` says): what ``connect()`` awaits."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        await self._connected(None)
        return self

    async def stream(self, method: str, arg: Any = None, *, timeout: float | None = None,
                     metadata: Mapping[str, str] | None = None,
                     response_type: Any = None) -> AsyncIterator[Any]:
        """Call a server-streaming ``method`` (an async generator handler): ``async for item in
        client.stream("m", arg)``. Flow-controlled: the server sends at most a window of items
        ahead of what this loop took. Leaving the loop early (break, an exception, a
        cancellation) cancels the handler; ``timeout`` bounds the whole stream."""
        async with StreamCall(self, method, arg, False, timeout, metadata, response_type) as call:
            async for item in call:
                yield item

    def open_stream(self, method: str, *, timeout: float | None = None,
                    metadata: Mapping[str, str] | None = None,
                    response_type: Any = None) -> StreamCall:
        """A call whose requests are a stream: a client-streaming ``method`` (``async def``
        taking an ``AsyncIterator[T]``) or a bidirectional one (an async generator taking
        one). Use it with ``async with``; see :class:`cxlrpc.streams.StreamCall`."""
        return StreamCall(self, method, None, True, timeout, metadata, response_type)

    def stub(self, service: Callable[..., S], *, timeout: float | None = None,
             prefix: str | None = None) -> S:
        """The typed ``service``'s methods as calls to the server (see :mod:`cxlrpc.service`):
        ``await client.stub(Greeter).norm(p)`` is checked by mypy, unlike ``call("norm", p)``."""
        return stub(self, service, timeout, prefix)

    async def close(self) -> None:
        """Detach from the server; calls still waiting fail with ``Unavailable``."""
        if self._closed:
            return
        self._closed = True
        task = self._connecting
        if task is not None:
            task.cancel()
            await asyncio.wait((task,))
        self._gone = "client closed"
        await self._drop_link()

    async def _connected(self, timeout: float | None) -> float | None:
        """Slow path of a call while not connected: reconnect (one attempt shared by the
        callers, each bounded by its own ``timeout`` too) or raise why not. Returns the time
        left of ``timeout``."""
        loop = self._loop
        if loop is None:
            raise Unavailable("client is not open: await it (or use async with) first")
        deadline = None if timeout is None else loop.time() + timeout
        while self._gone is not None:
            if self._closed:
                raise Unavailable("client is closed")
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
            if self._gone is not None:  # lost again at once: one reconnection per call
                raise Unavailable(self._gone)
        if deadline is None:
            return None
        left = deadline - loop.time()
        if left <= 0:
            raise DeadlineExceeded("deadline exceeded while connecting")
        return left

    def _connect_done(self, task: asyncio.Task) -> None:
        if self._connecting is task:
            self._connecting = None
        if not task.cancelled():
            task.exception()  # its callers raise it; none may be left to

    async def _connect(self) -> None:
        """One connection attempt: end what is left of the last connection, then attach
        (looking for a server until ``wait_for_ready`` runs out) and start the reader."""
        lost = self._gone if self._connected_once else None
        await self._drop_link()
        loop = self._loop
        end = _wait_end(self.wait_for_ready, loop.time())
        pause = _RETRY_FIRST
        while True:
            try:
                link = self._open()
                try:
                    await self._acknowledge()
                except BaseException:
                    self._forget_link().close()
                    raise
                break
            except Unavailable as exc:
                if end is not None and loop.time() >= end:
                    raise _lost(lost, exc) from exc.__cause__
            except ResourceExhausted as exc:
                raise _lost(lost, exc) from exc.__cause__
            await asyncio.sleep(pause if end is None else max(0.0, min(pause, end - loop.time())))
            pause = min(2 * pause, _RETRY_MAX)
        link.loop = loop
        link.reader = self._reader = loop.create_task(_read(weakref.ref(self), link.chan, self.strategy))
        self._gone = None
        self._connected_once = True

    async def _acknowledge(self) -> None:
        """Wait until a server on another host has seen our slot (it polls for us only then)."""
        wait = self._acknowledge_timeout()
        if wait is None:
            return
        deadline = self._loop.time() + wait
        while not self._acknowledged():
            if self._loop.time() >= deadline:
                raise self._unacknowledged(wait)
            await asyncio.sleep(0.002)

    async def _drop_link(self) -> None:
        """End the connection: its calls fail with ``Unavailable(_gone)``, its reader stops,
        then the slot is released and the region unmapped (even if this is cancelled)."""
        if self._link is None:
            return
        self._fail_all(Unavailable(self._gone))
        link = self._forget_link()
        reader = link.reader
        if reader is not None and not reader.done():
            reader.cancel()
            reader.add_done_callback(lambda _: link.close())  # also if we are cancelled meanwhile
            await asyncio.wait((reader,))
        link.close()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(self, method: str, arg: Any = None, *, timeout: float | None = None,
                   metadata: Mapping[str, str] | None = None, response_type: Any = None,
                   on_late_reply: Callable[[Any], None] | None = None) -> Any:
        """Call ``method`` with ``arg`` and optional ``metadata`` (small str pairs the handler
        reads from its context); raises an :class:`RpcError` subclass on failure.

        ``on_late_reply``: should the caller give up (cancelled, or its timeout passed), the
        client does not cancel the call (the server still ends it at its deadline), and this
        is called once, from the loop, with the reply when it comes (the result, or the
        RpcError it carries; Unavailable if the connection is lost first), or with the
        caller's CancelledError or DeadlineExceeded if the request never left: what the call
        did can then be undone. No task is made for it.
        """
        caller, turned = self._caller, False
        if (caller is not None and on_late_reply is None and not metadata and not self._interceptors
                and self._gone is None and (timeout is None or timeout > 0)):
            # the common shape, natively: out and, while no other call is in flight, its reply
            # polled for in place (no future, no loop turn) for the first microseconds
            call_id = next(self._ids)
            deadline = None if timeout is None else self._loop.time() + timeout
            spare = self._spare_for(arg)
            try:  # (see _dispatch.c: what each outcome means)
                decode = response_type is None or _native_decode(response_type)
                got = caller.call(method, arg, timeout or 0.0, call_id, self._hot_s, decode,
                                  self._hot_spin_s, False, spare)
                if got is NotImplemented and (self._woken or self._yielding):
                    # other tasks are owed a turn: give it, then call natively if nothing else
                    # is in flight (tasks sharing a client take turns at native cost)
                    # (its timeout counts from there, as the reference's does)
                    turned = True
                    await self._give_way()
                    caller = self._caller
                    if caller is not None and self._gone is None:
                        deadline = None if timeout is None else self._loop.time() + timeout
                        spare = self._spare_for(arg)  # (another task may have taken it meanwhile)
                        got = caller.call(method, arg, timeout or 0.0, call_id, self._hot_s, decode,
                                          self._hot_spin_s, True, spare)
            except ClaimRevoked as exc:
                raise self._revoked(exc) from exc
            except BaseException:
                if spare is not None and self._spare is spare:
                    # the native call raised, and may have sent it (the server reading it): FREE it
                    # (not one another task took while this one gave way)
                    self._spare = None
                    self._give_back(spare[0])
                raise
            if spare is not None and got is not NotImplemented and type(got) is not tuple:
                if type(got) is bytes:  # answered in place: the spare settled now, no coroutine
                    self._spare = None
                    self._settle(self._chan, spare[0], spare[1], self._methods[method], True)
                    return got
                return await self._followed_out(call_id, self._methods[method], spare, got, deadline,
                                                response_type)
            if type(got) is bytes:
                return got
            if type(got) is list:  # decoded by response_type's decoder
                return got[0]
            if type(got) is fr.Frame:
                return self._answer(got, response_type)
            if got is None:  # out; its reply comes later
                return await self._roundtrip(call_id, None, deadline, response_type)
            if type(got) is tuple:  # not out (a body for the heap, a full ring): the reference
                arg = _Encoded(*got)
            # (NotImplemented: other calls in flight, a method name not yet encoded, or a str
            # subclass)
        return await self._call_reference(method, arg, timeout, metadata, response_type, on_late_reply,
                                          turned)

    def _spare_for(self, arg: Any) -> tuple[int, int] | None:
        """The spare extent, if ``arg`` is a body to follow: the native caller sends it through
        the spare, with no Python before the frame is out (and the server reading)."""
        spare = self._spare
        if spare is not None and type(arg) is bytes and self._follow_min <= len(arg) <= self._follow_max:
            return spare
        return None

    async def _followed_out(self, call_id: int, mb: bytes, spare: tuple[int, int], got: Any,
                            deadline: float | None, response_type: Any) -> Any:
        """A request the native caller sent through the spare extent, its body written (the
        rest of ``_call_large``): its reply (``got``, a Frame, or awaited), then the spare settled."""
        chan = self._chan
        self._spare = None
        self._followed[call_id] = mb
        answered = False
        try:
            if type(got) is fr.Frame:
                result = self._answer(got, response_type)
            else:  # out; its reply comes later
                result = await self._roundtrip(call_id, None, deadline, response_type)
            answered = True
            return result
        finally:
            del self._followed[call_id]
            self._settle(chan, spare[0], spare[1], mb, answered)

    async def _give_way(self) -> None:
        """One loop turn for the tasks whose replies this client handed over, and those that
        gave way for them: a call answered in place never suspends, so they run first."""
        self._yielding.append(None)
        try:
            await asyncio.sleep(0)
        finally:
            self._yielding.pop()

    async def _call_reference(self, method: str, arg: Any, timeout: float | None,
                              metadata: Mapping[str, str] | None, response_type: Any,
                              on_late_reply: Callable[[Any], None] | None, turned: bool = False) -> Any:
        """A call the native caller left to the reference (see ``call``); ``turned``: it has
        given way already."""
        if not turned and (self._woken or self._yielding):
            await self._give_way()  # (before anything is sent)
        late = None if on_late_reply is None else _LateReply(on_late_reply, response_type)
        try:
            if self._interceptors:
                return await _chained(self._interceptors, lambda method, arg, metadata: self._start(
                    method, arg, timeout, metadata, response_type, late))(method, arg, _own_metadata(metadata))
            return await self._start(method, arg, timeout, metadata, response_type, late)
        except (asyncio.CancelledError, DeadlineExceeded) as exc:
            if late is not None and not late.waiting:
                self._loop.call_soon(late.callback, exc)
            raise

    def _start(self, method: str, arg: Any, timeout: float | None,
               metadata: Mapping[str, str] | None, response_type: Any,
               late: _LateReply | None = None) -> Awaitable[Any]:
        """Check and encode a call; the awaitable of its round trip (of reconnecting first,
        when the server was judged gone)."""
        if self._gone is not None:
            return self._start_connected(method, arg, timeout, metadata, response_type, late)
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded("timeout must be positive")
        call_id = next(self._ids)
        parts = self._request(call_id, method, arg, timeout or 0.0, metadata, follow=True)
        deadline = None if timeout is None else self._loop.time() + timeout
        if type(parts) is _Large:
            return self._call_large(call_id, parts, timeout or 0.0, deadline, response_type, late)
        return self._roundtrip(call_id, parts, deadline, response_type, late=late)

    async def _start_connected(self, method: str, arg: Any, timeout: float | None,
                               metadata: Mapping[str, str] | None, response_type: Any,
                               late: _LateReply | None) -> Any:
        """Slow path of a call while not connected: reconnect (or raise why not), then call."""
        timeout = await self._connected(timeout)
        return await self._start(method, arg, timeout, metadata, response_type, late)

    async def _call_large(self, call_id: int, large: _Large, timeout: float,
                          deadline: float | None, response_type: Any,
                          late: _LateReply | None) -> Any:
        """A request through the heap: ALLOC an extent (or take the spare), write the body
        there, then call."""
        chan = self._chan
        taken = self._take_spare(large)
        if taken is not None:
            (offset, size), spare = taken, True
        else:
            size = large.extent_size
            alloc_id, alloc = self._alloc_request(size, timeout, large.follow)
            reply = await self._granted(alloc_id, alloc, deadline)
            if self._gone is not None or self._chan is not chan:  # the extent is another server's
                raise Unavailable(self._gone or "the connection was lost while the call waited for heap space")
            offset, spare = _grant(reply)
        parts = self._staged(large, offset, call_id, timeout)
        if not large.follow:
            return await self._roundtrip(call_id, parts, deadline, response_type, unsent=offset, late=late)
        method = large.prefix[:large.method_len]
        self._followed[call_id] = method
        answered = False
        try:
            result = await self._roundtrip(call_id, parts, deadline, response_type,
                                           unsent=None if spare else offset, late=late,
                                           then=lambda: self._publish_body(offset, large.body))
            answered = True
            return result
        finally:
            del self._followed[call_id]
            if spare:  # (the server frees any other extent once it has read it)
                self._settle(chan, offset, size, method, answered)

    async def _granted(self, alloc_id: int, alloc: tuple, deadline: float | None) -> fr.Frame:
        """The ALLOC round trip. A caller that gives up first leaves the ALLOC known, so a
        grant the server sent meanwhile is given back when it comes (``_granted_late``)."""
        try:
            reply = await self._roundtrip(alloc_id, alloc, deadline, None)
        except (asyncio.CancelledError, DeadlineExceeded):
            raise
        except BaseException:
            self._allocs.discard(alloc_id)
            raise
        self._allocs.discard(alloc_id)
        return reply

    async def _roundtrip(self, call_id: int, parts: tuple | None, deadline: float | None,
                         response_type: Any, unsent: int | None = None,
                         late: _LateReply | None = None, then: Callable[[], None] | None = None) -> Any:
        """Push a request (None: it is out already) and await its reply. ``unsent``: a heap
        extent to give back if the request never left; ``late``: where the reply goes if the
        caller gives up after; ``then``: called once the request is out (a followed body's
        writing)."""
        loop = self._loop
        fut = loop.create_future()
        self._pending[call_id] = (fut, response_type)
        timer = None
        pushed = gave_up = False
        try:
            chan = self._chan
            if parts is not None:
                if self._frees:
                    self._send_frees()
                if self._push(parts):
                    chan.server_bell.ring()
                else:
                    await self._push_slow(parts, deadline)
            pushed = True
            if then is not None:
                then()
            if late is not None:  # from here its reply has a taker even if we give up first
                late.waiting = True
                self._late[call_id] = late
            if deadline is not None:
                timer = loop.call_at(deadline, _expire, fut)
            if not self._direct:
                if len(self._pending) == 1 and not chan.server_in_process:
                    await self._poll_directly(fut, waited=self._hot_s if parts is None else 0.0)
                else:  # the reader dispatches our reply (it may rest after a direct-polled call)
                    self._wake_reader()
            return await fut
        except (asyncio.CancelledError, DeadlineExceeded):
            gave_up = True
            if late is None or not pushed:
                self._send_cancel(call_id)
            elif call_id not in self._pending and self._late.pop(call_id, None) is not None:
                # the reply reached ``fut`` just before we gave up: it goes to the callback
                self._loop.call_soon(late.callback, fut.exception() or fut.result())
            raise
        finally:
            self._pending.pop(call_id, None)
            self._woken.discard(call_id)
            if late is not None and not gave_up:  # answered (an interceptor may call again)
                self._late.pop(call_id, None)
                late.waiting = False
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
        """Backpressure: retry while the request ring is full, until the deadline (or until
        the connection the request was made for is gone)."""
        chan = self._chan
        backoff = 0.0
        while True:
            if deadline is not None and self._loop.time() >= deadline:
                raise DeadlineExceeded("request ring stayed full until the deadline")
            chan.server_bell.ring()
            await asyncio.sleep(backoff)
            backoff = min(0.001, backoff * 2 + 1e-5)
            if self._gone is not None or self._chan is not chan:
                raise Unavailable(self._gone or "the connection was lost while the request waited for room")
            if self._push(parts):
                break
        chan.server_bell.ring()

    # ------------------------------------------------------------------ streaming calls
    async def _open_stream(self, call: StreamCall) -> None:
        """Send a streaming call's request, through the interceptors (``next`` returns the
        call): what opening the call awaits."""
        if self._interceptors:
            await _chained(self._interceptors, lambda method, arg, metadata: self._push_open(
                call, method, arg, metadata))(call.method, call._arg, _own_metadata(call._metadata))
        else:
            await self._push_open(call, call.method, call._arg, call._metadata)

    async def _push_open(self, call: StreamCall, method: str, arg: Any,
                         metadata: Mapping[str, str] | None) -> StreamCall:
        timeout = call._timeout
        if self._gone is not None:
            timeout = await self._connected(timeout)
        call_id = next(self._ids)
        parts = self._request(call_id, method, b"" if call._requests else arg, timeout or 0.0,
                              metadata, fr.STREAM if call._requests else 0)
        if type(parts) is _Large:
            raise ResourceExhausted("a stream's request must fit the request ring")
        loop, chan = self._loop, self._chan
        deadline = None if timeout is None else loop.time() + timeout
        self._streams[call_id] = call
        call._opened(call_id, chan, deadline)
        try:
            await self._push_parts(parts, deadline)
        except BaseException:
            call._finish()
            raise
        if call._closed:  # cancelled (or left) while it opened: the handler has no caller
            self._send_cancel(call_id)
            call._finish()
        self._wake_reader()  # the stream's frames come through the reader
        return call

    async def _push_parts(self, parts: tuple, deadline: float | None) -> None:
        if self._push(parts):
            self._chan.server_bell.ring()
        else:
            await self._push_slow(parts, deadline)

    def _stream_chan(self, call: StreamCall) -> ClientChannel | FlushClientChannel:
        """The channel a streaming call still runs on, or Unavailable (it was opened on a
        connection that is gone)."""
        chan = self._chan
        if chan is not call._chan or self._gone is not None:
            raise Unavailable(self._gone or "the connection of this call was lost")
        return chan

    async def _send_item(self, call: StreamCall, item: Any) -> None:
        """One request item of ``call`` (through the heap when it is too big for the ring)."""
        chan = self._stream_chan(call)
        flags, body = fr.encode_body(item)
        head = fr.header(fr.ITEM, flags, 0, chan.slot, chan.gen, call._call_id, 0.0, b"")
        if len(head) + len(body) <= chan.requests.max_payload:
            await self._push_parts((head, body), call._deadline)
            return
        large = self._out_of_line(flags, 0, b"", body, "stream item")
        left = 0.0 if call._deadline is None else max(1e-6, call._deadline - self._loop.time())
        alloc_id, alloc = self._alloc_request(len(body), left)
        reply = await self._granted(alloc_id, alloc, call._deadline)
        self._stream_chan(call)  # the extent is another server's if the connection changed
        offset, _ = _grant(reply)  # (not asked as a spare)
        parts = self._staged(large, offset, call._call_id, 0.0, fr.ITEM)
        pushed = False
        try:
            await self._push_parts(parts, call._deadline)
            pushed = True
        finally:
            if not pushed:
                self._give_back(offset)

    async def _send_end(self, call: StreamCall) -> None:
        chan = self._stream_chan(call)
        head = fr.header(fr.END, fr.RAW, 0, chan.slot, chan.gen, call._call_id, 0.0, b"")
        await self._push_parts((head,), call._deadline)

    def _send_credit(self, call: StreamCall, count: int) -> None:
        """Grant the server ``count`` more items of ``call``; a full ring is retried soon (a
        credit must never be lost: the server would wait for it forever)."""
        chan = self._chan
        if call._closed or chan is not call._chan or self._gone is not None:
            return
        head = fr.header(fr.CREDIT, fr.RAW, 0, chan.slot, chan.gen, call._call_id, 0.0, b"")
        try:
            pushed = self._push((head, OFFSET.pack(count)))
        except Unavailable:
            return
        if pushed:
            chan.server_bell.ring()
        else:
            self._loop.call_later(_CREDIT_RETRY_S, self._send_credit, call, count)

    def _cancel_stream(self, call: StreamCall) -> None:
        if call._chan is self._chan:
            self._send_cancel(call._call_id)

    async def _poll_directly(self, fut: asyncio.Future, waited: float = 0.0) -> None:
        """The only caller in flight polls the reply ring itself through the spin and yield
        phases of the wait strategy; the reader task parks meanwhile. (Not when the server runs
        in this process: it could not answer while we poll.) ``waited``: how long the call
        already waited in place (the native caller's window), counted against those phases.

        This saves the hop through the reader task (one loop iteration and a task switch per
        call). For the first ``_HOT_SPIN_S`` of the spin phase it polls without giving the
        loop a turn (a 64 B echo: 5.55 against 6.02 us p50 here, 8 alternating rounds); then it
        yields to other tasks between polls. Replies to other calls that arrive meanwhile are
        dispatched as usual.
        """
        self._direct = True
        try:
            poll, on_reply = self._chan.responses.poll, self._on_reply
            yield_cpu = self._chan.bell.shared_cpu.yield_cpu
            now = time.perf_counter
            start = now() - waited
            spin_end = start + self.strategy.spin_s
            yield_end = spin_end + self.strategy.yield_s
            hot_end = min(spin_end, start + _HOT_SPIN_S)
            while now() < hot_end:
                if poll(on_reply, 1024) and fut.done():
                    return
            while not fut.done():
                if not poll(on_reply, 1024):
                    if self._gone is not None:
                        fut.set_exception(Unavailable(self._gone))  # the reader may have ended
                        return
                    t = now()
                    if t > spin_end:
                        if t > yield_end:
                            self._direct_exhausted = True  # the reader should park at once
                            return
                        yield_cpu()  # (moves off a CPU it finds shared)
                    await asyncio.sleep(0)
        finally:
            self._direct = False
            # Hand over to the reader only if calls remain (ours, if we gave up, or others'):
            # waking it after every call would cost a few task switches per round trip. A call
            # that waits for its reply later, without polling for it, wakes it then.
            if self._pending or self._streams:
                self._wake_reader()

    def _wake_reader(self) -> None:
        """Wake the reader task if it rests until a direct poll ends."""
        wake = self._reader_wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _on_reply(self, view: memoryview) -> None:
        f = self._own_reply(view)
        if f is None:
            return
        if self._streams:
            call = self._streams.get(f.call_id)
            if call is not None:
                if f.flags & fr.HEAP and not self._heap_body(f, wanted=True):
                    call.fail(InvalidArgument("a stream item's heap extent is not inside the heap"))
                else:
                    call.on_frame(f)
                return
        entry = self._pending.pop(f.call_id, None)
        if entry is None or entry[0].done():
            late = self._late.pop(f.call_id, None) if self._late else None
            if late is not None:
                self._loop.call_soon(late.callback, self._late_outcome(f, late.response_type))
            else:
                self._granted_late(f)  # the caller gave up (timeout, cancel)
            return
        fut, response_type = entry
        self._woken.add(f.call_id)
        try:
            fut.set_result(self._answer(f, response_type))
        except RpcError as exc:
            fut.set_exception(exc)

    def _late_outcome(self, f: fr.Frame, response_type: Any) -> Any:
        """The result of a reply nobody awaits (for its on_late_reply), or the RpcError it is."""
        if f.flags & fr.HEAP and not self._heap_body(f, wanted=True):
            return InvalidArgument("the reply's heap extent is not inside the heap")
        try:
            return self._decode_reply(f, response_type)
        except RpcError as exc:
            return exc

    def _fail_all(self, exc: RpcError) -> None:
        for call in list(self._streams.values()):
            call.fail(exc)
        pending = list(self._pending.values())  # (the native caller holds this dict)
        self._pending.clear()
        for fut, _ in pending:
            if not fut.done():
                fut.set_exception(exc)
        late, self._late = self._late, {}
        for entry in late.values():
            self._loop.call_soon(entry.callback, exc)

    def _on_gone(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(lambda: None)  # wakes the loop; the reader sees _gone
            except RuntimeError:
                pass


async def _read(ref: "weakref.ref[Client]", chan: ClientChannel | FlushClientChannel,
                strategy: WaitStrategy) -> None:
    """The reader task: dispatches the replies no caller polls for itself. It holds the client
    only while it runs, never across an await, so a client dropped unclosed is collected."""
    ring = chan.responses
    poll = ring.poll

    def ready() -> bool:
        if ring.readable():
            return True
        client = ref()
        return client is None or client._gone is not None or client._direct

    idle = False
    while True:
        client = ref()
        if client is None:
            return
        if client._direct:  # a caller is polling for us; sleep until it stops
            wake = client._reader_wake = client._loop.create_future()
            del client
            await wake
            client = ref()
            if client is None:
                return
            client._reader_wake = None
            idle, client._direct_exhausted = client._direct_exhausted, False
            continue
        if poll(client._on_reply, 1024):
            idle = False
            del client
            await asyncio.sleep(0)
            continue
        if client._gone is not None:
            client._fail_all(Unavailable(client._gone))
            return
        del client
        idle = not await chan.bell.wait_async(ready, strategy, _BEAT_INTERVAL, idle)


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
            wait_for_ready: float | bool = False,
            interceptors: Sequence[ClientInterceptor] = ()) -> _Connecting:
    """Connect an asyncio client: ``async with cxlrpc.connect("shm://NAME") as client``.

    ``poll_interval`` bounds how long the idle client sleeps between looks at its reply ring
    when the server is on another host (which cannot wake it). ``wait_for_ready``: wait for
    a server to appear (True: without limit; a number: that many seconds), else
    ``Unavailable`` at once. ``interceptors`` (async, see :data:`ClientInterceptor`) wrap
    every call, the first outermost."""
    return _Connecting(Client(url, doorbell=doorbell, server_timeout=server_timeout,
                              poll_interval=poll_interval, wait_for_ready=wait_for_ready,
                              interceptors=interceptors))


class SyncClient(_Base):
    """Blocking client for synchronous callers. Thread-safe; calls from several threads are
    serialised (open one client per thread for parallel calls).

    Connects in the constructor (``wait_for_ready`` as for :class:`Client`), and reconnects
    and is collected as :class:`Client` is."""

    def __init__(self, url: str, *, doorbell: WaitStrategy | str | None = None,
                 server_timeout: float = 1.0, poll_interval: float = 1e-3,
                 wait_for_ready: float | bool = False,
                 interceptors: Sequence[ClientInterceptor] = ()) -> None:
        super().__init__(url, doorbell, server_timeout, poll_interval, wait_for_ready)
        self._interceptors = _checked(interceptors)
        self._lock = threading.Lock()
        self._failures = 0  # failed reconnections: callers queued behind one share its error
        self._failure: RpcError | None = None
        self._connect(None)

    def close(self) -> None:
        """Detach from the server; later calls raise ``Unavailable``."""
        with self._lock:
            self._closed = True
            self._gone = "client closed"
            self._drop_link()

    def _drop_link(self) -> None:
        link = self._forget_link()
        if link is not None:
            link.close()

    def _connected(self, timeout: float | None, failures: int) -> float | None:
        """Slow path of a call while not connected (lock held): reconnect or raise why not;
        a caller that waited for the lock while an attempt failed gets that attempt's error.
        Returns the time left of ``timeout``."""
        if self._closed:
            raise Unavailable("client is closed")
        failure = self._failure
        if self._failures != failures and failure is not None:
            raise type(failure)(failure.message, failure.code) from failure.__cause__
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._connect(deadline)
        except (Unavailable, ResourceExhausted) as exc:
            self._failures += 1
            self._failure = exc
            raise
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("deadline exceeded while connecting")
        return left

    def _connect(self, deadline: float | None) -> None:
        """One connection attempt: end the last connection, then attach (looking for a server
        until ``wait_for_ready`` or ``deadline`` runs out) and wait to be acknowledged."""
        lost = self._gone if self._connected_once else None
        self._drop_link()
        end = _wait_end(self.wait_for_ready, time.monotonic())
        stop = end if deadline is None else deadline if end is None else min(end, deadline)
        pause = _RETRY_FIRST
        while True:
            try:
                self._open()
                try:
                    self._acknowledge()
                except BaseException:
                    self._forget_link().close()
                    raise
                break
            except Unavailable as exc:
                now = time.monotonic()
                if end is not None and now >= end:
                    raise _lost(lost, exc) from exc.__cause__
                if deadline is not None and now >= deadline:
                    raise DeadlineExceeded("deadline exceeded while connecting") from exc
            except ResourceExhausted as exc:
                raise _lost(lost, exc) from exc.__cause__
            time.sleep(pause if stop is None else max(0.0, min(pause, stop - time.monotonic())))
            pause = min(2 * pause, _RETRY_MAX)
        self._gone = None
        self._connected_once = True

    def _acknowledge(self) -> None:
        """Wait until a server on another host has seen our slot (it polls for us only then)."""
        wait = self._acknowledge_timeout()
        if wait is None:
            return
        deadline = time.monotonic() + wait
        while not self._acknowledged():
            if time.monotonic() >= deadline:
                raise self._unacknowledged(wait)
            time.sleep(0.002)

    def __enter__(self) -> "SyncClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, method: str, arg: Any = None, *, timeout: float | None = None,
             metadata: Mapping[str, str] | None = None, response_type: Any = None) -> Any:
        """Call ``method`` with ``arg`` and optional ``metadata`` and wait for the reply (or
        raise an RpcError)."""
        if self._interceptors:
            return self._intercepted(method, arg, timeout, metadata, response_type)
        return self._call(method, arg, timeout, metadata, response_type)

    def _intercepted(self, method: str, arg: Any, timeout: float | None,
                     metadata: Mapping[str, str] | None, response_type: Any) -> Any:
        """A call through the interceptors (a closure of its own: ``call`` makes no cells)."""
        return _chained(self._interceptors, lambda method, arg, metadata: self._call(
            method, arg, timeout, metadata, response_type))(method, arg, _own_metadata(metadata))

    def _call(self, method: str, arg: Any, timeout: float | None,
              metadata: Mapping[str, str] | None, response_type: Any) -> Any:
        failures = self._failures
        with self._lock:
            caller = self._caller
            if caller is not None and self._gone is None and not metadata and (timeout is None or timeout > 0):
                # the common shape, natively (see Client.call): its reply polled for in place
                call_id = next(self._ids)
                deadline = None if timeout is None else time.monotonic() + timeout
                try:
                    got = caller.call(method, arg, timeout or 0.0, call_id, self._hot_s,
                                      response_type is None or _native_decode(response_type), self._hot_spin_s)
                except ClaimRevoked as exc:
                    raise self._revoked(exc) from exc
                if type(got) is bytes:
                    return got
                if type(got) is list:  # decoded by response_type's decoder
                    return got[0]
                if got is None:  # out; its reply comes later
                    got = self._roundtrip(call_id, None, deadline)
                if type(got) is fr.Frame:
                    if got.flags & fr.HEAP and not self._heap_body(got, wanted=True):
                        raise InvalidArgument("the reply's heap extent is not inside the heap")
                    return self._decode_reply(got, response_type)
                if type(got) is tuple:  # not out (a body for the heap, a full ring): the reference
                    arg = _Encoded(*got)
            if self._gone is not None:
                timeout = self._connected(timeout, failures)
            if timeout is not None and timeout <= 0:
                raise DeadlineExceeded("timeout must be positive")
            call_id = next(self._ids)
            parts = self._request(call_id, method, arg, timeout or 0.0, metadata, follow=True)
            deadline = None if timeout is None else time.monotonic() + timeout
            unsent = publish = kept = None
            if type(parts) is _Large:  # through the heap: ALLOC an extent (or take the spare)
                large = parts
                taken = self._take_spare(large)
                if taken is not None:
                    (offset, size), spare = taken, True
                else:
                    size = large.extent_size
                    alloc_id, alloc = self._alloc_request(size, timeout or 0.0, large.follow)
                    try:
                        reply = self._decode_reply(self._roundtrip(alloc_id, alloc, deadline), None)
                    except DeadlineExceeded:
                        raise  # a grant that comes later is given back (_granted_late)
                    except BaseException:
                        self._allocs.discard(alloc_id)
                        raise
                    self._allocs.discard(alloc_id)
                    offset, spare = _grant(reply)
                parts = self._staged(large, offset, call_id, timeout or 0.0)
                method = large.prefix[:large.method_len]
                if large.follow:
                    publish = functools.partial(self._publish_body, offset, large.body)  # (no cells in _call)
                    self._followed[call_id] = method
                if spare:  # settled below (the server frees any other extent once read)
                    kept = (self._chan, offset, size, method)
                else:
                    unsent = offset
            answered = False
            try:
                result = self._decode_reply(self._roundtrip(call_id, parts, deadline, unsent, publish),
                                            response_type)
                answered = True
                return result
            finally:
                self._followed.pop(call_id, None)
                if kept is not None:
                    self._settle(*kept, answered)

    def _roundtrip(self, call_id: int, parts: tuple | None, deadline: float | None,
                   unsent: int | None = None, then: Callable[[], None] | None = None) -> fr.Frame:
        """Push a request (None: it is out already) and wait for its reply frame. ``unsent``:
        a heap extent to give back if the request never left; ``then``: called once the
        request is out (a followed body's writing)."""
        chan = self._chan
        if parts is not None:
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
            if then is not None:
                then()
        ring, bell, strategy = chan.responses, chan.bell, self.strategy
        got: list[fr.Frame] = []

        def on_reply(view: memoryview) -> None:
            f = self._own_reply(view)
            if f is None:
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

    def _on_reply(self, view: memoryview) -> None:
        """A reply record the native caller polled that is not the one it waits for: nobody
        else waits here (calls are serialised), so it is late (see _granted_late)."""
        f = self._own_reply(view)
        if f is not None:
            self._granted_late(f)

    def send_nowait(self, method: str, arg: Any = None, *,
                    metadata: Mapping[str, str] | None = None) -> None:
        """One-way call (see :meth:`Client.send_nowait`), serialised with this client's other
        calls: the slot has one producer, whichever thread calls."""
        with self._lock:
            super().send_nowait(method, arg, metadata=metadata)

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
                 wait_for_ready: float | bool = False,
                 interceptors: Sequence[ClientInterceptor] = ()) -> SyncClient:
    """Connect a blocking client: ``with cxlrpc.connect_sync("shm://NAME") as client``
    (``wait_for_ready`` as for :func:`connect`; ``interceptors``: plain functions, see
    :data:`ClientInterceptor`)."""
    return SyncClient(url, doorbell=doorbell, server_timeout=server_timeout,
                      poll_interval=poll_interval, wait_for_ready=wait_for_ready,
                      interceptors=interceptors)
