"""Frames: the one place that encodes and decodes what crosses the rings.

A frame is a fixed little-endian header, the method name, then the body::

    kind u8 | flags u8 | status u16 | slot u16 | gen u32 | call_id u64 | timeout f64 | method_len u16

``bytes``-like bodies travel raw (flag ``RAW``: one copy into the ring, one out); anything
else is msgspec MessagePack. A body too big for a ring travels through the region's heap
(flag ``HEAP``: the frame's body is the extent, see ``cxlrpc.heap``). A request with call
metadata (flag ``META``) carries it between the method name and the body, in the frame even
when the body is out of line: ``length u16 | MessagePack map of str to str``. A request flagged
``STREAM`` opens a call whose requests follow as ITEM frames, ended by END. Every field is
validated on decode: a frame from shared memory may be garbage.
"""
from __future__ import annotations

import os
import struct
from types import MappingProxyType
from typing import AbstractSet, Any, Callable, Mapping, Protocol

import msgspec

from .errors import InvalidArgument

REQUEST, RESPONSE, ERROR, CANCEL = 1, 2, 3, 4
ALLOC, FREE = 5, 6  # ask the server for a heap extent (body: size); give one back (body: offset)
#: A stream's item and its end, and the reader's credit (body: a count). Both ways: a server
#: stream's go server to client (credit back), a request stream's client to server.
ITEM, END, CREDIT = 7, 8, 9
_KINDS = frozenset((REQUEST, RESPONSE, ERROR, CANCEL, ALLOC, FREE, ITEM, END, CREDIT))
RAW = 1  # body is the caller's bytes, not MessagePack
HEAP = 2  # the body is out of line: the frame carries its heap extent (offset, length)
META = 4  # call metadata precedes the body (see encode_metadata)
STREAM = 8  # a request whose items follow (ITEM frames, then END); its own body is empty
FOLLOW = 16  # with HEAP: the body is still being written after the frame (see cxlrpc.heap)
#: On a reply to a followed request: the method reads its body in place (a lent view), so
#: following gains nothing there; the caller sends it bodies the ring takes the plain way.
IN_PLACE = 32
_UNKNOWN_FLAGS = ~(RAW | HEAP | META | STREAM | FOLLOW | IN_PLACE)
NO_REPLY = 0  # call id of a one-way request: the server runs the handler and sends nothing back

# Methods every server answers (users cannot register names under the prefix)
RESERVED_PREFIX = "cxlrpc."
HEALTH = "cxlrpc.health"  # -> {"status": "SERVING" | "NOT_SERVING"} (gRPC health's names)
LIST_METHODS = "cxlrpc.methods"  # -> sorted names of the user's methods

HEADER = struct.Struct("<BBHHIQdH")
HEADER_SIZE = HEADER.size
MAX_METHOD = 255
MAX_METADATA_PAIRS = 64
MAX_METADATA_BYTES = 4096  # of the encoded map
_META_LEN = struct.Struct("<H")
NO_METADATA: Mapping[str, str] = MappingProxyType({})

_encode = msgspec.msgpack.Encoder().encode
#: encode_body's MessagePack encoder, for the native paths: they encode values that are not
#: bytes-like with it, and call encode_body only to pass memoryviews or to say why one failed
encode_msgpack = _encode
_decoders: dict[Any, Callable[[bytes | memoryview], Any]] = {}  # type -> its decode function
#: id(type) -> (type, its decode function), for the types callers pass again and again (a
#: response_type such as ``list[Lease | None]`` is looked up by identity: hashing a generic alias
#: cost as much as decoding with it). The entry keeps its type alive, so the id is not reused
#: meanwhile; bounded, as aliases written inline are new objects at every call.
_decoders_by_id: dict[int, tuple[Any, Callable[[bytes | memoryview], Any]]] = {}
_MAX_DECODERS_BY_ID = 1024
_decode_metadata = msgspec.msgpack.Decoder(dict[str, str]).decode
_method_names: dict[bytes, str] = {}


class FrameError(ValueError):
    """A frame that no correct peer would write."""


class BadMetadata(FrameError):
    """A frame whose header is sound but whose metadata block is not: ``frame`` holds the
    header's fields (no body), so that a request can be answered INVALID_ARGUMENT."""

    def __init__(self, message: str, frame: "Frame") -> None:
        super().__init__(message)
        self.frame = frame


class Frame(msgspec.Struct, gc=False):
    """A decoded frame; ``body`` is copied out of the ring (a lent body: a read-only view of it)."""

    kind: int
    flags: int
    status: int
    slot: int
    gen: int
    call_id: int
    timeout: float
    method: str
    body: bytes | memoryview
    #: Read-only call metadata (flag META; empty without).
    metadata: Mapping[str, str] = NO_METADATA


def encode_body(value: Any) -> tuple[int, bytes | bytearray | memoryview]:
    """(flags, body) for a value: bytes-likes pass through raw (a memoryview as one flat run
    of its bytes, whatever its shape, format or strides), the rest is MessagePack."""
    if type(value) is bytes or isinstance(value, (bytes, bytearray)):
        return RAW, value
    if isinstance(value, memoryview):
        if value.ndim == 1 and value.itemsize == 1 and value.c_contiguous:
            return RAW, value
        return RAW, value.cast("B") if value.c_contiguous else value.tobytes()
    try:
        return 0, _encode(value)
    except Exception as exc:  # TypeError, EncodeError, RecursionError on deep nesting
        raise InvalidArgument(f"cannot encode {type(value).__name__}: {exc}") from exc


def decoder(type_: Any = None) -> Callable[[bytes | memoryview], Any]:
    """The MessagePack decode function of ``type_`` (Any when None), made once per type
    (TypeError for a type msgspec cannot decode into)."""
    if type_ is None:
        type_ = Any
    entry = _decoders_by_id.get(id(type_))
    if entry is not None and entry[0] is type_:
        return entry[1]
    decode = _decoders.get(type_)
    if decode is None:
        decode = _decoders[type_] = msgspec.msgpack.Decoder(type_).decode
    if len(_decoders_by_id) < _MAX_DECODERS_BY_ID:
        _decoders_by_id[id(type_)] = (type_, decode)
    return decode


def decode_body(flags: int, body: bytes | memoryview, type_: Any = None) -> Any:
    """Inverse of ``encode_body``, validating into ``type_`` when given."""
    if flags & RAW:
        if type_ is None or type_ is bytes or type_ is Any:
            return body
        if type_ is memoryview:
            return body if type(body) is memoryview else memoryview(body)
        return msgspec.convert(body, type_)
    return decoder(type_)(body)


def encode_metadata(metadata: Mapping[str, str]) -> bytes:
    """A request's metadata block, refused (InvalidArgument) unless it holds at most
    MAX_METADATA_PAIRS pairs of a non-empty str key and a str value, MAX_METADATA_BYTES encoded."""
    if not isinstance(metadata, Mapping):
        raise InvalidArgument(f"metadata must be a mapping of str to str, not {type(metadata).__name__}")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidArgument(f"metadata has {len(metadata)} pairs, at most {MAX_METADATA_PAIRS} allowed")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str) or not key:
            raise InvalidArgument(f"metadata pairs must be a non-empty str key and a str value, "
                                  f"got {key!r:.40}: {type(value).__name__}")
    try:
        block = _encode(metadata if type(metadata) is dict else dict(metadata))
    except UnicodeEncodeError as exc:  # lone surrogates
        raise InvalidArgument(f"metadata is not valid UTF-8: {exc}") from exc
    if len(block) > MAX_METADATA_BYTES:
        raise InvalidArgument(f"metadata takes {len(block)} bytes encoded, at most "
                              f"{MAX_METADATA_BYTES} allowed")
    return _META_LEN.pack(len(block)) + block


def method_bytes(method: str) -> bytes:
    """Encode and check a method name once (callers cache the result)."""
    raw = method.encode()
    if not raw or len(raw) > MAX_METHOD:
        raise InvalidArgument(f"method name must be 1-{MAX_METHOD} bytes, got {len(raw)}")
    return raw


def header(kind: int, flags: int, status: int, slot: int, gen: int, call_id: int,
           timeout: float, method: bytes) -> bytes:
    """Pack a frame header; the ring record is ``header + method + body``."""
    return HEADER.pack(kind, flags, status, slot, gen & 0xFFFFFFFF, call_id, timeout, len(method))


def out_of_line(head: bytes, follow: bool = False) -> bytes:
    """The same header, flagged ``HEAP``: the record's body is the extent, not the bytes (and
    ``FOLLOW``: the body is written there after the frame is sent)."""
    return head[:1] + bytes((head[1] | HEAP | (FOLLOW if follow else 0),)) + head[2:]


_unpack = HEADER.unpack_from


def _decode_py(view: memoryview, lend: AbstractSet[str] | None = None) -> Frame:
    """Decode and validate a frame from a ring payload, copying the body out; a request's whose
    method is in ``lend`` is a read-only view into ``view`` instead (valid while the record is)."""
    n = len(view)
    if n < HEADER_SIZE:
        raise FrameError(f"frame of {n} bytes is shorter than its header")
    kind, flags, status, slot, gen, call_id, timeout, mlen = _unpack(view)
    end = HEADER_SIZE + mlen
    # ``not timeout >= 0`` also rejects NaN
    if kind not in _KINDS or mlen > MAX_METHOD or end > n or flags & _UNKNOWN_FLAGS or not timeout >= 0:
        raise FrameError("frame header out of range")
    method = ""
    if mlen:
        raw = bytes(view[HEADER_SIZE:end])
        cached = _method_names.get(raw)
        method = cached if cached is not None else _method_name(raw)
    if flags & META:
        try:
            metadata, end = _metadata(view, end, n)
        except FrameError as exc:
            raise BadMetadata(str(exc), Frame(kind, flags, status, slot, gen, call_id, timeout,
                                              method, b"")) from None
    else:
        metadata = NO_METADATA
    if lend is not None and kind == REQUEST and method in lend:
        body: bytes | memoryview = view[end:].toreadonly()
    else:
        body = bytes(view[end:])
    return Frame(kind, flags, status, slot, gen, call_id, timeout, method, body, metadata)


def _metadata(view: memoryview, start: int, n: int) -> tuple[Mapping[str, str], int]:
    """Decode and validate the metadata block at ``start``: (the metadata, where the body starts)."""
    if start + _META_LEN.size > n:
        raise FrameError("metadata block is cut short")
    (size,) = _META_LEN.unpack_from(view, start)
    start += _META_LEN.size
    end = start + size
    if not 0 < size <= MAX_METADATA_BYTES or end > n:
        raise FrameError(f"metadata block of {size} bytes is out of range")
    try:
        metadata = _decode_metadata(view[start:end])
    except Exception as exc:  # DecodeError, ValidationError
        raise FrameError(f"metadata is not a map of str to str: {exc}") from None
    if len(metadata) > MAX_METADATA_PAIRS or "" in metadata:
        raise FrameError(f"metadata of {len(metadata)} pairs is out of range")
    return MappingProxyType(metadata), end


def _method_name(raw: bytes) -> str:
    try:
        method = raw.decode()
    except UnicodeDecodeError as exc:
        raise FrameError("method name is not UTF-8") from exc
    if len(_method_names) < 4096:
        _method_names[raw] = method
    return method


class _Decode(Protocol):
    """``decode(view, lend=None)``: the reference's signature, which the native one shares."""

    def __call__(self, view: memoryview, lend: AbstractSet[str] | None = None, /) -> Frame: ...


class _FrameNative(Protocol):
    """``cxlrpc._frame`` as used here (typed by its stub, cxlrpc/_frame.pyi, that mypy checks
    the module against): a protocol, so ``_native`` may be None."""

    def configure(self, frame_type: Callable[..., object], frame_error: type[Exception],
                  method_cache: dict[bytes, str], method_name: Callable[[bytes], str],
                  reference_decode: Callable[..., object], /) -> None: ...

    #: the frame_type instance configure() named (typed Frame by ``decode`` below)
    def decode(self, view: memoryview, lend: AbstractSet[str] | None = None, /) -> Any: ...


decode: _Decode
_native: _FrameNative | None
try:  # the same decode in C (frames without metadata), where the package was built with one
    from . import _frame as _native
except ImportError:
    _native = None
if _native is not None and not os.environ.get("CXLRPC_NO_NATIVE"):
    _native.configure(Frame, FrameError, _method_names, _method_name, _decode_py)
    decode = _native.decode
else:
    decode = _decode_py
