"""The transport seam: the small interfaces the client and the server talk to the memory
through. Today's shared-memory channels (:mod:`cxlrpc.channel`) are their implementations; a
transport that has no shared heap or native path (a future ``tcp://``) fits behind them
without touching the call path, dispatch or streams.
"""
from __future__ import annotations

from typing import Awaitable, Callable, Protocol, Sequence

from .channel import Geometry, NativeCallPath
from .doorbell import WaitStrategy
from .region import Region

# ---------------------------------------------------------------------- the client's side


class ReplyRing(Protocol):
    """The client's reply ring: its records polled in order, garbage counted dropped."""

    dropped: int

    def poll(self, handler: Callable[[memoryview], None], limit: int = ...) -> int:
        """Hand up to ``limit`` records to ``handler``; how many it handed."""
        ...

    def readable(self) -> bool:
        """Is a record waiting?"""
        ...


class RequestLimit(Protocol):
    """The request ring as the client sizes its records by it."""

    @property
    def max_payload(self) -> int:
        """The longest record it takes."""
        ...


class ServerWake(Protocol):
    """Wakes the server after a push (when it sleeps where this side can wake it)."""

    def ring(self) -> None:
        """Wake the server if it is parked; costs nothing while it is awake."""
        ...


class CpuYield(Protocol):
    """Gives the CPU up once between two looks at the reply ring (spin phase over)."""

    def yield_cpu(self) -> None:
        """Yield the CPU (moving off one another process shares)."""
        ...


class ReplyWait(Protocol):
    """How the client sleeps until a reply record comes (or ``ready()`` says so)."""

    def wait_sync(self, ready: Callable[[], bool], strategy: WaitStrategy, timeout: float,
                  idle: bool = False) -> bool:
        """Block the thread until ``ready()`` or ``timeout``; ``ready()``'s last answer."""
        ...

    def wait_async(self, ready: Callable[[], bool], strategy: WaitStrategy, timeout: float,
                   idle: bool = False) -> Awaitable[bool]:
        """Wait in the event loop until ``ready()`` or ``timeout``; ``ready()``'s last answer."""
        ...

    @property
    def shared_cpu(self) -> CpuYield:
        """Where the waiting thread gives its CPU up between looks."""
        ...


class ClientTransport(Protocol):
    """A client's connection to one server: one slot, a way to push request frames, a reply
    ring to poll, the server's liveness. :class:`cxlrpc.channel.ClientChannel` and
    :class:`cxlrpc.channel.FlushClientChannel` implement it; the client uses nothing else of
    them."""

    #: The slot this connection holds, and its generation (every frame carries both).
    slot: int
    gen: int
    #: The server's (epoch, heartbeat) once it was judged gone (a reconnection that finds them
    #: unchanged knows at once there is still no server).
    stopped_beat: tuple[int, int] | None
    #: The server shares this host (it can wake us) / this very process (it cannot answer
    #: while we poll without giving its loop a turn).
    server_local: bool
    server_in_process: bool

    @property
    def region(self) -> Region:
        """The mapping the connection lives in (its heap holds out-of-line bodies)."""
        ...

    @property
    def geo(self) -> Geometry:
        """The server's layout: heap size, max_message_size."""
        ...

    @property
    def requests(self) -> RequestLimit | None:
        """The request ring, for the size of a record it takes (None before the server
        granted the slot, in flush mode)."""
        ...

    @property
    def responses(self) -> ReplyRing:
        """This slot's reply ring."""
        ...

    @property
    def bell(self) -> ReplyWait:
        """How the client waits for a reply."""
        ...

    @property
    def server_bell(self) -> ServerWake:
        """How the client wakes the server after a push."""
        ...

    def push(self, parts: Sequence[bytes | memoryview]) -> bool:
        """Push one request frame (its parts joined); False when the ring is full; ClaimRevoked
        when the server reclaimed the slot."""
        ...

    def acknowledged(self) -> bool:
        """Has the server seen this connection (BlockingIOError: every slot is taken)?"""
        ...

    def server_gone(self, timeout: float) -> str | None:
        """Why the server should be considered gone, or None while it looks alive."""
        ...

    def beat(self) -> None:
        """Say this client is alive (the monitor thread, every 0.1 s)."""
        ...

    def holds_slot(self) -> bool:
        """False once the server reclaimed the slot."""
        ...

    def release(self) -> None:
        """Give the slot back (safe from any thread, and twice)."""
        ...

    def detach(self) -> None:
        """Close what the connection holds of this process (wake-up socket), then release."""
        ...

    def native_path(self) -> NativeCallPath | None:
        """What the native caller (``cxlrpc._dispatch.Caller``) pushes, rings and polls
        through, or None for a transport it cannot use (memory without coherence)."""
        ...
