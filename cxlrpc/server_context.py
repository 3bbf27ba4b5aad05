"""What a handler knows of its call: the peer, the context, the interceptor's signature.

The types every room of the server (and its users, through ``cxlrpc.server``) shares;
below the rooms, above the transport (``cxlrpc.transport``), which is all it reads.
"""
from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Any, Awaitable, Callable, Mapping, NamedTuple, NoReturn

import msgspec

from .errors import ERRORS, StatusCode
from .transport import ServerTransport

#: A handler: a plain function, an ``async def`` or an async generator, taking the request.
Handler = Callable[..., Any]
#: A call's key in the server's tables: (slot, generation, call id; negative for a one-way call).
CallKey = tuple[int, int, int]


class Peer(NamedTuple):
    """Identifies one client connection: its slot and the slot's generation at attach."""

    slot: int
    gen: int


class PeerInfo(NamedTuple):
    """What a client published about itself in its slot: PID and host identity are None when
    it wrote none (or left); its PID names a process here only when ``same_host``."""

    slot: int
    gen: int
    pid: int | None
    host: int | None
    same_host: bool


class HandlerContext(msgspec.Struct, frozen=True, gc=False):
    """The call a handler (or interceptor) serves, as grpc.aio's ServicerContext: its method,
    read-only metadata, peer and deadline (on the ``time.monotonic()`` clock, or None)."""

    # gc=False: none of its fields can lead back to it (str, a read-only mapping of str,
    # ints, the channel), so it is never part of a cycle; untracked, it costs no GC passes.

    method: str
    metadata: Mapping[str, str]
    peer: Peer
    deadline: float | None
    _chan: ServerTransport

    def time_remaining(self) -> float | None:
        """Seconds left before the caller's deadline (0 once it passed), or None without one."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def peer_info(self) -> PeerInfo:
        """The peer's slot and generation with the PID and host identity it published."""
        slot, gen = self.peer
        chan = self._chan
        info = None if chan.closed else chan.peer_info(slot)
        if info is None or info[0] != gen:  # the client left meanwhile (or the server closed)
            return PeerInfo(slot, gen, None, None, False)
        pid, host = info[1] or None, info[2] or None
        return PeerInfo(slot, gen, pid, host, host == chan.identity)

    def abort(self, code: StatusCode | int, details: str = "") -> NoReturn:
        """End the call with status ``code`` (not OK) and ``details``: raises the RpcError the
        caller gets, so code after it does not run."""
        status = StatusCode(code)
        if status is StatusCode.OK:
            raise ValueError("abort() takes an error status, not OK")
        raise ERRORS[status](details)

    def __repr__(self) -> str:
        return (f"HandlerContext(method={self.method!r}, metadata={dict(self.metadata)!r}, "
                f"peer={self.peer!r}, deadline={self.deadline!r})")


ServerInterceptor = Callable[[HandlerContext, Callable[[], Awaitable[Any]]], Awaitable[Any]]
"""A server interceptor: ``await interceptor(call, next)`` runs the rest of the chain and the
handler when it awaits ``next()`` (``call``: the call's ``HandlerContext``); it may raise
instead, or return another result."""

_current_call: ContextVar[HandlerContext] = ContextVar("cxlrpc_call")


def context() -> HandlerContext:
    """The call the running handler serves (LookupError outside a handler)."""
    return _current_call.get()


def current_peer() -> Peer:
    """The client whose request the running handler serves (LookupError outside a handler)."""
    return _current_call.get().peer
