"""A consumer's doorbell: a 'parked' word in shared memory plus a host-local pollable wake-up.

The consumer writes its host identity into ``parked`` (sequentially consistent) and
re-checks its ring before it sleeps; a producer, after publishing, fences and reads
``parked`` and only then pays for a wake-up datagram.  Dekker's pattern on both sides means
no wake-up is lost, and the fast path (consumer awake) costs a fence and a load.  The
wake-up is a datagram on an abstract Unix socket named after the region's epoch: pollable
(asyncio sleeps in epoll), gone when its owner dies, nothing to clean up. It names the CPU it
was sent from, so a consumer woken beside its producer moves off (``placement``).

Only a producer of the consumer's own host identity can reach that socket, so only such a
producer clears the word; a producer on another host leaves it alone (clearing it would
make the consumer's local producers think it awake).  A consumer with peers on other hosts
(``remote_peers``) therefore never sleeps long: it polls its ring with a backoff bounded by
``poll_interval`` (the extra latency a call after idle costs), still waking at once for
local producers.
"""
from __future__ import annotations

import asyncio
import atexit
import select
import socket
import time
from typing import Callable, Iterator

from ..identity import host_identity
from ..memory import RELAXED, SEQ_CST, Counter, fence
from .placement import SharedCpu, this_cpu
from .strategy import WaitStrategy

_sender: socket.socket | None = None
_FIRST_POLL = 50e-6  # the remote-poll backoff starts here and doubles up to poll_interval
#: A wake-up datagram of this many bytes names its sender's CPU (little-endian).
WAKE_CPU_BYTES = 4


def _send_socket() -> socket.socket:
    global _sender
    if _sender is None or _sender.fileno() < 0:
        _sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _sender.setblocking(False)
        atexit.register(_sender.close)  # one per process, closed at exit (no ResourceWarning)
    return _sender


def wake_datagram(cpu: int) -> bytes:
    """A wake-up naming the CPU it was sent from (one byte, 1, where that is unknown)."""
    return cpu.to_bytes(WAKE_CPU_BYTES, "little") if cpu >= 0 else b"\x01"


def wake_address(epoch: int, consumer: str) -> bytes:
    """Abstract-namespace address of one consumer's wake-up socket."""
    return f"\0cxlrpc-{epoch:016x}-{consumer}".encode()


class Doorbell:
    """Producer side of a consumer's doorbell: ``ring()`` after publishing records."""

    __slots__ = ("_parked", "_address", "_me", "target")

    def __init__(self, parked: Counter, address: bytes, target: object = None) -> None:
        self._parked = parked
        self._address = address
        self._me = host_identity()
        self.target = target  # what the address was made for (e.g. a slot's generation)

    @property
    def parked_at(self) -> int:
        """Where the consumer's parked word lies in the region (native code's first look)."""
        return self._parked.offset

    @property
    def me(self) -> int:
        """The identity a consumer parked on this host writes there."""
        return self._me

    def retarget(self, address: bytes, target: object) -> None:
        """Ring another consumer's socket from now on (a slot's new holder)."""
        self._address, self.target = address, target

    def ring(self) -> None:
        """Wake the consumer if (and only if) it is parked on this host. No syscall when it is
        awake; nothing at all when it parks on another host (it polls)."""
        fence(SEQ_CST)
        me = self._me
        if self._parked.load(RELAXED) == me and self._parked.cas(me, 0, SEQ_CST) == me:
            try:
                _send_socket().sendto(wake_datagram(this_cpu()), self._address)
            except OSError:
                pass  # consumer gone (ECONNREFUSED) or a wake-up already queued (EAGAIN)


class DoorbellReceiver:
    """Consumer side: owns the wake-up socket and implements the wait strategies."""

    def __init__(self, parked: Counter, address: bytes, poll_interval: float = 1e-3) -> None:
        if not poll_interval > 0:
            raise ValueError("poll_interval must be > 0 seconds")
        self._parked = parked
        self._me = host_identity()
        self.poll_interval = poll_interval
        #: Set by the channel when a producer may be on another host: park by polling.
        self.remote_peers = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.setblocking(False)
            self._sock.bind(address)
        except BaseException:
            self._sock.close()
            raise
        self._parked.store(0, SEQ_CST)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        #: the yields of the waits (and of the owner's own polling): a thread that finds its
        #: CPU shared moves off it
        self.shared_cpu = SharedCpu()

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._loop = None
        self._sock.close()
        self._parked.store(0, SEQ_CST)

    def _drain(self) -> int:
        """Take the queued wake-ups; the CPU named by the last that named one (-1: none)."""
        cpu = -1
        try:
            while data := self._sock.recv(64):
                if len(data) == WAKE_CPU_BYTES:
                    cpu = int.from_bytes(data, "little")
        except (BlockingIOError, OSError):
            pass
        return cpu

    def _on_readable(self) -> None:
        cpu = self._drain()
        if cpu >= 0:
            self.shared_cpu.woken_from(cpu)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _park_begin(self, ready: Callable[[], bool]) -> bool:
        """Announce we are parking; True if records slipped in and we must not sleep."""
        self._parked.store(self._me, SEQ_CST)
        if ready():
            self._parked.store(0, SEQ_CST)
            return True
        return False

    def _steps(self, remaining: float, idle: bool) -> Iterator[float]:
        """How long each sleep of a park lasts: one sleep for the whole timeout, or (with
        peers on other hosts) a backoff from 50 us up to ``poll_interval``."""
        if not self.remote_peers:
            yield remaining
            return
        step = self.poll_interval if idle else min(_FIRST_POLL, self.poll_interval)
        end = time.perf_counter() + remaining
        while True:
            left = end - time.perf_counter()
            if left <= 0:
                return
            yield min(step, left)
            step = min(step * 2, self.poll_interval)

    async def wait_async(self, ready: Callable[[], bool], strategy: WaitStrategy, timeout: float,
                         idle: bool = False) -> bool:
        """Wait until ``ready()`` or ``timeout`` seconds, yielding to other tasks throughout.

        ``idle=True`` (the previous wait timed out with nothing to do) parks at once, so a
        consumer that wakes periodically for housekeeping does not spin on every wake-up.
        Cancellation propagates at once (no ``wait_for``, which can swallow a cancel).
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
        yield_cpu = self.shared_cpu.yield_cpu
        while now() < yield_end:
            yield_cpu()
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
        try:
            for step in self._steps(remaining, idle):
                waiter = self._waiter = loop.create_future()
                timer = loop.call_later(step, _settle, waiter)
                try:
                    await waiter
                finally:
                    timer.cancel()
                if ready() or self._park_begin(ready):  # a local producer may have cleared it
                    return True
        finally:
            self._waiter = None
            self._parked.store(0, SEQ_CST)
        return ready()

    def wait_sync(self, ready: Callable[[], bool], strategy: WaitStrategy, timeout: float,
                  idle: bool = False) -> bool:
        """Blocking twin of ``wait_async`` for threads without an event loop."""
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
        yield_cpu = self.shared_cpu.yield_cpu
        while now() < yield_end:
            yield_cpu()
            if ready():
                return True
        remaining = deadline - now()
        if not strategy.park or remaining <= 0:
            return ready()
        if self._park_begin(ready):
            return True
        try:
            for step in self._steps(remaining, idle):
                select.select([self._sock], [], [], step)
                cpu = self._drain()
                if cpu >= 0:
                    self.shared_cpu.woken_from(cpu)
                if ready() or self._park_begin(ready):
                    return True
        finally:
            self._parked.store(0, SEQ_CST)
        return ready()


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
