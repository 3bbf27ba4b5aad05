"""The blocking client (``SyncClient``), for synchronous callers: the same rooms as the
asyncio client (connection lifecycle, bodies, codec), its calls serialised by a lock and
their replies polled for in the calling thread.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable, Mapping, Sequence, TypeVar, overload

from . import frame as fr
from .client_base import ClientInterceptor, Encoded, Health, _Base, chained, checked, native_decode, own_metadata
from .client_bodies import Large, Parts, grant
from .client_connection import BEAT_INTERVAL, run_blocking, time_left
from .doorbell import WaitStrategy
from .errors import DeadlineExceeded, InvalidArgument, ResourceExhausted, RpcError, Unavailable
from .ring import ClaimRevoked
from .transport import ClientTransport

T = TypeVar("T")


class SyncClient(_Base):
    """Blocking client for synchronous callers. Thread-safe; calls from several threads are
    serialised (open one client per thread for parallel calls).

    Connects in the constructor (``wait_for_ready`` as for ``Client``), and reconnects
    and is collected as ``Client`` is."""

    def __init__(self, url: str, *, doorbell: WaitStrategy | str | None = None,
                 server_timeout: float = 1.0, poll_interval: float = 1e-3,
                 wait_for_ready: float | bool = False,
                 interceptors: Sequence[ClientInterceptor] = ()) -> None:
        super().__init__(url, doorbell, server_timeout, poll_interval, wait_for_ready)
        self._interceptors = checked(interceptors)
        self._lock = threading.Lock()
        self._failures = 0  # failed reconnections: callers queued behind one share its error
        self._failure: RpcError | None = None
        self._connect(None)

    def close(self) -> None:
        """Detach from the server; later calls raise ``Unavailable``."""
        with self._lock:
            self._conn.closed = True
            self._conn.gone = "client closed"
            self._drop_link()

    def _drop_link(self) -> None:
        link = self._forget_link()
        if link is not None:
            link.close()

    def _connected(self, timeout: float | None, failures: int) -> float | None:
        """Slow path of a call while not connected (lock held): reconnect or raise why not;
        a caller that waited for the lock while an attempt failed gets that attempt's error.
        Returns the time left of ``timeout``."""
        self._conn.check_open()
        failure = self._failure
        if self._failures != failures and failure is not None:
            raise type(failure)(failure.message, failure.code) from failure.__cause__
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._connect(deadline)
        except (Unavailable, ResourceExhausted) as exc:
            self._failures += 1
            self._failure = exc
            raise
        return time_left(deadline, time.monotonic())

    def _connect(self, deadline: float | None) -> None:
        """One connection attempt: end the last connection, then attach (looking for a server
        until ``wait_for_ready`` or ``deadline`` runs out) and wait to be acknowledged."""
        self._drop_link()
        self._install(run_blocking(self._conn.attempt(time.monotonic, deadline)))
        self._conn.up()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @overload
    def call(self, method: str, arg: Any = None, *, timeout: float | None = None,
             metadata: Mapping[str, str] | None = None, response_type: type[T]) -> T: ...
    @overload
    def call(self, method: str, arg: Any = None, *, timeout: float | None = None,
             metadata: Mapping[str, str] | None = None, response_type: Any = None) -> Any: ...

    def call(self, method: str, arg: Any = None, *, timeout: float | None = None,
             metadata: Mapping[str, str] | None = None, response_type: Any = None) -> Any:
        """Call ``method`` with ``arg`` and optional ``metadata`` and wait for the reply (or
        raise an RpcError)."""
        if self._interceptors:
            return self._intercepted(method, arg, timeout, metadata, response_type)
        return self._call(method, arg, timeout, metadata, response_type)

    def _intercepted(self, method: str, arg: Any, timeout: float | None,
                     metadata: Mapping[str, str] | None, response_type: Any) -> Any:
        """A call through the interceptors (a closure of its own: ``call`` makes no cells)."""
        return chained(self._interceptors, lambda method, arg, metadata: self._call(
            method, arg, timeout, metadata, response_type))(method, arg, own_metadata(metadata))

    def _call(self, method: str, arg: Any, timeout: float | None,
              metadata: Mapping[str, str] | None, response_type: Any) -> Any:
        failures = self._failures
        conn = self._conn
        with self._lock:
            caller = conn.caller
            if caller is not None and conn.gone is None and not metadata and (timeout is None or timeout > 0):
                # the common shape, natively (see Client.call): its reply polled for in place
                call_id = next(conn.ids)
                deadline = None if timeout is None else time.monotonic() + timeout
                try:
                    got = caller.call(method, arg, timeout or 0.0, call_id, conn.hot_s,
                                      response_type is None or native_decode(response_type), conn.hot_spin_s)
                except ClaimRevoked as exc:
                    raise conn.revoked(exc) from exc
                if type(got) is bytes:
                    return got
                if type(got) is list:  # decoded by response_type's decoder
                    return got[0]
                if got is None:  # out; its reply comes later
                    got = self._roundtrip(call_id, None, deadline)
                if type(got) is fr.Frame:
                    if got.flags & fr.HEAP and not self._bodies.heap_body(got, wanted=True):
                        raise InvalidArgument("the reply's heap extent is not inside the heap")
                    return self._codec.decode_reply(got, response_type)
                if type(got) is tuple:  # not out (a body for the heap, a full ring): the reference
                    arg = Encoded(*got)
            bodies, codec = self._bodies, self._codec
            if conn.gone is not None:
                timeout = self._connected(timeout, failures)
            if timeout is not None and timeout <= 0:
                raise DeadlineExceeded("timeout must be positive")
            call_id = next(conn.ids)
            parts = codec.request(call_id, method, arg, timeout or 0.0, metadata, follow=True)
            deadline = None if timeout is None else time.monotonic() + timeout
            unsent = publish = kept = None
            if type(parts) is Large:  # through the heap: ALLOC an extent (or take the spare)
                large = parts
                taken = bodies.take_spare(large)
                if taken is not None:
                    (offset, size), spare = taken, True
                else:
                    size = large.extent_size
                    alloc_id, alloc = bodies.alloc_request(size, timeout or 0.0, large.follow)
                    try:
                        reply = codec.decode_reply(self._roundtrip(alloc_id, alloc, deadline), None)
                    except DeadlineExceeded:
                        raise  # a grant that comes later is given back (granted_late)
                    except BaseException:
                        bodies.allocs.discard(alloc_id)
                        raise
                    bodies.allocs.discard(alloc_id)
                    offset, spare = grant(reply)
                parts = bodies.staged(large, offset, call_id, timeout or 0.0, fr.REQUEST)
                mb = large.prefix[:large.method_len]
                if large.follow:
                    publish = functools.partial(bodies.publish_body, offset, large.body)  # (no cells in _call)
                    bodies.followed[call_id] = mb
                if spare:  # settled below (the server frees any other extent once read)
                    kept = (conn.chan, offset, size, mb)
                else:
                    unsent = offset
            answered = False
            try:
                result = codec.decode_reply(self._roundtrip(call_id, parts, deadline, unsent, publish),
                                            response_type)
                answered = True
                return result
            finally:
                bodies.followed.pop(call_id, None)
                if kept is not None:
                    bodies.settle(*kept, answered)

    def _roundtrip(self, call_id: int, parts: Parts | None, deadline: float | None,
                   unsent: int | None = None, then: Callable[[], None] | None = None) -> fr.Frame:
        """Push a request (None: it is out already) and wait for its reply frame. ``unsent``:
        a heap extent to give back if the request never left; ``then``: called once the
        request is out (a followed body's writing)."""
        conn, bodies = self._conn, self._bodies
        chan: ClientTransport | None = conn.chan
        assert chan is not None
        if parts is not None:
            if bodies.frees:
                bodies.send_frees()
            backoff = 0.0
            try:
                while not conn.push(parts):
                    self._check(deadline, call_id, sent=False)
                    chan.server_bell.ring()
                    time.sleep(backoff)  # backpressure: the server is draining a full ring
                    backoff = min(0.001, backoff * 2 + 1e-5)
            except BaseException:
                if unsent is not None:
                    bodies.give_back(unsent)
                raise
            chan.server_bell.ring()
            if then is not None:
                then()
        ring, bell, strategy = chan.responses, chan.bell, conn.strategy
        got: list[fr.Frame] = []

        def on_reply(view: memoryview) -> None:
            f = self._codec.own_reply(view)
            if f is None:
                return
            if f.call_id != call_id or got:
                bodies.granted_late(f)
            elif f.flags & fr.HEAP and not bodies.heap_body(f, wanted=True):
                ring.dropped += 1
            else:
                got.append(f)

        ready = lambda: ring.readable() or conn.gone is not None
        idle = False
        while True:
            if ring.poll(on_reply):
                idle = False
            if got:
                return got[0]
            self._check(deadline, call_id, sent=True)
            wait = BEAT_INTERVAL
            if deadline is not None:
                wait = min(wait, max(deadline - time.monotonic(), 0.0))
            idle = not bell.wait_sync(ready, strategy, wait, idle)

    def _on_reply(self, view: memoryview) -> None:
        """A reply record the native caller polled that is not the one it waits for: nobody
        else waits here (calls are serialised), so it is late (see Bodies.granted_late)."""
        f = self._codec.own_reply(view)
        if f is not None:
            self._bodies.granted_late(f)

    def send_nowait(self, method: str, arg: Any = None, *,
                    metadata: Mapping[str, str] | None = None) -> None:
        """One-way call (see ``Client.send_nowait``), serialised with this client's other
        calls: the slot has one producer, whichever thread calls."""
        with self._lock:
            super().send_nowait(method, arg, metadata=metadata)

    def health(self, *, timeout: float | None = None) -> str:
        """The server's status (``cxlrpc.health``): "SERVING", or "NOT_SERVING" while it shuts down."""
        return self.call(fr.HEALTH, timeout=timeout, response_type=Health).status

    def methods(self, *, timeout: float | None = None) -> list[str]:
        """The names of the server's methods, sorted (``cxlrpc.methods``; reserved ones left out)."""
        return self.call(fr.LIST_METHODS, timeout=timeout, response_type=list[str])

    def _check(self, deadline: float | None, call_id: int, sent: bool) -> None:
        conn = self._conn
        if conn.gone is not None:
            raise Unavailable(conn.gone)
        if deadline is not None and time.monotonic() >= deadline:
            if sent:
                conn.send_cancel(call_id)
            raise DeadlineExceeded("deadline exceeded")


def connect_sync(url: str, *, doorbell: WaitStrategy | str | None = None,
                 server_timeout: float = 1.0, poll_interval: float = 1e-3,
                 wait_for_ready: float | bool = False,
                 interceptors: Sequence[ClientInterceptor] = ()) -> SyncClient:
    """Connect a blocking client: ``with cxlrpc.connect_sync("shm://NAME") as client``
    (``wait_for_ready`` as for ``connect``; ``interceptors``: plain functions, see
    ``ClientInterceptor``)."""
    return SyncClient(url, doorbell=doorbell, server_timeout=server_timeout,
                      poll_interval=poll_interval, wait_for_ready=wait_for_ready,
                      interceptors=interceptors)
