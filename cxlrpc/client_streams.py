"""The asyncio client's side of streaming calls (``cxlrpc.streams.StreamCall``): the
opening request, request items (big ones through the heap), the end of the requests, credit
for the server's items, cancellation. Frames of the server come through
``cxlrpc.client_replies.Replies.on_reply``.
"""
from __future__ import annotations

from typing import Any, Mapping

from . import frame as fr
from .client_base import Codec
from .client_bodies import Bodies, Large, grant
from .client_connection import Connection
from .client_replies import Replies
from .errors import ResourceExhausted, Unavailable
from .heap import OFFSET
from .streams import StreamCall
from .transport import ClientTransport

#: How soon a credit that met a full request ring is offered again.
_CREDIT_RETRY_S = 0.0005


class ClientStreams:
    """Streaming calls' frames out, on the connection they were opened on."""

    def __init__(self, conn: Connection, bodies: Bodies, codec: Codec, replies: Replies) -> None:
        self._conn = conn
        self._bodies = bodies
        self._codec = codec
        self._replies = replies

    async def open(self, call: StreamCall[Any], method: str, arg: Any,
                   metadata: Mapping[str, str] | None, timeout: float | None) -> StreamCall[Any]:
        """Send a streaming call's request (connected, ``timeout`` what is left of it)."""
        conn, replies = self._conn, self._replies
        call_id = next(conn.ids)
        parts = self._codec.request(call_id, method, b"" if call._requests else arg, timeout or 0.0,
                                    metadata, fr.STREAM if call._requests else 0)
        if type(parts) is Large:
            raise ResourceExhausted("a stream's request must fit the request ring")
        loop = replies.event_loop()
        deadline = None if timeout is None else loop.time() + timeout
        replies.streams[call_id] = call
        call._opened(call_id, conn.chan, deadline)
        try:
            await replies.push_parts(parts, deadline)
        except BaseException:
            call._finish()
            raise
        if call._closed:  # cancelled (or left) while it opened: the handler has no caller
            conn.send_cancel(call_id)
            call._finish()
        replies.wake_reader()  # the stream's frames come through the reader
        return call

    def _stream_chan(self, call: StreamCall[Any]) -> ClientTransport:
        """The channel a streaming call still runs on, or Unavailable (it was opened on a
        connection that is gone)."""
        conn = self._conn
        chan = conn.chan
        if chan is None or chan is not call._chan or conn.gone is not None:
            raise Unavailable(conn.gone or "the connection of this call was lost")
        return chan

    async def send_item(self, call: StreamCall[Any], item: Any) -> None:
        """One request item of ``call`` (through the heap when it is too big for the ring)."""
        chan = self._stream_chan(call)
        replies, bodies = self._replies, self._bodies
        flags, body = fr.encode_body(item)
        head = fr.header(fr.ITEM, flags, 0, chan.slot, chan.gen, call._call_id, 0.0, b"")
        if len(head) + len(body) <= self._conn.max_request:
            await replies.push_parts((head, body), call._deadline)
            return
        large = bodies.out_of_line(flags, 0, b"", body, "stream item")
        left = 0.0 if call._deadline is None else max(1e-6, call._deadline - replies.event_loop().time())
        alloc_id, alloc = bodies.alloc_request(len(body), left)
        reply = await replies.granted(alloc_id, alloc, call._deadline)
        self._stream_chan(call)  # the extent is another server's if the connection changed
        offset, _ = grant(reply)  # (not asked as a spare)
        parts = bodies.staged(large, offset, call._call_id, 0.0, fr.ITEM)
        pushed = False
        try:
            await replies.push_parts(parts, call._deadline)
            pushed = True
        finally:
            if not pushed:
                bodies.give_back(offset)

    async def send_end(self, call: StreamCall[Any]) -> None:
        """The caller is done writing ``call``'s requests."""
        chan = self._stream_chan(call)
        head = fr.header(fr.END, fr.RAW, 0, chan.slot, chan.gen, call._call_id, 0.0, b"")
        await self._replies.push_parts((head,), call._deadline)

    def send_credit(self, call: StreamCall[Any], count: int) -> None:
        """Grant the server ``count`` more items of ``call``; a full ring is retried soon (a
        credit must never be lost: the server would wait for it forever)."""
        conn = self._conn
        chan = conn.chan
        if call._closed or chan is None or chan is not call._chan or conn.gone is not None:
            return
        head = fr.header(fr.CREDIT, fr.RAW, 0, chan.slot, chan.gen, call._call_id, 0.0, b"")
        try:
            pushed = conn.push((head, OFFSET.pack(count)))
        except Unavailable:
            return
        if pushed:
            chan.server_bell.ring()
        else:
            self._replies.event_loop().call_later(_CREDIT_RETRY_S, self.send_credit, call, count)

    def cancel(self, call: StreamCall[Any]) -> None:
        """Tell the server to cancel ``call`` (if its connection is still the client's)."""
        if call._chan is self._conn.chan:
            self._conn.send_cancel(call._call_id)
