"""The native copies of bodies (cxlrpc/_copy.h's copy_span) at every skew between destination and
source modulo a page: byte-exact, nothing outside the destination touched.

copy_span takes its own loop where the destination lies 1-63 bytes past the source modulo 4 KiB
(glibc's ``rep movsb`` crawls there on AMD Zen), memmove elsewhere; these tests put the copies of
publish_copy, follow_copy and the rings' pushes on both sides of that window.
"""
from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from cxlrpc import memory
from cxlrpc.ring import SpscRing, base

from ring_env import Env

pytestmark = pytest.mark.timeout(120)
native_flush = pytest.mark.skipif(memory._native is None, reason="cxlrpc._flush was not built")

#: skews (destination - source, modulo 4096) on both sides of and inside the 1-63 window
SKEWS = (*range(0, 72), 4000, 4032, 4088, 4095)
GUARD = 0x5A


def _address(buf: mmap.mmap | bytearray) -> int:
    anchor = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def _source_at(skew: int, dst_address: int, length: int) -> tuple[memoryview, bytes]:
    """A view of ``length`` random bytes whose address is ``dst_address - skew`` modulo 4096."""
    store = bytearray(length + 8192)
    at = (dst_address - skew - _address(store)) % 4096
    data = os.urandom(length)
    store[at:at + length] = data
    return memoryview(store)[at:at + length], data


@native_flush
@pytest.mark.parametrize("length", [4095, 4096, (64 << 10) + 17])
def test_publish_copy_is_exact_at_every_skew(length: int) -> None:
    """The followed body's writer: each chunk copied whole, the progress word the length."""
    with mmap.mmap(-1, length + 2 * 4096) as m:
        dst_at = 4096 + 64  # a followed extent's body: 64 bytes into a page
        for skew in SKEWS:
            m[:] = bytes([GUARD]) * len(m)
            view = memoryview(m)
            src, data = _source_at(skew, _address(m) + dst_at, length)
            progress = bytearray(8)
            memory._native.publish_copy(view[dst_at:dst_at + length], src, progress, (16 << 10) + 40)
            view.release()
            assert m[dst_at:dst_at + length] == data, skew
            assert m[:dst_at] == bytes([GUARD]) * dst_at, skew
            assert m[dst_at + length:] == bytes([GUARD]) * (len(m) - dst_at - length), skew
            assert int.from_bytes(progress, "little") == length


@native_flush
def test_follow_copy_is_exact_from_every_source_offset() -> None:
    """The followed body's reader: its destination is a new bytes object (wherever malloc puts
    it), so the source moves through a page in 8-byte steps and every skew of the window comes."""
    length = (8 << 10) + 24
    with mmap.mmap(-1, length + 8192) as m:
        data = os.urandom(length + 4096)
        m[:len(data)] = data
        view = memoryview(m)
        progress = memoryview(bytearray(length.to_bytes(8, "little")))
        try:
            for at in range(0, 4096, 8):
                assert memory._native.follow_copy(view[at:at + length], progress, 1.0, 5.0) == data[at:at + length]
        finally:
            view.release()


@pytest.mark.skipif(not base.NATIVE, reason="cxlrpc._ring is not built")
def test_ring_pushes_are_exact_at_every_skew() -> None:
    """A record's body copied into the ring from sources at every skew, each read back whole,
    the guards around the ring intact. Records of two pages (header, 8-byte head, body) fill
    the 16-page ring exactly, so every body lands at one place modulo a page."""
    env = Env(SpscRing, 16 * 4096)
    length = 2 * 4096 - 16
    for i, skew in enumerate(SKEWS):
        head = i.to_bytes(8, "little")
        if i == 0:
            assert env.ring.try_push_parts((head, b"\0" * length))  # find where bodies land
            first = env.buf.obj.find(head + b"\0" * 64, env.data)
            body_at = env.base_addr + first + 8
            assert env.ring.pop() == head + b"\0" * length
        src, data = _source_at(skew, body_at, length)
        assert env.ring.try_push_parts((head, src))
        assert env.ring.pop() == head + data, (i, skew)
    assert env.guards_intact()


@native_flush
def test_copy_into_an_overlapping_destination_is_a_move() -> None:
    """Source and destination may overlap (a ring's part may be a view of the ring): a
    destination 16 bytes past its source, inside the skew window, still gets the source's bytes."""
    length = 64 << 10
    with mmap.mmap(-1, length + 4096) as m:
        data = os.urandom(length)
        m[64:64 + length] = data
        view = memoryview(m)
        progress = bytearray(8)
        memory._native.publish_copy(view[80:80 + length], view[64:64 + length], progress, length)
        view.release()
        assert m[80:80 + length] == data


@pytest.mark.parametrize("impl", ["native", "fallback"])
@pytest.mark.parametrize("length", [4095, 4096, (64 << 10) + 17])
def test_plain_copies_are_exact_at_every_skew(impl: str, length: int, monkeypatch) -> None:
    """memory.plain_copy / plain_bytes (pool blocks into users' buffers, heap extents into
    bytes): exact, inside the destination, with the native module and without it."""
    if impl == "fallback":
        monkeypatch.setattr(memory, "_native", None)
    elif memory._native is None:
        pytest.skip("cxlrpc._flush was not built")
    with mmap.mmap(-1, length + 2 * 4096) as m:
        dst_at = 4096 + 16  # a numpy array's data, as malloc maps it
        for skew in SKEWS:
            m[:] = bytes([GUARD]) * len(m)
            view = memoryview(m)
            src, data = _source_at(skew, _address(m) + dst_at, length)
            memory.plain_copy(view[dst_at:dst_at + length + 3], src)
            view.release()
            assert m[dst_at:dst_at + length] == data, skew
            assert m[:dst_at] == bytes([GUARD]) * dst_at, skew
            assert m[dst_at + length:] == bytes([GUARD]) * (len(m) - dst_at - length), skew
            copy = memory.plain_bytes(src)
            assert type(copy) is bytes and copy == data, skew


def test_plain_copy_refuses_what_does_not_fit() -> None:
    if memory._native is None:
        pytest.skip("cxlrpc._flush was not built")
    with pytest.raises(ValueError):
        memory.plain_copy(memoryview(bytearray(5000)), b"x" * 5001)
    with pytest.raises(TypeError):
        memory.plain_copy(memoryview(b"y" * 5000), b"x" * 5000)  # not writable
