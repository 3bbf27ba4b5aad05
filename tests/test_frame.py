"""Body codec: decoders are made once per type and found by identity, and that cache stays bounded
whatever types callers pass; a memoryview body is sent as its bytes, whatever its shape."""
from __future__ import annotations

from typing import Any

import msgspec
import pytest

from cxlrpc import frame as fr


class Point(msgspec.Struct, array_like=True):
    x: int
    y: int


def test_a_type_has_one_decoder_found_by_identity_or_equality():
    points = list[Point | None]
    decode = fr.decoder(points)
    assert fr.decoder(points) is decode  # by identity
    assert fr.decoder(list[Point | None]) is decode  # an equal alias made anew: by equality
    assert fr.decoder(None) is fr.decoder(Any)
    body = msgspec.msgpack.encode([Point(1, 2), None])
    assert decode(body) == [Point(1, 2), None]
    assert fr.decode_body(0, body, list[Point | None]) == [Point(1, 2), None]
    with pytest.raises(msgspec.ValidationError):
        fr.decode_body(0, msgspec.msgpack.encode([1]), points)


def test_the_identity_cache_is_bounded_by_aliases_made_at_every_call():
    body = msgspec.msgpack.encode([1, 2])
    for _ in range(3 * fr._MAX_DECODERS_BY_ID):
        assert fr.decode_body(0, body, list[int]) == [1, 2]  # a new alias object each time
    assert len(fr._decoders_by_id) <= fr._MAX_DECODERS_BY_ID
    assert fr.decoder(list[int]) is fr.decoder(list[int])  # past the bound, still made once


def test_a_memoryview_body_is_sent_as_one_flat_run_of_its_bytes():
    """A memoryview of any format, shape or strides encodes raw, as exactly the bytes
    ``tobytes()`` gives, and as a view whose length counts bytes (the rings and the heap size
    records by len())."""
    data = bytes(range(256)) * 64
    views = [memoryview(data), memoryview(data).cast("Q"), memoryview(data).cast("B", (128, 128)),
             memoryview(data)[::3], memoryview(bytearray(data)).cast("I")[::2]]
    for view in views:
        flags, body = fr.encode_body(view)
        assert flags == fr.RAW
        assert bytes(body) == view.tobytes() and len(body) == view.nbytes, view
