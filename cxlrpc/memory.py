"""Every cross-process atomic access goes through this module.

Shared counters are 8-byte aligned u64 words updated with real atomic instructions
(the native module ``cxlrpc._atomic``, ~30 ns per op) with explicit memory orderings.  Code in higher layers
binds a ``Counter`` once per field and calls ``load``/``store``/``cas``/``fetch_add``
on it; it never packs a published field with ``struct``.

Memory without cross-host cache coherence (most multi-host CXL pools today) needs more:
a writer writes back the lines it published before the store that publishes them, and a
reader invalidates the lines it is about to read.  ``AtomicMemory.writeback`` and
``AtomicMemory.invalidate`` do that; on coherent memory they are no-ops and
``AtomicMemory.flushing`` is False, so callers skip them on the hot path.  The instructions
(clwb/clflushopt + fences) come from the small native module ``cxlrpc._flush``; a simulator
region (``sim://``) supplies its own implementation instead.
"""
from __future__ import annotations

import ctypes
import time
from typing import TYPE_CHECKING, Callable, Literal, Protocol

try:
    from . import _atomic
except ImportError:  # built where a C compiler exists; else libatomic through ctypes (it warns once)
    from . import _atomic_ref as _atomic  # type: ignore[no-redef, unused-ignore]

if TYPE_CHECKING:
    from typing_extensions import Buffer  # (collections.abc.Buffer from Python 3.12)

    from ._flush import Follower, Lines


class _Flush(Protocol):
    """What this module takes from ``cxlrpc._flush`` (typed by its stub, cxlrpc/_flush.pyi,
    which mypy checks the module against): a protocol, so ``_native`` may be None."""

    def writeback(self, address: int, length: int, /) -> None: ...
    def invalidate(self, address: int, length: int, /) -> None: ...
    def stream_copy(self, dst: Buffer, src: Buffer, /) -> None: ...
    def stream_bytes(self, src: Buffer, /) -> bytes: ...
    def copy(self, dst: Buffer, src: Buffer, /) -> None: ...
    def copied(self, src: Buffer, /) -> bytes: ...
    def publish_copy(self, dst: Buffer, src: Buffer, progress: Buffer, chunk: int, seal: Buffer = ...,
                     expected: int = ..., /) -> bool: ...
    def publish_flushed(self, lines: Lines, at: int, src: Buffer, progress_at: int, chunk: int, seal_at: int = ...,
                        expected: int = ..., /) -> bool: ...
    def follow_flushed(self, lines: Lines, at: int, length: int, progress_at: int, stall: float, limit: float,
                       seal_at: int = ..., expected: int = ..., /) -> bytes | Literal[False] | None: ...
    def follow_copy(self, src: Buffer, progress: Buffer, stall: float, limit: float, seal: Buffer = ...,
                    expected: int = ..., /) -> bytes | Literal[False] | None: ...
    @property
    def Follower(self) -> type[Follower]: ...
    @property
    def Lines(self) -> type[Lines]: ...


_native: _Flush | None
try:
    from . import _flush as _native
except ImportError:  # built by the package where a C compiler exists
    _native = None

#: Coherence modes a region can be in (stored in its header).
HARDWARE, FLUSH = "hardware", "flush"
COHERENCE_MODES = (HARDWARE, FLUSH)

RELAXED: int = _atomic.RELAXED
ACQUIRE: int = _atomic.ACQUIRE
RELEASE: int = _atomic.RELEASE
ACQ_REL: int = _atomic.ACQ_REL
SEQ_CST: int = _atomic.SEQ_CST

#: An atomic 64-bit cell bound to one offset: ``load(order)``, ``store(v, order)``,
#: ``cas(expected, desired, order)`` (returns the previous value), ``fetch_add(n, order)``,
#: ``exchange(v, order)``.
Counter = _atomic.AtomicU64

class AtomicMemory:
    """Atomic access to a writable buffer (a region's mapping, or any bytearray/mmap).

    ``load(off, order)``, ``store(off, value, order)``, ``cas(off, expected, desired, order)``
    (returns the previous value) and ``fetch_add(off, delta, order)`` act on the aligned u64
    at ``off``; they are the extension's bound methods, so a call costs no Python frame.
    """

    __slots__ = ("_view", "size", "load", "store", "cas", "fetch_add", "exchange", "flushing",
                 "lines", "_writeback", "_invalidate")

    def __init__(self, buffer: Buffer) -> None:
        view = _atomic.AtomicView(buffer)
        self._view = view
        self.size: int = view.nbytes
        self.load = view.load_u64
        self.store = view.store_u64
        self.cas = view.cas_u64
        self.fetch_add = view.fetch_add_u64
        self.exchange = view.exchange_u64
        #: True when lines must be written back / invalidated explicitly (no coherence).
        self.flushing = False
        #: In flush mode, the write-back and invalidation the native paths call (and count):
        #: ``cxlrpc._flush.Lines`` over this buffer; None on coherent memory.
        self.lines: Lines | None = None
        self._writeback: Callable[[int, int], None] = _coherent
        self._invalidate: Callable[[int, int], None] = _coherent

    @property
    def address(self) -> int:
        """Where the buffer starts in this process (for native calls over it)."""
        return self._view.address

    def use_flushes(self, writeback: Callable[[int, int], None] | None = None,
                    invalidate: Callable[[int, int], None] | None = None, native: _Flush | None = None) -> None:
        """Switch to non-coherent operation: the given (offset, length) hooks (a simulator's), or
        the CPU's own write-back/invalidate instructions over this buffer's addresses; through one
        ``Lines`` object of ``native`` (default: this module's ``cxlrpc._flush``), which the native
        paths call too and which counts them. Hooks without the native module are called as they
        are (no native path runs then); the instructions without it raise RuntimeError."""
        if (writeback is None) != (invalidate is None):
            raise TypeError("use_flushes: both hooks or neither")
        native = native or _native
        if native is None:
            if writeback is None or invalidate is None:
                require_native_flush()  # (raises)
                return
            self._writeback, self._invalidate = writeback, invalidate
        else:
            lines = self.lines = native.Lines(self._view.address, self.size, writeback, invalidate)
            self._writeback, self._invalidate = lines.writeback, lines.invalidate
        self.flushing = True

    def writeback(self, offset: int, length: int) -> None:
        """Write the lines of ``[offset, offset+length)`` back to memory, then fence (before the
        store that publishes them). A no-op on coherent memory."""
        if self.flushing:
            self._check(offset, length)
            self._writeback(offset, length)

    def invalidate(self, offset: int, length: int) -> None:
        """Drop the lines of ``[offset, offset+length)`` from this CPU's caches, then fence
        (before reading what another host wrote there). A no-op on coherent memory."""
        if self.flushing:
            self._check(offset, length)
            self._invalidate(offset, length)

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"range ({offset}, {length}) outside a {self.size}-byte buffer")

    def zero(self, offset: int, length: int) -> None:
        """memset ``length`` bytes at ``offset`` to zero (no source buffer to read, unlike a copy)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"zero({offset}, {length}) outside a {self.size}-byte buffer")
        try:
            address = self._view.address
        except ValueError:  # the view is closed
            _closed(offset, length)
        ctypes.memset(address + offset, 0, length)

    def counter(self, offset: int) -> Counter:
        """Bind an atomic u64 at ``offset`` (bounds and 8-byte alignment checked here, once)."""
        return self._view.cell_u64(offset)

    def close(self) -> None:
        """Release the buffer export so the mapping can be closed. From here every access
        raises ValueError, write-back and invalidation too (their hooks may hold the mapping's
        address: after it is unmapped they would fault)."""
        self._view.close()
        if self.lines is not None:
            self.lines.close()
        elif self.flushing:
            self._writeback = self._invalidate = _closed

    def __enter__(self) -> "AtomicMemory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _coherent(offset: int, length: int) -> None:
    """Write-back and invalidation on coherent memory: nothing to do (the hooks until
    use_flushes; writeback/invalidate skip them while ``flushing`` is False anyway)."""


def _closed(offset: int, length: int) -> None:
    """A closed AtomicMemory's write-back and invalidate hooks (and zero's check)."""
    raise ValueError("operation on a closed AtomicMemory (its region was closed)")


#: What the copies below take as their source: anything with a length and a buffer.
BytesLike = bytes | bytearray | memoryview

#: From these sizes up, a copy into shared memory is made with streaming (non-temporal) stores:
#: they skip the read-for-ownership of each cold destination line and leave the bytes in memory,
#: not in this CPU's caches, which is where a reader on another host looks. Into a cold
#: destination (a pool block the allocator hands out again) they win from 64 KiB here (a 1 MiB
#: block: 53 against 91 us); into one still cached only from 4 MiB (1 MiB: 51 against 29 us).
STREAM_COLD_MIN = 256 << 10
STREAM_WARM_MIN = 4 << 20


def stream_copy(dst: memoryview, src: BytesLike) -> None:
    """Copy the bytes-like ``src`` into the start of ``dst`` with streaming stores and a store
    fence (a plain copy where the native module was not built)."""
    if _native is not None:
        _native.stream_copy(dst, src)
    else:
        dst[:len(src)] = src


def stream_bytes(src: BytesLike) -> bytes:
    """A copy of the bytes-like ``src`` as bytes, written with streaming stores."""
    return _native.stream_bytes(src) if _native is not None else bytes(src)


#: From this size up a plain copy goes through the native module: glibc's memcpy crawls (up to
#: 12x slower on AMD Zen) where the destination lies 1-63 bytes past the source modulo a page,
#: e.g. a numpy array's data (page offset 16) filled from a page-aligned pool block.
NATIVE_COPY_MIN = 4096


def plain_copy(dst: memoryview, src: BytesLike) -> None:
    """Copy the bytes-like ``src`` into the start of ``dst`` with plain (cached) stores."""
    if _native is not None and len(src) >= NATIVE_COPY_MIN:
        _native.copy(dst, src)
    else:
        dst[:len(src)] = src


def plain_bytes(src: BytesLike) -> bytes:
    """A copy of the bytes-like ``src`` as bytes, with plain stores."""
    return _native.copied(src) if _native is not None and len(src) >= NATIVE_COPY_MIN else bytes(src)


def copy_bytes(dst: memoryview, src: BytesLike, cold: bool = False) -> None:
    """Copy ``src`` into the start of ``dst``, with streaming stores where they win: from
    STREAM_COLD_MIN into a destination just handed out (``cold``), else from STREAM_WARM_MIN."""
    if len(src) >= (STREAM_COLD_MIN if cold else STREAM_WARM_MIN):
        stream_copy(dst, src)
    else:
        plain_copy(dst, src)


def to_bytes(src: BytesLike) -> bytes:
    """A copy of ``src`` as bytes (with streaming stores from STREAM_WARM_MIN)."""
    return stream_bytes(src) if len(src) >= STREAM_WARM_MIN else plain_bytes(src)


#: A followed copy (publish_copy / follow_copy) publishes its progress every this many bytes:
#: small enough that the reader's copy runs beside the writer's, big enough that the stores of
#: the progress word cost nothing (a 1 MiB echo: 32-64 KiB chunks best, 1 MiB ones no overlap).
FOLLOW_CHUNK = 64 << 10


class SealBroken(ValueError):
    """A followed extent's seal word is not the one its user expects: the extent was taken
    back (its user was judged gone) or handed to another (cxlrpc.heap's seals)."""


def publish_copy(mem: AtomicMemory, buf: memoryview, progress_at: int, at: int, src: BytesLike,
                 seal_at: int = -1, seal: int = 0) -> None:
    """Copy ``src`` to ``buf[at:]`` a chunk at a time, storing the count of bytes copied so far
    into the u64 at ``progress_at`` (release) after each, for ``follow_copy`` on another
    core to copy them out meanwhile. Coherent memory only: no write-back between chunks. Both
    copies, and the heap's others on coherent memory, use plain stores: the reader takes the
    lines from the writer's cache. Streaming stores lost at every size (16 MiB echo, p50 in
    three alternating pairs of runs: 4.3-4.9 against 5.2-7.1 ms; 1 MiB: 227-277 against 313).

    With ``seal_at`` (>= 0), the u64 there must read ``seal`` before each chunk and each
    progress store, else the copy stops there, nothing more written: SealBroken.

    Without coherence (``mem.lines``, over the whole of ``buf``): streaming stores, then a store
    fence and the progress word's write-back after each chunk; the seal's line invalidated
    before each check (``cxlrpc._flush.publish_flushed``)."""
    n = len(src)
    lines = mem.lines
    if lines is not None and _native is not None:
        if not _native.publish_flushed(lines, at, src, progress_at, FOLLOW_CHUNK, seal_at, seal):
            raise SealBroken("the extent's seal changed while its body was written")
        return
    if _native is not None:
        if seal_at < 0:
            _native.publish_copy(buf[at:at + n], src, buf[progress_at:progress_at + 8], FOLLOW_CHUNK)
        elif not _native.publish_copy(buf[at:at + n], src, buf[progress_at:progress_at + 8], FOLLOW_CHUNK,
                                      buf[seal_at:seal_at + 8], seal):
            raise SealBroken("the extent's seal changed while its body was written")
        return
    src = memoryview(src).cast("B")
    for done in range(0, n, FOLLOW_CHUNK):
        end = min(n, done + FOLLOW_CHUNK)
        if seal_at >= 0 and mem.load(seal_at, ACQUIRE) != seal:
            raise SealBroken("the extent's seal changed while its body was written")
        buf[at + done:at + end] = src[done:end]
        if seal_at >= 0 and mem.load(seal_at, ACQUIRE) != seal:
            raise SealBroken("the extent's seal changed while its body was written")
        mem.store(progress_at, end, RELEASE)


def follow_copy(mem: AtomicMemory, buf: memoryview, progress_at: int, at: int, length: int,
                stall: float, limit: float, seal_at: int = -1, seal: int = 0) -> bytes:
    """A copy of ``buf[at:at + length]`` taken while ``publish_copy`` writes it, as the
    progress word says its bytes are there. TimeoutError if the writer makes no progress for
    ``stall`` seconds (it died or froze) or is not done within ``limit``; ValueError if the
    word is garbage; with ``seal_at`` (>= 0), SealBroken if once copied the u64 there does not
    read ``seal`` (re-read after a fence, seqlock-style: the copy may hold another's bytes).
    Without coherence (``mem.lines``, over the whole of ``buf``): the progress word's line
    invalidated before each look, each run of bytes it announces right before it is copied, the
    seal's line before it is checked (``cxlrpc._flush.follow_flushed``)."""
    lines = mem.lines
    if lines is not None and _native is not None:
        got = _native.follow_flushed(lines, at, length, progress_at, stall, limit, seal_at, seal)
        if got is None:
            raise TimeoutError(f"the writer stopped for {stall} s or took over {limit:.3g} s")
        if got is False:
            raise SealBroken("the extent's seal changed while its body was read")
        return got
    if _native is not None:
        if seal_at < 0:
            got = _native.follow_copy(buf[at:at + length], buf[progress_at:progress_at + 8], stall, limit)
        else:
            got = _native.follow_copy(buf[at:at + length], buf[progress_at:progress_at + 8], stall, limit,
                                      buf[seal_at:seal_at + 8], seal)
        if got is None:
            raise TimeoutError(f"the writer stopped for {stall} s or took over {limit:.3g} s")
        if got is False:
            raise SealBroken("the extent's seal changed while its body was read")
        return got
    out, done = bytearray(length), 0
    since = start = time.monotonic()
    while done < length:
        p = mem.load(progress_at, ACQUIRE)
        if not done <= p <= length:
            raise ValueError(f"progress word {p} is outside [{done}, {length}]")
        now = time.monotonic()
        if p > done:
            out[done:p] = buf[at + done:at + p]
            done, since = p, now
        elif now - since > stall or now - start > limit:
            raise TimeoutError(f"the writer stopped for {stall} s or took over {limit:.3g} s")
    if seal_at >= 0:
        fence(ACQUIRE)  # the copy's loads before the seal's
        if mem.load(seal_at, RELAXED) != seal:
            raise SealBroken("the extent's seal changed while its body was read")
    return bytes(out)


class FollowedBody:
    """A body ``publish_copy`` writes at ``buf[at:at + length]``, taken a step at a time
    (with ``copy``, into bytes; without, only waited for), so a reader serving others (the
    server's loop) never waits long for one writer."""

    def __init__(self, mem: AtomicMemory, buf: memoryview, progress_at: int, at: int,
                 length: int, copy: bool) -> None:
        self._mem, self._buf, self._progress_at, self._at = mem, buf, progress_at, at
        self.length, self.done = length, 0
        self._native = _native.Follower(length, copy) if _native is not None else None
        self._body: bytearray | None = bytearray(length) if copy and _native is None else None
        self._taken = False

    def step(self, spin: float, budget: float) -> bool:
        """Follow on while progress moves (up to ``spin`` s without it, ``budget`` s in all);
        whether the body is complete. ValueError if the progress word is garbage."""
        at, buf = self._at, self._buf
        if self._native is not None:
            lines = self._mem.lines
            if lines is not None:  # (without coherence: each look and each run invalidated first)
                self.done = self._native.step_flushed(lines, at, self._progress_at, spin, budget)
            else:
                self.done = self._native.step(buf[at:at + self.length],
                                              buf[self._progress_at:self._progress_at + 8], spin, budget)
            return self.done == self.length
        since = start = time.monotonic()
        while self.done < self.length:
            p = self._mem.load(self._progress_at, ACQUIRE)
            if not self.done <= p <= self.length:
                raise ValueError(f"progress word {p} is outside [{self.done}, {self.length}]")
            now = time.monotonic()
            if p > self.done:
                if self._body is not None:
                    self._body[self.done:p] = buf[at + self.done:at + p]
                self.done, since = p, now
            elif now - since > spin or now - start > budget:
                break
        return self.done == self.length

    def take(self) -> bytes | None:
        """The completed copy (once; None when not copying)."""
        if self._native is not None:
            return self._native.take()
        if self.done < self.length or self._taken:
            raise ValueError("FollowedBody.take: the body is not complete, or was taken")
        self._taken = True
        body, self._body = self._body, None
        return None if body is None else bytes(body)


def require_native_flush() -> _Flush:
    """The native write-back/invalidate module, or a clear error when it was not built."""
    if _native is None:
        raise RuntimeError("coherence='flush' needs the native module cxlrpc._flush, which was not "
                           "built (it needs a C compiler at install time: apt-get install gcc, "
                           "then pip install -e . again)")
    return _native


def check_coherence(mode: str) -> str:
    """Validate a coherence mode name."""
    if mode not in COHERENCE_MODES:
        raise ValueError(f"coherence must be one of {COHERENCE_MODES}, got {mode!r}")
    return mode


#: ``fence(order=SEQ_CST)``: a full (by default) memory fence, ordering this thread's loads and
#: stores (the extension's function itself: no Python frame on hot paths).
fence = _atomic.fence

