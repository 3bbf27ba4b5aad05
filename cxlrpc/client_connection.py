"""A client's connection lifecycle, written once for the asyncio and the blocking client:
attach (claim a slot), wait to be acknowledged, look for a server while ``wait_for_ready``
says so, the monitor thread's heartbeat and watch, reconnecting, release.

Connecting is a generator of pauses (``Connection.attempt``): the asyncio client sleeps
them with ``asyncio.sleep``, the blocking one with ``time.sleep``. Neither the monitor thread
nor the reader task holds the client (a weak reference to its ``Connection``, and a
``Link`` of what they need), so a client dropped without ``close()`` is collected: its
finalizer ends the link and warns (``ResourceWarning``), as sockets do.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Generator, Generic, Sequence, TypeVar, overload

from . import frame as fr
from .channel import KIND_RPC, client_channel
from .doorbell import WaitStrategy, resolve
from .errors import DeadlineExceeded, ResourceExhausted, RpcError, Unavailable
from .memory import BytesLike
from .process_heap import keep_freed_heap
from .region import Region, RegionError
from .ring import ClaimRevoked
from .size_guard import cut_message
from .transport import ClientTransport

BEAT_INTERVAL = 0.1
#: Backoff between looks for a server while ``wait_for_ready`` lets a connection wait.
_RETRY_FIRST, _RETRY_MAX = 0.002, 0.1
#: Longest a call waits for its reply in place (the native caller: no future, no loop turn),
#: through the strategy's spin phase and then its yield phase (the CPU is given up between
#: polls, the loop is not); other tasks wait at most this long. A kv get's reply comes 8-10 us
#: after it is sent: a 10 us window sent a quarter of them the slow way.
HOT_WINDOW_S = 40e-6
#: Between two looks whether a server on another host has acknowledged us.
_ACK_PAUSE = 0.002

T = TypeVar("T")


def attach(url: str, poll_interval: float,
           stopped_beat: tuple[int, int] | None = None) -> ClientTransport:
    """Claim a slot of the server at ``url``. ``stopped_beat``: the (epoch, heartbeat) of a
    server judged gone; a region still showing them has no server (a server on another host
    cannot unlink its region when it dies, nor acknowledge us)."""
    try:
        region = Region.open(url, kind=KIND_RPC)
    except FileNotFoundError as exc:
        raise Unavailable(f"no server at {url}") from exc
    except RegionError as exc:
        raise Unavailable(f"cannot use {url}: {exc}") from exc
    try:
        if region.owner_alive_locally() is False:  # a region left by a server that closed or died
            raise Unavailable(f"no server at {url} (its last server is gone)")
        if stopped_beat is not None and (region.epoch, region.heartbeat_value()) == stopped_beat:
            raise Unavailable(f"no server at {url} (its heartbeat has not moved since it stopped)")
        chan: ClientTransport = client_channel(region, poll_interval)
        return chan
    except (ConnectionRefusedError, RegionError) as exc:
        region.close()
        raise Unavailable(str(exc)) from exc
    except BlockingIOError as exc:
        region.close()
        raise ResourceExhausted(str(exc)) from exc
    except OSError as exc:
        region.close()
        raise Unavailable(f"cannot attach to {url}: {exc}") from exc
    except BaseException:
        region.close()
        raise


class Link:
    """One connection: its channel and the monitor thread beating its slot (and, for the
    asyncio client, the loop and reader task). It holds nothing of the client, so a client
    dropped without ``close()`` is collected, and its finalizer ends the connection here."""

    def __init__(self, chan: ClientTransport, conn: Connection) -> None:
        self.chan = chan
        self.stop = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.reader: asyncio.Task[None] | None = None
        self._closed = False
        self.monitor = threading.Thread(target=_watch, name="cxlrpc-client-monitor", daemon=True,
                                        args=(weakref.ref(conn), chan, self.stop, conn.server_timeout))
        self.monitor.start()

    def close(self) -> None:
        """Stop the monitor, detach (wake-up socket closed, slot released) and unmap; only
        once the reader task, if any, has ended (it reads the mapping)."""
        if self._closed:
            return
        self._closed = True
        self.stop.set()
        if self.monitor is not threading.current_thread():
            self.monitor.join()
        self.chan.detach()
        self.chan.region.close()

    def abandon(self) -> None:
        """For a client collected unclosed (in whatever thread the collector runs): free the
        slot at once; the rest on the reader's loop once the reader has ended."""
        self.stop.set()
        loop = self.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._end_reader)
            except RuntimeError:
                pass  # the loop closed meanwhile: its tasks will never run again
            else:
                # The slot's next holder may take it before our parked word is cleared (the
                # reader's and the socket's last store): at worst it misses one wake-up and
                # looks at its ring 0.1 s later.
                self.chan.release()
                return
        self.close()

    def _end_reader(self) -> None:
        reader = self.reader
        if reader is None or reader.done():
            self.close()
        else:
            reader.cancel()
            reader.add_done_callback(lambda _: self.close())


def _watch(ref: weakref.ref[Connection], chan: ClientTransport, stop: threading.Event,
           server_timeout: float) -> None:
    """The monitor thread: beat our slot's heartbeat and tell the connection when its server
    is gone, or its region's file was truncated (looked at first: then the region is not
    touched, and calls fail with Unavailable). It holds the connection only for a moment per
    beat."""
    while not stop.wait(BEAT_INTERVAL):
        conn = ref()
        if conn is None:
            return
        cut = chan.region.size_guard.short()
        if conn.gone is None and conn.chan is chan:
            reason = cut_message(chan.region.url, cut) if cut is not None else chan.server_gone(server_timeout)
            if reason is not None:
                if cut is None:
                    conn.stopped_beat = chan.stopped_beat
                conn.set_gone(reason)
        del conn  # the finalizer of a client dropped meanwhile may run here: it sets stop
        if stop.is_set():
            return
        if cut is None and chan.holds_slot():
            chan.beat()  # a reaped client stops writing its old slot's words


def collected(link: Link, what: str) -> None:
    """Finalizer of a client dropped without ``close()``: end its connection, and say so."""
    try:
        link.abandon()
    finally:
        warnings.warn(f"unclosed cxlrpc client {what}: its slot was freed when it was collected; "
                      f"close() it or use a with block", ResourceWarning)


def _lost(reason: str | None, exc: RpcError) -> RpcError:
    """The error of a failed attempt: a reconnection's is Unavailable and says why it was needed."""
    if reason is None:
        return exc
    return Unavailable(f"{reason}; reconnecting failed: {exc.message}")


def time_left(deadline: float | None, now: float) -> float | None:
    """What is left of a call's timeout once it has connected (None: no deadline)."""
    if deadline is None:
        return None
    left = deadline - now
    if left <= 0:
        raise DeadlineExceeded("deadline exceeded while connecting")
    return left


class Connection:
    """The connection state both clients share, and its lifecycle: the settings, the link in
    use (channel and monitor), why calls cannot go out (``gone``), the native caller and the
    in-place reply wait of this connection. The call paths read ``gone``, ``caller`` and
    ``hot_s`` on every call; the monitor thread sets ``gone``."""

    def __init__(self, url: str, doorbell: WaitStrategy | str | None, server_timeout: float,
                 poll_interval: float, wait_for_ready: float | bool) -> None:
        if not poll_interval > 0:
            raise ValueError("poll_interval must be > 0 seconds")
        if not (isinstance(wait_for_ready, bool) or wait_for_ready >= 0):
            raise ValueError("wait_for_ready must be a bool or >= 0 seconds")
        self.url = url
        self.strategy = resolve(doorbell)
        self.server_timeout = server_timeout
        self.poll_interval = poll_interval
        #: How long connecting (and reconnecting) waits for a server: not at all (False),
        #: that many seconds, or without limit (True).
        self.wait_for_ready = wait_for_ready
        self.chan: ClientTransport | None = None
        self.link: Link | None = None
        #: Why calls cannot go out now (None while connected): the one check on the hot path.
        self.gone: str | None = "client is not connected"
        self.closed = False
        self.connected_once = False  # a failed attempt after this is a failed reconnection
        self.stopped_beat: tuple[int, int] | None = None  # of the server last judged gone
        self.ids = itertools.count(1)
        #: The connection's native caller (None: the reference only), and how long a lone
        #: caller polls for its reply without giving the loop a turn.
        self.caller: Any = None
        self.hot_s = self.hot_spin_s = 0.0  # the in-place wait, and its spin part
        self.max_request = 0  # the longest request record the connection's ring takes
        #: Called once the server is judged gone (from the monitor thread, or a caller).
        self.on_gone: Callable[[], None] | None = None

    # ------------------------------------------------------------------ connecting
    def attempt(self, clock: Callable[[], float],
                deadline: float | None = None) -> Generator[float, None, Link]:
        """One connection attempt: attach (looking for a server until ``wait_for_ready`` or
        ``deadline`` runs out) and wait to be acknowledged. Yields the pauses to sleep between
        looks; returns the acknowledged link (not yet adopted: ``adopt``)."""
        lost = self.gone if self.connected_once else None
        end = None if self.wait_for_ready is True else clock() + float(self.wait_for_ready)
        stop = end if deadline is None else deadline if end is None else min(end, deadline)
        pause = _RETRY_FIRST
        while True:
            try:
                link = self._open()
                try:
                    yield from self._acknowledge(link.chan, clock)
                except BaseException:
                    link.close()
                    raise
                return link
            except Unavailable as exc:
                now = clock()
                if end is not None and now >= end:
                    raise _lost(lost, exc) from exc.__cause__
                if deadline is not None and now >= deadline:
                    raise DeadlineExceeded("deadline exceeded while connecting") from exc
            except ResourceExhausted as exc:
                raise _lost(lost, exc) from exc.__cause__
            yield pause if stop is None else max(0.0, min(pause, stop - clock()))
            pause = min(2 * pause, _RETRY_MAX)

    def _open(self) -> Link:
        """Attach (claim a slot) and start the monitor: a connection not yet acknowledged."""
        keep_freed_heap()  # big replies land in fresh bytes objects: no page faults for them
        chan = attach(self.url, self.poll_interval, self.stopped_beat)
        try:
            return Link(chan, self)
        except BaseException:
            chan.detach()
            chan.region.close()
            raise

    def _acknowledge(self, chan: ClientTransport,
                     clock: Callable[[], float]) -> Generator[float, None, None]:
        """Wait until a server on another host has seen our slot (it polls for us only then;
        one on this host need not): ResourceExhausted when every slot is taken."""
        if chan.server_local:
            return
        wait = self.server_timeout + 2 * BEAT_INTERVAL
        deadline = clock() + wait
        while True:
            try:
                if chan.acknowledged():
                    return
            except BlockingIOError as exc:
                raise ResourceExhausted(str(exc)) from exc
            if clock() >= deadline:
                raise Unavailable(f"the server at {self.url} did not acknowledge this connection "
                                  f"within {wait:.1f} s")
            yield _ACK_PAUSE

    def adopt(self, link: Link) -> None:
        """Make ``link`` the connection calls go out on (the in-place wait set for it)."""
        self.link, self.chan = link, link.chan
        assert link.chan.requests is not None  # (acknowledged: a flush-mode slot has its ring)
        self.max_request = link.chan.requests.max_payload
        # (no reply is polled for in place while the server shares this process: it could not
        # answer before the loop turns)
        strategy = self.strategy
        self.hot_s = 0.0 if link.chan.server_in_process else min(HOT_WINDOW_S,
                                                                 strategy.spin_s + strategy.yield_s)
        self.hot_spin_s = min(self.hot_s, strategy.spin_s)

    def up(self) -> None:
        """The adopted link is ready: calls go out from here."""
        self.gone = None
        self.connected_once = True

    def forget(self) -> Link | None:
        """Take the link away (the caller ends it); ``gone`` is already set."""
        link, self.link = self.link, None
        if link is not None:
            self.chan = self.caller = None
        return link

    def check_open(self) -> None:
        """Unavailable once the client was closed."""
        if self.closed:
            raise Unavailable("client is closed")

    # ------------------------------------------------------------------ while connected
    def set_gone(self, reason: str) -> None:
        """Judge the server gone (once): calls fail with Unavailable(reason) until reconnected."""
        if self.gone is None:
            self.gone = reason
            on_gone = self.on_gone
            if on_gone is not None:
                on_gone()

    def revoked(self, exc: ClaimRevoked) -> Unavailable:
        """The server reclaimed our slot (it judged us dead): the connection is gone."""
        reason = f"the server reclaimed this client's slot ({exc})"
        self.set_gone(reason)
        return Unavailable(self.gone or reason)

    def push(self, parts: Sequence[BytesLike]) -> bool:
        """Push a request as our slot's producer; Unavailable if the server reclaimed the slot."""
        assert self.chan is not None
        try:
            return self.chan.push(parts)
        except ClaimRevoked as exc:
            raise self.revoked(exc) from exc

    def send_cancel(self, call_id: int) -> None:
        """Best effort: tell the server to cancel ``call_id`` (dropped if the ring is full)."""
        chan = self.chan
        if chan is None or self.gone is not None:
            return
        head = fr.header(fr.CANCEL, fr.RAW, 0, chan.slot, chan.gen, call_id, 0.0, b"")
        try:
            if self.push((head,)):
                chan.server_bell.ring()
        except Unavailable:
            pass



def run_blocking(steps: Generator[float, None, T]) -> T:
    """Drive a connection attempt (``Connection.attempt``) in this thread."""
    try:
        while True:
            time.sleep(next(steps))
    except StopIteration as done:
        value: T = done.value
        return value
    finally:
        steps.close()  # interrupted: the attempt ends its link


async def run_async(steps: Generator[float, None, T]) -> T:
    """Drive a connection attempt (``Connection.attempt``) in the event loop."""
    try:
        while True:
            await asyncio.sleep(next(steps))
    except StopIteration as done:
        value: T = done.value
        return value
    finally:
        steps.close()  # cancelled: the attempt ends its link


class OfConnection(Generic[T]):
    """A client's setting that its ``Connection`` keeps (read and written through it)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> OfConnection[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> T | OfConnection[T]:
        if obj is None:
            return self
        value: T = getattr(obj.__dict__["_conn"], self.name)
        return value

    def __set__(self, obj: object, value: T) -> None:
        setattr(obj.__dict__["_conn"], self.name, value)
