"""The pool region holding the values, and the views clients read and write it through.

The pool is a cxlrpc region (kind 2): the region header, a version table (one u64 per
``alignment`` bytes of pool), then ``capacity`` bytes of blocks at offsets the metadata server
hands out. The server writes a live block's version into the table entry of its first unit
when it commits it and zero before the block can be reused, so a reader holding a lease that
lapsed learns it (``LeaseExpired``) instead of reading another key's bytes: it checks the
entry after copying (as a seqlock reader does) and whenever it hands out a view. Every offset
a client is given is range-checked here.

While a put is open its block's entry holds a *claim*, ``CLAIMED | ticket_id`` (no version has
that bit set), written by the server at begin: the writer re-reads it before each stretch of its
copy (``Pool.write``) and when it hands out a view of the block, and stops with
``PutFenced`` once the block is no longer its own (the server judged its connection gone,
fenced it, and freed the block: see docs on fencing). A check before a copy is not a lock: a
writer frozen between the two still writes one stretch late.

On memory without coherence (a ``"flush"`` region) a writer writes a block's lines back before
the commit that publishes it (and before an abort, a failed put or a close gives it back
unpublished: ``Pool.given_back``), a reader invalidates them before reading them in place, and
the server writes back each version entry it sets; blocks are whole lines, so no line has two
writers. There kvservice._block does it in C (where it built): a copied value is streamed into
its block (nothing left to write back), a copy out invalidates each chunk right before copying
it, a zero-copy view invalidates the block once before it is first handed out; a version whose
block this mapping invalidated already is read again with the version check alone (_block.c).
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from cxlrpc.errors import Aborted
from cxlrpc.memory import ACQUIRE, HARDWARE, RELEASE, copy_bytes, fence, to_bytes
from cxlrpc.region import HEADER_SIZE, Region, RegionError, parse_url, prefault

if TYPE_CHECKING:
    from kvservice._block import Leaser

_native: ModuleType | None
try:  # the leased Block in C (CXLRPC_NO_NATIVE=1: the reference only)
    from kvservice import _block as _native
except ImportError:  # built by the package where a C compiler exists
    _native = None
if os.environ.get("CXLRPC_NO_NATIVE"):
    _native = None

POOL_KIND = 2
logger = logging.getLogger("kvservice.pool")
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14
_PAGE = 4096
_LINE = 64
#: The bit of a version-table entry that says "claimed by the open put whose ticket id is the
#: rest" (versions and ticket ids stay below 2**63).
CLAIMED = 1 << 63
#: Bytes a writer copies between two checks of its claim (a check: one load, ~1 us in all).
CLAIM_CHECK_EVERY = 4 << 20


def _prefault(region: Region, offset: int, length: int, chunk: int = 256 << 20) -> None:
    """Fault the pool's pages in at start, so a put into a fresh block costs no page faults
    (one per 4 KiB page otherwise: ~400 us per new MiB); a progress line once it takes over
    a second."""
    start = time.monotonic()
    said = False
    for at in range(offset, offset + length, chunk):
        prefault(_mapping(region), at & ~(mmap.PAGESIZE - 1), min(chunk, offset + length - at))
        if time.monotonic() - start > 1.0 and (not said or at + chunk >= offset + length):
            logger.info("kvservice: pool %s pre-faulted %d of %d MiB (%.1f s)", region.url,
                        (min(at + chunk, offset + length) - offset) >> 20, length >> 20,
                        time.monotonic() - start)
            said = True


def _mapping(region: Region) -> mmap.mmap:
    """The region's mapping (an mmap, sim:// too: its cache)."""
    return region._mmap


_madvise = ctypes.CDLL(None, use_errno=True).madvise  # through ctypes: releases the GIL
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_WINDOW = 2 << 20  # a client pre-faults the pool in windows of a huge page
_AHEAD = 4  # windows populated in the background past the one a put writes
#: Bytes of the pool a process's first connection populates in the background: a bounded head
#: start (1 GiB: ~262k faults, ~0.1 s of a background thread here), so the first puts into a
#: fresh pool pay no mapping whatever the pool's size. KVSERVICE_CONNECT_PREFAULT overrides it.
CONNECT_PREFAULT = 1 << 30
_HEAD_STARTED: set[tuple[str, int]] = set()  # the pools (url, epoch) this process gave it


def connect_prefault() -> int:
    """The head start in bytes: KVSERVICE_CONNECT_PREFAULT if set (0 turns it off)."""
    raw = os.environ.get("KVSERVICE_CONNECT_PREFAULT")
    if raw is None:
        return CONNECT_PREFAULT
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(f"KVSERVICE_CONNECT_PREFAULT must be a number of bytes, not {raw!r}") from None


class _Prefaulter:
    """Maps in, in this process, the pool pages a client writes, and only those (each mapping
    faults its own pages: one fault per 4 KiB, ~400 us per fresh MiB, on first touch).

    Before a put writes a block, ``writing`` populates (MADV_POPULATE_WRITE, ~70 us a MiB)
    the block's pages whose windows this process has not populated yet, and queues those
    windows and the next ``_AHEAD`` to a background thread: a fresh pool hands out offsets in
    ascending order, so the next puts find their pages mapped. A process's first connection
    also queues the pool's first ``CONNECT_PREFAULT`` bytes (``ahead``). A
    client that only reads populates nothing: a read fault maps 64 KiB of pages at once
    (fault-around), ~17 faults a MiB, about what a populate of that MiB costs. So what a
    connection costs is bounded, and grows with what it writes, not with the pool. Where the kernel lacks
    MADV_POPULATE_WRITE (before 5.14) pages fault on first touch instead."""

    def __init__(self, address: int, capacity: int) -> None:
        self._address = address  # of the pool's data in this mapping
        self._first = address // _WINDOW
        #: per window (huge-page aligned in the address space): 0 untouched, 1 queued, 2 mapped
        self._state = bytearray((address + capacity - 1) // _WINDOW - self._first + 1)
        self._end = address + capacity
        self._queue: deque[int] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._unsupported = False

    def writing(self, offset: int, size: int) -> None:
        """A put is about to write ``[offset, offset+size)`` of the pool (range-checked)."""
        start = self._address + offset
        first, last = start // _WINDOW - self._first, (start + size - 1) // _WINDOW - self._first
        state = self._state
        ahead = min(last + _AHEAD, len(state) - 1)
        if state[ahead] and all(state[w] == 2 for w in range(first, last + 1)):
            return  # mapped, and the windows ahead queued: the common case
        if self._unsupported:
            return
        if not all(state[w] == 2 for w in range(first, last + 1)):
            page = start & ~(_PAGE - 1)
            if _madvise(page, start + size - page, _POPULATE_WRITE):
                self._unsupported = True  # old kernel (EINVAL): pages fault on first touch
                return
        self._queue_windows(first, ahead)

    def ahead(self, length: int) -> None:
        """Populate the pool's first ``length`` bytes in the background (the windows a fresh
        pool hands out first): a bounded head start at connect, whatever the pool's size."""
        if length > 0:
            self._queue_windows(0, min((self._address + length - 1) // _WINDOW - self._first,
                                       len(self._state) - 1))

    def _queue_windows(self, first: int, last: int) -> None:
        """Queue windows ``first..last`` not yet queued to the background thread (started on
        first use)."""
        state = self._state
        with self._wake:
            if self._stopped:
                return
            for window in range(first, last + 1):
                if not state[window]:
                    state[window] = 1
                    self._queue.append(window)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvservice-pool-prefault",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        """The background thread: populate queued windows until stopped."""
        while True:
            with self._wake:
                while not self._queue and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
                window = self._queue.popleft()
            start = max((self._first + window) * _WINDOW, self._address)
            if _madvise(start, min((self._first + window + 1) * _WINDOW, self._end) - start,
                        _POPULATE_WRITE):
                self._unsupported = True  # pages fault on first touch from now on
                return
            self._state[window] = 2

    def stop(self) -> None:
        """End the background thread (before the pool is unmapped)."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()


class LeaseOwner(Protocol):
    """What took a block's lease (a client) and ends it when the block is done with."""

    def _release(self, lease_id: int, collected: bool = False) -> None: ...


class LeaseExpired(RuntimeError):
    """A block's lease ended and its bytes may belong to another value now: read it again."""


class PutFenced(Aborted):
    """This put's block is no longer its own: the server judged the connection gone, fenced it
    and freed the block; nothing more was written into it. Put the value again."""

    def __init__(self) -> None:
        super().__init__("the server judged this connection gone and freed this put's block; "
                         "nothing more was written into it: put the value again")


def pool_url_for(url: str) -> str:
    """The default pool URL beside a service URL: ``shm://kv`` -> ``shm://kv.pool``. A
    sub-region (``file:///PATH?offset=&size=``) has none: its pool needs a range of its own."""
    parse_url(url)
    if "?" in url:  # only file:// URLs, validated above, take a query
        raise RegionError(f"{url} is a sub-region: pass pool_url= (e.g. the same file or device "
                          f"at another offset)")
    return url + ".pool"


def as_bytes(value: Any) -> memoryview:
    """A value (bytes-like or numpy array) as a flat byte view, without copying when contiguous."""
    if isinstance(value, np.ndarray):
        value = np.ascontiguousarray(value)
    try:
        view = memoryview(value)
    except TypeError as exc:
        raise TypeError(f"value must be bytes-like or a numpy array, not {type(value).__name__}") from exc
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class Pool:
    """A mapped pool region; ``slice(offset, size)`` is a bounds-checked view of a block."""

    def __init__(self, region: Region, capacity: int, alignment: int) -> None:
        if alignment < 8 or alignment & (alignment - 1) or capacity % alignment:
            raise RegionError(f"pool alignment {alignment} must be a power of two >= 8 dividing {capacity}")
        table = self.table_size(capacity, alignment)
        if region.size < HEADER_SIZE + table + capacity:
            raise RegionError(f"pool {region.url} is {region.size} bytes, too small for {capacity}")
        if region.mem.flushing and alignment < _LINE:
            raise RegionError(f"pool alignment {alignment} is below a cache line ({_LINE}): on memory "
                              f"without coherence two blocks would share a line and lose writes")
        self.region = region
        self.capacity = capacity
        self.alignment = alignment
        self._versions = HEADER_SIZE  # the table's offset in the region
        self._mem = region.mem
        self._data_offset = HEADER_SIZE + table
        self.data = region.buf[HEADER_SIZE + table:HEADER_SIZE + table + capacity]
        self._readable = self.data.toreadonly()  # what leased blocks are sliced from
        #: Client: ``leased(offset, size, version, owner, lease_id)``, the Block a lease names
        #: (RegionError for a range outside the pool); any stale cached copy of its lines is
        #: dropped before it is read (memory without coherence). Its release ends the lease
        #: through ``owner``. In C (kvservice._block): once per get.
        self.leased: Callable[[int, int, int, LeaseOwner, int], Block] = self._leased
        #: kvservice._block's Leaser: leases, and in flush mode a put's copy and write-backs
        #: too (None: the reference does them)
        self._leaser: Leaser[Any, LeaseOwner] | None = None  # (Any: to mypy Block is the reference)
        lines = region.mem.lines
        if _native is not None and (not region.mem.flushing or lines is not None):
            self._leaser = _native.Leaser(Block if lines is None else FlushBlock, self._readable, self,
                                          self._leased, capacity, alignment, self._versions,
                                          self._data_offset, lines)
            self.leased = self._leaser.lease
        self._prefaulter: _Prefaulter | None = None  # a client's: see _Prefaulter

    @staticmethod
    def table_size(capacity: int, alignment: int) -> int:
        """Bytes of the version table for a pool (page-rounded)."""
        return -(-(capacity // alignment) * 8 // _PAGE) * _PAGE

    @classmethod
    def create(cls, url: str, capacity: int, alignment: int, mode: int = 0o600,
               stale_after: float = 2.0, coherence: str = HARDWARE) -> "Pool":
        """Create the pool region, or take over one whose owner is gone or closed it."""
        table = cls.table_size(capacity, alignment)
        region = Region.acquire(url, HEADER_SIZE + table + capacity, POOL_KIND, mode, stale_after,
                                coherence)
        try:
            region.mem.zero(HEADER_SIZE, table)  # a taken-over pool keeps its old versions
            pool = cls(region, capacity, alignment)
            pool._advise_huge_pages()
            _prefault(region, HEADER_SIZE + table, capacity)
        except BaseException:  # nothing left behind: a half-made pool is no one's
            region.close()
            region.unlink()
            raise
        region.publish()
        return pool

    @classmethod
    def open(cls, url: str, capacity: int, epoch: int, alignment: int) -> "Pool":
        """Map the pool a server advertised; RegionError unless its epoch matches (not a stale one)."""
        region = Region.open(url, kind=POOL_KIND)
        try:
            if region.epoch != epoch:
                raise RegionError(f"pool {url} has epoch {region.epoch}, the server expects {epoch}")
            pool = cls(region, capacity, alignment)
        except BaseException:
            region.close()
            raise
        pool._advise_huge_pages()
        pool._prefaulter = _Prefaulter(region.mem.address + pool._data_offset, capacity)
        if (url, epoch) not in _HEAD_STARTED:  # once a process: its later mappings start cold
            _HEAD_STARTED.add((url, epoch))
            pool._prefaulter.ahead(connect_prefault())
        return pool

    def _advise_huge_pages(self) -> None:
        """Ask for transparent huge pages over the data (used where the system enables them for
        shared memory: far fewer faults and TLB misses); nothing happens elsewhere."""
        try:
            _mapping(self.region).madvise(mmap.MADV_HUGEPAGE, self._data_offset, self.capacity)
        except (AttributeError, OSError, ValueError):
            pass

    def _entry(self, offset: int) -> int:
        if not 0 <= offset < self.capacity or offset % self.alignment:
            raise RegionError(f"block offset {offset} is not a unit of the pool")
        return self._versions + offset // self.alignment * 8

    def publish(self, offset: int, version: int) -> None:
        """Server: the block at ``offset`` now holds ``version`` (after its bytes were written)."""
        entry = self._entry(offset)
        self._mem.store(entry, version, RELEASE)
        self._mem.writeback(entry, 8)

    def clear(self, offset: int) -> None:
        """Server: the block at ``offset`` is freed (before it can be handed out again)."""
        entry = self._entry(offset)
        self._mem.store(entry, 0, RELEASE)
        self._mem.writeback(entry, 8)

    def claim(self, offset: int, ticket_id: int) -> None:
        """Server: the block at ``offset`` is reserved for the put ``ticket_id`` (before the
        ticket is handed out)."""
        entry = self._entry(offset)
        self._mem.store(entry, CLAIMED | ticket_id, RELEASE)
        self._mem.writeback(entry, 8)

    def claimed(self, offset: int, ticket_id: int) -> bool:
        """Writer: whether the block at ``offset`` is still reserved for its put ``ticket_id``."""
        return self.holds(self._entry(offset), CLAIMED | ticket_id)

    def _leased(self, offset: int, size: int, version: int, owner: LeaseOwner,
                lease_id: int) -> "Block":
        """``leased`` in Python: a pool without coherence's, and what the native one refuses."""
        alignment = self.alignment  # _entry's and slice's checks, inline: once per get
        if offset % alignment or not (0 <= offset and 0 < size and offset + size <= self.capacity):
            self._entry(offset)
            self.slice(offset, size)  # one of them raises
        view = self._readable[offset:offset + size]
        if self._mem.flushing:
            self._mem.invalidate(self._data_offset + offset, size)
        return Block(view, version, owner, lease_id, self, self._versions + offset // alignment * 8)

    def holds(self, entry: int, version: int) -> bool:
        """Client: whether the version table ``entry`` still says ``version``. Call it after
        reading the block: its fence orders those reads before the check."""
        fence()
        mem = self._mem
        try:
            if mem.flushing:
                mem.invalidate(entry, 8)
            held: bool = mem.load(entry, ACQUIRE) == version
            return held
        except ValueError:
            if self.region.closed:  # (a block that outlived its pool: kvservice._block's too)
                raise ValueError(f"the pool {self.region.url} was closed: its blocks can no "
                                 f"longer be read") from None
            raise

    def written(self, offset: int, size: int) -> None:
        """The block's bytes are complete: write its lines back (memory without coherence)
        and fence, before the commit that publishes them."""
        if self._mem.flushing:
            self.slice(offset, size).release()  # range check
            if self._leaser is not None:  # (its store fence is the one the commit needs)
                self._leaser.written(offset, size)
                return
            self._mem.writeback(self._data_offset + offset, size)
        fence()

    def given_back(self, offset: int, size: int) -> None:
        """Writer: the reserved block at ``offset`` goes back unpublished (an abort, a failed
        put, a close); server: a fenced writer's block is freed (its writer died on this host:
        the server's write-back reaches its lines). Without coherence, write back the lines its
        writer may have written, and fence, before the message that frees it: else they land
        later (an eviction, the writer's next invalidate of them) over the block's next value,
        which no check catches."""
        if self._mem.flushing:
            self.slice(offset, size).release()  # range check
            if self._leaser is not None:
                self._leaser.given_back(offset, size)
                return
            self._mem.writeback(self._data_offset + offset, size)
            fence()

    def slice(self, offset: int, size: int) -> memoryview:
        """The ``size`` bytes at ``offset``; RegionError if the range is not inside the pool."""
        if not (0 <= offset and 0 < size and offset + size <= self.capacity):
            raise RegionError(f"block [{offset}, {offset}+{size}) is outside the pool of {self.capacity}")
        return self.data[offset:offset + size]

    def writable(self, offset: int, size: int) -> memoryview:
        """The block at ``offset`` a put is to fill (``slice``), its pages mapped in first
        (a client's pool: see _Prefaulter)."""
        view = self.slice(offset, size)
        if self._prefaulter is not None:
            self._prefaulter.writing(offset, size)
        return view

    def write(self, offset: int, data: memoryview, ticket_id: int | None = None) -> None:
        """Copy ``data`` into the block at ``offset`` and fence, before the commit publishes it
        (a big value with streaming stores: the block is cold, its readers elsewhere).
        ``ticket_id``: a client's put, which checks its claim before each CLAIM_CHECK_EVERY
        bytes and raises PutFenced once the block is not its own."""
        size = len(data)
        dst = self.writable(offset, size)
        if self._mem.flushing and self._leaser is not None:
            dst.release()
            self._stream(offset, data, ticket_id)
            return
        try:
            if ticket_id is None:
                copy_bytes(dst, data, cold=True)
            else:
                for at in range(0, size, CLAIM_CHECK_EVERY):
                    if not self.claimed(offset, ticket_id):
                        raise PutFenced()
                    end = min(at + CLAIM_CHECK_EVERY, size)
                    copy_bytes(dst[at:end], data[at:end], cold=True)
        finally:
            dst.release()
        self.written(offset, size)

    def _stream(self, offset: int, data: memoryview, ticket_id: int | None) -> None:
        """``write`` in flush mode, in C: each stretch streamed into the block (nothing left to
        write back) and a store fence, the claim checked before each as ``write`` does."""
        assert self._leaser is not None
        size = len(data)
        if ticket_id is None:
            self._leaser.write(offset, data)
            return
        for at in range(0, size, CLAIM_CHECK_EVERY):
            if not self.claimed(offset, ticket_id):
                raise PutFenced()
            end = min(at + CLAIM_CHECK_EVERY, size)
            self._leaser.write(offset + at, data[at:end])

    def close(self) -> None:
        """Unmap (a view a user still holds keeps the mapping alive until it is dropped)."""
        if self._prefaulter is not None:
            self._prefaulter.stop()
        self._readable.release()
        self.data.release()
        self.region.close()

    def retire(self) -> None:
        """Owner only: mark the pool closed (a file pool is taken at once by the next server)
        and unlink it (shm)."""
        self.region.mark_closed()
        self.region.unlink()


class _Copies:
    """A Block's arrays and copies, made through its ``view()``/``check()`` (both kinds)."""

    __slots__ = ()

    if TYPE_CHECKING:  # what both kinds of block have
        size: int

        def view(self) -> memoryview: ...
        def check(self) -> None: ...
        def _tracked_view(self) -> memoryview: ...

    def array(self, dtype: Any = np.uint8, shape: Any = None) -> npt.NDArray[Any]:
        """The value as a read-only numpy array (no copy), optionally reshaped."""
        arr = np.frombuffer(self._tracked_view(), dtype=dtype)
        return arr if shape is None else arr.reshape(shape)

    def tobytes(self) -> bytes:
        """A copy of the value (checked after the copy)."""
        data = to_bytes(self.view())
        self.check()
        return data

    def copy_into(self, out: Any) -> int:
        """Copy the value into the writable buffer ``out`` (checked after the copy); its size."""
        dst = memoryview(out).cast("B")
        if len(dst) < self.size:
            raise ValueError(f"buffer of {len(dst)} bytes is too small for {self.size}")
        copy_bytes(dst, self.view())
        self.check()
        return self.size


class ReferenceBlock(_Copies):
    """Block in Python: the reference for kvservice._block.Block, and Block's base where that
    did not build."""

    __slots__ = ("_view", "_views", "size", "version", "_owner", "_lease_id", "_pool", "_entry")

    def __init__(self, view: memoryview, version: int = 0, owner: LeaseOwner | None = None,
                 lease_id: int = 0, pool: Pool | None = None, entry: int = 0) -> None:
        """``view``: the value (made read-only here); ``owner._release(lease_id, collected)``
        ends the lease on ``release`` (collected False) or when a block nobody released is
        garbage-collected (True: it may run inside any allocation); ``pool.holds(entry,
        version)`` tells whether the pool still holds this value (a block without a pool
        always does)."""
        self._view: memoryview | None = view if view.readonly else view.toreadonly()
        self._views: list[memoryview] | None = None  # the array()s' views, made on demand
        self.size = len(view)
        self.version = version
        self._owner = owner
        self._lease_id = lease_id
        self._pool = pool
        self._entry = entry

    @property
    def released(self) -> bool:
        return self._view is None

    def check(self) -> None:
        """Raise LeaseExpired if the block no longer holds this value."""
        pool = self._pool
        if pool is not None and not pool.holds(self._entry, self.version):
            raise LeaseExpired(f"the lease on this block (version {self.version}) ended and "
                               f"the pool reused its bytes")

    def view(self) -> memoryview:
        """A read-only memoryview of the value (into the pool: no copy)."""
        if self._view is None:
            raise ValueError("block already released")
        self.check()
        return self._view

    def _tracked_view(self) -> memoryview:
        """A view of its own, released with the block (what array() wraps)."""
        view = self.view()[:]
        if self._views is None:
            self._views = []
        self._views.append(view)
        return view

    def release(self) -> None:
        """End the lease (idempotent) and release the views into the pool."""
        view, views = self._view, self._views
        if view is None:
            return
        self._view = self._views = None
        for view in (view, *views) if views is not None else (view,):
            try:
                view.release()
            except BufferError:
                pass  # an array still exports it; see Block's docstring
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._release(self._lease_id, False)

    def __del__(self) -> None:
        # collected unreleased (__del__, not weakref.finalize: 0.2 against 1.7 us a block)
        owner = getattr(self, "_owner", None)
        if owner is not None:
            self._owner = None
            try:
                owner._release(self._lease_id, True)
            except Exception:  # at interpreter exit the client may be half torn down
                pass

    def __enter__(self) -> "ReferenceBlock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __len__(self) -> int:
        return self.size


if TYPE_CHECKING:  # kvservice._block's Block has ReferenceBlock's interface
    _BlockBase = ReferenceBlock
else:
    _BlockBase = _native.Block if _native is not None else ReferenceBlock


class Block(_BlockBase, _Copies):
    """A leased value read in place: ``view()`` / ``array()``; use ``with`` to end the lease.

    ``Block(view, version=0, owner=None, lease_id=0, pool=None, entry=0)``: see
    ``ReferenceBlock``, whose behaviour kvservice._block's base has (in C: a get makes and
    ends one per call).

    ``view()``, ``array()`` and the copies (``tobytes``, ``copy_into``) raise
    ``LeaseExpired`` once the lease lapsed and the pool reused the block; the copies check
    after copying, so a copy they return is never torn. A view already handed out cannot be
    revoked: call ``check`` after reading through it. After ``release`` every view
    handed out is released (using one raises ValueError); an array from ``array`` cannot
    be revoked and must not be read after the block ends.
    """

    __slots__ = ()


class FlushBlock(Block):
    """The Block a pool without coherence leases where kvservice._block built (its flush
    mode): its copies invalidate each chunk right before copying it, in C."""

    __slots__ = ()
    if not TYPE_CHECKING and _native is not None:
        copy_into = _native.Block._copy_into_lines
        tobytes = _native.Block._tobytes_lines


class PendingPut:
    """A reserved, still invisible block: fill ``view()``/``array()`` in place, then commit."""

    def __init__(self, view: memoryview, commit: Callable[[], Any], abort: Callable[[], Any],
                 written: Callable[[], None] = fence,
                 claimed: Callable[[], bool] = lambda: True,
                 pending: "set[PendingPut] | None" = None,
                 given_back: Callable[[], None] | None = None) -> None:
        self._view = view
        self.size = len(view)
        self._commit = commit
        self._abort = abort
        #: writes the bytes back and fences (Pool.written): before the commit that publishes them
        self._written = written
        #: the same before an abort or a close frees the block (Pool.given_back says why)
        self._given_back = written if given_back is None else given_back
        self._claimed = claimed  # whether the block is still this put's (Pool.claimed)
        #: the client's puts still pending, which its close gives back (memory without
        #: coherence only: None where nothing is to be written back)
        self._pending = pending
        if pending is not None:
            pending.add(self)

    def view(self) -> memoryview:
        """The writable block (into the pool); PutFenced if it is no longer this put's. Writes
        through a view handed out earlier are not checked: get a view per stretch you write."""
        if not self._claimed():
            raise PutFenced()
        return self._view

    def array(self, dtype: Any = np.uint8, shape: Any = None) -> npt.NDArray[Any]:
        """The block as a writable numpy array, optionally reshaped (checked as ``view``)."""
        arr = np.frombuffer(self.view(), dtype=dtype)
        return arr if shape is None else arr.reshape(shape)

    def commit(self) -> Any:
        """Publish the value (a coroutine on the asyncio client); the view is released."""
        self._end()
        self._written()
        return self._commit()

    def abort(self) -> Any:
        """Drop the reservation (a coroutine on the asyncio client); the view is released,
        and what was written through it written back first (Pool.given_back)."""
        self._end()
        self._given_back()
        return self._abort()

    def _abandon(self) -> None:
        """The client closes with this put pending (the server frees its block as it departs):
        write back what was written (Pool.given_back) and release the view."""
        self._end()
        self._given_back()

    def _end(self) -> None:
        if self._pending is not None:
            self._pending.discard(self)
        try:
            self._view.release()
        except BufferError:
            pass  # an array from array() still exports it
