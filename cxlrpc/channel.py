"""A server region's layout: request ring, slot table, response rings; attach, detach, liveness.

Two layouts, chosen by the region's coherence (server and client code never see which):
coherent memory (``"hardware"``) uses the layout below; memory without cross-host coherence
(``"flush"``) uses the single-writer layout of ``FlushServerChannel``.

Layout on coherent memory (after the region header)::

    control block   state, geometry, server doorbell word, drop counter
    request ring    MPSC: every client -> server (producer id = slot index)
    slot table      per slot: state word (generation << 1 | claimed), heartbeat,
                    client doorbell word, pid hint + host identity + claim word (client's),
                    acknowledged generation (server's)
    response rings  SPSC per slot: server -> the client holding the slot
    heap            bodies too big for a ring (see ``cxlrpc.heap``); in the single-writer
                    layout, after the per-client request rings

A client claims a free slot with a CAS that bumps its generation, adopts the response
ring's tail as its head (whatever an earlier holder left is skipped), records its host
identity and beats its heartbeat.  Frames carry the generation, so a reply meant for a
slot's previous holder is recognised and dropped.  Liveness is judged from heartbeat
counters that stop changing (valid across hosts); a PID check speeds the verdict up only
when the client's host identity is the server's (same kernel and namespaces).  The server
acknowledges each holder in its slot, so a client on another host knows the server has seen
it (and polls for its requests) before its first call.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import struct
import time
from dataclasses import dataclass
from typing import Callable, Collection, NamedTuple, Sequence

from .doorbell import Doorbell, DoorbellReceiver, wake_address
from .identity import host_identity
from .memory import ACQ_REL, ACQUIRE, FLUSH, RELAXED, RELEASE, BytesLike, Counter, check_coherence
from .owned import OwnedWords
from .region import HEADER_SIZE as REGION_HEADER, PidWatch, Region, RegionError
from .ring import MpscRing, SpscRing, ring_size
from .ring.base import RingBase
from .ring.mpsc import NO_CLAIM, ClaimRevoked
from .ring.record import CONTROL_SIZE as RING_CONTROL, TAG_MASK
from .transport import DEAD, DETACHED, REAPED, Departure, NativeCallPath, NativeRings

KIND_RPC = 1
PAGE = 4096
SLOT_STRIDE = 640
MAX_SLOTS = 1024
MAX_HEAP = 1 << 40

STATE_STARTING, STATE_RUNNING, STATE_CLOSED = 0, 1, 2

# control block offsets (relative to CONTROL)
CONTROL = REGION_HEADER
_STATE, _SLOTS, _REQ_CAP, _RESP_CAP, _HEAP_SIZE, _MAX_MESSAGE = 0, 8, 16, 24, 32, 40
_GEOMETRY = (_SLOTS, _REQ_CAP, _RESP_CAP, _HEAP_SIZE, _MAX_MESSAGE)
#: a checksum of the geometry words and the region's coherence: a client attaches only to a
#: geometry its server wrote (plausible garbage would have it write into another slot's words)
_GEOMETRY_SUM = 48
#: Seconds a client waits for a control block that fails its checksum to be put right by the
#: server's housekeeping (~0.1 s) before it gives up with a RegionError.
GEOMETRY_PATIENCE = 0.5
#: Seconds a client waits, while the server's heartbeat moves, before it believes one word
#: that says the server closed or died (its server puts a stray write back within ~0.1 s); a
#: clean close (both state words agree) and the death of the PID it attached to count at once.
WORD_CONFIRM_S = 0.35
_SERVER_PARKED = 128
_DROPPED = 256
# slot offsets (relative to the slot's base); each line has one writer except the state
# word (claimed by the client, reaped by the server) and the parked word (doorbell)
_SLOT_STATE, _SLOT_HEARTBEAT, _SLOT_PARKED = 0, 128, 256
_SLOT_PID, _SLOT_IDENTITY, _SLOT_CLAIM = 384, 392, 400  # the client's line
#: the generation whose holder wrote the PID and identity words (written after them): until
#: it matches, they may still be the previous holder's, whose PID proves nothing of this one
_SLOT_WRITER = 408
#: the generation of a holder that released its slot itself, written before it frees it: a slot
#: found free (or claimed anew) without it was freed by a stray write, and its holder may still run
_SLOT_RELEASED = 416
_SLOT_ACK = 512  # the server's line: the generation it has seen claimed
_SLOT_WORDS = (_SLOT_HEARTBEAT, _SLOT_PARKED, _SLOT_PID, _SLOT_IDENTITY, _SLOT_CLAIM, _SLOT_WRITER,
               _SLOT_RELEASED,
               _SLOT_ACK)


def _page(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


@dataclass(frozen=True)
class Geometry:
    """Sizes and offsets of everything in a server region."""

    slots: int
    request_capacity: int
    response_capacity: int
    #: Single-writer layout (memory without coherence): one SPSC request ring per slot, of
    #: ``request_capacity`` each, instead of one shared MPSC ring.
    per_client_requests: bool = False
    #: Bytes of the heap that carries bodies too big for a ring (a multiple of the page size),
    #: and the largest message either side may send (``max_message_size``).
    heap_size: int = 0
    max_message_size: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in [1, {MAX_SLOTS}], got {self.slots}")
        ring_size(self.request_capacity)  # validates the capacities
        ring_size(self.response_capacity)
        if not 0 <= self.heap_size <= MAX_HEAP or self.heap_size % PAGE:
            raise ValueError(f"heap_size must be a multiple of {PAGE} in [0, {MAX_HEAP}], "
                             f"got {self.heap_size}")
        if not 0 <= self.max_message_size <= max(self.heap_size, 1 << 31):
            raise ValueError(f"max_message_size {self.max_message_size} does not fit the "
                             f"heap of {self.heap_size} bytes: raise heap_size")

    @property
    def request_ring(self) -> int:
        """The shared MPSC request ring (coherent layout)."""
        return CONTROL + PAGE

    @property
    def slot_table(self) -> int:
        shared = 0 if self.per_client_requests else ring_size(self.request_capacity)
        return _page(self.request_ring + shared)

    def slot(self, i: int) -> int:
        return self.slot_table + i * SLOT_STRIDE

    @property
    def response_rings(self) -> int:
        return _page(self.slot_table + self.slots * SLOT_STRIDE)

    def response_ring(self, i: int) -> int:
        return self.response_rings + i * _page(ring_size(self.response_capacity))

    def client_request_ring(self, i: int) -> int:
        """Slot ``i``'s own request ring (single-writer layout)."""
        return self.response_ring(self.slots) + i * _page(ring_size(self.request_capacity))

    @property
    def heap(self) -> int:
        """Where the heap starts (after the rings)."""
        if self.per_client_requests:
            return self.client_request_ring(self.slots)
        return self.response_ring(self.slots)

    @property
    def size(self) -> int:
        return self.heap + self.heap_size


def layout(slots: int, request_capacity: int, response_capacity: int, coherence: str,
           heap_size: int = 0, max_message_size: int = 0) -> Geometry:
    """The geometry a server region of that coherence mode uses."""
    return Geometry(slots, request_capacity, response_capacity, check_coherence(coherence) == FLUSH,
                    _page(heap_size), max_message_size)


def geometry_sum(words: Sequence[int], coherence: str) -> int:
    """The checksum of a control block's geometry words (in ``_GEOMETRY`` order) for a region
    of that coherence: 64 bits of BLAKE2b, so no plausible stray write matches it."""
    packed = struct.pack("<5Q", *(w & 0xFFFFFFFFFFFFFFFF for w in words)) + coherence.encode()
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8, person=b"cxlrpc.geometry").digest(),
                          "little")


def _write_geometry(region: Region, geo: Geometry) -> OwnedWords:
    """Store the geometry words of the control block and their checksum (what
    ``read_geometry`` reads); they and the state word are the server's to keep true."""
    mem = region.mem
    words = (geo.slots, geo.request_capacity, geo.response_capacity, geo.heap_size, geo.max_message_size)
    owned = OwnedWords(mem)
    for off, value in (*zip(_GEOMETRY, words), (_GEOMETRY_SUM, geometry_sum(words, region.coherence))):
        mem.store(CONTROL + off, value, RELAXED)
        owned.expect(CONTROL + off, value)
    owned.expect(CONTROL + _STATE, STATE_RUNNING)  # stored last, by the channel
    return owned


def read_geometry(region: Region, patience: float = GEOMETRY_PATIENCE) -> Geometry:
    """Read and validate a server region's geometry (it may be garbage): words that fail their
    checksum are read again for up to ``patience`` seconds (the server puts stray writes
    back), then RegionError, before anything is written where they point."""
    mem = region.mem
    deadline = time.monotonic() + patience
    while True:
        mem.invalidate(CONTROL, 64)
        words = [mem.load(CONTROL + off, ACQUIRE) for off in _GEOMETRY]
        if mem.load(CONTROL + _GEOMETRY_SUM, ACQUIRE) == geometry_sum(words, region.coherence):
            break
        if time.monotonic() >= deadline:
            raise RegionError(f"{region.url}: the control block's geometry fails its checksum "
                              f"(words written over it that its server did not put back within "
                              f"{patience} s, or a server of another build)")
        time.sleep(0.01)
    try:
        slots, req, resp, heap, most = words
        geo = Geometry(slots, req, resp, region.coherence == FLUSH, heap, most)
    except ValueError as exc:
        raise RegionError(f"{region.url}: bad geometry in control block ({exc})") from exc
    if geo.size > region.size:
        raise RegionError(f"{region.url}: geometry needs {geo.size} bytes, region has {region.size}")
    return geo


class Liveness:
    """Judges a peer dead when its heartbeat counter has not changed for ``timeout`` seconds."""

    __slots__ = ("timeout", "_last", "_since")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._last: int | None = None
        self._since = 0.0

    def stale(self, value: int, now: float) -> bool:
        if value != self._last:
            self._last, self._since = value, now
            return False
        return now - self._since > self.timeout

    def forget(self) -> None:
        """Start over: the next value observed is fresh."""
        self._last = None

    def age(self, now: float) -> float:
        return now - self._since if self._last is not None else 0.0


def _reaped(slot: int, gen: int, pid: int, local: bool, watches: list[PidWatch]) -> Departure:
    """A holder freed for its stale heartbeat: its slot's PidWatch goes with it, when local."""
    if not local:
        return Departure(slot, gen, REAPED)
    watch, watches[slot] = watches[slot], PidWatch()
    return Departure(slot, gen, REAPED, pid, True, watch)


class _ServerWords:
    """What both server channels share: the words of the region header and control block
    they alone write, kept true by the server's housekeeping (see ``cxlrpc.owned``)."""

    region: Region
    state: Counter
    _owned: OwnedWords

    @property
    def closed(self) -> bool:
        """Whether the region was closed (its words cannot be read any more)."""
        return self.region.closed

    def republish(self) -> int:
        """Put back the owner's and control words a stray write changed (housekeeping calls
        it, ~10 times a second; nothing is stored while they hold, nor once the region's
        epoch word is not ours: another server took it over); how many were wrong."""
        if not self.region.still_ours():
            return 0
        return self.region.republish() + self._owned.restore()

    def _store_closed(self) -> None:
        self._owned.expect(CONTROL + _STATE, STATE_CLOSED)
        self.state.store(STATE_CLOSED, RELEASE)


class ServerChannel(_ServerWords):
    """The server's side of a region: consumes requests, produces responses, watches slots."""

    def __init__(self, region: Region, geo: Geometry, poll_interval: float = 1e-3) -> None:
        self.region = region
        self.geo = geo
        mem = region.mem
        self.identity = host_identity()
        #: A client of this very process holds a slot (set by reap): it shares our GIL, so
        #: polling for its requests without giving the loop a turn cannot see them.
        self.peers_in_process = False
        self.state = mem.counter(CONTROL + _STATE)
        self.dropped = mem.counter(CONTROL + _DROPPED)
        self._owned = _write_geometry(region, geo)
        self.requests = MpscRing(region.buf, mem, geo.request_ring, geo.request_capacity)
        self.requests.reset()
        self.responses: list[SpscRing] = []
        self.slot_state = []
        self.slot_state_at: list[int] = []  # where each slot's state word lies in the region
        self.slot_heartbeat = []
        self.slot_claim = []
        self.slot_ack = []
        self.client_bells: list[Doorbell] = []
        for i in range(geo.slots):
            base = geo.slot(i)
            for off in _SLOT_WORDS:
                mem.store(base + off, 0, RELAXED)
            # generations go on from the memory's previous server (a file or device region is
            # the same memory for the next one): its clients' (slot, generation) never match
            # a claim made of this server, so none of them mistakes its slot for still held
            mem.store(base + _SLOT_STATE, mem.load(base + _SLOT_STATE, ACQUIRE) & 0x1FFFFFFFE, RELAXED)
            mem.store(base + _SLOT_CLAIM, NO_CLAIM, RELAXED)
            ring = SpscRing(region.buf, mem, geo.response_ring(i), geo.response_capacity)
            ring.reset()
            self.responses.append(ring)
            self.slot_state.append(mem.counter(base + _SLOT_STATE))
            self.slot_state_at.append(base + _SLOT_STATE)
            self.slot_heartbeat.append(mem.counter(base + _SLOT_HEARTBEAT))
            self.slot_claim.append(mem.counter(base + _SLOT_CLAIM))
            self.slot_ack.append(mem.counter(base + _SLOT_ACK))
            self.client_bells.append(Doorbell(mem.counter(base + _SLOT_PARKED), b""))
        self.bell = DoorbellReceiver(mem.counter(CONTROL + _SERVER_PARKED),
                                     wake_address(region.epoch, "server"), poll_interval)
        self._liveness = [Liveness(0.0) for _ in range(geo.slots)]
        self._pids = [PidWatch() for _ in range(geo.slots)]  # holders that share our identity
        #: per slot, (generation, PID, same host) its holder published at attach, pinned
        self._pinned: list[tuple[int, int, bool] | None] = [None] * geo.slots
        self.seen: list[int | None] = [None] * geo.slots  # generation last seen claimed (or sending)
        self.requests.live_claims = self.live_claims  # garbage recovery spares claims being written
        self.state.store(STATE_RUNNING, RELEASE)

    def slot_generation(self, slot: int) -> int:
        """Current generation of a claimed slot, or -1 when it is free (or no slot: garbage)."""
        if not 0 <= slot < self.geo.slots:
            return -1
        word = self.slot_state[slot].load(ACQUIRE)
        return (word >> 1) & 0xFFFFFFFF if word & 1 else -1

    def peer_info(self, slot: int) -> tuple[int, int, int] | None:
        """(generation, PID, host identity) the slot's holder published (0: not written), or
        None while the slot is free or changes hands under the read."""
        word = self.slot_state[slot].load(ACQUIRE)
        if not word & 1:
            return None
        base, mem = self.geo.slot(slot), self.region.mem
        gen = (word >> 1) & 0xFFFFFFFF
        pid, identity = mem.load(base + _SLOT_PID, ACQUIRE), mem.load(base + _SLOT_IDENTITY, ACQUIRE)
        if self.slot_state[slot].load(ACQUIRE) != word:
            return None
        if mem.load(base + _SLOT_WRITER, ACQUIRE) != gen:
            return gen, 0, 0  # not written yet: what the words hold is the previous holder's
        return gen, pid, identity

    def reap(self, timeout: float, now: float) -> list[Departure]:
        """Free slots whose client stopped beating for ``timeout`` s (or whose PID died, when
        the client shares our host identity); acknowledge new holders; note whether any
        client is on another host (the doorbell then polls instead of sleeping long).

        Returns every holder that departed since the last call: reaped here, or detached
        cleanly by the client itself, and how.
        """
        departed = []
        mem = self.region.mem
        remote = in_process = False
        for i in range(self.geo.slots):
            word = self.slot_state[i].load(ACQUIRE)
            gen = (word >> 1) & 0xFFFFFFFF
            seen = self.seen[i]
            if seen is not None and (not word & 1 or gen != seen):
                departed.append(self.departure(i, seen))  # (we never freed it)
                self.seen[i] = None
            if not word & 1:
                self._liveness[i].forget()
                self._pids[i].close()
                self._pinned[i] = None
                continue
            live = self._liveness[i]
            live.timeout = timeout
            beat = self.slot_heartbeat[i].load(ACQUIRE)
            pid, local = self._holder(i, gen)
            dead = local and self._pids[i].dead(pid)
            if dead or live.stale(beat, now):
                if self.slot_state[i].cas(word, word & ~1, ACQ_REL) == word:
                    live.forget()
                    departed.append(Departure(i, gen, DEAD) if dead
                                    else _reaped(i, gen, pid, local, self._pids))
                    self.seen[i] = None
                continue
            self.seen[i] = gen
            remote = remote or not local  # (a holder not yet written counts as remote: polled)
            in_process = in_process or pid == os.getpid()
            if self.slot_ack[i].load(RELAXED) != gen:
                self.slot_ack[i].store(gen, RELEASE)
        self.bell.remote_peers = remote
        self.peers_in_process = in_process
        return departed

    def departure(self, slot: int, gen: int) -> Departure:
        """How the holder ``gen`` of ``slot`` left a slot we did not free: DETACHED when it
        wrote its generation into its released word first; else a stray write freed or
        re-claimed the slot under it, and it may still run and write: REAPED (fenced as one)."""
        if self.said_stopped(slot, gen):
            return Departure(slot, gen, DETACHED)
        pinned = self._pinned[slot]
        pid, local = pinned[1:] if pinned is not None and pinned[0] == gen else (0, False)
        return _reaped(slot, gen, pid, local, self._pids)

    def fenced(self, slot: int, gen: int) -> None:
        """Nothing kept: a slot here is claimed by its client's own CAS, and what a reaped
        holder may still write is refused by generation (frames) and revoked claims (pushes)."""

    def _holder(self, slot: int, gen: int) -> tuple[int, bool]:
        """The holder's PID and whether it shares our host identity, as it published them at
        attach and pinned from then on (a stray write to those words later changes nothing:
        a PID written over must not make a live holder look dead, nor a dead one alive)."""
        pinned = self._pinned[slot]
        if pinned is not None and pinned[0] == gen:
            return pinned[1], pinned[2]
        base, mem = self.geo.slot(slot), self.region.mem
        # the PID and identity are this holder's only once it wrote its generation after them
        if mem.load(base + _SLOT_WRITER, ACQUIRE) != gen:
            return 0, False
        local = mem.load(base + _SLOT_IDENTITY, ACQUIRE) == self.identity
        pid = mem.load(base + _SLOT_PID, ACQUIRE) if local else 0
        self._pinned[slot] = (gen, pid, local)
        return pid, local

    def said_stopped(self, slot: int, gen: int) -> bool:
        """Did the holder ``gen`` of ``slot`` write its generation into its released word (it
        released the slot itself)?"""
        return self.region.mem.load(self.geo.slot(slot) + _SLOT_RELEASED, ACQUIRE) == gen

    def producer_dead(self, slot: int, tag: int) -> bool:
        """Is the writer of a request header (slot id, generation tag) gone?  Proven when the
        slot is free or held by another generation: a slot is only freed when its holder
        detached, stopped beating for the client timeout, or died on this host."""
        if slot >= self.geo.slots:
            return True  # garbage: no such producer
        word = self.slot_state[slot].load(ACQUIRE)
        return not word & 1 or (word >> 1) & TAG_MASK != tag

    def live_claims(self) -> list[int]:
        """Claim words of the slots still held: positions a live producer may be claiming."""
        return [self.slot_claim[i].load(ACQUIRE) for i in range(self.geo.slots)
                if self.slot_state[i].load(ACQUIRE) & 1]

    def revoke_claims(self, positions: Collection[int]) -> None:
        """Take back the claims at ``positions``, which the request ring's consumer passes
        although live slots hold them (no progress for the stall bound): each such claim word
        is set to NO_CLAIM, so a producer that resumes learns its claim was revoked (its push
        raises ClaimRevoked) instead of committing into space already reused."""
        for i in range(self.geo.slots):
            if self.slot_state[i].load(ACQUIRE) & 1:
                word = self.slot_claim[i].load(ACQUIRE)
                if word in positions:
                    self.slot_claim[i].cas(word, NO_CLAIM, ACQ_REL)

    def unblock_requests(self, timeout: float) -> int | None:
        """Unblock a request record its producer never committed (dead, or a live one stalled
        for ``timeout`` s: see MpscRing.unblock); the head position while it stays blocked."""
        ring = self.requests
        if ring.blocked_producer() is None or ring.unblock(self.producer_dead, self.live_claims,
                                                          timeout, self.revoke_claims):
            return None
        return ring.head_position

    def write_back_holder(self, slot: int) -> None:
        """Nothing to write back: on coherent memory no dead holder's line outlives it."""

    def native_rings(self) -> NativeRings:
        """The words the native dispatcher reads and rings (see cxlrpc.transport)."""
        return NativeRings(self.region.buf, self.slot_state_at, *self.client_bell_words(), self.responses)

    def client_bell_words(self) -> tuple[list[int], int]:
        """Where each slot's doorbell word lies in the region, and what a holder parked on this
        host writes there: a native ringer looks first and calls ``ring_client`` only then."""
        return [bell.parked_at for bell in self.client_bells], host_identity()

    def ring_client(self, slot: int, gen: int) -> None:
        """Wake the holder ``gen`` of ``slot`` if it is parked (each holder has its own socket,
        so a departing holder that still has its socket never blocks the next one)."""
        bell = self.client_bells[slot]
        if bell.target != gen:
            bell.retarget(client_wake_address(self.region.epoch, slot, gen), gen)
        bell.ring()

    def close(self) -> None:
        """Mark the server closed and wake every parked client so it sees that at once."""
        self._store_closed()
        for slot in range(self.geo.slots):
            gen = self.slot_generation(slot)
            if gen >= 0:
                self.ring_client(slot, gen)
        self.bell.close()
        for watch in self._pids:
            watch.close()


def client_wake_address(epoch: int, slot: int, gen: int) -> bytes:
    """The wake-up socket address of one holder (generation) of a slot."""
    return wake_address(epoch, f"c{slot}.{gen}")


class _ServerWatch:
    """What both client channels share: judging from the region whether the server is gone
    (each says how it reads the server's state word: ``_server_state``)."""

    #: The server's (epoch, heartbeat) when its heartbeat was judged stopped: a reconnection
    #: that finds them unchanged knows at once there is still no server.
    stopped_beat: tuple[int, int] | None = None
    #: The server runs in this very process (it shares our GIL and, likely, our event loop:
    #: polling for its reply without letting it run cannot see one).
    server_in_process: bool = False
    #: The server's PID when we attached (its death, seen by that PID, is believed at once).
    _owner_pid: int = 0
    #: Since when the words say the server closed or died while its heartbeat moves on.
    _suspect_since: float | None = None
    # What each client channel provides (declared only: no value here to shadow theirs).
    region: Region
    server_liveness: Liveness
    _server_state: Callable[[], int]
    holds_slot: Callable[[], bool]

    def _note_server(self, region: Region) -> bool:
        """Note whether the server runs in this process; whether it shares our identity."""
        info = region.info()
        local = info.owner_identity == host_identity()
        self.server_in_process = local and info.owner_pid == os.getpid()
        self._owner_pid = info.owner_pid
        return local

    def server_gone(self, timeout: float) -> str | None:
        """Why the server should be considered gone, or None while it looks alive.

        Its heartbeat stopped for ``timeout``: gone. A clean close (the control block's state
        and the owner state both say closed) and the death of the PID we attached to count at
        once; one word alone that says closed or dead (a stray write, which the server puts
        back) counts only once it held for WORD_CONFIRM_S."""
        now = time.monotonic()
        live = self.server_liveness
        live.timeout = timeout
        beat = self.region.heartbeat_value()
        if live.stale(beat, now):
            self.stopped_beat = (self.region.epoch, beat)
            return f"server heartbeat stopped for {live.age(now):.2f} s"
        closed = self._server_state() != STATE_RUNNING
        dead = self.region.owner_alive_locally() is False
        if closed or dead:
            info = self.region.info()
            if closed and info.closed:
                return "server closed"
            if dead and not info.closed and info.owner_pid == self._owner_pid:
                return "server process died"
            if self._suspect_since is None:
                self._suspect_since = now
            elif now - self._suspect_since >= WORD_CONFIRM_S:
                return "server closed" if closed else "server process died"
        else:
            self._suspect_since = None
        if not self.holds_slot():
            return ("the server reclaimed this client's slot (it saw no heartbeat from it for "
                    "its client_timeout)")
        return None


class ClientChannel(_ServerWatch):
    """A client's side: one claimed slot, its response ring, and the shared request ring."""

    def __init__(self, region: Region, poll_interval: float = 1e-3) -> None:
        self.region = region
        mem = region.mem
        self.geo = geo = read_geometry(region)
        self.state = mem.counter(CONTROL + _STATE)
        if self.state.load(ACQUIRE) != STATE_RUNNING:
            raise ConnectionRefusedError(f"server at {region.url} is not running")
        self.server_local = self._note_server(region)
        self.slot = -1
        busy = 0
        for i in range(geo.slots):
            st = mem.counter(geo.slot(i) + _SLOT_STATE)
            word = st.load(ACQUIRE)
            if word & 1:
                continue
            gen = ((word >> 1) + 1) & 0xFFFFFFFF
            claimed = (gen << 1) | 1
            if st.cas(word, claimed, ACQ_REL) != word:
                continue
            try:
                self._take(i, gen, st, poll_interval)
            except OSError:  # e.g. the wake-up address is bound (a holder of the same generation)
                st.cas(claimed, claimed & ~1, ACQ_REL)
                busy += 1
                continue
            except BaseException:
                st.cas(claimed, claimed & ~1, ACQ_REL)
                raise
            break
        if self.slot < 0:
            raise BlockingIOError(f"all {geo.slots} client slots of {region.url} are taken"
                                  + (f" ({busy} still held by departing clients)" if busy else ""))

    def _take(self, slot: int, gen: int, state: Counter, poll_interval: float) -> None:
        mem, geo = self.region.mem, self.geo
        base = geo.slot(slot)
        # the wake-up socket first: binding is the step that can fail
        self.bell = DoorbellReceiver(mem.counter(base + _SLOT_PARKED),
                                     client_wake_address(self.region.epoch, slot, gen), poll_interval)
        self.bell.remote_peers = not self.server_local
        self.slot, self.gen, self._slot_state = slot, gen, state
        self.tag = gen & TAG_MASK
        self.claim = mem.counter(base + _SLOT_CLAIM)
        self.claim.store(NO_CLAIM, RELEASE)
        self.heartbeat = mem.counter(base + _SLOT_HEARTBEAT)
        self.heartbeat.fetch_add(1, ACQ_REL)
        mem.store(base + _SLOT_IDENTITY, host_identity(), RELEASE)
        mem.store(base + _SLOT_PID, os.getpid(), RELEASE)
        mem.store(base + _SLOT_WRITER, gen, RELEASE)
        self.ack = mem.counter(base + _SLOT_ACK)
        self.requests = MpscRing(self.region.buf, mem, geo.request_ring, geo.request_capacity)
        self.responses = SpscRing(self.region.buf, mem, geo.response_ring(slot), geo.response_capacity)
        self.responses.skip_to_tail()
        self.server_bell = Doorbell(mem.counter(CONTROL + _SERVER_PARKED),
                                    wake_address(self.region.epoch, "server"))
        self.server_liveness = Liveness(0.0)

    def push(self, parts: Sequence[BytesLike]) -> bool:
        """Push a request record as this slot's producer; False when the ring is full.

        ClaimRevoked when the server already reclaimed this slot (it judged us dead)."""
        return self.requests.try_push_parts(parts, self.slot, self.tag, self.claim, self._revoked)

    def push_args(self) -> tuple[int, int, Counter, Callable[[], bool]]:
        """What ``push`` passes the request ring's ``try_push_parts`` after the parts (for
        native callers that push without this method's frame)."""
        return (self.slot, self.tag, self.claim, self._revoked)

    def _revoked(self) -> bool:
        """Asked by a push in its slow paths: the server reclaimed our slot, or took back the
        claim being pushed (it made no progress for the server's client_timeout, see
        ``ServerChannel.revoke_claims``): nothing of ours may be committed then."""
        return not self.holds_slot() or self.claim.load(ACQUIRE) == NO_CLAIM

    def acknowledged(self) -> bool:
        """Has the server seen this connection (it acknowledges new holders every ~0.1 s)?"""
        return self.ack.load(ACQUIRE) == self.gen

    def holds_slot(self) -> bool:
        """False once the server reclaimed the slot (it saw no heartbeat for its timeout)."""
        return self._slot_state.load(ACQUIRE) == (self.gen << 1) | 1

    def _server_state(self) -> int:
        return self.state.load(ACQUIRE)

    def beat(self) -> None:
        self.heartbeat.fetch_add(1, ACQ_REL)

    def release(self) -> None:
        """Give the slot back if it is still ours (one CAS: safe from any thread, and twice),
        saying first in the released word that we do (the server then frees what we held at
        once). A slot taken from us is not ours to speak for: the layers above may still write
        through what it held (a kvservice put in another thread), so its holder stays
        quarantined until our process exits (or its fence timeout passes)."""
        word = (self.gen << 1) | 1
        if self._slot_state.load(ACQUIRE) == word:
            self.region.mem.store(self.geo.slot(self.slot) + _SLOT_RELEASED, self.gen, RELEASE)
        self._slot_state.cas(word, word & ~1, ACQ_REL)

    def detach(self) -> None:
        """Close the wake-up socket, then release the slot (if still ours)."""
        self.bell.close()
        self.release()

    def native_path(self) -> NativeCallPath:
        """The rings and words the native caller uses (it pushes without ``push``'s frame)."""
        bell = self.server_bell
        return NativeCallPath(self.requests, self.push_args(), bell.ring, self.responses,
                              self.region.buf, bell.parked_at, bell.me)


# ---------------------------------------------------------------------- single-writer layout
# Slot words of the single-writer layout; every line has one writer.
_F_GRANT = 0       # the server's line: nonce << 32 | generation << 1 | held
_F_HOLDER = 128    # the holder's line: heartbeat, generation, released generation, identity, pid
_F_BEAT, _F_GEN, _F_RELEASED, _F_IDENTITY, _F_PID = 128, 136, 144, 152, 160
_F_PARKED = 256    # the holder's doorbell word (it alone writes it: nobody rings across hosts)
_F_KNOCK = 384     # claimants' mailbox: nonce << 32 | free period, of whoever asks for the slot last
_GEN_MASK = 0x7FFFFFFF
#: A knock's free period: the generation of the slot's last grant, as the grant word said
#: when the claimant knocked (a knock of an earlier period is stale: never granted).
_KNOCK_PERIOD = _GEN_MASK
#: Seconds a claimant goes on looking while every slot is held (the server frees a released
#: slot at its next look, within ~0.1 s) before it reports the table full.
FULL_PATIENCE = 0.5
_NONCE_MASK = 0xFFFFFFFF
#: What the native paths compare a doorbell word with where nobody is woken (memory without
#: coherence): the control block's state word, which holds a STATE_* (a garbage value the
#: server puts back), never this; so no reply or request costs a call to ring nobody.
_NO_PARKED, _NEVER_PARKED = CONTROL + _STATE, 0xFFFFFFFFFFFFFFFF


def _grant_word(nonce: int, gen: int, held: bool) -> int:
    """A slot's grant word: held in bit 0, the generation (31 bits) above it, the nonce in the
    high half; so ``word & 1`` and ``(word >> 1) & _GEN_MASK`` read as a slot's state word does
    (the native dispatcher's check, with ``_GEN_MASK`` as its mask)."""
    return nonce << 32 | gen << 1 | int(held)


class _QuietBell:
    """A producer's doorbell where no producer can wake a consumer: it polls instead."""

    __slots__ = ()
    target = None

    def ring(self) -> None:
        pass


class _ClientRequestRings:
    """The server's view of the per-slot request rings: polled in turn, held slots only.

    Looks like a ring to the server (``poll``, ``poll_within``, ``readable``); an SPSC ring
    below its tail is always complete, so nothing ever blocks its head. The native dispatcher
    polls ``active`` itself, in turn, through the rings' C API (``native_rings``)."""

    head_position = -1

    def __init__(self) -> None:
        self.active: list[SpscRing] = []
        self._next = 0

    def poll(self, handler: Callable[[memoryview], object], limit: int = 1 << 30) -> int:
        rings = self.active
        n = len(rings)
        if not n:
            return 0
        start = self._next % n
        self._next = start + 1  # a different ring goes first each time: fairness
        count = 0
        for k in range(n):
            count += rings[(start + k) % n].poll(handler, limit - count)
            if count >= limit:
                break
        return count

    #: poll_within(handler, limit, seconds), as a ring's (the same loop over this poll)
    poll_within = RingBase._poll_within_py

    def readable(self) -> bool:
        for ring in self.active:
            if ring.readable():
                return True
        return False


class FlushServerChannel(_ServerWords):
    """The server's side of the single-writer layout (memory without cross-host coherence).

    No line is written by two hosts and nothing is read-modify-written across hosts: each
    client produces into its own SPSC request ring, which the server scans; the server alone
    writes a slot's grant word, the holder alone its heartbeat line. A client asks for a free
    slot by writing a random nonce into the slot's knock line (the one line several claimants
    may write: a lost knock only means that claimant sees another nonce granted and tries the
    next slot); the server grants the nonce it reads there. Every published line is written
    back and every line read from another host invalidated first (the ring does its own).
    """

    def __init__(self, region: Region, geo: Geometry, poll_interval: float = 1e-3) -> None:
        if not geo.per_client_requests:
            raise ValueError("the single-writer layout needs per_client_requests geometry")
        self.region = region
        self.geo = geo
        mem = region.mem
        self.identity = host_identity()
        #: A client of this very process holds a slot (set by reap): it shares our GIL, so
        #: polling for its requests without giving the loop a turn cannot see them.
        self.peers_in_process = False
        self.state = mem.counter(CONTROL + _STATE)
        self.dropped = mem.counter(CONTROL + _DROPPED)
        self._owned = _write_geometry(region, geo)
        self.requests = _ClientRequestRings()
        self.request_rings: list[SpscRing] = []
        self.responses: list[SpscRing] = []
        for i in range(geo.slots):
            base = geo.slot(i)
            mem.zero(base, SLOT_STRIDE)
            for offset, capacity, rings in ((geo.response_ring(i), geo.response_capacity, self.responses),
                                            (geo.client_request_ring(i), geo.request_capacity,
                                             self.request_rings)):
                ring = SpscRing(region.buf, mem, offset, capacity)
                ring.reset()
                rings.append(ring)
        self.bell = DoorbellReceiver(mem.counter(CONTROL + _SERVER_PARKED),
                                     wake_address(region.epoch, "server"), poll_interval)
        self.bell.remote_peers = True  # nobody can wake us across hosts: poll
        self._held = [-1] * geo.slots  # generation granted, or -1 (we alone write the grant)
        self._gens = [0] * geo.slots  # the generation last granted: a free slot's knock period
        self._nonces = [0] * geo.slots  # the knock last granted
        #: per slot, the generation of a holder reaped for its stale heartbeat and not yet
        #: fenced (-1: none): the slot is granted to nobody meanwhile (see ``_free``)
        self._quarantined = [-1] * geo.slots
        self._liveness = [Liveness(0.0) for _ in range(geo.slots)]
        self._pids = [PidWatch() for _ in range(geo.slots)]  # holders that share our identity
        self.seen: list[int | None] = [None] * geo.slots
        self.state.store(STATE_RUNNING, RELEASE)  # written back when the region is published

    def slot_generation(self, slot: int) -> int:
        """Generation of the slot's holder, or -1 when it is free."""
        return self._held[slot] if 0 <= slot < self.geo.slots else -1

    def peer_info(self, slot: int) -> tuple[int, int, int] | None:
        """(generation, PID, host identity) the slot's holder published (0: not written), or
        None while the slot is free or its holder has not written its line yet."""
        gen = self.slot_generation(slot)
        if gen < 0:
            return None
        base, mem = self.geo.slot(slot), self.region.mem
        mem.invalidate(base + _F_HOLDER, 40)
        if mem.load(base + _F_GEN, ACQUIRE) != gen:
            return None
        return gen, mem.load(base + _F_PID, ACQUIRE), mem.load(base + _F_IDENTITY, ACQUIRE)

    def departure(self, slot: int, gen: int) -> Departure:
        """How a holder left a slot that changed hands unseen: here only the server frees a
        slot, on the holder's released word (or when it reaped it, and said so then)."""
        return Departure(slot, gen, DETACHED)

    def reap(self, timeout: float, now: float) -> list[Departure]:
        """Grant free slots that were knocked on; free those whose holder released them,
        stopped beating for ``timeout`` s, or died (its PID, when it shares our identity).

        Returns every holder freed, and how."""
        departed = []
        mem, geo = self.region.mem, self.geo
        load = mem.load
        in_process = False
        for i in range(geo.slots):
            base = geo.slot(i)
            gen = self._held[i]
            if gen < 0:
                if self._quarantined[i] < 0:
                    mem.invalidate(base + _F_KNOCK, 8)
                    knock = load(base + _F_KNOCK, ACQUIRE)
                    # a knock counts only in the free period it was made in (the one after
                    # the generation last granted): an older one is a claimant's that lost
                    # the race or landed after the grant, and nobody waits for it any more
                    if knock >> 32 and knock & _KNOCK_PERIOD == self._gens[i]:
                        self._grant(i, knock >> 32)
                continue
            mem.invalidate(base + _F_HOLDER, 40)
            beat = load(base + _F_BEAT, ACQUIRE)
            ours = load(base + _F_GEN, ACQUIRE) == gen
            live = self._liveness[i]
            live.timeout = timeout
            local = ours and load(base + _F_IDENTITY, ACQUIRE) == self.identity
            pid = load(base + _F_PID, ACQUIRE) if local else 0
            if ours and load(base + _F_RELEASED, ACQUIRE) == gen:
                gone = Departure(i, gen, DETACHED)
            elif local and self._pids[i].dead(pid):
                gone = Departure(i, gen, DEAD)
            elif live.stale(beat, now):
                gone = _reaped(i, gen, pid, local, self._pids)
            else:
                in_process = in_process or pid == os.getpid()
                continue
            departed.append(gone)
            self._free(i, gen, gone.how == REAPED)
        self.peers_in_process = in_process
        return departed

    def _grant(self, slot: int, nonce: int) -> None:
        gen = self._gens[slot] = (self._gens[slot] % _GEN_MASK) + 1
        self._publish_grant(slot, _grant_word(nonce, gen, True))
        self._held[slot], self._nonces[slot] = gen, nonce
        self._liveness[slot].forget()
        self.seen[slot] = gen
        self.requests.active.append(self.request_rings[slot])

    def _free(self, slot: int, gen: int, quarantine: bool) -> None:
        """Take the slot from its holder: free for the next knock at once when it released
        the slot or died; when it was reaped for its stale heartbeat it may only be frozen, and
        resume the stores it was making (its heartbeat, holder line, request ring's tail and
        data, reply ring's head) after a check that found the slot still its own: the slot is
        then granted to nobody (held, nonce 0: claimants pass it by) until ``fenced``."""
        if quarantine:
            self._quarantined[slot] = gen
            self._publish_grant(slot, _grant_word(0, gen, True))
        else:
            self._publish_grant(slot, _grant_word(self._nonces[slot], gen, False))
        self._held[slot] = -1
        self._liveness[slot].forget()
        self._pids[slot].close()
        self.seen[slot] = None
        self.requests.active.remove(self.request_rings[slot])

    def fenced(self, slot: int, gen: int) -> None:
        """The reaped holder ``gen`` of ``slot`` can no longer write (``cxlrpc.fencing``):
        its quarantined slot is free for the next knock."""
        if 0 <= slot < self.geo.slots and self._quarantined[slot] == gen and not self.closed:
            self._quarantined[slot] = -1
            self._publish_grant(slot, _grant_word(self._nonces[slot], gen, False))

    def _publish_grant(self, slot: int, word: int) -> None:
        at = self.geo.slot(slot) + _F_GRANT
        self.region.mem.store(at, word, RELEASE)
        self.region.mem.writeback(at, 8)

    def ring_client(self, slot: int, gen: int) -> None:
        """Clients poll their reply rings here: there is nobody to wake."""

    def unblock_requests(self, timeout: float) -> None:
        """Nothing to unblock: an SPSC ring below its tail is always complete."""

    def write_back_holder(self, slot: int) -> None:
        """Write back every line the slot's departed holder could have left dirty: its slot
        lines, its request ring and its reply ring (whose head it wrote). Called for a holder
        that died on this host (``DEAD``), before the slot can be granted again: its dirty
        lines are in this host's caches, where this host's write-back reaches them (clwb acts
        on the whole host's caches); else they would land whenever evicted, over the next
        holder's records. A holder of another host is beyond it (see docs/operations.md)."""
        for offset, length in self.holder_ranges(slot):
            self.region.mem.writeback(offset, length)

    def holder_ranges(self, slot: int) -> list[tuple[int, int]]:
        """What a slot's holder writes (``holder_ranges``)."""
        return holder_ranges(self.geo, slot)

    def native_rings(self) -> NativeRings | None:
        """The words the native dispatcher reads and rings (see cxlrpc.transport): each slot's
        grant word (which we alone write: our own line needs no invalidate), no doorbell that
        can ever say parked (nobody is woken across hosts), and the granted slots' request rings
        to poll in turn. None where the rings keep to the reference (no native flush module)."""
        if self.region.mem.lines is None:
            return None
        slots = self.geo.slots
        return NativeRings(self.region.buf, [self.geo.slot(i) + _F_GRANT for i in range(slots)],
                           [_NO_PARKED] * slots, _NEVER_PARKED, self.responses, _GEN_MASK,
                           self.requests.active)

    def close(self) -> None:
        """Mark the server closed (clients see it at their next look)."""
        self._store_closed()
        self.region.mem.writeback(CONTROL, 64)
        self.bell.close()
        for watch in self._pids:
            watch.close()


def holder_ranges(geo: Geometry, slot: int) -> list[tuple[int, int]]:
    """Single-writer layout: (offset, length) of every line a slot's holder writes: its request
    ring (records and tail), its slot lines (heartbeat line, doorbell word, knock) and its reply
    ring's control block (the head it stores)."""
    return [(geo.client_request_ring(slot), ring_size(geo.request_capacity)),
            (geo.slot(slot), SLOT_STRIDE), (geo.response_ring(slot), RING_CONTROL)]


class HolderLine(NamedTuple):
    """A slot's holder line as an observer reads it (single-writer layout): ``held`` when the
    server's grant names the generation the line was written by and it has not released it."""
    held: bool
    gen: int
    pid: int
    identity: int
    released: int


def holder_line(region: Region, geo: Geometry, slot: int) -> HolderLine:
    """Single-writer layout, for an observer (not the server): the slot's grant and holder
    line as memory holds them now (both invalidated first)."""
    base, mem = geo.slot(slot), region.mem
    mem.invalidate(base + _F_GRANT, 8)
    grant = mem.load(base + _F_GRANT, ACQUIRE)
    mem.invalidate(base + _F_HOLDER, 40)
    gen, released = mem.load(base + _F_GEN, ACQUIRE), mem.load(base + _F_RELEASED, ACQUIRE)
    held = bool(grant & 1) and (grant >> 1) & _GEN_MASK == gen and released != gen
    return HolderLine(held, gen, mem.load(base + _F_PID, ACQUIRE), mem.load(base + _F_IDENTITY, ACQUIRE),
                      released)


class FlushClientChannel(_ServerWatch):
    """A client's side of the single-writer layout: knock on a free slot, wait for the grant
    (``acknowledged``), then produce into the slot's own request ring."""

    def __init__(self, region: Region, poll_interval: float = 1e-3) -> None:
        self.region = region
        self.geo = read_geometry(region)
        self.state = region.mem.counter(CONTROL + _STATE)
        if self._server_state() != STATE_RUNNING:
            raise ConnectionRefusedError(f"server at {region.url} is not running")
        self.server_local = False  # without coherence every peer is treated as remote
        self._note_server(region)
        self._poll_interval = poll_interval
        self.slot, self.gen, self.tag = -1, 0, 0
        self._word = 0  # the grant word while we hold the slot
        self._granted = False
        self._nonce = 0
        self._knocked = -1
        self._full_since: float | None = None  # when we last found every slot held
        self.server_bell = _QuietBell()
        self.server_liveness = Liveness(0.0)
        self.requests: SpscRing | None = None
        self._scan()
        self._knock_next()

    def _server_state(self) -> int:
        self.region.mem.invalidate(CONTROL + _STATE, 8)
        return self.state.load(ACQUIRE)

    def _grant(self, slot: int) -> int:
        at = self.geo.slot(slot) + _F_GRANT
        self.region.mem.invalidate(at, 8)
        return self.region.mem.load(at, ACQUIRE)

    def _scan(self) -> None:
        """Go over the slot table once more, from a random slot (racing claimants spread)."""
        start = secrets.randbelow(self.geo.slots)
        self._candidates = iter([(start + k) % self.geo.slots for k in range(self.geo.slots)])

    def _knock_next(self) -> None:
        """Knock on the next slot that looks free (none: ``_knocked`` is -1)."""
        mem = self.region.mem
        self._knocked = -1
        for slot in self._candidates:
            word = self._grant(slot)
            if word & 1:
                continue
            self._nonce = secrets.randbelow(_NONCE_MASK) + 1
            at = self.geo.slot(slot) + _F_KNOCK
            # stamped with the free period seen (the generation the grant word names): the
            # server grants it in that period only, never after the slot changed hands
            mem.store(at, self._nonce << 32 | (word >> 1) & _KNOCK_PERIOD, RELEASE)
            mem.writeback(at, 8)
            self._knocked = slot
            self._full_since = None
            return
        now = time.monotonic()
        if self._full_since is None:
            self._full_since = now
        elif now - self._full_since > FULL_PATIENCE:
            raise BlockingIOError(f"all {self.geo.slots} client slots of {self.region.url} are taken")
        self._scan()  # slots released a moment ago are freed at the server's next look

    def acknowledged(self) -> bool:
        """Has the server granted us a slot? Knocks on the next free one when another
        claimant won ours; BlockingIOError once every slot stayed taken for FULL_PATIENCE."""
        if self._granted:
            return True
        if self._knocked < 0:
            self._knock_next()
            return False
        word = self._grant(self._knocked)
        if not word & 1:
            if word >> 32 == self._nonce and (word >> 1) & _GEN_MASK:
                # granted, then withdrawn before we looked (we seemed gone): that nonce is
                # never granted again, so knock anew
                self._scan()
                self._knock_next()
            return False  # the server has not looked yet (it grants every ~0.1 s)
        if word >> 32 != self._nonce:
            self._knock_next()
            return False
        self._take(self._knocked, (word >> 1) & _GEN_MASK, word)
        return True

    def _take(self, slot: int, gen: int, word: int) -> None:
        region, geo = self.region, self.geo
        mem = region.mem
        base = geo.slot(slot)
        self.bell = DoorbellReceiver(mem.counter(base + _F_PARKED),
                                     client_wake_address(region.epoch, slot, gen), self._poll_interval)
        self.bell.remote_peers = True
        self._beat = 1  # the server judges liveness by change, from the grant on
        mem.store(base + _F_BEAT, self._beat, RELAXED)
        mem.store(base + _F_GEN, gen, RELAXED)
        mem.store(base + _F_RELEASED, 0, RELAXED)
        mem.store(base + _F_IDENTITY, host_identity(), RELAXED)
        mem.store(base + _F_PID, os.getpid(), RELEASE)
        mem.writeback(base + _F_HOLDER, 40)
        self.responses = SpscRing(region.buf, mem, geo.response_ring(slot), geo.response_capacity)
        self.responses.skip_to_tail()
        self.requests = SpscRing(region.buf, mem, geo.client_request_ring(slot), geo.request_capacity)
        self.requests.attach()  # go on from where the last holder's tail stands
        self.slot, self.gen, self.tag, self._word = slot, gen, gen & TAG_MASK, word
        self._granted = True

    def push(self, parts: Sequence[BytesLike]) -> bool:
        """Push a request into our own ring; False when it is full. ClaimRevoked once the
        server freed the slot (it judged us dead): another holder may own the ring now."""
        if self._grant(self.slot) != self._word:
            raise ClaimRevoked("the server freed this client's slot")
        return self.requests.try_push_parts(parts)  # type: ignore[union-attr]  # (set once granted: pushes come after)

    def holds_slot(self) -> bool:
        """False once the server freed our slot (True while the grant is still awaited)."""
        return not self._granted or self._grant(self.slot) == self._word

    def beat(self) -> None:
        """Advance our heartbeat (only once the slot is ours: before, its line is another's)."""
        if self._granted:
            at = self.geo.slot(self.slot) + _F_BEAT
            self._beat += 1
            self.region.mem.store(at, self._beat, RELEASE)
            self.region.mem.writeback(at, 8)

    def release(self) -> None:
        """Tell the server we released the slot, if it is still ours (safe from any thread,
        and twice)."""
        if self._granted and self.holds_slot():
            at = self.geo.slot(self.slot) + _F_RELEASED
            self.region.mem.store(at, self.gen, RELEASE)
            self.region.mem.writeback(at, 8)

    def detach(self) -> None:
        """Close the wake-up socket and tell the server we released the slot."""
        if not self._granted:
            return
        self.bell.close()
        self.release()

    def native_path(self) -> NativeCallPath | None:
        """The rings and words the native caller uses: our own request ring, the reply ring,
        no server to wake, and the grant word it checks before each push as ``push`` does.
        None where the rings keep to the reference (no native flush module)."""
        lines = self.region.mem.lines
        if lines is None or self.requests is None:
            return None
        return NativeCallPath(self.requests, (), self.server_bell.ring, self.responses, self.region.buf,
                              _NO_PARKED, _NEVER_PARKED, self.geo.slot(self.slot) + _F_GRANT, self._word, lines)


def server_channel(region: Region, geo: Geometry,
                   poll_interval: float = 1e-3) -> ServerChannel | FlushServerChannel:
    """The server side of the layout the region's coherence asks for."""
    if geo.per_client_requests != (region.coherence == FLUSH):
        raise ValueError(f"geometry is for the other coherence mode than {region.url}'s "
                         f"({region.coherence})")
    cls = FlushServerChannel if geo.per_client_requests else ServerChannel
    return cls(region, geo, poll_interval)


def client_channel(region: Region, poll_interval: float = 1e-3) -> ClientChannel | FlushClientChannel:
    """A client side of the layout the region's coherence asks for."""
    cls = FlushClientChannel if region.coherence == FLUSH else ClientChannel
    return cls(region, poll_interval)
