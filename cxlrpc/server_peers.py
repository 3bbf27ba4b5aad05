"""The server's peers coming and going: a departed client's calls cancelled, its replies
dropped, its heap extents quarantined, the on_disconnect callbacks told; then, once it can no
longer write into the region (``cxlrpc.fencing``), what it held freed and the on_fenced
callbacks told."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from .fencing import Fences
from .server_bodies import Bodies
from .server_context import CallKey, Peer
from .server_replies import Replies
from .server_tasks import _cancel
from .transport import DEAD, Departure, ServerTransport

logger = logging.getLogger("cxlrpc.server")


class Departures:
    """Departed clients, from their departure to their fence."""

    def __init__(self, fences: Fences, tasks: dict[CallKey, asyncio.Task[Any]], replies: Replies,
                 bodies: Bodies) -> None:
        self.fences = fences
        self._tasks, self._replies, self._bodies = tasks, replies, bodies
        self.on_disconnect: list[Callable[[Peer], None]] = []
        self.on_fenced: list[Callable[[Peer], None]] = []
        self._chan: ServerTransport | None = None

    def attach(self, chan: ServerTransport) -> None:
        """Serve ``chan`` (start()): it is told of each fence too (``ServerTransport.fenced``)."""
        self._chan = chan

    def housekeeping(self, chan: ServerTransport, client_timeout: float, now: float) -> None:
        """Reap the clients that stopped beating; fence the departed ones that can no longer write."""
        for gone in chan.reap(client_timeout, now):
            if gone.how == DEAD:  # (before the next reap can grant its slot to another)
                chan.write_back_holder(gone.slot)
            self.departed(gone)
        for slot, gen in self.fences.due(now):
            self.fenced(Peer(slot, gen))

    def departed(self, gone: Departure) -> None:
        """A slot's holder left (detached, reaped, or replaced by a new holder): cancel its
        handlers, drop its replies, quarantine its heap extents, tell the on_disconnect
        callbacks; then fence it, at once or once it can no longer write (Server.on_fenced)."""
        slot, gen = gone.slot, gone.gen
        self._bodies.departed(slot, gen)
        self._replies.departed(slot, gen)
        for key, task in list(self._tasks.items()):
            if key[0] == slot and key[1] == gen:
                _cancel(task)
        peer = Peer(slot, gen)
        for callback in self.on_disconnect:
            try:
                callback(peer)
            except Exception:
                logger.exception("on_disconnect callback failed for %s", peer)
        if self.fences.depart(gone, time.monotonic()):
            self.fenced(peer)

    def fenced(self, peer: Peer) -> None:
        """A departed holder can no longer write into the region: free what it held (its
        heap extents; its slot, where the transport kept it from new holders), then tell the
        on_fenced callbacks."""
        if self._chan is not None:
            self._chan.fenced(peer.slot, peer.gen)
        self._bodies.fenced(peer.slot, peer.gen)
        for callback in self.on_fenced:
            try:
                callback(peer)
            except Exception:
                logger.exception("on_fenced callback failed for %s", peer)
