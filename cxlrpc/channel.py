"""A server region's layout: request ring, slot table, response rings; attach, detach, liveness.

Layout (after the region header)::

    control block   state, geometry, server doorbell word, drop counter
    request ring    MPSC: every client -> server (producer id = slot index)
    slot table      per slot: state word (generation << 1 | claimed), heartbeat,
                    client doorbell word, pid hint
    response rings  SPSC per slot: server -> the client holding the slot

A client claims a free slot with a CAS that bumps its generation, adopts the response
ring's tail as its head (whatever an earlier holder left is skipped), and beats its
heartbeat.  Frames carry the generation, so a reply meant for a slot's previous holder
is recognised and dropped.  Liveness is judged from heartbeat counters that stop
changing (valid across hosts); a same-host PID check only speeds the verdict up.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .doorbell import Doorbell, DoorbellReceiver, wake_address
from .memory import ACQ_REL, ACQUIRE, RELAXED, RELEASE
from .region import HEADER_SIZE as REGION_HEADER, Region, RegionError, pid_alive
from .ring import MpscRing, SpscRing, ring_size

KIND_RPC = 1
PAGE = 4096
SLOT_STRIDE = 512
MAX_SLOTS = 1024

STATE_STARTING, STATE_RUNNING, STATE_CLOSED = 0, 1, 2

# control block offsets (relative to CONTROL)
CONTROL = REGION_HEADER
_STATE, _SLOTS, _REQ_CAP, _RESP_CAP = 0, 8, 16, 24
_SERVER_PARKED = 128
_DROPPED = 256
# slot offsets (relative to the slot's base)
_SLOT_STATE, _SLOT_HEARTBEAT, _SLOT_PARKED, _SLOT_PID = 0, 128, 256, 384


def _page(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


@dataclass(frozen=True)
class Geometry:
    """Sizes and offsets of everything in a server region."""

    slots: int
    request_capacity: int
    response_capacity: int

    def __post_init__(self) -> None:
        if not 1 <= self.slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in [1, {MAX_SLOTS}], got {self.slots}")
        ring_size(self.request_capacity)  # validates the capacities
        ring_size(self.response_capacity)

    @property
    def request_ring(self) -> int:
        return CONTROL + PAGE

    @property
    def slot_table(self) -> int:
        return _page(self.request_ring + ring_size(self.request_capacity))

    def slot(self, i: int) -> int:
        return self.slot_table + i * SLOT_STRIDE

    @property
    def response_rings(self) -> int:
        return _page(self.slot_table + self.slots * SLOT_STRIDE)

    def response_ring(self, i: int) -> int:
        return self.response_rings + i * _page(ring_size(self.response_capacity))

    @property
    def size(self) -> int:
        return self.response_ring(self.slots)


def read_geometry(region: Region) -> Geometry:
    """Read and validate a server region's geometry (it may be garbage)."""
    mem = region.mem
    try:
        geo = Geometry(mem.load(CONTROL + _SLOTS, ACQUIRE), mem.load(CONTROL + _REQ_CAP, ACQUIRE),
                       mem.load(CONTROL + _RESP_CAP, ACQUIRE))
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


class ServerChannel:
    """The server's side of a region: consumes requests, produces responses, watches slots."""

    def __init__(self, region: Region, geo: Geometry) -> None:
        self.region = region
        self.geo = geo
        mem = region.mem
        self.state = mem.counter(CONTROL + _STATE)
        self.dropped = mem.counter(CONTROL + _DROPPED)
        mem.store(CONTROL + _SLOTS, geo.slots, RELAXED)
        mem.store(CONTROL + _REQ_CAP, geo.request_capacity, RELAXED)
        mem.store(CONTROL + _RESP_CAP, geo.response_capacity, RELAXED)
        self.requests = MpscRing(region.buf, mem, geo.request_ring, geo.request_capacity)
        self.requests.reset()
        self.responses: list[SpscRing] = []
        self.slot_state = []
        self.slot_heartbeat = []
        self.client_bells: list[Doorbell] = []
        for i in range(geo.slots):
            base = geo.slot(i)
            for off in (_SLOT_STATE, _SLOT_HEARTBEAT, _SLOT_PARKED, _SLOT_PID):
                mem.store(base + off, 0, RELAXED)
            ring = SpscRing(region.buf, mem, geo.response_ring(i), geo.response_capacity)
            ring.reset()
            self.responses.append(ring)
            self.slot_state.append(mem.counter(base + _SLOT_STATE))
            self.slot_heartbeat.append(mem.counter(base + _SLOT_HEARTBEAT))
            self.client_bells.append(Doorbell(mem.counter(base + _SLOT_PARKED),
                                              wake_address(region.epoch, f"c{i}")))
        self.bell = DoorbellReceiver(mem.counter(CONTROL + _SERVER_PARKED),
                                     wake_address(region.epoch, "server"))
        self._liveness = [Liveness(0.0) for _ in range(geo.slots)]
        self.seen: list[int | None] = [None] * geo.slots  # generation last seen claimed (or sending)
        self.state.store(STATE_RUNNING, RELEASE)

    def slot_generation(self, slot: int) -> int:
        """Current generation of a claimed slot, or -1 when it is free."""
        word = self.slot_state[slot].load(ACQUIRE)
        return (word >> 1) & 0xFFFFFFFF if word & 1 else -1

    def reap(self, timeout: float, now: float) -> list[tuple[int, int]]:
        """Free slots whose client stopped beating for ``timeout`` s (or whose local PID died).

        Returns every (slot, generation) that departed since the last call: reaped here, or
        detached cleanly by the client itself.
        """
        departed = []
        mem = self.region.mem
        for i in range(self.geo.slots):
            word = self.slot_state[i].load(ACQUIRE)
            gen = (word >> 1) & 0xFFFFFFFF
            seen = self.seen[i]
            if seen is not None and (not word & 1 or gen != seen):
                departed.append((i, seen))
                self.seen[i] = None
            if not word & 1:
                self._liveness[i].forget()
                continue
            live = self._liveness[i]
            live.timeout = timeout
            beat = self.slot_heartbeat[i].load(ACQUIRE)
            pid = mem.load(self.geo.slot(i) + _SLOT_PID, ACQUIRE)
            if live.stale(beat, now) or pid_dead_here(pid):
                if self.slot_state[i].cas(word, word & ~1, ACQ_REL) == word:
                    live.forget()
                    departed.append((i, gen))
                    self.seen[i] = None
            else:
                self.seen[i] = gen
        return departed

    def close(self) -> None:
        """Mark the server closed and wake every parked client so it sees that at once."""
        self.state.store(STATE_CLOSED, RELEASE)
        for bell in self.client_bells:
            bell.ring()
        self.bell.close()


def pid_dead_here(pid_word: int) -> bool:
    """Host-local accelerator: the PID hint names a process of this host that is gone.

    The hint's top bit marks a PID written on another host (never checked)."""
    return 0 < pid_word < (1 << 32) and not pid_alive(pid_word)


class ClientChannel:
    """A client's side: one claimed slot, its response ring, and the shared request ring."""

    def __init__(self, region: Region) -> None:
        self.region = region
        mem = region.mem
        self.geo = geo = read_geometry(region)
        self.state = mem.counter(CONTROL + _STATE)
        if self.state.load(ACQUIRE) != STATE_RUNNING:
            raise ConnectionRefusedError(f"server at {region.url} is not running")
        self.slot = -1
        for i in range(geo.slots):
            st = mem.counter(geo.slot(i) + _SLOT_STATE)
            word = st.load(ACQUIRE)
            if word & 1:
                continue
            gen = ((word >> 1) + 1) & 0xFFFFFFFF
            if st.cas(word, (gen << 1) | 1, ACQ_REL) == word:
                self.slot, self.gen, self._slot_state = i, gen, st
                break
        if self.slot < 0:
            raise BlockingIOError(f"all {geo.slots} client slots of {region.url} are taken")
        base = geo.slot(self.slot)
        self.heartbeat = mem.counter(base + _SLOT_HEARTBEAT)
        self.heartbeat.fetch_add(1, ACQ_REL)
        mem.store(base + _SLOT_PID, os.getpid(), RELEASE)
        self.requests = MpscRing(region.buf, mem, geo.request_ring, geo.request_capacity)
        self.responses = SpscRing(region.buf, mem, geo.response_ring(self.slot), geo.response_capacity)
        self.responses.skip_to_tail()
        self.bell = DoorbellReceiver(mem.counter(base + _SLOT_PARKED),
                                     wake_address(region.epoch, f"c{self.slot}"))
        self.server_bell = Doorbell(mem.counter(CONTROL + _SERVER_PARKED),
                                    wake_address(region.epoch, "server"))
        self.server_liveness = Liveness(0.0)

    def server_gone(self, timeout: float) -> str | None:
        """Why the server should be considered gone, or None while it looks alive."""
        if self.state.load(ACQUIRE) != STATE_RUNNING:
            return "server closed"
        live = self.server_liveness
        live.timeout = timeout
        if live.stale(self.region.heartbeat.load(ACQUIRE), time.monotonic()):
            return f"server heartbeat stopped for {live.age(time.monotonic()):.2f} s"
        if self.region.owner_alive_locally() is False:
            return "server process died"
        return None

    def beat(self) -> None:
        self.heartbeat.fetch_add(1, ACQ_REL)

    def detach(self) -> None:
        """Release the slot (if still ours) and close the wake-up socket."""
        word = (self.gen << 1) | 1
        self._slot_state.cas(word, word & ~1, ACQ_REL)
        self.bell.close()
