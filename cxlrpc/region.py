"""Named shared regions: ``shm://NAME`` (POSIX shared memory) and ``file:///PATH`` (any
mmap-able file, e.g. a DAX device or a file on a DAX/hugetlbfs mount).

Every region starts with a fixed header (magic, layout version, size, creation epoch, kind,
owner hints and the owner's heartbeat) that is validated on open.  The magic is stored
last, with release ordering, so a half-initialised region is never mistaken for a live one.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
import socket
import stat
import time
from dataclasses import dataclass

import posix_ipc

from .memory import ACQUIRE, RELAXED, RELEASE, AtomicMemory

MAGIC = int.from_bytes(b"CXLRPC\x00\x01", "little")
LAYOUT_VERSION = 1
HEADER_SIZE = 4096
SHM_PREFIX = "cxlrpc."

# Header fields (byte offsets). Published words are 8-byte aligned and written atomically.
_MAGIC, _VERSION, _SIZE, _EPOCH, _KIND, _PID, _CREATED_NS = 0, 8, 16, 24, 32, 40, 48
_HOST, _HOST_LEN = 64, 64
HEARTBEAT_OFFSET = 128  # owner's heartbeat counter, its own cache lines

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


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
    created: float
    heartbeat: int


def parse_url(url: str) -> tuple[str, str]:
    """Split a region URL into ("shm", segment name) or ("file", path), validating it."""
    if url.startswith("shm://"):
        name = url[len("shm://"):]
        if not _NAME_RE.match(name):
            raise RegionError(f"bad shm region name {name!r}: use 1-200 of [A-Za-z0-9._-]")
        return "shm", "/" + SHM_PREFIX + name
    if url.startswith("file://"):
        path = url[len("file://"):]
        if not path.startswith("/"):
            raise RegionError(f"file:// URLs need an absolute path, got {url!r}")
        return "file", path
    raise RegionError(f"unsupported region URL {url!r}: expected shm://NAME or file:///PATH")


class Region:
    """A mapped shared region: ``buf`` is the whole mapping, ``mem`` its atomic accessor."""

    def __init__(self, url: str, backend: str, path: str, mapping: mmap.mmap, size: int) -> None:
        self.url = url
        self.backend = backend
        self.path = path
        self._mmap = mapping
        self.size = size
        self.buf = memoryview(mapping)
        self.mem = AtomicMemory(mapping)
        self.heartbeat = self.mem.counter(HEARTBEAT_OFFSET)
        self.epoch = self.mem.load(_EPOCH, ACQUIRE)
        self.kind = self.mem.load(_KIND, ACQUIRE)
        self.closed = False

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(cls, url: str, size: int, kind: int, mode: int = 0o600) -> "Region":
        """Create and initialise a region (owner-only by default); FileExistsError if it exists.

        The caller fills its layout, then calls :meth:`publish` to make it openable.
        """
        backend, path = parse_url(url)
        if size < HEADER_SIZE * 2:
            raise RegionError(f"region size {size} is below the minimum {HEADER_SIZE * 2}")
        size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        if backend == "shm":
            try:
                shm = posix_ipc.SharedMemory(path, posix_ipc.O_CREX, mode=mode, size=size)
            except posix_ipc.ExistentialError as exc:
                raise FileExistsError(f"region {url} already exists") from exc
            try:
                mapping = mmap.mmap(shm.fd, size)
            finally:
                shm.close_fd()
        else:
            mapping = _map_file(path, size, create=True, mode=mode)
        region = cls(url, backend, path, mapping, size)
        region._init_header(size, kind)
        return region

    def _init_header(self, size: int, kind: int) -> None:
        mem = self.mem
        mem.store(_MAGIC, 0, RELEASE)
        self.buf[8:HEADER_SIZE] = bytes(HEADER_SIZE - 8)
        epoch = (time.time_ns() << 16 | secrets.randbits(16)) & ((1 << 63) - 1) or 1
        mem.store(_VERSION, LAYOUT_VERSION, RELAXED)
        mem.store(_SIZE, size, RELAXED)
        mem.store(_EPOCH, epoch, RELAXED)
        mem.store(_KIND, kind, RELAXED)
        mem.store(_PID, os.getpid(), RELAXED)
        mem.store(_CREATED_NS, time.time_ns(), RELAXED)
        host = socket.gethostname().encode()[:_HOST_LEN]
        self.buf[_HOST:_HOST + len(host)] = host
        self.epoch, self.kind = epoch, kind

    def publish(self) -> None:
        """Make the region visible to openers: the magic is the last word written."""
        self.mem.store(_MAGIC, MAGIC, RELEASE)

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, url: str, kind: int | None = None) -> "Region":
        """Map an existing region and validate its header; :class:`RegionError` if unusable."""
        backend, path = parse_url(url)
        if backend == "shm":
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
            finally:
                shm.close_fd()
        else:
            mapping = _map_file(path, None, create=False)
            actual = len(mapping)
        try:
            _validate_header(url, mapping, actual, kind)
        except BaseException:
            mapping.close()
            raise
        return cls(url, backend, path, mapping, actual)

    # ------------------------------------------------------------------ lifetime
    def info(self) -> RegionInfo:
        host = bytes(self.buf[_HOST:_HOST + _HOST_LEN]).rstrip(b"\0").decode(errors="replace")
        return RegionInfo(
            url=self.url, size=self.size, epoch=self.epoch, kind=self.kind,
            owner_pid=self.mem.load(_PID, ACQUIRE), owner_host=host,
            created=self.mem.load(_CREATED_NS, ACQUIRE) / 1e9,
            heartbeat=self.heartbeat.load(ACQUIRE),
        )

    def owner_alive_locally(self) -> bool | None:
        """Host-local accelerator: is the owner PID alive? None when it is another host's."""
        info = self.info()
        if info.owner_host != socket.gethostname()[:_HOST_LEN]:
            return None
        return pid_alive(info.owner_pid)

    def owner_alive(self, window: float) -> bool:
        """Same host: is the owner's PID alive? Another host's owner: does its heartbeat move
        within ``window`` seconds (polled every 10 ms)?"""
        local = self.owner_alive_locally()
        if local is not None:
            return local
        first = self.heartbeat.load(ACQUIRE)
        deadline = time.monotonic() + window
        while time.monotonic() < deadline:
            if self.heartbeat.load(ACQUIRE) != first:
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        """Unmap. Views still exported (zero-copy readers) keep the mapping until released."""
        if self.closed:
            return
        self.closed = True
        self.mem.close()
        self.buf.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # a caller still holds a view into the region; the GC unmaps it later

    def unlink(self) -> None:
        """Remove the shm segment's name (mappings stay valid). File regions are kept."""
        if self.backend == "shm":
            unlink_shm(self.path)

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def unlink_shm(path: str) -> bool:
    """Unlink a POSIX shm segment by name; False if it was already gone."""
    try:
        posix_ipc.unlink_shared_memory(path)
        return True
    except posix_ipc.ExistentialError:
        return False


def untouched_for(url: str, seconds: float) -> bool:
    """True if the region's backing object was not modified for ``seconds`` (or is gone).

    Used to recognise a segment whose creator died before publishing it."""
    backend, path = parse_url(url)
    full = "/dev/shm" + path if backend == "shm" else path
    try:
        return time.time() - os.stat(full).st_mtime > seconds
    except FileNotFoundError:
        return True


def pid_alive(pid: int) -> bool:
    """Is a process of this host running (a zombie, killed but not reaped, counts as dead)?"""
    if pid <= 0:
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


def _map_file(path: str, size: int | None, create: bool, mode: int = 0o600) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT if create and size is not None else 0)
    try:
        fd = os.open(path, flags, mode)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"no region file {path}") from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            if size is not None and st.st_size < size:
                os.ftruncate(fd, size)
            length = size if size is not None else st.st_size
        else:  # a DAX character device: its size must be given
            if size is None:
                raise RegionError(f"{path} is a device: pass size= to map it")
            length = size
        if length < HEADER_SIZE:
            raise RegionError(f"region file {path} is {length} bytes, smaller than a header")
        return mmap.mmap(fd, length)
    finally:
        os.close(fd)


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
