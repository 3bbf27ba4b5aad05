"""The client's out-of-line bodies (``cxlrpc.heap``): requests too big for the ring go
through the server's heap (an ALLOC round trip, or the spare extent the client keeps), big
ones are followed (the frame first, the body written after it); replies that name an extent
are copied out (a followed one as the server writes it) and the extent given back (FREE).

Both clients keep one ``Bodies``; what it holds of a connection goes with it
(``Bodies.reset``).
"""
from __future__ import annotations

import sys
from typing import Any, NamedTuple

from . import frame as fr
from . import heap as heap_settings
from .client_connection import Connection
from .errors import InvalidArgument, ResourceExhausted, StatusCode, Unavailable
from .heap import EXTENT, FOLLOW_HEADER, FOLLOW_MIN, GRANT, OFFSET, SEAL_BROKEN, HeapAccess, seal_word
from .memory import BytesLike, SealBroken
from .ring import ClaimRevoked
from .transport import ClientTransport

#: A request frame's parts: header, method name (then the metadata block), body.
Parts = tuple[Any, ...]


class Large(NamedTuple):
    """A request too big for the ring: its body goes through the server's heap (its metadata
    block stays in the frame)."""

    flags: int
    method_len: int
    prefix: bytes  # the method name, then the metadata block if any
    body: BytesLike
    follow: bool = False  # written after its frame is sent, the server following (cxlrpc.heap)
    header: int = FOLLOW_HEADER  # a followed extent's header (cxlrpc.heap.HeapAccess.header)

    @property
    def extent_size(self) -> int:
        """The heap bytes to ALLOC: a followed body's progress word comes first."""
        return self.header + len(self.body) if self.follow else len(self.body)


def grant(reply: bytes) -> tuple[int, bool]:
    """What an ALLOC's reply grants: the extent's offset, and whether it is a spare."""
    if len(reply) != GRANT.size:
        raise InvalidArgument(f"the server's heap grant is {len(reply)} bytes, not {GRANT.size}")
    offset, spare = GRANT.unpack(reply)
    return int(offset), spare == 1


class Bodies:
    """The heap side of one client: the connection's heap, extents to give back, ALLOCs in
    flight, the spare extent, and which calls and methods are followed."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.heap: HeapAccess | None = None
        self.frees: list[int] = []  # heap extents of replies read, to give back
        self.allocs: set[int] = set()  # call ids of ALLOCs whose reply may still come
        #: unary requests with bodies in [follow_min, follow_max] are followed (cxlrpc.heap):
        #: with a heap only (without coherence by the Python paths only)
        self.follow_min, self.follow_max = sys.maxsize, 0
        self.followed: dict[int, bytes] = {}  # call id -> method name, of followed calls out
        self.in_place: set[bytes] = set()  # methods that read their bodies in place: not followed
        #: an extent the server granted as a spare (cxlrpc.heap), kept for the next followed
        #: request (no ALLOC round trip then): (offset, size)
        self.spare: tuple[int, int] | None = None

    def open(self, chan: ClientTransport) -> bool:
        """Use ``chan``'s heap; whether the native caller may follow bodies (coherent memory
        with a heap: it has no write-backs; without coherence the Python paths follow them)."""
        geo, region = chan.geo, chan.region
        # (our followed extents hold this seal while they are ours: cxlrpc.heap)
        self.heap = heap = HeapAccess(region.buf, region.mem, geo.heap, geo.heap_size, seal_word(chan.slot, chan.gen))
        # (without coherence bodies are followed through the native module's flushed copies only)
        following = geo.heap_size > heap.header and (not region.mem.flushing or region.mem.lines is not None)
        if following:
            self.follow_min = FOLLOW_MIN
            self.follow_max = min(geo.heap_size, geo.max_message_size) - heap.header  # ALLOC's limit
        return following and not region.mem.flushing

    def reset(self) -> None:
        """The connection is gone, and its server's heap with it."""
        self.heap = None
        self.frees.clear()
        self.allocs.clear()
        self.spare = None

    def _chan(self) -> ClientTransport:
        chan = self._conn.chan
        assert chan is not None
        return chan

    def _heap(self) -> HeapAccess:
        heap = self.heap
        assert heap is not None
        return heap

    # ------------------------------------------------------------------ requests
    def out_of_line(self, flags: int, method_len: int, prefix: bytes, body: BytesLike,
                    what: str) -> Large:
        """A body too big for the request ring, to go through the server's heap (or the
        ResourceExhausted naming the limit it breaks)."""
        chan = self._chan()
        limit, ring_limit = chan.geo.max_message_size, self._conn.max_request
        if not chan.geo.heap_size:
            raise ResourceExhausted(f"{what} of {len(body)} bytes exceeds the request ring's "
                                    f"limit {ring_limit} (the server has no heap)")
        if len(body) > limit:
            raise ResourceExhausted(f"{what} of {len(body)} bytes exceeds the server's "
                                    f"max_message_size={limit}")
        if fr.HEADER_SIZE + len(prefix) + EXTENT.size > ring_limit:
            raise ResourceExhausted(f"request metadata of {len(prefix) - method_len} bytes does "
                                    f"not fit the request ring's limit {ring_limit}")
        return Large(flags, method_len, prefix, body)

    def alloc_request(self, size: int, timeout: float, spare: bool = False) -> tuple[int, Parts]:
        """An ALLOC frame asking the server for ``size`` bytes of heap (as a spare, for a
        followed request): (its call id, parts)."""
        chan = self._chan()
        alloc_id = next(self._conn.ids)
        self.allocs.add(alloc_id)
        head = fr.header(fr.ALLOC, fr.RAW, 0, chan.slot, chan.gen, alloc_id, timeout, b"")
        return alloc_id, (head, GRANT.pack(size, spare))

    def spare_for(self, arg: Any) -> tuple[int, int] | None:
        """The spare extent, if ``arg`` is a body to follow: the native caller sends it through
        the spare, with no Python before the frame is out (and the server reading)."""
        spare = self.spare
        if (spare is not None and type(arg) is bytes and self.follow_min <= len(arg) <= self.follow_max
                and not self._heap().mem.flushing):
            return spare
        return None

    def take_spare(self, large: Large) -> tuple[int, int] | None:
        """The spare extent for a followed request if it is big enough (one too small is
        given back): (offset, size); None to ALLOC one."""
        spare = self.spare
        if spare is None or not large.follow:
            return None
        self.spare = None
        if spare[1] >= large.extent_size:
            return spare
        self.give_back(spare[0])
        return None

    def settle(self, chan: ClientTransport | None, offset: int, size: int, method: bytes,
               answered: bool) -> None:
        """A spare extent once its call ended: kept if the call was answered (the server has
        read the body) and no spare is kept yet, else given back (freed at once, or once the
        server has stopped reading it)."""
        if chan is not self._conn.chan:
            return  # its server's heap is gone (and its extents freed) with the connection
        if answered and self.spare is None and method not in self.in_place:
            self.spare = (offset, size)
        else:
            self.give_back(offset)

    def staged(self, large: Large, offset: int, call_id: int, timeout: float, kind: int) -> Parts:
        """Write the body into the extent at ``offset`` (a followed one: zero its progress
        word, the body comes after the frame); the record's parts."""
        chan, heap = self._chan(), self._heap()
        try:
            if large.follow:
                heap.check(offset, large.extent_size)
                heap.begin_publish(offset)
            else:
                heap.write(offset, (large.body,))
        except SealBroken:
            raise self.extent_revoked() from None
        except ValueError as exc:
            raise InvalidArgument(f"the server granted a bad heap extent: {exc}") from exc
        flags = large.flags | fr.HEAP | (fr.FOLLOW if large.follow else 0)
        head = fr.HEADER.pack(kind, flags, 0, chan.slot, chan.gen, call_id, timeout, large.method_len)
        return head, large.prefix, EXTENT.pack(offset, len(large.body))

    def publish_body(self, offset: int, body: BytesLike) -> None:
        """Write a followed request's body into our extent at ``offset``, stopping (Unavailable)
        once its seal says it is not ours: the server reaped us (a frozen client resumed)."""
        try:
            self._heap().publish(offset, body)
        except SealBroken:
            raise self.extent_revoked() from None

    def extent_revoked(self) -> Unavailable:
        """The error of a call whose followed request's extent was taken back (the native
        caller raises it too)."""
        return Unavailable(f"the request body was not written whole: {SEAL_BROKEN}")

    # ------------------------------------------------------------------ replies
    def heap_body(self, f: fr.Frame, wanted: bool) -> bool:
        """An out-of-line reply: copy its body out (if ``wanted``; a followed one as the server
        writes it) and give the extent back; False when the extent is garbage. A followed body
        the server stopped writing, or whose progress is garbage, or whose extent's seal is no
        longer ours (we were reaped: never given back then), turns ``f`` into an error."""
        if len(f.body) != EXTENT.size:
            return False
        offset, length = EXTENT.unpack(f.body)
        ours = True
        body: BytesLike
        try:
            if not wanted:
                body = b""
            elif f.flags & fr.FOLLOW:
                heap = self._heap()
                heap.check(offset, heap.header + length)
                try:
                    body = heap.follow(offset, length)
                except SealBroken:
                    f.kind, f.status, f.flags = fr.ERROR, int(StatusCode.UNAVAILABLE), fr.RAW
                    body, ours = SEAL_BROKEN.encode(), False
                except (TimeoutError, ValueError) as exc:
                    f.kind, f.status, f.flags = fr.ERROR, int(StatusCode.UNAVAILABLE), fr.RAW
                    body = f"the server stopped writing the reply's body: {exc}".encode()
                    self._conn.send_cancel(f.call_id)  # a stream's handler would go on sending
            else:
                body = self._heap().read(offset, length)
        except ValueError:
            return False
        f.body, f.flags = body, f.flags & ~(fr.HEAP | fr.FOLLOW)
        if ours:
            self.give_back(offset)
        return True

    def reply_unfollowed(self, call_id: int, offset: int, why: str | None) -> Unavailable:
        """The native caller's followed reply whose server stopped writing it (``why`` None) or
        whose progress is garbage: cancel the call, give the extent back, and the error to raise
        (as ``heap_body`` makes it); or whose seal is not ours (``why`` SEAL_BROKEN): the
        error alone (the extent is not ours to give back)."""
        if why == SEAL_BROKEN:
            return Unavailable(SEAL_BROKEN)
        if why is None:
            why = (f"the writer stopped for {heap_settings.FOLLOW_STALL_S} s or was slower than "
                   f"{heap_settings.FOLLOW_MIN_RATE:.3g} B/s")
        self._conn.send_cancel(call_id)
        self.give_back(offset)
        return Unavailable(f"the server stopped writing the reply's body: {why}")

    def read_in_place(self, f: fr.Frame) -> None:
        """The reply's method reads its body in place: its calls stop following bodies."""
        method = self.followed.get(f.call_id)
        if method is not None and len(self.in_place) < 4096:
            self.in_place.add(method)

    def granted_late(self, f: fr.Frame) -> None:
        """A reply nobody waits for: if it grants an extent (its ALLOC was abandoned), give
        the extent back; if it carries one, too."""
        if f.call_id in self.allocs:
            self.allocs.discard(f.call_id)
            if f.kind == fr.RESPONSE and len(f.body) == GRANT.size:
                self.give_back(GRANT.unpack(f.body)[0])
        elif f.flags & fr.HEAP:
            self.heap_body(f, wanted=False)

    def give_back(self, offset: int) -> None:
        """Queue a FREE of a heap extent and send what the ring takes now (none to a server
        that is gone: its heap went with it, or it freed our extents when it reaped us)."""
        if self._conn.gone is None:
            self.frees.append(offset)
            self.send_frees()

    def send_frees(self) -> None:
        """Push the queued FREEs the request ring takes now (the next call sends the rest)."""
        conn = self._conn
        chan = conn.chan
        if chan is None or conn.gone is not None:
            return
        sent = 0
        try:
            while self.frees:
                head = fr.header(fr.FREE, fr.RAW, 0, chan.slot, chan.gen, fr.NO_REPLY, 0.0, b"")
                if not chan.push((head, OFFSET.pack(self.frees[0]))):
                    break  # the ring is full: the next call sends the rest
                self.frees.pop(0)
                sent += 1
        except ClaimRevoked:
            return
        if sent:
            chan.server_bell.ring()
