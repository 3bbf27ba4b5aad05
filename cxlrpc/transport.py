"""The transport seam: what the RPC layer needs of the medium between a server and its clients.
This module sits below the channel that implements it and imports nothing above the doorbell.

Server side (``ServerTransport``). The server's rooms (dispatch, streams, replies, bodies,
the serve loop) see a transport only through this interface, never a region, a slot table or a
control block. Today's implementations are ``cxlrpc.channel.ServerChannel`` (coherent
shared memory) and ``cxlrpc.channel.FlushServerChannel`` (memory without coherence: the
single-writer layout). A new transport (``tcp://``, a flush-mode native path) implements:

- ``requests``: a ``RequestSource`` the serve loop polls (records in, each handed to the
  server's handler as a ``memoryview`` that lives until the handler returns);
- ``responses``: per peer slot, a ``ReplySink`` a reply frame is pushed into (a full one
  is backpressure: the server holds the reply and retries), and ``ring_client`` to wake a
  peer once something was pushed for it;
- ``bell``: the server's own wait for requests (``ServerBell``);
- liveness: ``slot_generation`` (who holds a slot now), ``seen`` (the holder the server last
  saw per slot), ``reap`` and ``departure`` (who left, and how: ``Departure``),
  ``peer_info``, ``identity``, ``peers_in_process``, ``unblock_requests``, ``republish``;
- ``dropped`` (a counter of dropped frames peers can read), ``closed`` and ``close``;
- ``native_rings``: the optional native hot path (``NativeRings``, what the C
  dispatcher of ``cxlrpc._dispatch`` drives directly), or None when the transport has none:
  the server then dispatches every request through its Python reference path.

Client side (``ClientTransport``). The client's rooms (connection, call path, bodies, streams)
see one connection to one server: push a request frame, poll its reply ring, wake the server,
the server's liveness (``server_gone``, ``beat``, ``holds_slot``), ``release``/``detach``, and
``native_path``, the optional native call path (``NativeCallPath``), or None. Implementations:
``cxlrpc.channel.ClientChannel`` and ``cxlrpc.channel.FlushClientChannel``.

Out-of-line bodies (the heap) are the server's, not the transport's: a transport without a
shared heap is served with ``heap_size=0`` (bodies then go in line, up to the reply limit).
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, NamedTuple, Protocol, Sequence

from .doorbell import WaitStrategy
from .memory import BytesLike
from .region import PidWatch, Region
from .ring import SpscRing

#: How a slot's holder left (``Departure``): it released its slot itself; it died on this
#: host (its PID is gone); or it was reaped, its heartbeat stopped (frozen, or on another host)
DETACHED, DEAD, REAPED = "detached", "dead", "reaped"


class Departure(NamedTuple):
    """A holder that left its slot, and how (DETACHED, DEAD or REAPED). A REAPED holder may
    still run (frozen, then resumed): ``local`` says it shares our host identity and ``pid``
    is its PID then, with ``watch`` the pidfd opened while it held the slot (handed over: the
    slot's next holder gets a watch of its own), so its exit can be proven later."""
    slot: int
    gen: int
    how: str
    pid: int = 0
    local: bool = False
    watch: PidWatch | None = None


class RequestSource(Protocol):
    """Where requests come in (a ring, or the rings of every peer polled in turn)."""

    @property
    def head_position(self) -> int:
        """Where the next record is read (a blocked head is retried gently while it stays)."""

    def poll(self, handler: Callable[[memoryview], object], limit: int = ...) -> int:
        """Hand up to ``limit`` records to ``handler``, each a view valid until it returns;
        how many were handed."""

    def poll_within(self, handler: Callable[[memoryview], object], limit: int,
                    seconds: float) -> int:
        """As ``poll``, looking for a first record for up to ``seconds``."""

    def readable(self) -> bool:
        """Whether a record (committed or being written) waits at the head."""


class ReplySink(Protocol):
    """One peer's reply queue (a response ring)."""

    @property
    def max_payload(self) -> int:
        """The largest record it takes (header included)."""

    def try_push_parts(self, parts: Sequence[BytesLike]) -> bool:
        """Push one record made of ``parts``; False while it is full (nothing was pushed)."""


class _YieldCpu(Protocol):
    def yield_cpu(self) -> None:
        """Give the CPU away for a moment when another task shares it."""


class ServerBell(Protocol):
    """How the server waits for requests without burning a core."""

    @property
    def shared_cpu(self) -> _YieldCpu:
        """The CPU-sharing evidence the serve loop's yield phase uses."""

    def wait_async(self, ready: Callable[[], bool], strategy: WaitStrategy, timeout: float,
                   idle: bool = False) -> Awaitable[bool]:
        """Wait until ``ready()`` or ``timeout`` seconds (True: ready)."""


class SharedCounter(Protocol):
    """A counter peers can read (the frames the server dropped)."""

    def fetch_add(self, value: int, order: int = ...) -> int:
        """Add ``value``; the previous value."""

    def load(self, order: int = ...) -> int:
        """The current value."""


class NativeRings(NamedTuple):
    """What the native dispatcher drives directly: the mapping, where each slot's state word
    and doorbell word lie in it, what a holder parked on this host writes there, and the
    slots' reply rings (whose C API it pushes through). A slot's word says it is held by
    generation ``gen`` when ``word & 1`` and ``(word >> 1) & gen_mask == gen``. ``requests``:
    what the dispatcher polls, when not the transport's ``requests`` itself: a list of rings
    (changed in place as slots are granted and freed), polled in turn through their C API."""
    buf: memoryview
    slot_state_at: list[int]
    parked_at: list[int]
    host: int
    responses: list[SpscRing]
    gen_mask: int = 0xFFFFFFFF
    requests: list[SpscRing] | None = None


class ServerTransport(Protocol):
    """The server's side of a transport: requests in, replies out, peers' liveness."""

    @property
    def requests(self) -> RequestSource:
        """The requests of every peer."""

    @property
    def responses(self) -> Sequence[ReplySink]:
        """Per slot, the reply queue of its holder."""

    @property
    def seen(self) -> list[int | None]:
        """Per slot, the generation the server last saw holding it (None: none); the server's
        dispatch updates it when a new holder's first frame comes."""

    @property
    def bell(self) -> ServerBell:
        """The server's wait for requests."""

    @property
    def dropped(self) -> SharedCounter:
        """Frames dropped (garbage, or from a departed holder), as peers can read it."""

    @property
    def identity(self) -> int:
        """This host's identity (a peer's PID names a process here only when its equals it)."""

    @property
    def peers_in_process(self) -> bool:
        """A peer of this very process holds a slot (it needs the loop to run)."""

    @property
    def closed(self) -> bool:
        """Whether the transport was closed (its peers' words cannot be read any more)."""

    def slot_generation(self, slot: int) -> int:
        """The generation of the slot's holder, or -1 when it is free (or no such slot)."""

    def peer_info(self, slot: int) -> tuple[int, int, int] | None:
        """(generation, PID, host identity) the slot's holder published (0: not written), or
        None while the slot is free."""

    def reap(self, timeout: float, now: float) -> list[Departure]:
        """Free the slots of holders that stopped beating for ``timeout`` s (or died); every
        holder that departed since the last call."""

    def departure(self, slot: int, gen: int) -> Departure:
        """How the holder ``gen`` of ``slot`` left, when a new holder's frame came first."""

    def write_back_holder(self, slot: int) -> None:
        """Write back what the slot's holder, dead on this host, may have left dirty in this
        host's caches (memory without coherence; a no-op elsewhere), before the slot is reused."""

    def fenced(self, slot: int, gen: int) -> None:
        """The departed holder ``gen`` of ``slot`` can no longer write into the region
        (``cxlrpc.fencing``): what the transport kept from new holders for it may be handed on."""

    def ring_client(self, slot: int, gen: int) -> None:
        """Wake the holder ``gen`` of ``slot`` if it sleeps (something was pushed for it)."""

    def unblock_requests(self, timeout: float) -> int | None:
        """Recover a request record its producer never finished (dead, or stalled for
        ``timeout`` s); the head position while a live producer still blocks it, else None."""

    def republish(self) -> int:
        """Put back the words only the server writes that a stray write changed; how many."""

    def native_rings(self) -> NativeRings | None:
        """What the native dispatcher drives, or None: this transport has no native path."""

    def close(self) -> None:
        """Tell every peer the server closed, and wake them."""


# ---------------------------------------------------------------------- the client's side


class Layout(Protocol):
    """The server's layout as the client reads it: where the heap lies and how large a message
    may be (``cxlrpc.channel.Geometry``; a transport without a shared heap says 0)."""

    @property
    def heap(self) -> int:
        """The heap's offset in the region."""
        ...

    @property
    def heap_size(self) -> int:
        """Bytes of heap for out-of-line bodies (0: none)."""
        ...

    @property
    def max_message_size(self) -> int:
        """The largest message either side may send."""
        ...


class NativeCallPath(NamedTuple):
    """What the native caller (``cxlrpc._dispatch.Caller``) pushes, rings and polls through:
    the rings themselves (their C API), the push's arguments after the parts, the server's
    bell, and where its parked word lies in the region. On memory without coherence, the
    slot's grant word (at ``grant_at``, -1: none) must still read ``grant`` before each push
    (its line invalidated first through ``lines``, the region's ``cxlrpc._flush.Lines``), else
    the push raises ClaimRevoked."""

    requests: Any
    push_args: tuple[Any, ...]
    ring_server: Callable[[], None]
    responses: Any
    buf: Any
    parked_at: int
    me: int
    grant_at: int = -1
    grant: int = 0
    lines: Any = None


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
    ring to poll, the server's liveness. ``cxlrpc.channel.ClientChannel`` and
    ``cxlrpc.channel.FlushClientChannel`` implement it; the client uses nothing else of
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
    def geo(self) -> Layout:
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

    def push(self, parts: Sequence[BytesLike]) -> bool:
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
