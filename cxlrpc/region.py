"""Named shared regions: ``shm://NAME`` (POSIX shared memory), ``file:///PATH`` (any
mmap-able file, e.g. a DAX device, a PCI BAR's sysfs resource, a file on a DAX mount) and
``sim://NAME`` (shared memory seen through a per-process cache simulator: memory without
coherence, for tests; see ``cxlrpc.simulator``).  ``file:///PATH?offset=N&size=M`` is
a sub-region: one range of an existing file or device, so one device holds several regions.

Every region starts with a fixed header (magic, layout version, size, creation epoch, kind,
owner hints, the owner's host identity, heartbeat and open/closed state) validated on open.
The magic is stored last, with release ordering, so a half-initialised region is never
mistaken for a live one.  Taking a region (new, zeroed, or left by a dead or closed owner)
is decided by one CAS on the epoch word, so of several racing creators exactly one wins,
on any host that maps the region.  A shared-memory segment is not reused but replaced: its
winner's CAS writes a tombstone (the segment is retired), then the winner unlinks the name and
creates a new segment under it; a retired segment is never claimed or unlinked again.
"""
from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import select
import socket
import stat
import threading
import time
from dataclasses import dataclass

import posix_ipc

from .identity import host_identity
from .memory import ACQ_REL, ACQUIRE, FLUSH, HARDWARE, RELAXED, RELEASE, AtomicMemory, check_coherence
from .memory import _native as _native_flush
from .owned import OwnedWords
from .simulator import CacheSim, remove_side_files
from .size_guard import SizeGuard

MAGIC = int.from_bytes(b"CXLRPC\x00\x01", "little")
#: 3: a server's control block carries a checksum of its geometry (cxlrpc.channel)
LAYOUT_VERSION = 3
HEADER_SIZE = 4096
SHM_PREFIX = "cxlrpc."

# Header fields (byte offsets). Published words are 8-byte aligned and written atomically.
_MAGIC, _VERSION, _SIZE, _EPOCH, _KIND, _PID, _CREATED_NS, _IDENTITY = 0, 8, 16, 24, 32, 40, 48, 56
_HOST, _HOST_LEN = 64, 64
HEARTBEAT_OFFSET = 128  # owner's heartbeat counter, its own cache lines
_OWNER_STATE = 256      # OWNER_LIVE while the owner serves, OWNER_CLOSED after a clean close
_COHERENCE = 264        # how openers must treat the memory: _CODES below
OWNER_LIVE, OWNER_CLOSED = 1, 2
#: The header words an owner keeps true (Region.republish): all but the epoch and the heartbeat
_OWNED_WORDS = (_VERSION, _SIZE, _KIND, _PID, _CREATED_NS, _IDENTITY, _OWNER_STATE, _COHERENCE)
# Epoch word values: 0 never claimed; 1 .. 2**63-1 a claim (live, dead or being created);
# _RETIRED | PID the tombstone of a shm/sim segment the process PID won in order to replace
# it (it unlinks the name next, then creates a new segment there). No claim has the top bit,
# so a tombstone is never an owner's epoch. Files and devices are taken over in place and never
# retired: there the top bit means nothing (a garbage word on a device that was never ours).
_RETIRED = 1 << 63
_EPOCH_MASK = _RETIRED - 1
_TAKEOVER_TRIES = 50     # rounds of acquire while the name holds a retired or no segment
_TAKEOVER_PAUSE = 0.02   # seconds between those rounds: a replacer unlinks within microseconds
_CODES = {HARDWARE: 1, FLUSH: 2}
_MODES = {code: mode for mode, code in _CODES.items()}

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_AMOUNT_RE = re.compile(r"([0-9]{1,20})([KMGT]?)")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
DAX_ALIGNMENT = 2 << 20  # device DAX's default, where sysfs does not say
_SYSFS_CHAR = "/sys/dev/char"  # a character device's attributes: <root>/MAJOR:MINOR/<name>


class RegionError(ValueError):
    """A region is missing, of another layout, too small, or otherwise unusable."""


class UninitializedRegion(RegionError):
    """The segment exists but holds no valid header (creator died early, or not ours)."""


@dataclass(frozen=True)
class RegionInfo:
    """What a region's header says about it (for listing and stale-owner checks)."""

    url: str
    size: int
    epoch: int
    kind: int
    owner_pid: int
    owner_host: str
    owner_identity: int
    closed: bool
    coherence: str
    created: float
    heartbeat: int


def parse_url(url: str) -> tuple[str, str]:
    """Split a region URL into ("shm", segment name) or ("file", path), validating it.

    ``file:///PATH?offset=N&size=M`` is a sub-region: bytes ``[N, N+M)`` of an existing file
    or device (see ``_subrange``); its path is returned without the query.
    """
    if url.startswith(("shm://", "sim://")) and "?" in url:
        raise RegionError(f"{url!r}: only file:// URLs take ?offset=&size= (a sub-region of a "
                          f"file or device); a shared-memory segment is a region of its own")
    if url.startswith("shm://"):
        name = url[len("shm://"):]
        if not _NAME_RE.match(name):
            raise RegionError(f"bad shm region name {name!r}: use 1-200 of [A-Za-z0-9._-]")
        return "shm", "/" + SHM_PREFIX + name
    if url.startswith("file://"):
        path = url[len("file://"):].partition("?")[0]
        if not path.startswith("/"):
            raise RegionError(f"file:// URLs need an absolute path, got {url!r}")
        _subrange(url)  # validates the query
        return "file", path
    if url.startswith("sim://"):
        name = url[len("sim://"):]
        if not _NAME_RE.match(name):
            raise RegionError(f"bad sim region name {name!r}: use 1-200 of [A-Za-z0-9._-]")
        return "sim", "/" + SHM_PREFIX + "sim." + name
    raise RegionError(f"unsupported region URL {url!r}: expected shm://NAME, file:///PATH or sim://NAME")


def _subrange(url: str) -> tuple[int, int | None] | None:
    """A sub-region URL's ``(offset, size)`` (size None: to the end of the file), or None
    for a URL without a query.  Amounts are decimal byte counts, optionally with a binary
    unit (``2M`` is 2 MiB); the keys are ``offset`` (default 0) and ``size``."""
    _, sep, query = url.partition("?")
    if not sep:
        return None
    values: dict[str, int] = {}
    for item in query.split("&"):
        key, eq, text = item.partition("=")
        if key not in ("offset", "size") or not eq:
            raise RegionError(f"bad query item {item!r} in {url!r}: a sub-region takes "
                              f"offset=N and size=M")
        if key in values:
            raise RegionError(f"{key}= given twice in {url!r}")
        amount = _AMOUNT_RE.fullmatch(text)
        if amount is None:
            raise RegionError(f"bad {key}={text!r} in {url!r}: expected a byte count, decimal, "
                              f"optionally with a unit K, M, G or T (KiB, MiB, GiB, TiB)")
        values[key] = int(amount[1]) * _UNITS[amount[2]]
        if values[key] >= 1 << 63:
            raise RegionError(f"{key}={text} in {url!r} is beyond any file (2**63 bytes)")
    if values.get("size") == 0:
        raise RegionError(f"size=0 in {url!r}: a sub-region needs at least a header")
    return values.get("offset", 0), values.get("size")


def overlapping(a: str, b: str) -> bool:
    """Do the region URLs ``a`` and ``b`` name overlapping bytes (of one segment, file or
    device; a whole-file URL spans all of it)? Sub-regions of one device must not overlap:
    nothing in the memory could tell one region's header from another's ring."""
    (backend_a, path_a), (backend_b, path_b) = parse_url(a), parse_url(b)
    if backend_a != backend_b or os.path.realpath(path_a) != os.path.realpath(path_b):
        return False
    spans = []
    for url in (a, b):
        offset, size = _subrange(url) or (0, None)
        spans.append((offset, float("inf") if size is None else offset + size))
    (start_a, end_a), (start_b, end_b) = spans
    return start_a < end_b and start_b < end_a


class Region:
    """A mapped shared region: ``buf`` is the whole mapping, ``mem`` its atomic accessor."""

    def __init__(self, url: str, backend: str, path: str, mapping: mmap.mmap | CacheSim,
                 size: int, fd: int = -1) -> None:
        self.url = url
        #: notices the region's file cut short under the mapping (it owns ``fd``)
        self.size_guard = SizeGuard(fd, (_subrange(url) or (0, None))[0] + size, url)
        self.backend = backend
        self.path = path
        self._sim = mapping if isinstance(mapping, CacheSim) else None
        self._mmap = mapping.cache if isinstance(mapping, CacheSim) else mapping
        self.size = size
        self.buf = memoryview(self._mmap)
        self.mem = AtomicMemory(self._mmap)
        if self._sim is not None:
            self.mem.use_flushes(self._sim.writeback, self._sim.invalidate)
        self.heartbeat = self.mem.counter(HEARTBEAT_OFFSET)
        self.epoch = self.mem.load(_EPOCH, ACQUIRE)
        self.kind = self.mem.load(_KIND, ACQUIRE)
        self.coherence = _MODES.get(self.mem.load(_COHERENCE, ACQUIRE), HARDWARE)
        if self._sim is None and self.coherence == FLUSH:
            self.mem.use_flushes()  # the CPU's write-back/invalidate instructions
            self.mem.invalidate(0, size)  # lines cached from an earlier mapping are stale
        self._owner = PidWatch()
        self.closed = False
        #: Owner only: the header words it wrote, which ``republish`` keeps true.
        self._owned: OwnedWords | None = None

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(cls, url: str, size: int, kind: int, mode: int = 0o600,
               coherence: str = HARDWARE) -> "Region":
        """Create a new region (owner-only by default); FileExistsError if the name is taken.

        ``coherence`` is stored in the header so every opener treats the memory alike:
        ``"hardware"`` (one host, or coherent CXL) or ``"flush"`` (no cross-host coherence:
        published lines are written back and read lines invalidated). ``sim://`` regions are
        always ``"flush"``. The caller fills its layout, then calls ``publish``.

        A sub-region (``file:///PATH?offset=&size=``) always exists and keeps its size (at
        least ``size``; ``mode`` is unused): it is created only if it was never claimed (its
        epoch word is zero, as on a zeroed device); ``acquire`` takes over a used one.
        """
        backend, path = parse_url(url)
        size = _check_size(size)
        coherence = FLUSH if backend == "sim" else check_coherence(coherence)
        mapping: mmap.mmap | CacheSim
        if backend in ("shm", "sim"):
            try:
                shm = posix_ipc.SharedMemory(path, posix_ipc.O_CREX, mode=mode, size=size)
            except posix_ipc.ExistentialError as exc:
                raise FileExistsError(f"region {url} already exists") from exc
            try:
                _reserve(shm.fd, size, url, "/dev/shm")
                mapping = mmap.mmap(shm.fd, size)
                fd = os.dup(shm.fd)
            except BaseException:
                unlink_shm(path)
                raise
            finally:
                shm.close_fd()
        elif _subrange(url) is not None:
            mapping, actual, fd = _map_existing(url, backend, path)
            _check_fits(url, mapping, actual, size, fd)
            try:
                return cls._claim(url, backend, path, mapping, kind, observed_epoch=0,
                                  coherence=coherence, fd=fd)
            except FileExistsError as exc:
                raise FileExistsError(f"sub-region {url} already holds a region (or another "
                                      f"process claimed it first); Region.acquire takes over "
                                      f"one nobody serves") from exc
        else:
            mapping, fd = _map_new_file(path, size, mode)
        if backend == "sim":
            mapping = CacheSim(mapping, path=path)
        return cls._claim(url, backend, path, mapping, kind, observed_epoch=0, coherence=coherence,
                          fd=fd)

    @classmethod
    def acquire(cls, url: str, size: int, kind: int, mode: int = 0o600,
                stale_after: float = 2.0, coherence: str = HARDWARE) -> "Region":
        """Create the region, or take over an existing one nobody serves any more.

        An existing region is taken when it was closed cleanly, when its owner is a dead
        process of this host, when a remote owner's heartbeat stood still for
        ``stale_after`` seconds, or when it was never initialised (a zeroed device).  Of
        several processes racing for it exactly one wins; the others get FileExistsError.
        An existing file keeps its size (a device or BAR cannot be resized): it must hold
        ``size`` bytes.  So does a sub-region (``file:///PATH?offset=&size=``), which always
        exists: its range of the file is the region, its header at ``offset``.

        A shared-memory segment is replaced, not reused: the winner retires the old one (a
        tombstone in its epoch word), unlinks the name and creates a new segment there.  One
        that finds a retired segment (a winner is replacing it) or none looks again, a bounded
        number of times: the winner's new segment is then in use, or free if the winner died.
        """
        backend, path = parse_url(url)
        size = _check_size(size)
        retired: _Retired | None = None
        for attempt in range(_TAKEOVER_TRIES):
            if attempt:
                time.sleep(_TAKEOVER_PAUSE)
            try:
                return cls.create(url, size, kind, mode, coherence)
            except FileExistsError:
                pass
            if backend == "file":
                return cls._take_over_in_place(url, path, size, kind, stale_after, coherence)
            try:
                mapping, _, fd = _map_existing(url, backend, path)
                os.close(fd)
            except FileNotFoundError:
                retired = None  # a winner unlinked the old segment, its own not yet created
                continue
            try:
                _retire(url, mapping, stale_after)
            except _Retired as exc:
                retired = exc  # never claimed or unlinked: the name is, or will be, its winner's
                continue
            finally:
                mapping.close()
            unlink_shm(path)  # only the process that retired the old segment removes its name
            return cls.create(url, size, kind, mode, coherence)
        if retired is None:
            raise FileExistsError(f"region {url} existed but was gone when mapped, "
                                  f"{_TAKEOVER_TRIES} times: other processes keep replacing it")
        raise FileExistsError(
            f"region {url} still holds a segment retired by process {retired.pid} after "
            f"{_TAKEOVER_TRIES} tries: that process was to replace it; if it died first, remove "
            f"the segment with `python -m cxlrpc clean`") from retired

    @classmethod
    def _take_over_in_place(cls, url: str, path: str, size: int, kind: int, stale_after: float,
                            coherence: str) -> "Region":
        """Take over an existing file or device region nobody serves, in place (it is never
        unlinked or resized); FileExistsError if it is in use."""
        mapping, actual, fd = _map_existing(url, "file", path)
        try:
            epoch = _takeover_epoch(url, mapping, stale_after)
        except BaseException:
            mapping.close()
            os.close(fd)
            raise
        _check_fits(url, mapping, actual, size, fd)
        return cls._claim(url, "file", path, mapping, kind, epoch, coherence=coherence, fd=fd)

    @classmethod
    def _claim(cls, url: str, backend: str, path: str, mapping: mmap.mmap | CacheSim, kind: int,
               observed_epoch: int, coherence: str = HARDWARE, fd: int = -1) -> "Region":
        """Win the region by a CAS of its epoch word from ``observed_epoch``, then initialise it
        (``fd``, the file's, is the region's from here)."""
        raw = mapping.cache if isinstance(mapping, CacheSim) else mapping
        try:
            if _cas_epoch(mapping, observed_epoch, _new_epoch()) != observed_epoch:
                raise FileExistsError(f"region {url} was taken over by another process first")
        except BaseException:
            mapping.close()
            if fd >= 0:
                os.close(fd)
            raise
        region = cls(url, backend, path, mapping, len(raw), fd)
        region._init_header(kind, coherence)
        return region

    def _init_header(self, kind: int, coherence: str) -> None:
        mem = self.mem
        self.buf[_VERSION:_EPOCH] = bytes(_EPOCH - _VERSION)
        self.buf[_EPOCH + 8:HEADER_SIZE] = bytes(HEADER_SIZE - _EPOCH - 8)
        mem.store(_VERSION, LAYOUT_VERSION, RELAXED)
        mem.store(_SIZE, self.size, RELAXED)
        mem.store(_KIND, kind, RELAXED)
        mem.store(_PID, os.getpid(), RELAXED)
        mem.store(_CREATED_NS, time.time_ns(), RELAXED)
        mem.store(_IDENTITY, host_identity(), RELAXED)
        mem.store(_OWNER_STATE, OWNER_LIVE, RELEASE)
        mem.store(_COHERENCE, _CODES[coherence], RELEASE)
        host = socket.gethostname().encode()[:_HOST_LEN]
        self.buf[_HOST:_HOST + len(host)] = host
        self._owned = OwnedWords(mem, ((at, mem.load(at, RELAXED)) for at in _OWNED_WORDS))
        self.kind = kind
        if coherence == FLUSH and not mem.flushing:
            mem.use_flushes()
        self.coherence = coherence

    def publish(self) -> None:
        """Make the region visible to openers: the magic is the last word written (after
        everything before it is written back, on memory without coherence)."""
        self.mem.writeback(0, self.size)
        self.mem.store(_MAGIC, MAGIC, RELEASE)
        self.mem.writeback(_MAGIC, 8)
        if self._owned is not None:
            self._owned.expect(_MAGIC, MAGIC)

    def mark_closed(self) -> None:
        """Owner only: record a clean close, so the next server takes the region at once."""
        self.mem.store(_OWNER_STATE, OWNER_CLOSED, RELEASE)
        self.mem.writeback(_OWNER_STATE, 8)
        if self._owned is not None:
            self._owned.expect(_OWNER_STATE, OWNER_CLOSED)

    def republish(self) -> int:
        """Owner only: put back header words a stray write changed (owner state, PID, identity,
        magic, layout words); how many were wrong.  Not the epoch word, by which servers take
        a region over: while it is not ours, nothing is written (the region is another's)."""
        if self._owned is None or not self.still_ours():
            return 0
        return self._owned.restore()

    def still_ours(self) -> bool:
        """Does the epoch word still hold the epoch this mapping was opened (or won) with?"""
        if self.closed:
            return False
        self.mem.invalidate(_EPOCH, 8)
        return self.mem.load(_EPOCH, ACQUIRE) == self.epoch

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, url: str, kind: int | None = None) -> "Region":
        """Map an existing region and validate its header; ``RegionError`` if unusable."""
        backend, path = parse_url(url)
        mapping: mmap.mmap | CacheSim
        mapping, actual, fd = _map_existing(url, backend, path)
        try:
            if backend == "sim":
                mapping = CacheSim(mapping, path=path)  # a cold cache: a fresh copy of the memory
                _validate_header(url, mapping.cache, actual, kind)
            else:
                if _native_flush is not None:  # the header may be another host's, uncached
                    with AtomicMemory(mapping) as mem:
                        _native_flush.invalidate(mem._view.address, HEADER_SIZE)
                _validate_header(url, mapping, actual, kind)
        except BaseException:
            mapping.close()
            os.close(fd)
            raise
        return cls(url, backend, path, mapping, actual, fd)

    # ------------------------------------------------------------------ lifetime
    def info(self) -> RegionInfo:
        self.mem.invalidate(0, _COHERENCE + 8)  # the owner may be another host: fresh lines
        return _info(self.url, self.mem, self.buf)

    def beat(self) -> None:
        """Owner only: advance the heartbeat (written back, for peers without coherence)."""
        self.heartbeat.fetch_add(1, ACQ_REL)
        self.mem.writeback(HEARTBEAT_OFFSET, 8)

    def heartbeat_value(self) -> int:
        """The owner's heartbeat as memory holds it now."""
        self.mem.invalidate(HEARTBEAT_OFFSET, 8)
        return self.heartbeat.load(ACQUIRE)

    def owner_alive_locally(self) -> bool | None:
        """Host-local accelerator: is the owner PID alive? None when it is another host's
        (identity differs) and only its heartbeat can tell.  Cheap enough for a watcher that
        asks ten times a second: three header words and a pidfd poll."""
        mem = self.mem
        mem.invalidate(0, _COHERENCE + 8)  # the owner may be another host: fresh lines
        if mem.load(_OWNER_STATE, ACQUIRE) == OWNER_CLOSED:
            return False
        if mem.load(_IDENTITY, ACQUIRE) != host_identity():
            return None
        return self._owner.alive(mem.load(_PID, ACQUIRE))

    def owner_alive(self, window: float) -> bool:
        """Closed cleanly: no. Same host: is the owner's PID alive? Another host's owner:
        does its heartbeat move within ``window`` seconds (polled every 10 ms)?"""
        local = self.owner_alive_locally()
        if local is not None:
            return local
        return _heartbeat_moves(self.mem, window)

    def close(self) -> None:
        """Unmap. Views still exported (zero-copy readers) keep the mapping until released."""
        if self.closed:
            return
        self.closed = True
        self._owner.close()
        self.size_guard.close()
        self.mem.close()
        self.buf.release()
        try:
            if self._sim is not None:
                self._sim.close()
            else:
                self._mmap.close()
        except BufferError:
            pass  # a caller still holds a view into the region; the GC unmaps it later

    def unlink(self) -> None:
        """Remove the shm segment's name (mappings stay valid). File regions are kept."""
        if self.backend in ("shm", "sim"):
            unlink_shm(self.path)

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def unlink_shm(path: str) -> bool:
    """Unlink a POSIX shm segment by name (a simulated region's side files with it, see
    cxlrpc.simulator's LIMBO); False if it was already gone."""
    if path.startswith("/" + SHM_PREFIX + "sim."):
        remove_side_files(path)
    try:
        posix_ipc.unlink_shared_memory(path)
        return True
    except posix_ipc.ExistentialError:
        return False


def in_use(url: str, window: float) -> str | None:
    """Why the region at ``url`` is still in use (a live owner, a creator still working, or a
    live process replacing its shm segment), or None when a new owner may take it (or
    ``clean`` remove it).  Raises RegionError for another layout."""
    backend, path = parse_url(url)
    mapping, _, fd = _map_existing(url, backend, path)
    os.close(fd)
    try:
        with _header_memory(mapping) as mem:
            mem.invalidate(0, _COHERENCE + 8)  # the owner may be a host without coherence
            if backend != "file":
                retirer = _retirer(mem.load(_EPOCH, ACQUIRE))
                if retirer is not None:  # a hint: another PID namespace's PID names nothing here
                    return f"being replaced by process {retirer}" if pid_alive(retirer) else None
            with memoryview(mapping) as view:  # released even when it raises (another layout)
                return _busy_reason(url, mem, view, window)
    finally:
        mapping.close()


_PID_LIMIT = 1 << 31  # pid_t is an int: larger "PIDs" read from a region are garbage


def pid_alive(pid: int) -> bool:
    """Is a process of this host running (a zombie, killed but not reaped, counts as dead)?"""
    if not 0 < pid < _PID_LIMIT:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


#: Most pidfds one process holds for PidWatch; past it, checks read /proc (a server with many
#: local clients must not use up the descriptors its user needs).
PIDFD_BUDGET = 128
_pidfds_open = 0
_pidfd_lock = threading.Lock()


class PidWatch:
    """Liveness of one host-local PID at a time through a pidfd: opened once per PID, then each
    check is a zero-timeout poll (~1 us) instead of ``pid_alive``'s kill and /proc read
    (~35 us), which housekeeping would repeat ten times a second for every slot.  The pidfd
    also pins the process: a PID reused after its holder died reads as dead, not alive.
    Without pidfds (old kernel, sandbox, budget spent) it falls back to ``pid_alive``."""

    __slots__ = ("_pid", "_fd", "_poll", "_lock")

    def __init__(self) -> None:
        self._pid = 0
        self._fd = -1  # -1: no pidfd (ask pid_alive); -2: the PID was gone when we looked
        self._poll = select.poll()
        self._lock = threading.Lock()

    def alive(self, pid: int) -> bool:
        """Is ``pid`` (a process of this host) running?  A zombie counts as dead."""
        if not 0 < pid < _PID_LIMIT:
            return False
        with self._lock:
            if pid != self._pid:
                self._close()
                self._pid = pid
                self._fd = _open_pidfd(pid)
                if self._fd >= 0:
                    self._poll.register(self._fd, select.POLLIN)
            fd = self._fd
            if fd >= 0:
                return not self._poll.poll(0)  # readable once the process has exited
        return fd == -1 and pid_alive(pid)

    def dead(self, pid: int) -> bool:
        """A PID hint read from a region names a process of this host that is gone (a hint
        that is no PID at all, such as 0 for "not written", proves nothing: False)."""
        return 0 < pid < _PID_LIMIT and not self.alive(pid)

    def pinned(self, pid: int) -> bool:
        """Does a pidfd hold ``pid`` (opened by an earlier check): is its exit, never a reuse of
        its number by another process, what ``alive`` reports?"""
        return pid == self._pid and self._fd >= 0

    def close(self) -> None:
        """Drop the pidfd (the slot was freed, or its watcher ends)."""
        if self._pid or self._fd >= 0:
            with self._lock:
                self._close()
                self._pid = 0

    def __del__(self) -> None:
        if self._fd >= 0:
            self.close()

    def _close(self) -> None:
        global _pidfds_open
        if self._fd >= 0:
            self._poll.unregister(self._fd)
            os.close(self._fd)
            with _pidfd_lock:
                _pidfds_open -= 1
        self._fd = -1


def _open_pidfd(pid: int) -> int:
    """A pidfd for ``pid``; -2 when there is no such process; -1 when none can be had."""
    global _pidfds_open
    with _pidfd_lock:
        if _pidfds_open >= PIDFD_BUDGET or not hasattr(os, "pidfd_open"):
            return -1
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return -2
        except OSError:  # ENOSYS, EPERM under seccomp, EMFILE
            return -1
        _pidfds_open += 1
    return fd  # close-on-exec, as every pidfd


def _check_size(size: int) -> int:
    if size < HEADER_SIZE * 2:
        raise RegionError(f"region size {size} is below the minimum {HEADER_SIZE * 2}")
    return (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE


def _info(url: str, mem: AtomicMemory, buf: memoryview) -> RegionInfo:
    host = bytes(buf[_HOST:_HOST + _HOST_LEN]).rstrip(b"\0").decode(errors="replace")
    return RegionInfo(
        url=url, size=mem.load(_SIZE, ACQUIRE), epoch=mem.load(_EPOCH, ACQUIRE),
        kind=mem.load(_KIND, ACQUIRE), owner_pid=mem.load(_PID, ACQUIRE), owner_host=host,
        owner_identity=mem.load(_IDENTITY, ACQUIRE),
        closed=mem.load(_OWNER_STATE, ACQUIRE) == OWNER_CLOSED,
        coherence=_MODES.get(mem.load(_COHERENCE, ACQUIRE), HARDWARE),
        created=mem.load(_CREATED_NS, ACQUIRE) / 1e9, heartbeat=mem.load(HEARTBEAT_OFFSET, ACQUIRE),
    )


def _owner_alive_locally(info: RegionInfo) -> bool | None:
    """Closed cleanly: dead. The owner's identity is ours: is its PID alive? Otherwise None
    (another host's owner: only its heartbeat can tell)."""
    if info.closed:
        return False
    if info.owner_identity != host_identity():
        return None
    return pid_alive(info.owner_pid)


def _heartbeat_moves(mem: AtomicMemory, window: float, also: int | None = None) -> bool:
    """Does the owner's heartbeat (or the word at ``also``) change within ``window`` s?"""
    mem.invalidate(0, HEADER_SIZE)
    first = mem.load(HEARTBEAT_OFFSET, ACQUIRE)
    other = mem.load(also, ACQUIRE) if also is not None else None
    deadline = time.monotonic() + window
    while True:
        mem.invalidate(0, HEADER_SIZE)
        if mem.load(HEARTBEAT_OFFSET, ACQUIRE) != first:
            return True
        if also is not None and mem.load(also, ACQUIRE) != other:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def _busy_reason(url: str, mem: AtomicMemory, buf: memoryview, window: float) -> str | None:
    if mem.load(_MAGIC, ACQUIRE) == MAGIC:
        version = mem.load(_VERSION, ACQUIRE)
        if version != LAYOUT_VERSION:
            raise RegionError(f"{url} has layout version {version}; this build reads {LAYOUT_VERSION}")
        info = _info(url, mem, buf)
        local = _owner_alive_locally(info)
        if local is not None:
            return f"in use by live process {info.owner_pid}" if local else None
        if _heartbeat_moves(mem, window):
            return f"in use by a live server on another host ({info.owner_host})"
        return None
    if mem.load(_EPOCH, ACQUIRE) == 0:
        return None  # never claimed: a zeroed device or a creator that died at once
    if _heartbeat_moves(mem, window, also=_EPOCH):
        return "being created by another process"
    return None  # its creator stopped before publishing it


class _Retired(FileExistsError):
    """A shm segment is retired: the process ``pid`` won it to replace it under its name."""

    def __init__(self, url: str, pid: int) -> None:
        super().__init__(f"region {url}'s segment is retired by process {pid}, which replaces it")
        self.pid = pid


def _retirer(epoch: int) -> int | None:
    """The PID in a shm segment's tombstone epoch (garbage beyond a PID's range reads as
    no live process), or None when ``epoch`` is no tombstone."""
    return epoch & _EPOCH_MASK if epoch & _RETIRED else None


def _new_epoch() -> int:
    """A fresh claim's epoch: nonzero, below the tombstone bit, unlike any earlier claim's."""
    return (time.time_ns() << 16 | secrets.randbits(16)) & _EPOCH_MASK or 1


def _header_memory(mapping: mmap.mmap | CacheSim) -> AtomicMemory:
    """An accessor over ``mapping`` for a claim or takeover, which must see the header as
    memory holds it (its owner may be a host without coherence): through the simulator's
    cache, or with the CPU's write-back/invalidate instructions where they exist."""
    if isinstance(mapping, CacheSim):
        mem = AtomicMemory(mapping.cache)
        mem.use_flushes(mapping.writeback, mapping.invalidate)
    else:
        mem = AtomicMemory(mapping)
        if _native_flush is not None:  # (its module given: nothing here can raise with the view held)
            mem.use_flushes(native=_native_flush)
    return mem


def _cas_epoch(mapping: mmap.mmap | CacheSim, observed_epoch: int, epoch: int) -> int:
    """CAS the epoch word from ``observed_epoch`` to ``epoch``; returns the word it held (the
    claim is won when that is ``observed_epoch``: openers then see an unpublished region).
    Without coherence the CAS arbitrates only among one host's processes: two hosts must not
    race to take over one region (start one server per region)."""
    with _header_memory(mapping) as mem:
        # line 0 as memory holds it: a CAS on a stale copy could win a region another host
        # claimed since, and writing that line back would overwrite its epoch and magic
        mem.invalidate(_MAGIC, _EPOCH + 8)
        held = mem.cas(_EPOCH, observed_epoch, epoch, ACQ_REL)
        if held == observed_epoch:
            mem.store(_MAGIC, 0, RELEASE)
            mem.writeback(_MAGIC, _EPOCH + 8)  # the epoch and magic stored (line 0), for peers
    return held


def _retire(url: str, mapping: mmap.mmap | CacheSim, stale_after: float) -> None:
    """Win an old shm segment nobody serves by a CAS of its epoch word to this process's
    tombstone, so that no one else ever claims it or unlinks its name.  _Retired when another
    process retired it first; FileExistsError when it is in use or claimed meanwhile."""
    epoch = _takeover_epoch(url, mapping, stale_after, retirable=True)
    held = _cas_epoch(mapping, epoch, _RETIRED | os.getpid())
    if held != epoch:
        retirer = _retirer(held)
        if retirer is not None:
            raise _Retired(url, retirer)
        raise FileExistsError(f"region {url} was taken over by another process first")


def _takeover_epoch(url: str, mapping: mmap.mmap | CacheSim, stale_after: float,
                    retirable: bool = False) -> int:
    """The epoch to CAS from when taking over ``mapping``; FileExistsError if it is in use,
    _Retired if it is a ``retirable`` (shm or sim) segment another process retired."""
    with _header_memory(mapping) as mem:
        # the owner may be a host without coherence: a header cached earlier (closed, or
        # another epoch) would judge a live owner gone
        mem.invalidate(0, _COHERENCE + 8)
        epoch = mem.load(_EPOCH, ACQUIRE)
        retirer = _retirer(epoch) if retirable else None
        if retirer is not None:
            raise _Retired(url, retirer)
        try:
            raw = mapping.cache if isinstance(mapping, CacheSim) else mapping
            with memoryview(raw) as view:  # released even when it raises: the caller unmaps
                reason = _busy_reason(url, mem, view, stale_after)
        except RegionError as exc:
            raise FileExistsError(f"region {url} exists but is unusable here ({exc}); "
                                  f"remove it if no server of another build uses it") from exc
    if reason is not None:
        raise FileExistsError(f"region {url} is {reason}")
    return epoch


def _map_existing(url: str, backend: str, path: str) -> tuple[mmap.mmap, int, int]:
    """Map an existing region: a segment or file whole (its size is the object's), or a
    sub-region's range of its file or device (never created, truncated or grown). Returns the
    mapping, its size and a descriptor of the file (the caller closes it)."""
    if backend in ("shm", "sim"):
        try:
            shm = posix_ipc.SharedMemory(path)
        except posix_ipc.ExistentialError as exc:
            raise FileNotFoundError(f"no region {url}") from exc
        except posix_ipc.PermissionsError as exc:
            raise PermissionError(f"no permission to open region {url}") from exc
        try:
            actual = shm.size
            if actual < HEADER_SIZE:
                raise RegionError(f"region {url} is {actual} bytes, smaller than a header")
            mapping = mmap.mmap(shm.fd, actual)
            try:
                return mapping, actual, os.dup(shm.fd)
            except BaseException:
                mapping.close()
                raise
        finally:
            shm.close_fd()
    sub = _subrange(url)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError as exc:
        hint = " (a sub-region's file or device must exist: it is never created)" if sub else ""
        raise FileNotFoundError(f"no region file {path}{hint}") from exc
    try:
        st = os.fstat(fd)
        size = _file_size(path, st)
        offset = 0
        if sub is not None:
            offset, size = _fit_subrange(url, path, st, size, *sub)
        if size < HEADER_SIZE:
            raise RegionError(f"region {url} is {size} bytes, smaller than a header")
        return mmap.mmap(fd, size, offset=offset), size, fd
    except BaseException:
        os.close(fd)
        raise


def _fit_subrange(url: str, path: str, st: os.stat_result, file_size: int, offset: int,
                  size: int | None) -> tuple[int, int]:
    """A sub-region's ``(offset, size)``, checked against its file or device: both aligned
    (a device's to its mapping alignment, a file's to pages) and inside it."""
    if stat.S_ISCHR(st.st_mode):
        start_unit = length_unit = _dax_alignment(path, st)
        unit = f"the alignment of device {path}"
    else:
        start_unit, length_unit = mmap.ALLOCATIONGRANULARITY, mmap.PAGESIZE
        unit = "the page size"
    if offset % start_unit:
        raise RegionError(f"{url}: offset {offset} is not a multiple of {start_unit} ({unit})")
    if offset >= file_size:
        raise RegionError(f"{url}: offset {offset} is past the end of {path} ({file_size} bytes)")
    rest = size is None
    size = file_size - offset if size is None else size
    if size % length_unit:
        whose = " (the rest of the file)" if rest else ""
        raise RegionError(f"{url}: size {size}{whose} is not a multiple of {length_unit} ({unit})")
    if offset + size > file_size:
        raise RegionError(f"{url}: offset {offset} + size {size} = {offset + size} is past the "
                          f"end of {path} ({file_size} bytes); a sub-region never grows its file")
    return offset, size


def _check_fits(url: str, mapping: mmap.mmap, actual: int, size: int, fd: int) -> None:
    """An existing file or sub-region of ``actual`` bytes must hold the ``size`` asked for
    (unmapped, its descriptor closed, and refused otherwise: it is never resized)."""
    if actual < size:
        mapping.close()
        os.close(fd)
        raise RegionError(f"{url} is {actual} bytes, this server needs {size}; existing "
                          f"files and devices are never resized")


def _sysfs_dir(st: os.stat_result) -> str:
    """The sysfs directory of the character device ``st`` describes."""
    return f"{_SYSFS_CHAR}/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


def _file_size(path: str, st: os.stat_result) -> int:
    """A regular file's size, or a character device's (a DAX device) from sysfs."""
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    if stat.S_ISCHR(st.st_mode):
        sysfs = f"{_sysfs_dir(st)}/size"
        try:
            with open(sysfs) as f:
                return int(f.read().strip())
        except (OSError, ValueError) as exc:
            raise RegionError(f"{path} is a device whose size {sysfs} cannot be read ({exc})") from exc
    raise RegionError(f"{path} is neither a regular file nor a character device")


def _dax_alignment(path: str, st: os.stat_result) -> int:
    """A character device's (a DAX device's) mapping alignment from sysfs, or 2 MiB (device
    DAX's default) where the kernel does not say: a mapping must start and end on it."""
    sysfs = f"{_sysfs_dir(st)}/align"
    try:
        with open(sysfs) as f:
            align = int(f.read().strip())
    except FileNotFoundError:
        return DAX_ALIGNMENT
    except (OSError, ValueError) as exc:
        raise RegionError(f"{path} is a device whose alignment {sysfs} cannot be read ({exc})") from exc
    if align < mmap.PAGESIZE or align & (align - 1):
        raise RegionError(f"{path}: {sysfs} says alignment {align}, not a power of two of at "
                          f"least a page")
    return align


def _map_new_file(path: str, size: int, mode: int) -> tuple[mmap.mmap, int]:
    """Create, size and map a new region file. It appears under its name only at full size
    (made under a temporary name, then linked: exclusive), so a racing creator never maps a
    file still being sized. Returns the mapping and a descriptor of the file."""
    if os.path.exists(path):
        raise FileExistsError(f"region file {path} already exists")
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.creating"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.ftruncate(fd, size)
        _reserve(fd, size, "file://" + path, os.path.dirname(path) or "/")
        mapping = mmap.mmap(fd, size)
        try:
            os.link(tmp, path)
        except FileExistsError as exc:
            mapping.close()
            raise FileExistsError(f"region file {path} already exists") from exc
        return mapping, os.dup(fd)
    finally:
        os.unlink(tmp)
        os.close(fd)


def _reserve(fd: int, size: int, url: str, where: str) -> None:
    """Allocate a new region's memory now: a full tmpfs is a clear error here, not a SIGBUS
    on first touch later (the caller removes what it created)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        try:
            st = os.statvfs(where)
            free = f"{st.f_bavail * st.f_frsize} bytes free"
        except OSError:
            free = "free space unknown"
        raise RegionError(f"{url} needs {size} bytes and {where} has {free} ({exc.strerror}): "
                          f"free memory there or ask for a smaller region") from None


def prefault(mapping: mmap.mmap, offset: int = 0, length: int | None = None) -> None:
    """Fault every page of ``[offset, offset+length)`` in now (writable), so first touches on
    the hot path cost no page fault: MADV_POPULATE_WRITE where the kernel has it (5.14+),
    otherwise a write of each page (values unchanged)."""
    length = len(mapping) - offset if length is None else length
    try:
        mapping.madvise(_MADV_POPULATE_WRITE, offset, length)
        return
    except (OSError, ValueError):
        pass
    view = memoryview(mapping)
    try:
        for page in range(offset, offset + length, mmap.PAGESIZE):
            view[page] = view[page]
    finally:
        view.release()


def _validate_header(url: str, mapping: mmap.mmap, actual: int, kind: int | None) -> None:
    with AtomicMemory(mapping) as mem:
        magic = mem.load(_MAGIC, ACQUIRE)
        if magic != MAGIC:
            raise UninitializedRegion(f"{url} is not an initialised cxlrpc region (bad magic)")
        version = mem.load(_VERSION, ACQUIRE)
        if version != LAYOUT_VERSION:
            raise RegionError(f"{url} has layout version {version}; this build reads {LAYOUT_VERSION}")
        size = mem.load(_SIZE, ACQUIRE)
        if size != actual:
            raise RegionError(f"{url} header says {size} bytes but the mapping is {actual}")
        if kind is not None and mem.load(_KIND, ACQUIRE) != kind:
            raise RegionError(f"{url} holds a different kind of region ({mem.load(_KIND, ACQUIRE)})")


def coherence_for(url: str, coherence: str) -> str:
    """The coherence mode a region at ``url`` gets: ``sim://`` is always ``"flush"``."""
    check_coherence(coherence)
    return FLUSH if url.startswith("sim://") else coherence
