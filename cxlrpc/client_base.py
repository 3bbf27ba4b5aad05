"""What both clients share of the call path: request encoding and reply decoding
(``Codec``), the interceptor helpers, and ``_Base``, which puts a client's rooms
together (its ``cxlrpc.client_connection.Connection``, its
``cxlrpc.client_bodies.Bodies``, its codec) and gives a connection its native caller.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import msgspec

from . import frame as fr
from . import heap as heap_settings
from .client_bodies import Bodies, Large, Parts
from .client_connection import Connection, Link, OfConnection, collected
from .doorbell import WaitStrategy
from .errors import InvalidArgument, ResourceExhausted, Unavailable, error_for
from .memory import FOLLOW_CHUNK

NativeCaller: type[Caller] | None
try:  # calls of the common shape in C (CXLRPC_NO_NATIVE=1: the reference only)
    from ._dispatch import Caller
    NativeCaller = None if os.environ.get("CXLRPC_NO_NATIVE") else Caller
except ImportError:
    NativeCaller = None

ClientInterceptor = Callable[[str, Any, dict[str, str], Callable[[str, Any, dict[str, str]], Any]], Any]
"""A client interceptor: ``await interceptor(method, arg, metadata, next)`` makes the call
when it awaits ``next(method, arg, metadata)`` (``metadata``: a dict of its own to change);
it may raise instead, or return another result. SyncClient's are plain functions."""
#: What an interceptor's ``next`` is: the call (or the next interceptor) as it goes on.
Next = Callable[[str, Any, dict[str, str]], Any]


class Encoded(NamedTuple):
    """A request body the native caller encoded but did not send (too big for the ring, or the
    ring was full): the reference sends it as it is, not encoding it again."""

    flags: int
    body: bytes | memoryview


class Health(msgspec.Struct):
    """The reply of ``cxlrpc.health``."""

    status: str


def native_decode(response_type: Any) -> Any:
    """What the native caller decodes a typed reply with: ``response_type``'s decode function,
    or False (a Frame back) for a type msgspec cannot decode into (``answer`` says so)."""
    try:
        return fr.decoder(response_type)
    except Exception:
        return False


def chained(interceptors: tuple[ClientInterceptor, ...], last: Next) -> Next:
    """``last`` wrapped in the interceptors, the first outermost."""
    def wrap(interceptor: ClientInterceptor, inner: Next) -> Next:
        return lambda method, arg, metadata: interceptor(method, arg, metadata, inner)

    call = last
    for interceptor in reversed(interceptors):
        call = wrap(interceptor, call)
    return call


def checked(interceptors: Sequence[ClientInterceptor]) -> tuple[ClientInterceptor, ...]:
    """The interceptors as a tuple (empty: the call path skips them), each callable."""
    for interceptor in interceptors:
        if not callable(interceptor):
            raise TypeError(f"interceptor is not callable: {interceptor!r}")
    return tuple(interceptors)


def own_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """A copy of the caller's metadata for the interceptors to change ({} for None)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidArgument(f"metadata must be a mapping of str to str, not {type(metadata).__name__}")
    return dict(metadata)


class Codec:
    """Request frames out, reply frames in: the method names encoded once, arguments and
    metadata encoded, bodies too big for the ring handed to the heap; replies checked as ours
    and decoded into the caller's ``response_type`` (or raised as the RpcError they carry)."""

    def __init__(self, conn: Connection, bodies: Bodies) -> None:
        self._conn = conn
        self._bodies = bodies
        self.methods: dict[str, bytes] = {}

    def request(self, call_id: int, method: str, arg: Any, timeout: float,
                metadata: Mapping[str, str] | None = None, flags: int = 0,
                follow: bool = False) -> Parts | Large:
        """The parts of a request record: header, method name (then the metadata block, if
        any), body; or the request to send through the heap (``follow``: a unary call's big
        body may be followed)."""
        mb = self.methods.get(method)
        if mb is None:
            mb = fr.method_bytes(method)
            if len(self.methods) < 4096:
                self.methods[method] = mb
        body: Any
        if type(arg) is bytes:
            flags |= fr.RAW
            body = arg
        elif type(arg) is Encoded:
            flags |= arg.flags
            body = arg.body
        else:
            raw, body = fr.encode_body(arg)
            flags |= raw
        prefix = mb
        if metadata:
            prefix = mb + fr.encode_metadata(metadata)
            flags |= fr.META
        conn, bodies = self._conn, self._bodies
        chan = conn.chan
        assert chan is not None
        head = fr.HEADER.pack(fr.REQUEST, flags, 0, chan.slot, chan.gen, call_id, timeout, len(mb))
        if follow and bodies.follow_min <= len(body) <= bodies.follow_max and mb not in bodies.in_place:
            if type(body) is not bytes:
                body = memoryview(body)
                body = body.cast("B") if body.c_contiguous else body.tobytes()
            if bodies.follow_min <= len(body) <= bodies.follow_max:  # its bytes, not its items
                large = bodies.out_of_line(flags, len(mb), prefix, body, "request")
                assert bodies.heap is not None  # (follow_min is finite only with a heap)
                return large._replace(follow=True, header=bodies.heap.header)
        if len(head) + len(prefix) + len(body) > conn.max_request:
            return bodies.out_of_line(flags, len(mb), prefix, body, "request")
        return head, prefix, body

    def own_reply(self, view: memoryview) -> fr.Frame | None:
        """A reply record decoded, or None: garbage (counted dropped) or a reply meant for this
        slot's previous holder."""
        chan = self._conn.chan
        assert chan is not None
        try:
            f = fr.decode(view)
        except fr.FrameError:
            chan.responses.dropped += 1
            return None
        return f if f.gen == chan.gen and f.slot == chan.slot else None

    def answer(self, f: fr.Frame, response_type: Any) -> Any:
        """What a reply to a call carries: its result, or the RpcError it is (raised)."""
        if not f.flags and f.kind == fr.RESPONSE:  # a plain encoded result (a kv get's leases)
            try:
                return fr.decoder(response_type)(f.body)
            except Exception:
                pass  # the checks below say why not
        if f.flags & fr.HEAP and not self._bodies.heap_body(f, wanted=True):
            raise InvalidArgument("the reply's heap extent is not inside the heap")
        if f.kind == fr.RESPONSE and f.flags & fr.RAW and response_type is None:
            if f.flags & fr.IN_PLACE:
                self._bodies.read_in_place(f)
            return f.body  # raw bytes: nothing to decode
        return self.decode_reply(f, response_type)

    def decode_reply(self, f: fr.Frame, response_type: Any) -> Any:
        """A reply's result decoded into ``response_type``, or the RpcError it is (raised)."""
        if f.flags & fr.IN_PLACE:
            self._bodies.read_in_place(f)
        if f.kind == fr.ERROR:
            raise error_for(f.status, bytes(f.body).decode(errors="replace"))
        try:
            return fr.decode_body(f.flags, f.body, response_type)
        except Exception as exc:
            raise InvalidArgument(f"reply does not decode as {response_type}: {exc}") from exc


class _Base:
    """What both clients share: their rooms (the connection, its bodies, the codec), a
    connection's native caller, and one-way calls."""

    url = OfConnection[str]()
    strategy = OfConnection[WaitStrategy]()
    server_timeout = OfConnection[float]()
    poll_interval = OfConnection[float]()
    #: How long connecting (and reconnecting) waits for a server: not at all (False), that
    #: many seconds, or without limit (True).
    wait_for_ready = OfConnection["float | bool"]()

    def __init__(self, url: str, doorbell: WaitStrategy | str | None, server_timeout: float,
                 poll_interval: float, wait_for_ready: float | bool) -> None:
        self._conn = conn = Connection(url, doorbell, server_timeout, poll_interval, wait_for_ready)
        self._bodies = bodies = Bodies(conn)
        self._codec = Codec(conn, bodies)
        self._finalizer: weakref.finalize[Any, Any] | None = None
        # What the native caller calls on the client it was given (see _dispatch.c): bound
        # once to the bodies' own methods.
        self._give_back: Callable[[int], None] = bodies.give_back
        self._reply_unfollowed: Callable[[int, int, str | None], Unavailable] = bodies.reply_unfollowed
        self._extent_revoked: Callable[[], Unavailable] = bodies.extent_revoked

    def _install(self, link: Link) -> None:
        """Make an acknowledged ``link`` the client's connection: its heap, its native caller,
        the finalizer that ends it if the client is dropped unclosed."""
        conn, bodies = self._conn, self._bodies
        conn.adopt(link)
        chan = link.chan
        following = bodies.open(chan)
        caller_type = NativeCaller
        native = chan.native_path() if caller_type is not None else None
        if caller_type is not None and native is not None:
            # through a proxy: the client stays collectable when dropped unclosed (the stall
            # after which it gives up a followed reply is read now)
            geo = chan.geo
            conn.caller = caller_type(
                weakref.proxy(self), self._codec.methods, native.requests, native.push_args,
                native.ring_server, native.responses, fr.encode_body, fr.decode, chan.slot, chan.gen,
                min(native.requests.max_payload, fr.HEADER_SIZE + bodies.follow_min - 1),
                native.buf, native.parked_at, native.me, self._in_flight(), self._owed_turns(),
                bodies.in_place, geo.heap, geo.heap_size, FOLLOW_CHUNK,
                heap_settings.FOLLOW_STALL_S if following else 0.0, heap_settings.FOLLOW_MIN_RATE,
                fr.encode_msgpack, native.grant_at, native.grant, native.lines)
        self._finalizer = weakref.finalize(self, collected, link, f"{type(self).__name__}({conn.url!r})")
        self._finalizer.atexit = False  # at exit the server reclaims the slot by our PID

    def _in_flight(self) -> tuple[Any, ...]:
        """The containers of work in flight that the native caller leaves to the reference
        while any holds something (heap extents of replies read, not yet given back)."""
        return (self._bodies.frees,)

    def _owed_turns(self) -> tuple[Any, ...]:
        """The containers of tasks owed a loop turn before a call goes natively (none here)."""
        return ()

    def _forget_link(self) -> Link | None:
        """Take the connection away from the client (the caller ends it); ``gone`` is set."""
        link = self._conn.forget()
        if link is not None:
            assert self._finalizer is not None
            self._finalizer.detach()
            self._bodies.reset()
        return link

    def send_nowait(self, method: str, arg: Any = None, *,
                    metadata: Mapping[str, str] | None = None) -> None:
        """One-way call: queue ``method(arg)`` without waiting and without a reply (ordered
        with this client's other calls). ``ResourceExhausted`` if the request ring is full;
        ``Unavailable`` while the server is gone (the next ``call`` reconnects). It does
        not go through the client's interceptors (they are async): pass ``metadata`` here."""
        conn = self._conn
        if conn.gone is not None:
            raise Unavailable(conn.gone)
        chan = conn.chan
        assert chan is not None
        parts = self._codec.request(fr.NO_REPLY, method, arg, 0.0, metadata)
        if type(parts) is Large:
            raise ResourceExhausted(f"a one-way call carries at most the request ring's "
                                    f"{conn.max_request} bytes")
        if not conn.push(parts):
            raise ResourceExhausted("request ring is full")
        chan.server_bell.ring()

