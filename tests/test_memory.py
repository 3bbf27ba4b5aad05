"""Copies into shared memory with streaming stores (cxlrpc.memory.stream_copy / stream_bytes):
byte-exact at every alignment and length, nothing outside the destination touched, bad
buffers refused, and the same results from the plain-copy fallback."""
from __future__ import annotations

import mmap
import os

import pytest

from cxlrpc import memory

# lengths around the 16-byte alignment prologue and the 64-byte main loop, and big ones
LENGTHS = (0, 1, 15, 16, 17, 63, 64, 65, 127, 129, 4096 + 3, (1 << 20) + 31)
_INVERTED = bytes(255 - b for b in range(256))


@pytest.fixture(params=["native", "fallback"])
def copies(request, monkeypatch):
    """stream_copy and stream_bytes with the native module, and without it."""
    if request.param == "native":
        if memory._native is None:
            pytest.skip("cxlrpc._flush was not built")
    else:
        monkeypatch.setattr(memory, "_native", None)
    return memory.stream_copy, memory.stream_bytes


@pytest.mark.parametrize("length", LENGTHS)
def test_stream_copy_is_exact_and_stays_inside_its_destination(copies, length):
    stream_copy, _ = copies
    src = os.urandom(length + 7)
    with mmap.mmap(-1, length + 64) as m:
        for at in (0, 1, 8, 15, 16, 33):
            m[:] = b"\xaa" * len(m)
            view = memoryview(m)
            dst = view[at:at + length + 5]
            stream_copy(dst, memoryview(src)[3:3 + length])  # a source not aligned either
            dst.release()
            data = m[:]
            view.release()
            assert data[at:at + length] == src[3:3 + length], at
            assert data[:at] == b"\xaa" * at and data[at + length:] == b"\xaa" * (len(m) - at - length)


@pytest.mark.parametrize("length", LENGTHS)
def test_stream_bytes_is_a_copy(copies, length):
    _, stream_bytes = copies
    src = bytearray(os.urandom(length + 1))
    out = stream_bytes(memoryview(src)[1:])
    assert type(out) is bytes and out == src[1:]
    src[1:] = src[1:].translate(_INVERTED)  # every byte changes: a copy keeps the old ones
    assert length == 0 or out != src[1:]


def test_stream_copy_refuses_what_does_not_fit_or_cannot_be_written(copies):
    stream_copy, stream_bytes = copies
    with pytest.raises(ValueError):
        stream_copy(memoryview(bytearray(10)), b"x" * 11)
    with pytest.raises(TypeError):
        stream_copy(memoryview(b"x" * 20), b"y" * 5)  # read-only destination


def test_native_copies_refuse_non_contiguous_buffers():
    if memory._native is None:
        pytest.skip("cxlrpc._flush was not built")
    strided = memoryview(bytearray(64))[::2]
    with pytest.raises((BufferError, TypeError)):
        memory.stream_copy(memoryview(bytearray(64)), strided)
    with pytest.raises((BufferError, TypeError)):
        memory.stream_copy(strided, b"x")
    with pytest.raises((BufferError, TypeError)):
        memory.stream_bytes(strided)


def test_copies_stream_from_the_size_where_streaming_wins(monkeypatch):
    """copy_bytes and to_bytes stream from STREAM_COLD_MIN into a destination just handed out,
    from STREAM_WARM_MIN into any other, and copy plainly below; the bytes are right either way."""
    streamed: list[int] = []
    real_copy, real_bytes = memory.stream_copy, memory.stream_bytes
    monkeypatch.setattr(memory, "stream_copy", lambda dst, src: (streamed.append(len(src)), real_copy(dst, src)))
    monkeypatch.setattr(memory, "stream_bytes", lambda src: (streamed.append(len(src)), real_bytes(src))[1])
    cold, warm = memory.STREAM_COLD_MIN, memory.STREAM_WARM_MIN
    dst = memoryview(bytearray(warm + 1))
    for size, is_cold, streams in ((cold - 1, True, False), (cold, True, True), (cold, False, False),
                                   (warm - 1, False, False), (warm, False, True)):
        src = os.urandom(size)
        streamed.clear()
        memory.copy_bytes(dst, src, cold=is_cold)
        assert dst[:size] == src and streamed == ([size] if streams else []), (size, is_cold)
    for size, streams in ((warm - 1, False), (warm, True)):
        src = os.urandom(size)
        streamed.clear()
        assert memory.to_bytes(memoryview(src)) == src and streamed == ([size] if streams else [])
