"""Fencing: when a departed connection can no longer write into the region.

A server frees a slot whose holder stopped beating for its client timeout, but a holder that
was only frozen (SIGSTOP, a VM pause, swapping) resumes where it stopped and finishes the
stores it was making: into a request extent it was writing, past the progress word of a
reply it was reading. What it held must not be handed to another connection before that
cannot happen, so a departed connection is *quarantined* until it is *fenced*:

- at once when it detached itself (it released its slot) or its process is proven gone on
  this host (its PID's pidfd reads exited);
- a holder reaped for its stale heartbeat whose process runs on this host (frozen): when that
  process exits, seen through the pidfd opened while it held its slot (a reuse of its PID by
  another process reads as the exit it is, never as the holder alive);
- a holder on another host, or whose PID cannot be pinned by a pidfd: ``fence_timeout``
  seconds after it was reaped (a bound, not a proof: see docs/peers.md).

``Fences`` keeps the quarantined holders; the server checks them from its housekeeping
(O(quarantined) a look, nothing on the hot path).
"""
from __future__ import annotations

from typing import NamedTuple

from .transport import DEAD, DETACHED, Departure
from .region import PidWatch


class _Held(NamedTuple):
    slot: int
    gen: int
    pid: int
    watch: PidWatch | None  # a pidfd pins the PID: its exit fences (else: the timeout)
    until: float  # when the timeout fences it (inf: only its exit does)


class Fences:
    """Departed holders quarantined until they can no longer write into the region."""

    def __init__(self, timeout: float) -> None:
        if not timeout > 0:
            raise ValueError("fence_timeout must be > 0 seconds")
        self.timeout = timeout
        self._held: list[_Held] = []

    def __len__(self) -> int:
        return len(self._held)

    def depart(self, gone: Departure, now: float) -> bool:
        """Note a departure; True when it is fenced already (detached, or proven dead)."""
        if gone.how in (DETACHED, DEAD):
            return True
        watch = gone.watch
        if watch is not None and gone.local:
            if watch.dead(gone.pid):  # exited meanwhile (and a pidfd, if any, proves it)
                watch.close()
                return True
            if watch.pinned(gone.pid):
                self._held.append(_Held(gone.slot, gone.gen, gone.pid, watch, float("inf")))
                return False
            watch.close()  # no pidfd: its PID's number could be another process's later
        self._held.append(_Held(gone.slot, gone.gen, gone.pid, None, now + self.timeout))
        return False

    def due(self, now: float) -> list[tuple[int, int]]:
        """The (slot, generation) of holders fenced since the last look (each once)."""
        if not self._held:
            return []
        fenced, kept = [], []
        for held in self._held:
            if now >= held.until or (held.watch is not None and held.watch.dead(held.pid)):
                if held.watch is not None:
                    held.watch.close()
                fenced.append((held.slot, held.gen))
            else:
                kept.append(held)
        self._held = kept
        return fenced

    def close(self) -> None:
        """Drop every pending fence (the server closes: its region goes with it)."""
        for held in self._held:
            if held.watch is not None:
                held.watch.close()
        self._held = []
