"""Bare ring ping-pong: two SpscRings in one POSIX shm segment, busy-polled, no RPC layers."""
from __future__ import annotations

import mmap
import os
from multiprocessing.connection import Connection

import posix_ipc

from cxlrpc.memory import AtomicMemory
from cxlrpc.ring import SpscRing, ring_size


def capacity_for(max_payload: int) -> int:
    """Smallest power-of-two ring capacity (>= 4 MiB) whose payload limit fits ``max_payload``."""
    cap = 4 << 20
    while cap // 2 - 64 < max_payload:
        cap *= 2
    return cap


class _Mapping:
    """A mapped shm segment with two rings: ``a`` (ping -> pong) at 0 and ``b`` (pong -> ping)."""

    def __init__(self, name: str, capacity: int, create: bool) -> None:
        span = ring_size(capacity)
        span += -span % 128
        if create:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=2 * span)
        else:
            shm = posix_ipc.SharedMemory(name)
        try:
            self.mm = mmap.mmap(shm.fd, 2 * span)
        finally:
            shm.close_fd()
        self.buf = memoryview(self.mm)
        self.mem = AtomicMemory(self.mm)
        self.a = SpscRing(self.buf, self.mem, 0, capacity)
        self.b = SpscRing(self.buf, self.mem, span, capacity)
        if create:
            self.a.reset()
            self.b.reset()

    def close(self) -> None:
        self.a = self.b = None
        self.mem.close()
        self.buf.release()
        self.mm.close()


def serve(conn: Connection, address: str, max_payload: int = 1 << 20, **_: object) -> None:
    """Pong: create the segment, echo every record from ring a into ring b until told to stop."""
    cap = capacity_for(max_payload)
    m = _Mapping(address, cap, create=True)
    try:
        conn.send(("ready", {"pid": os.getpid(), "address": address, "capacity": cap}))
        a, b, stop = m.a, m.b, conn.poll
        push = b.try_push
        echo = lambda view: push(view) or _push_spin(push, view)  # noqa: E731
        idle = 0
        while True:
            if a.poll(echo, 1):
                idle = 0
                continue
            idle += 1
            if idle & 0x3FF == 0 and stop():
                break
    finally:
        m.close()
        try:
            posix_ipc.unlink_shared_memory(address)
        except posix_ipc.ExistentialError:
            pass


def _push_spin(push, view: memoryview) -> bool:
    while not push(view):
        pass
    return True


class PingClient:
    """Ping: ``call(payload)`` pushes into ring a and busy-polls ring b for the echo."""

    def __init__(self, address: str, max_payload: int) -> None:
        self.m = _Mapping(address, capacity_for(max_payload), create=False)
        self._push, self._pop = self.m.a.try_push, self.m.b.pop

    def call(self, payload: bytes) -> bytes:
        push, pop = self._push, self._pop
        while not push(payload):
            pass
        while True:
            r = pop()
            if r is not None:
                return r

    def close(self) -> None:
        self._push = self._pop = None
        self.m.close()


def open_sync(address: str, max_payload: int = 1 << 20, **_: object) -> PingClient:
    """Attach to the pong's segment."""
    return PingClient(address, max_payload)
