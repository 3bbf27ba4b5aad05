"""A consumer's doorbell: a 'parked' word in shared memory plus a host-local pollable wake-up.

The consumer sets ``parked`` (sequentially consistent) and re-checks its ring before it
sleeps; a producer, after publishing, fences and reads ``parked`` and only then pays for a
wake-up datagram.  Dekker's pattern on both sides means no wake-up is lost, and the fast
path (consumer awake) costs a fence and a load.  The wake-up is a datagram on an abstract
Unix socket named after the region's epoch: pollable (asyncio sleeps in epoll), gone when
its owner dies, nothing to clean up.  Peers on another host cannot reach it; consumers
therefore also wake on a bounded timeout and poll.
"""
from __future__ import annotations

import asyncio
import os
import select
import socket
import time
from typing import Callable

from ..memory import RELAXED, SEQ_CST, Counter, fence
from .strategy import WaitStrategy

_sender: socket.socket | None = None


def _send_socket() -> socket.socket:
    global _sender
    if _sender is None or _sender.fileno() < 0:
        _sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _sender.setblocking(False)
    return _sender


def wake_address(epoch: int, consumer: str) -> bytes:
    """Abstract-namespace address of one consumer's wake-up socket."""
    return f"\0cxlrpc-{epoch:016x}-{consumer}".encode()


class Doorbell:
    """Producer side of a consumer's doorbell: ``ring()`` after publishing records."""

    __slots__ = ("_parked", "_address")

    def __init__(self, parked: Counter, address: bytes) -> None:
        self._parked = parked
        self._address = address

    def ring(self) -> None:
        """Wake the consumer if (and only if) it is parked. No syscall when it is awake."""
        fence(SEQ_CST)
        if self._parked.load(RELAXED) and self._parked.exchange(0, SEQ_CST):
            try:
                _send_socket().sendto(b"\x01", self._address)
            except OSError:
                pass  # consumer gone (ECONNREFUSED) or a wake-up already queued (EAGAIN)


class DoorbellReceiver:
    """Consumer side: owns the wake-up socket and implements the wait strategies."""

    def __init__(self, parked: Counter, address: bytes) -> None:
        self._parked = parked
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._sock.bind(address)
        self._parked.store(0, SEQ_CST)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future | None = None

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._loop = None
        self._sock.close()
        self._parked.store(0, SEQ_CST)

    def _drain(self) -> None:
        try:
            while self._sock.recv(64):
                pass
        except (BlockingIOError, OSError):
            pass

    def _on_readable(self) -> None:
        self._drain()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _park_begin(self, ready: Callable[[], bool]) -> bool:
        """Announce we are parking; True if records slipped in and we must not sleep."""
        self._parked.store(1, SEQ_CST)
        if ready():
            self._parked.store(0, SEQ_CST)
            return True
        return False

    async def wait_async(self, ready: Callable[[], bool], strategy: WaitStrategy, timeout: float,
                         idle: bool = False) -> bool:
        """Wait until ``ready()`` or ``timeout`` seconds, yielding to other tasks throughout.

        ``idle=True`` (the previous wait timed out with nothing to do) parks at once, so a
        consumer that wakes periodically for housekeeping does not spin on every wake-up.
        """
        if ready():
            return True
        now = time.perf_counter
        start = now()
        deadline = start + timeout
        spin_end = start if idle and strategy.park else min(start + strategy.spin_s, deadline)
        sleep0 = asyncio.sleep
        while True:
            await sleep0(0)
            if ready():
                return True
            t = now()
            if t >= spin_end:
                break
        yield_end = spin_end if idle and strategy.park else min(spin_end + strategy.yield_s, deadline)
        while now() < yield_end:
            os.sched_yield()
            await sleep0(0)
            if ready():
                return True
        remaining = deadline - now()
        if not strategy.park or remaining <= 0:
            return ready()
        if self._park_begin(ready):
            return True
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.fileno())
            loop.add_reader(self._sock.fileno(), self._on_readable)
            self._loop = loop
        self._waiter = loop.create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._waiter), remaining)
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiter = None
            self._parked.store(0, SEQ_CST)
        return ready()

    def wait_sync(self, ready: Callable[[], bool], strategy: WaitStrategy, timeout: float,
                  idle: bool = False) -> bool:
        """Blocking twin of :meth:`wait_async` for threads without an event loop."""
        if ready():
            return True
        now = time.perf_counter
        start = now()
        deadline = start + timeout
        spin_end = start if idle and strategy.park else min(start + strategy.spin_s, deadline)
        while now() < spin_end:
            if ready():
                return True
        yield_end = spin_end if idle and strategy.park else min(spin_end + strategy.yield_s, deadline)
        while now() < yield_end:
            os.sched_yield()
            if ready():
                return True
        remaining = deadline - now()
        if not strategy.park or remaining <= 0:
            return ready()
        if self._park_begin(ready):
            return True
        try:
            select.select([self._sock], [], [], remaining)
            self._drain()
        finally:
            self._parked.store(0, SEQ_CST)
        return ready()
