"""The kvservice RPC schema: every request and reply as a msgspec Struct, and their one codec.

The shared-memory service hands these Structs to cxlrpc (which MessagePack-encodes them); the
gRPC twin encodes them itself with ``encode``/``decode``. Keys travel as bytes.
"""
from __future__ import annotations

from typing import Any, TypeVar, overload

import msgspec

from kvservice.index import Lease, PutTicket

__all__ = ["Hello", "Begin", "Inline", "Tickets", "Undo", "GetStream", "Get", "Release", "Renew", "RemoveKeys",
           "RemoveMatching", "Key", "Keys", "Lease", "PutTicket", "encode", "decode"]

T = TypeVar("T")

#: The FAILED_PRECONDITION details of a request from a connection that has not said hello to
#: this server (a client that reconnected to a restarted server still maps the old pool): the
#: client says hello, maps the new pool, and retries.
NOT_GREETED = "kvservice: this connection has not said hello to this server"


class Hello(msgspec.Struct, frozen=True):
    """What a client needs to map the pool: where it is, its size, epoch and block alignment,
    and the inline limit."""

    pool_url: str
    pool_size: int
    epoch: int
    inline_limit: int
    alignment: int


class Release(msgspec.Struct, array_like=True, frozen=True):
    """End leases: a one-way message of its own, or riding on a get or put (the server ends
    them before it serves that request)."""

    ids: list[int]


class Begin(msgspec.Struct, array_like=True, frozen=True):
    """Reserve one block per key (phase one of a put); the reply is a list of PutTicket."""

    ns: str
    keys: list[bytes]
    sizes: list[int]
    ttl: float | None = None
    if_absent: bool = False  # reserve nothing for (and never replace) a key that has a value
    release: Release | None = None


class Inline(msgspec.Struct, array_like=True, frozen=True):
    """Values carried in the request (small ones, and every gRPC-twin put): stored and committed."""

    ns: str
    keys: list[bytes]
    values: list[bytes]
    ttl: float | None = None
    if_absent: bool = False
    release: Release | None = None


class Tickets(msgspec.Struct, array_like=True, frozen=True):
    """Put tickets to commit (phase two) or abort."""

    ids: list[int]


class Undo(msgspec.Struct, array_like=True, frozen=True):
    """Take back puts whose caller was cancelled after they committed: each key is removed
    if it still holds the version that put created (a newer value is left alone)."""

    ns: str
    keys: list[bytes]
    versions: list[int]


class GetStream(msgspec.Struct, array_like=True, frozen=True):
    """Lease each key's value, ``chunk`` keys per item of a server stream."""

    ns: str
    keys: list[bytes]
    lease_s: float | None = None
    chunk: int = 8
    release: Release | None = None


class Get(msgspec.Struct, array_like=True, frozen=True):
    """Lease each key's value; the reply is a list of Lease, None for a miss."""

    ns: str
    keys: list[bytes]
    lease_s: float | None = None
    hold_s: float = 0.0  # leases outlive their release this long after the get (Mooncake reads)
    release: Release | None = None


class RemoveKeys(msgspec.Struct, array_like=True, frozen=True):
    """Remove keys; the reply says REMOVED, ABSENT or LEASED (kept: a lease holds it, no force)
    for each."""

    ns: str
    keys: list[bytes]
    force: bool = True


class RemoveMatching(msgspec.Struct, array_like=True, frozen=True):
    """Remove the keys of a namespace a regular expression finds a match in (all when None);
    the reply is how many."""

    ns: str
    pattern: str | None
    force: bool = True


class Renew(msgspec.Struct, array_like=True, frozen=True):
    """Extend leases whose blocks are still held (one-way; the client renews at half-life)."""

    ids: list[int]
    lease_s: float


class Key(msgspec.Struct, array_like=True, frozen=True):
    """One key of a namespace (exists, remove)."""

    ns: str
    key: bytes


class Keys(msgspec.Struct, array_like=True, frozen=True):
    """Keys of a namespace (lookup_prefix, and the gRPC twin's get)."""

    ns: str
    keys: list[bytes]


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def encode(obj: Any) -> bytes:
    """MessagePack bytes of a schema object (the gRPC twin's serializer)."""
    return _encoder.encode(obj)


@overload
def decode(data: bytes, type_: type[T]) -> T: ...
@overload
def decode(data: bytes, type_: Any) -> Any: ...
def decode(data: bytes, type_: Any) -> Any:
    """Decode and validate MessagePack ``data`` as ``type_`` (msgspec.ValidationError if bad)."""
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.msgpack.Decoder(type_)
    return dec.decode(data)
