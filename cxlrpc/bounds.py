"""Per-connection bounds of what one client may make a server hold (issue 40, items 4-6).

A server serves many clients from one loop and one request ring: a client that stops reading
its replies, floods ALLOCs, or starts followed requests and never finishes writing them must
cost the others neither memory nor latency. Each such resource is bounded per connection
(slot, generation); what goes past a bound is refused to that connection alone, with
``RESOURCE_EXHAUSTED`` on the call (gRPC's status for a peer over its quota).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterator

from . import frame as fr
from .memory import BytesLike
from .errors import StatusCode

#: The most bytes a refusal in the backlog (a RESOURCE_EXHAUSTED error frame) takes.
REFUSAL_MAX = 512
#: What ``HeldReplies.hold`` did with a reply: held it, held a refusal in its place, or
#: dropped it (past twice the limit of entries).
HELD, REFUSED, SHED = 0, 1, 2


@dataclass(frozen=True)
class Limits:
    """The server's per-connection limits (its keyword options of the same names, validated).

    - ``max_backlog_bytes`` / ``max_backlog_replies``: replies held for a client whose response
      ring is full (it reads slower than it calls) or that wait for room in the heap (the
      server's default for the bytes: the larger of 16 MiB and max_message_size). A reply past
      either is replaced by a RESOURCE_EXHAUSTED error for its call (as are its new requests,
      unrun, while it is over), held up to as many entries again; past that it is dropped
      (``Server.shed_replies``) and the call ends at its deadline. A connection's first held
      reply is held whatever its size.
    - ``max_alloc_waiters``: ALLOCs (heap extents for big request bodies) of one connection
      waiting for room in the heap; ``alloc_timeout``: how long one without a deadline waits
      (its caller then gets RESOURCE_EXHAUSTED).
    - ``max_followed_requests``: followed requests of one connection whose bodies are still
      being written.
    - ``max_stream_bytes``: bytes of request-stream items one connection sent that its handlers
      have not taken yet (each stream holds at most its credit of items; this bounds them all
      together; the server's default: the larger of 64 MiB and twice max_message_size). The
      item past it fails its stream with RESOURCE_EXHAUSTED.
    """

    max_backlog_bytes: int = 16 << 20
    max_backlog_replies: int = 1024
    max_alloc_waiters: int = 16
    alloc_timeout: float = 30.0
    max_followed_requests: int = 32
    max_stream_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for name in ("max_backlog_bytes", "max_backlog_replies", "max_alloc_waiters",
                     "max_followed_requests", "max_stream_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        timeout = self.alloc_timeout
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not math.isfinite(timeout) or timeout <= 0):
            raise ValueError(f"alloc_timeout must be a finite number of seconds > 0, got {timeout!r}")


class HeldReplies:
    """One slot's replies held back while its response ring is full, in order, with their
    bytes counted: entries ``(gen, head, body)`` (the native dispatcher sees only whether a
    slot has any)."""

    __slots__ = ("_queue", "size")

    def __init__(self) -> None:
        self._queue: deque[tuple[int, bytes, bytes]] = deque()
        self.size = 0  # bytes held (heads and bodies)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[tuple[int, bytes, bytes]]:
        return iter(self._queue)

    def first(self) -> tuple[int, bytes, bytes]:
        return self._queue[0]

    def append(self, entry: tuple[int, bytes, bytes]) -> None:
        self._queue.append(entry)
        self.size += len(entry[1]) + len(entry[2])

    def pop(self) -> None:
        """Drop the first entry (sent, or its connection left)."""
        _, head, body = self._queue.popleft()
        self.size -= len(head) + len(body)

    def drop_gen(self, gen: int) -> None:
        """Drop the entries of a departed holder of the slot."""
        kept = [entry for entry in self._queue if entry[0] != gen]
        self._queue.clear()
        self.size = 0
        for entry in kept:
            self.append(entry)

    def full(self, limits: Limits) -> bool:
        """At or past the connection's limit: its replies (and requests) are refused."""
        return len(self._queue) >= limits.max_backlog_replies or self.size >= limits.max_backlog_bytes

    def hold(self, slot: int, gen: int, head: bytes, body: BytesLike, limits: Limits) -> int:
        """Hold a reply (HELD; a connection's first always is); past the limits, a
        RESOURCE_EXHAUSTED error for its call in its place (REFUSED), up to as many entries
        again; past that, nothing (SHED: a client that reads nothing makes us hold no more)."""
        queue = self._queue
        if not queue or (len(queue) < limits.max_backlog_replies
                         and self.size + len(head) + len(body) <= limits.max_backlog_bytes):
            self.append((gen, head, bytes(body)))
            return HELD
        if len(queue) >= 2 * limits.max_backlog_replies:
            return SHED
        call_id = fr.HEADER.unpack_from(head)[5]
        self.append((gen, fr.header(fr.ERROR, fr.RAW, int(StatusCode.RESOURCE_EXHAUSTED), slot, gen, call_id,
                                    0.0, b""), self.why(limits).encode()[:REFUSAL_MAX - fr.HEADER_SIZE]))
        return REFUSED

    def why(self, limits: Limits) -> str:
        """Why the connection's replies and requests are refused: replies wait for it already."""
        return (f"{len(self._queue)} replies ({self.size} bytes) wait to be sent to this client already "
                f"(it reads slower than it calls, or they wait for heap room; max_backlog_replies="
                f"{limits.max_backlog_replies}, max_backlog_bytes={limits.max_backlog_bytes})")


class PerConnection:
    """A count per connection (slot, generation) of something it holds, e.g. followed
    requests in progress."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[tuple[int, int], int] = {}

    def __getitem__(self, peer: tuple[int, int]) -> int:
        return self._counts.get(peer, 0)

    def add(self, peer: tuple[int, int]) -> None:
        self._counts[peer] = self._counts.get(peer, 0) + 1

    def remove(self, peer: tuple[int, int]) -> None:
        left = self._counts.get(peer, 0) - 1
        if left > 0:
            self._counts[peer] = left
        else:
            self._counts.pop(peer, None)

    def clear(self) -> None:
        self._counts.clear()
