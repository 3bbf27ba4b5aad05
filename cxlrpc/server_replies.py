"""The server's replies: frames pushed to a client in line, through the heap, or followed
(``cxlrpc.heap``), and held back per client while its reply queue is full (bounded by
``cxlrpc.bounds.Limits``; past them, refused or shed)."""
from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

from . import frame as fr
from .memory import BytesLike
from .bounds import HELD, SHED, HeldReplies, Limits
from .errors import RpcError, StatusCode
from .heap import EXTENT, ServerHeap
from .transport import ReplySink, ServerTransport

logger = logging.getLogger("cxlrpc.server")


class Replies:
    """Sends frames to clients and holds back what a full reply queue cannot take yet."""

    def __init__(self, limits: Limits, max_message_size: int, heap_waiting: list[tuple[Any, ...]],
                 error_details: bool) -> None:
        self.limits = limits
        #: Whether clients see a failing handler's exception text (see Server.error_details).
        self.error_details = error_details
        self.max_message_size = max_message_size
        #: replies held back per slot while its response ring is full (bounded: limits)
        self.backlog: dict[int, HeldReplies] = {}
        #: replies dropped past a connection's backlog limits (their calls end at their deadline)
        self.shed_replies = 0
        #: ALLOCs waiting for the heap (a big reply then takes the ring, not the heap)
        self._heap_waiting = heap_waiting
        self._chan: ServerTransport
        self._heap: ServerHeap | None = None
        #: replies of this many bytes and more are followed (cxlrpc.heap); never without a heap
        #: (nor without coherence where the native module is missing: no flushed copies then)
        self.follow_min = sys.maxsize
        #: the largest body through the heap: max_message_size, or a smaller heap's size
        self.body_limit = max_message_size

    def attach(self, chan: ServerTransport, heap: ServerHeap | None, follow_min: int,
               body_limit: int) -> None:
        """Serve ``chan``, with ``heap`` for bodies too big for its rings (start())."""
        self._chan, self._heap, self.follow_min, self.body_limit = chan, heap, follow_min, body_limit

    def limit_setting(self) -> str:
        """The setting that bounds a body through the heap, to name in errors."""
        if self.body_limit < self.max_message_size:
            return f"heap_size={self.body_limit} (below max_message_size={self.max_message_size})"
        return f"max_message_size={self.max_message_size}"

    def reply_limit(self) -> int:
        """The longest reply record pushed straight into a response ring (bigger ones are
        followed, or go through the heap)."""
        return min(self._chan.responses[0].max_payload, fr.HEADER_SIZE + self.follow_min - 1)

    def error(self, f: fr.Frame, code: int, message: str) -> None:
        """Answer ``f`` with status ``code`` (a one-way call's INTERNAL failure is logged)."""
        if f.call_id == fr.NO_REPLY:
            if code == StatusCode.INTERNAL:
                logger.warning("one-way call %r failed: %s", f.method, message)
            return
        head = fr.header(fr.ERROR, fr.RAW, int(code), f.slot, f.gen, f.call_id, 0.0, b"")
        self.send(f.slot, f.gen, head, message.encode()[:4096])

    def fail(self, f: fr.Frame, exc: BaseException) -> None:
        """Answer ``f`` with the status its handler's exception says (a bug: INTERNAL, logged)."""
        if isinstance(exc, asyncio.CancelledError):
            self.error(f, StatusCode.CANCELLED, "cancelled")
        elif isinstance(exc, RpcError):
            self.error(f, exc.code, exc.message)
        else:  # a bug in the handler: the server's log gets the traceback
            logger.error("handler of %r raised", f.method, exc_info=exc)
            detail = f"{type(exc).__name__}: {exc}" if self.error_details else "the handler failed"
            self.error(f, StatusCode.INTERNAL, detail)

    def send(self, slot: int, gen: int, head: bytes, body: BytesLike) -> bool:
        """Send a frame to a client: into its ring, else held for it (False: refused instead,
        its backlog is full; see hold)."""
        chan = self._chan
        if chan.slot_generation(slot) != gen:
            return True  # the client left or died: nobody to answer
        ring = chan.responses[slot]
        if len(head) + len(body) > ring.max_payload and (self._heap is None
                                                         or len(body) > self.body_limit):
            code = int(StatusCode.RESOURCE_EXHAUSTED)
            limit = (self.limit_setting() if self._heap is not None
                     else f"the ring's limit {ring.max_payload} (this server has no heap)")
            msg = f"response of {len(body)} bytes exceeds {limit}".encode()
            call_id = fr.HEADER.unpack_from(head)[5]
            head, body = fr.header(fr.ERROR, fr.RAW, code, slot, gen, call_id, 0.0, b""), msg
        # a small reply need not wait behind replies that wait for the heap (it may be the
        # ALLOC grant whose request frees the heap for them)
        inline = len(head) + len(body) <= ring.max_payload
        sent = True
        if (slot in self.backlog and not inline) or not self.push(slot, gen, ring, head, body):
            sent = self.hold(slot, gen, head, body)
        chan.ring_client(slot, gen)
        return sent

    def push(self, slot: int, gen: int, ring: ReplySink, head: bytes, body: BytesLike) -> bool:
        """Push a reply, through the heap when it is too big for the ring or big enough to be
        followed; False while the ring (or the heap) is full."""
        if len(body) >= self.follow_min:
            pushed = self.push_followed(slot, gen, ring, head, body)
            if pushed is not None:
                return pushed
        if len(head) + len(body) <= ring.max_payload:
            return ring.try_push_parts((head, body))
        if self._chan.slot_generation(slot) != gen:
            return True  # the caller left (its extents were freed): nobody would free this one
        heap = self._heap
        assert heap is not None  # (send refused a body too big for the ring without one)
        offset = heap.alloc(slot, gen, len(body))
        if offset is None:
            return False
        heap.access.write(offset, (body,))
        if ring.try_push_parts((fr.out_of_line(head), EXTENT.pack(offset, len(body)))):
            return True
        heap.free(offset, slot, gen)
        return False

    def push_followed(self, slot: int, gen: int, ring: ReplySink, head: bytes,
                      body: BytesLike) -> bool | None:
        """Send a big reply's frame first, then write its body into the heap while the client
        copies it out (``cxlrpc.heap``); False while the ring is full, None when it goes
        the plain way: the heap has no room for it now, or ALLOCs wait for the heap (a reply
        can take the ring instead, a big request cannot), or the body is not one contiguous
        run of bytes."""
        if self._chan.slot_generation(slot) != gen:
            return True  # the caller left: nobody to answer
        heap = self._heap
        assert heap is not None  # (follow_min is finite only with a heap)
        try:
            body = memoryview(body).cast("B")
        except TypeError:
            return None
        size = heap.access.header + len(body)
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

    def hold(self, slot: int, gen: int, head: bytes, body: BytesLike) -> bool:
        """Hold a reply until its client's ring has room; False: refused instead (its backlog
        is full; a RESOURCE_EXHAUSTED error is held for the call, or past twice the limit
        nothing, counted in ``shed_replies``)."""
        queue = self.backlog.get(slot)
        if queue is None:
            queue = self.backlog[slot] = HeldReplies()
        held = queue.hold(slot, gen, head, body, self.limits)
        if held == SHED:
            self.shed_replies += 1
        return held == HELD

    def flush_backlog(self) -> None:
        """Retry responses that met a full response ring (backpressure; bounded: hold)."""
        chan = self._chan
        for slot in list(self.backlog):
            queue = self.backlog[slot]
            ring = chan.responses[slot]
            holder = chan.slot_generation(slot)
            while queue:
                gen, head, body = queue.first()
                if holder != gen:
                    queue.pop()
                    continue
                if not self.push(slot, gen, ring, head, body):
                    break
                queue.pop()
            if holder >= 0:
                chan.ring_client(slot, holder)
            if not queue:
                del self.backlog[slot]

    def departed(self, slot: int, gen: int) -> None:
        """The holder ``gen`` of ``slot`` left: drop the replies held for it."""
        queue = self.backlog.get(slot)
        if queue:
            queue.drop_gen(gen)
            if not queue:
                del self.backlog[slot]
