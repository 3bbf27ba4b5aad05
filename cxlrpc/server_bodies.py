"""Out-of-line bodies on the server's side: heap extents handed out on ALLOC and taken back on
FREE, request bodies read (or lent) from their extents, followed requests taken a step at a
time while their clients write them, and a departed client's extents quarantined until it is
fenced (``cxlrpc.fencing``). The heap itself is ``cxlrpc.heap.ServerHeap``."""
from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from . import frame as fr
from .bounds import Limits, PerConnection
from .errors import StatusCode
from .heap import (EXTENT, FOLLOW_IDLE_MAX_S, FOLLOW_SPIN_S, FOLLOW_STALL_S,
                   FOLLOW_STEP_S, GRANT, ServerHeap)
from .memory import FollowedBody
from .server_context import CallKey
from .server_replies import Replies
from .server_tasks import Calls, _take_back

#: A followed request whose writer paused is looked at (without a spin) this many loop turns in
#: a row before its looks back off to timers (a writer that only started late loses no time).
_FOLLOW_HOT_LOOKS = 3


class _Following:
    """A followed request in progress: its frame, extent, and how far its body has come."""

    __slots__ = ("frame", "offset", "length", "lends", "arrived", "body", "done", "since", "idle", "soon")

    def __init__(self, frame: fr.Frame, offset: int, length: int, lends: bool, arrived: float,
                 body: FollowedBody) -> None:
        self.frame, self.offset, self.length, self.lends = frame, offset, length, lends
        self.arrived = self.since = arrived  # the clock reading of the poll that found it
        self.body = body
        self.done = 0
        self.idle = 0  # looks in a row that found no progress (they come ever less often)
        self.soon = False  # its next step is due next loop turn (Bodies.hot_follows counts it)


class Bodies:
    """The server's heap traffic: ALLOC/FREE, bodies read from extents, followed requests."""

    def __init__(self, limits: Limits, replies: Replies, heap_waiting: list[tuple[Any, ...]]) -> None:
        self.limits = limits
        self._replies = replies
        self.calls: Calls  # (wired by the dispatch room, which sits above this one)
        self.heap: ServerHeap | None = None
        #: ALLOCs the full heap could not serve yet (changed in place: the native dispatcher holds it)
        self.heap_waiting = heap_waiting
        #: followed requests whose bodies their clients are still writing, per call
        self.following: dict[CallKey, _Following] = {}
        self.followed_by = PerConnection()  # how many of them each connection has
        self.hot_follows = 0  # how many of them are followed every loop turn (their writers write)
        self.follow_min = sys.maxsize  # (see Replies.follow_min)
        self._loop: asyncio.AbstractEventLoop

    def attach(self, heap: ServerHeap | None, follow_min: int, loop: asyncio.AbstractEventLoop) -> None:
        """Serve ``heap`` (None: the server has none) from ``loop`` (start())."""
        self.heap, self.follow_min, self._loop = heap, follow_min, loop

    def alloc(self, f: fr.Frame) -> None:
        """A client asks for a heap extent to write a big request into."""
        replies = self._replies
        if len(f.body) != GRANT.size or self.heap is None:
            replies.error(f, StatusCode.RESOURCE_EXHAUSTED if self.heap is None
                          else StatusCode.INVALID_ARGUMENT,
                          "this server has no heap (heap_size=0)" if self.heap is None
                          else "bad ALLOC frame")
            return
        size, keep = GRANT.unpack(f.body)
        if not 0 < size <= replies.body_limit:
            replies.error(f, StatusCode.RESOURCE_EXHAUSTED, f"request of {size} bytes exceeds the "
                          f"server's {replies.limit_setting()}")
            return
        peer, limit = (f.slot, f.gen), self.limits.max_alloc_waiters
        if sum(1 for w in self.heap_waiting if w[1:3] == peer) >= limit:
            replies.error(f, StatusCode.RESOURCE_EXHAUSTED, f"{limit} ALLOCs of this connection wait for "
                          f"room in the heap already (max_alloc_waiters={limit})")
            return
        # (one without a deadline waits alloc_timeout at most: True at the end says so)
        default = not f.timeout > 0
        deadline = time.monotonic() + (self.limits.alloc_timeout if default else f.timeout)
        self.heap_waiting.append((deadline, f.slot, f.gen, f.call_id, size, keep, default))
        self.heap_freed()

    def free_extent(self, offset: int, slot: int, gen: int) -> None:
        """The heap extent at ``offset`` comes back from the client in ``slot``/``gen`` (a FREE;
        the native dispatcher calls this with its checks of the header and the sender done)."""
        if self.heap is None or not self.heap.free(offset, slot, gen):
            self.calls._drop()
            return
        self.heap_freed()

    def heap_freed(self) -> None:
        """Heap space came back: replies waiting for it go first (finishing calls frees more),
        then waiting ALLOCs in order while they fit (the first that does not, waits on)."""
        replies = self._replies
        if replies.backlog:
            replies.flush_backlog()
        heap, waiting = self.heap, self.heap_waiting
        assert heap is not None  # (space comes back only to a heap)
        while waiting:
            slot, gen, call_id, size, keep = waiting[0][1:6]
            offset = heap.alloc(slot, gen, size, keep == 1)
            if offset is None:
                return
            waiting.pop(0)
            if not replies.send(slot, gen, fr.header(fr.RESPONSE, fr.RAW, 0, slot, gen, call_id, 0.0, b""),
                                GRANT.pack(offset, heap.is_spare(offset))):
                heap.free(offset, slot, gen)  # the grant was refused (its client's backlog is full)

    def housekeeping(self, now: float) -> None:
        """Answer ALLOCs that waited past their deadline; free abandoned extents once written."""
        if self.heap_waiting:
            self._expire_heap_waiters(now)
        if self.heap is not None and self.heap.abandoned and self.heap.free_abandoned():
            self.heap_freed()

    def _expire_heap_waiters(self, now: float) -> None:
        expired = [w for w in self.heap_waiting if w[0] is not None and w[0] <= now]
        if not expired:
            return
        self.heap_waiting[:] = [w for w in self.heap_waiting if w not in expired]
        for w in expired:
            slot, gen, call_id, size = w[1:5]
            if len(w) > 6 and w[6]:  # it had no deadline: alloc_timeout's
                code = StatusCode.RESOURCE_EXHAUSTED
                why = (f"the heap had no room for {size} bytes within "
                       f"alloc_timeout={self.limits.alloc_timeout} s")
            else:
                code = StatusCode.DEADLINE_EXCEEDED
                why = f"the heap had no room for {size} bytes before the deadline"
            self._replies.send(slot, gen, fr.header(fr.ERROR, fr.RAW, int(code), slot, gen, call_id, 0.0, b""),
                               why.encode())

    def take_body(self, f: fr.Frame) -> int | None:
        """Replace an out-of-line request's extent by its bytes and free the extent (-1), or,
        for a method that lends its body (the frame's body is a view), by a read-only view of
        the extent, kept until the handler is done (its offset); None (the request answered or
        dropped) when the extent is not the sender's."""
        heap = self.heap
        if heap is not None and len(f.body) == EXTENT.size:
            offset: int
            offset, length = EXTENT.unpack(f.body)
            if heap.owned(offset, length, f.slot, f.gen):
                f.flags &= ~fr.HEAP
                if type(f.body) is memoryview:
                    f.body = heap.access.view(offset, length)
                    return offset
                f.body = heap.access.read(offset, length)
                heap.free(offset, f.slot, f.gen)
                self.heap_freed()
                return -1
        self.calls._drop()
        self._replies.error(f, StatusCode.INVALID_ARGUMENT, "request body is not in a heap extent of its own")
        return None

    def item_body(self, f: fr.Frame) -> bool:
        """Replace an out-of-line item's extent by its bytes and free the extent; False when
        the extent is not the sender's."""
        heap = self.heap
        if heap is None or len(f.body) != EXTENT.size:
            return False
        offset, length = EXTENT.unpack(f.body)
        if not heap.owned(offset, length, f.slot, f.gen):
            return False
        f.body = heap.access.read(offset, length)
        f.flags &= ~fr.HEAP
        heap.free(offset, f.slot, f.gen)
        self.heap_freed()
        return True

    def lend(self, extent: int) -> None:
        """A task carries on a handler that reads its body in the extent: keep it till then."""
        heap = self.heap
        assert heap is not None
        heap.lend(extent)

    def give_back(self, extent: int, view: memoryview, _: asyncio.Task[Any] | None = None) -> None:
        """A handler (or the task that finished it) that read its body in the heap is done:
        end its view and free the extent."""
        _take_back(view)
        heap = self.heap
        assert heap is not None
        if heap.give_back(extent):
            self.heap_freed()

    def follow_request(self, f: fr.Frame) -> None:
        """A request whose body its client writes into the heap after sending the frame:
        followed a step at a time between the server's other work (never waiting long for
        one client), then dispatched with its bytes (or, to a method that lends its body, a
        view of the complete extent). Its extent is kept until then, even if its owner leaves;
        after, a spare is the client's again (to write its next such request into, or to
        FREE), any other extent is freed."""
        heap = self.heap
        if heap is not None and self.follow_min != sys.maxsize and len(f.body) == EXTENT.size:
            offset, length = EXTENT.unpack(f.body)
            key = (f.slot, f.gen, f.call_id)
            if heap.owned(offset, heap.access.header + length, f.slot, f.gen) and key not in self.following:
                lends = type(f.body) is memoryview
                f.body = b""  # (a view of the ring's record, which is reused once we return)
                heap.lend(offset)
                if self.followed_by[key[:2]] >= self.limits.max_followed_requests:
                    self._refuse_following(f, offset, length)
                    return
                self.followed_by.add(key[:2])
                self.following[key] = _Following(f, offset, length, lends, self.calls._polled_at,
                                                 heap.access.follower(offset, length, copy=not lends))
                self.follow_step(key)
                return
        self.calls._drop()
        self._replies.error(f, StatusCode.INVALID_ARGUMENT, "request body is not in a heap extent of its own")

    def follow_step(self, key: CallKey) -> None:
        """Take what the client has written of a followed request (following on while it
        writes, for up to FOLLOW_STEP_S); dispatch it once whole, else come back next turn."""
        following = self.following.get(key)
        calls = self.calls
        if following is None or calls._closing:
            return  # cancelled, its client departed, or the server closed
        self._cool(following)
        f, offset, length = following.frame, following.offset, following.length
        heap = self.heap
        assert heap is not None
        try:
            try:  # (one idle at its last look is looked at, not waited for)
                whole = following.body.step(0.0 if following.idle else FOLLOW_SPIN_S, FOLLOW_STEP_S)
            except ValueError as exc:  # garbage, or the client gave up writing
                self.end_following(key, StatusCode.INVALID_ARGUMENT,
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
                    self.end_following(key, StatusCode.DEADLINE_EXCEEDED,
                                       "the deadline passed while the request body was written")
                elif now - following.since > FOLLOW_STALL_S:
                    self.end_following(key, StatusCode.UNAVAILABLE,
                                       f"the client stopped writing its request body for {FOLLOW_STALL_S} s")
                elif following.idle > _FOLLOW_HOT_LOOKS:  # back off: turns go to writers that write
                    doubled = 1 << min(following.idle - _FOLLOW_HOT_LOOKS, 16)
                    pause = min(FOLLOW_IDLE_MAX_S, FOLLOW_SPIN_S * doubled)
                    self._loop.call_later(pause, self.follow_step, key)
                else:
                    following.soon = True
                    self.hot_follows += 1
                    self._loop.call_soon(self.follow_step, key)
                return
            del self.following[key]
            self.followed_by.remove(key[:2])
            if not following.lends:
                f.body = following.body.take()  # type: ignore[assignment]  # (copy=True: bytes)
                if heap.give_back(offset):  # (else it is the client's again)
                    self.heap_freed()
                fast = calls._fast
                if fast is not None and not f.metadata:  # natively, as a record in the ring is
                    # (its deadline counted from the request's arrival, as any other's)
                    timeout = 0.0 if deadline is None else deadline - fast.polled_at
                    if ((deadline is None or timeout > 0) and type(f.body) is bytes
                            and fast.dispatch_body(f.slot, f.gen, f.call_id, f.flags & fr.RAW, timeout,
                                                   fr.method_bytes(f.method), f.body)):
                        return
            if deadline is not None:  # counted from the request's arrival, as any other's
                f.timeout = deadline - calls._polled_at
            f.flags &= ~fr.HEAP  # (FOLLOW stays: a lent body's reply says IN_PLACE)
            if not following.lends:
                calls._dispatch_request(f)
                return
            f.body = heap.access.followed_view(offset, length)
            carried: bool | None = False
            try:
                carried = calls._dispatch_request(f, offset)
            finally:
                if not carried:  # the handler is done with the lent body
                    self.give_back(offset, f.body)
        except Exception as exc:  # nothing a peer sends may stop the server
            calls._broken(exc)

    def end_following(self, key: CallKey, code: int = 0, message: str = "") -> None:
        """Stop following a request and give its extent back (a spare is its client's again;
        another is freed once its writer stopped: ServerHeap.abandon); answer ``code`` (0: no
        answer, the caller gave up or left)."""
        following = self.following.pop(key)
        self.followed_by.remove(key[:2])
        self._cool(following)
        heap = self.heap
        assert heap is not None
        if heap.abandon(following.offset, following.length):
            self.heap_freed()
        if code:
            self._replies.error(following.frame, code, message)

    def _cool(self, following: _Following) -> None:
        """A followed request's step that was due next turn ran (or it ended)."""
        if following.soon:
            following.soon = False
            self.hot_follows -= 1

    def _refuse_following(self, f: fr.Frame, offset: int, length: int) -> None:
        """A followed request past its connection's max_followed_requests: RESOURCE_EXHAUSTED at
        once, its extent kept from reuse until its client is done writing it (abandoned)."""
        limit = self.limits.max_followed_requests
        heap = self.heap
        assert heap is not None
        if heap.abandon(offset, length):
            self.heap_freed()
        self._replies.error(f, StatusCode.RESOURCE_EXHAUSTED, f"{limit} followed requests of this connection "
                            f"are being written already (max_followed_requests={limit})")

    def cancel(self, key: CallKey) -> None:
        """A CANCEL for a call with no task: stop following its body, or drop its ALLOC."""
        if key in self.following:
            self.end_following(key)
        elif self.heap_waiting:
            self.heap_waiting[:] = [w for w in self.heap_waiting if w[1:4] != key]

    def departed(self, slot: int, gen: int) -> None:
        """The holder ``gen`` of ``slot`` left: quarantine its extents (until it is fenced),
        drop its waiting ALLOCs and stop following its bodies."""
        if self.heap is not None:
            self.heap.quarantine(slot, gen)
            self.heap_waiting[:] = [w for w in self.heap_waiting if w[1:3] != (slot, gen)]
            for key in [k for k in self.following if k[:2] == (slot, gen)]:
                self.end_following(key)

    def fenced(self, slot: int, gen: int) -> None:
        """The departed holder can no longer write into the region: free what it held."""
        if self.heap is not None and self.heap.release_owner(slot, gen):
            self.heap_freed()

    def stop(self) -> None:
        """The server closes: followed requests are dropped (their steps find nothing to do)."""
        self.following.clear()
        self.followed_by.clear()
        self.hot_follows = 0
