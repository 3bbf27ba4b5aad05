"""The server's serve loop: it drains the request source batch after batch (in C where the
transport has a native path), retries replies held back, and runs the housekeeping that
reaps departed clients, fences them and puts back words a stray write changed."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from .doorbell import WaitStrategy
from .server_bodies import Bodies
from .server_context import CallKey
from .server_dispatch import Dispatch
from .server_peers import Departures
from .server_replies import Replies
from .size_guard import TruncationWatch
from .transport import ServerTransport

#: How long a server with no call in a task watches its empty request ring before it gives the
#: loop a turn between looks (within the strategy's spin phase); other callbacks wait at most
#: this long.
_HOT_SPIN_S = 10e-6
#: How long a server that has nothing but its request ring to serve goes on serving batches
#: without giving the loop a turn (other callbacks wait at most about this long under load).
#: At 50 us a big call (a 1 MiB echo, ~110 us) was followed by a turn every time, on the path
#: of its client's next request (1 MiB async echo p50, 1 ms against 50 us in one pair, five
#: runs: 1-7 us less, p99 lower in each).
_TURN_EVERY_S = 1e-3
#: The most requests one batch takes. Each batch takes as many as the one before handled in
#: _TURN_EVERY_S, and natively ends at the first request handled after the turn falls due:
#: slow handlers (20 us each) in batches of 256 kept the loop from its turn for 6 ms of CPU
#: between turns, and 100 ms on a slower machine, under a flood of one-way calls.
_BATCH_MAX = 256
def _batch_fitting(handled: int, took: float) -> int:
    """The next batch's size: the requests that fit in _TURN_EVERY_S at ``handled`` per
    ``took`` seconds, 1 to _BATCH_MAX (the native dispatcher's ``fitting``)."""
    if took <= 0.0:
        return _BATCH_MAX
    return max(1, min(_BATCH_MAX, int(_TURN_EVERY_S * handled / took)))


logger = logging.getLogger("cxlrpc.server")


class ServeLoop:
    """The reader task's loop over one server's transport, and its housekeeping."""

    def __init__(self, chan: ServerTransport, strategy: WaitStrategy, client_timeout: float, url: str,
                 cuts: TruncationWatch, calls: Dispatch, replies: Replies, bodies: Bodies,
                 departures: Departures, tasks: dict[CallKey, asyncio.Task[Any]],
                 note_drained: Callable[[], None]) -> None:
        self._chan, self.strategy, self.client_timeout, self.url = chan, strategy, client_timeout, url
        self._cuts, self._calls, self._replies, self._bodies = cuts, calls, replies, bodies
        self._departures, self._tasks, self._note_drained = departures, tasks, note_drained

    async def run(self) -> None:
        """Serve until cancelled (Server._stop cancels the task that runs it)."""
        chan = self._chan
        ring = chan.requests
        poll, poll_within = ring.poll, ring.poll_within
        hot_s = min(self.strategy.spin_s, _HOT_SPIN_S)  # the ring's own look, before the wait's
        calls, bodies, tasks = self._calls, self._bodies, self._tasks
        backlog, flush_backlog = self._replies.backlog, self._replies.flush_backlog
        fast = calls._fast
        fast_ring = calls._fast_requests  # what the native dispatcher polls (a ring, or a list)
        on_request = calls._on_request  # the reference's handler (natively, the dispatcher polls)
        housekeeping_every = min(0.1, self.client_timeout / 4)
        next_housekeeping = time.monotonic() + housekeeping_every
        stuck_at: int | None = None  # head position housekeeping found blocked
        idle = False
        turned = served = time.monotonic()  # when the loop last had a turn, a batch was served
        batch = _BATCH_MAX  # the reference's batch size (natively, the dispatcher's own)
        strategy = self.strategy
        yield_cpu = chan.bell.shared_cpu.yield_cpu
        while True:
            # one clock reading a batch: its requests' deadlines count from it
            calls._polled_at = now = time.monotonic()
            if now >= next_housekeeping:
                self._cuts.check()  # a truncated file grown back before the ring is touched
            if fast is not None:
                until = min(turned + _TURN_EVERY_S, next_housekeeping)  # the turn, or housekeeping
                n = fast.poll(fast_ring, now, until)
            else:
                n = poll(on_request, batch)
                if n:  # the next batch from this one's pace; the turn's due from its end
                    done = time.monotonic()
                    batch = _batch_fitting(n, done - now)
                    now = done
            # nothing else of ours to run (no call in a task, no body being written that is
            # followed every turn, no client in this process, which needs the loop to run):
            # the next request is looked for a moment longer without loop turns, by the ring
            # itself (its requests' deadlines then count from the clock reading above, at most
            # that moment early); natively, batch after batch until one of them needs the loop
            # or its turn is due. Replies held back are retried between batches, and idle
            # followed bodies are looked at by timers: neither takes the hot path from others.
            lone = not (tasks or bodies.hot_follows or chan.peers_in_process)
            if lone and hot_s and not (idle and self.strategy.park):
                if fast is not None:
                    n += fast.serve(fast_ring, hot_s, until)
                    calls._polled_at = now = fast.polled_at
                elif not n:
                    n = poll_within(on_request, batch, hot_s)
            if backlog:
                flush_backlog()
            if now >= next_housekeeping:
                next_housekeeping = now + housekeeping_every
                stuck_at = self._housekeeping(now)
            if calls._draining:  # replies flushed, departed clients' calls cancelled: done?
                self._note_drained()
            if n:
                idle = False
                served = now
                # Nothing else of ours needs the loop: look for the next request at once (a loop
                # turn costs an epoll_wait, on the next call's path), yet turn it at least
                # every _TURN_EVERY_S of serving.
                if (tasks or bodies.hot_follows or chan.peers_in_process
                        or now - turned >= _TURN_EVERY_S):
                    await asyncio.sleep(0)
                    turned = time.monotonic()
            elif ring.readable():
                # The head record is claimed but not committed: its producer is mid-write, or
                # dead (housekeeping then unblocks it). Poll gently once it is known stuck.
                await asyncio.sleep(0.001 if stuck_at == ring.head_position else 0)
                turned = time.monotonic()
            elif lone and hot_s and now - served < strategy.spin_s + strategy.yield_s:
                # the strategy's spin and yield phases: the ring looked at natively for hot_s
                # (above) between loop turns, not once a turn (a request that came while its
                # client computed, e.g. after copying out 1 MiB, was seen ~3 us later)
                if now - served >= strategy.spin_s:
                    yield_cpu()
                await asyncio.sleep(0)
                turned = time.monotonic()
            else:
                # replies waiting for a full response ring, bodies being followed: come back
                # soon to retry them; a lone server past its spin and yield phases parks at once
                wait = 0.0005 if backlog or bodies.hot_follows else housekeeping_every
                idle = not await chan.bell.wait_async(ring.readable, strategy, wait,
                                                      idle or bool(lone and hot_s))
                turned = time.monotonic()

    def _housekeeping(self, now: float) -> int | None:
        """Reclaim dead clients' slots, put back the words only the server writes, and unblock
        records their producers never committed (a live one's after client_timeout without
        progress: see MpscRing.unblock).

        Returns the head position when the request ring is blocked by a live producer."""
        self._cuts.check()  # (a truncated file grown back before the slots are read)
        self._departures.housekeeping(self._chan, self.client_timeout, now)
        self._bodies.housekeeping(now)
        self._republish()
        return self._chan.unblock_requests(self.client_timeout)

    def _republish(self) -> None:
        """Put back owner, state and geometry words a stray write changed (clients would
        otherwise see a closed or dead server, or a wrong geometry, for good)."""
        restored = self._chan.republish()
        if restored:
            logger.warning("put back %d word(s) of %s's header or control block that were written "
                           "over", restored, self.url)
