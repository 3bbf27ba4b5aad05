"""A region backend that behaves like memory without cross-host cache coherence (``sim://NAME``).

Each process that maps a simulated region works on its own private copy (its "cache") of a
shared segment (the "memory"). Loads and stores, atomic ones included, touch only the cache:
another process sees a line only after its writer wrote it back (``writeback``, or a random
eviction), and a reader sees new memory contents only after it invalidated its copy
(``invalidate``, or a random eviction of a clean line). Lines move whole, 64 bytes at a time,
as real caches move them: two processes writing one line lose each other's updates. Random
evictions make partial writes visible in any order. Atomic read-modify-writes are atomic only
within one process, as on a non-coherent CXL pool they are only within one host.

It exists for tests: code that forgets one write-back or one invalidate fails under it.

Harsher modes, off by default (each a module setting, read at import from the environment
variable named beside it, so a test's peer processes get them too; a CacheSim reads them when
it is made):

- ``LIMBO`` (``CXLRPC_SIM_LIMBO=SECONDS``): dirty lines outlive their process. On hardware a
  killed process's dirty lines stay in its host's caches and reach memory whenever they are
  evicted, maybe after the memory was reclaimed and reused. Here each process's cache lives in
  a file beside the memory (``/dev/shm/cxlrpc.sim.NAME~c.HOST.PID.TOKEN``, its cache then its
  clean copy, flock-ed while the process runs), so a killed process's dirty lines stay there
  (SIGKILL runs no code: nothing needs to), and so do those of a process that closed its region
  without writing them back. They land (are written to memory, once): when a process of the
  same simulated ``HOST`` writes back or invalidates their range (clwb and clflushopt act on
  the whole host's caches), before that process's own lines; and all of them at the first
  write-back or invalidate of any process ``LIMBO`` seconds after it saw their owner gone (an
  eviction on that host, whenever it comes). Costs a file mapping per process and, per call,
  an fstat and a lock probe per live peer. The files go with the region (``unlink``).
- ``HOST`` (``CXLRPC_SIM_HOST``): the simulated host of this process's cache, for ``LIMBO``
  (default ``"h"``: every process on one host).
- ``TARGETED`` (``CXLRPC_SIM_TARGETED=LINES``): evictions aimed at what is being published: at
  every write-back or invalidate, this process's other dirty lines within ``LINES`` lines of
  the range (-1: all of them) reach memory first, then ``TARGETED_HOOK`` runs (if set), then the
  range's own lines. A store that publishes data before that data's write-back (a tail stored
  too early) then lands before the data, as an eviction may make it on hardware.
- ``EVICT_NEAR`` (``CXLRPC_SIM_EVICT_NEAR=LINES``): the random evictions (``EVICTION_RATE``)
  pick a line within ``LINES`` lines of the call's range instead of anywhere in the region,
  where one line in a megabyte region is almost never one that matters.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import random
import re
import secrets
import threading
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

LINE = 64
SHM_DIR = "/dev/shm"


def _env(name: str, default: float) -> float:
    text = os.environ.get(name)
    return float(text) if text else default


#: Chance that a write-back or invalidate call also evicts one random line (tests may lower it
#: to 0 to make a missing flush fail deterministically instead of merely slowly).
EVICTION_RATE = 0.05
#: Seconds after which a gone process's dirty lines land (0: off, they are dropped; see above).
LIMBO = _env("CXLRPC_SIM_LIMBO", 0.0)
#: The simulated host of the caches made from here on (``LIMBO``): [A-Za-z0-9_-]{1,32}.
HOST = os.environ.get("CXLRPC_SIM_HOST") or "h"
#: Lines around a call's range whose dirty lines are written back first (0: off; -1: all).
TARGETED = int(_env("CXLRPC_SIM_TARGETED", 0))
#: Run between a targeted eviction (when it wrote lines back) and the call's own lines (tests:
#: a peer's poll, to show what memory holds in that moment).
TARGETED_HOOK: Callable[["CacheSim"], None] | None = None
#: Lines around a call's range the random evictions pick from (0: the whole region).
EVICT_NEAR = int(_env("CXLRPC_SIM_EVICT_NEAR", 0))

_HOST_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
_SIDE = "~"  # separates a region's segment name from its side files' suffix (no region has it)


class CacheSim:
    """One process's cache over a shared ``memory`` mapping (the same size, page-rounded);
    ``path`` is the memory's segment name (``/cxlrpc.sim.NAME``), for ``LIMBO``'s files."""

    def __init__(self, memory: mmap.mmap, eviction_rate: float | None = None,
                 seed: int | None = None, path: str | None = None) -> None:
        size = len(memory)
        if size % LINE:
            raise ValueError("simulated regions are whole lines")
        import numpy as np  # here, not at import: numpy's BLAS threads spin in every process that loads it

        self.memory = memory
        self._own: _OwnCache | None = None
        self._peers: _Peers | None = None
        self.host = HOST
        if LIMBO > 0 and path is not None:
            if not _HOST_RE.match(HOST):
                raise ValueError(f"CXLRPC_SIM_HOST {HOST!r}: use 1-32 of [A-Za-z0-9_-]")
            self._own = _OwnCache(path, size, HOST)
            self.cache, self._clean_map = self._own.cache, self._own.clean
        else:
            self.cache = _anonymous(size)
            self._clean_map = _anonymous(size)  # what the cache last agreed with memory on, per line
        # 8-byte elements: a line moves as whole aligned words, so another process never sees
        # a torn word (real caches move whole lines; the rings rely on atomic 8-byte words)
        self._mem = np.frombuffer(memory, dtype=np.uint64).reshape(-1, LINE // 8)
        self._cache = np.frombuffer(self.cache, dtype=np.uint64).reshape(-1, LINE // 8)
        self._clean = np.frombuffer(self._clean_map, dtype=np.uint64).reshape(-1, LINE // 8)
        self._clean[:] = self._mem
        self._cache[:] = self._clean  # a cold cache: everything fetched from memory now
        if self._own is not None and path is not None:
            self._peers = _Peers(path, self._own.name, self._mem)
            self._peers.announce(self._own.name)  # (locked: nobody can take it for a gone one's)
        self._rate = EVICTION_RATE if eviction_rate is None else eviction_rate
        self._near = EVICT_NEAR
        self._targeted = TARGETED
        self._rng = random.Random(seed)
        self.writebacks = self.invalidates = self.evictions = 0

    def _lines(self, offset: int, length: int) -> slice:
        return slice(offset // LINE, -(-(offset + length) // LINE))

    def _write_dirty(self, lines: slice) -> bool:
        """Write the dirty lines of ``lines`` back; whether there were any."""
        cache, clean = self._cache[lines], self._clean[lines]
        dirty = (cache != clean).any(axis=1)
        if dirty.any():
            self._mem[lines][dirty] = cache[dirty]
            clean[dirty] = cache[dirty]
            return True
        return False

    def writeback(self, offset: int, length: int) -> None:
        """Write the range's dirty lines back to memory (whole lines)."""
        self.writebacks += 1
        lines = self._lines(offset, length)
        self._before(lines)
        self._write_dirty(lines)
        self._evict_some(lines)

    def invalidate(self, offset: int, length: int) -> None:
        """Write back the range's dirty lines (as clflushopt does), then refetch every line."""
        self.invalidates += 1
        lines = self._lines(offset, length)
        self._before(lines)
        self._write_dirty(lines)
        self._refetch(lines)
        self._evict_some(lines)

    def _before(self, lines: slice) -> None:
        """What lands before a call's own lines: this process's other dirty lines near them
        (``TARGETED``), and dead processes' lines (``LIMBO``) of this host in the range."""
        if self._targeted:
            width = len(self._mem) if self._targeted < 0 else self._targeted
            before = self._write_dirty(slice(max(lines.start - width, 0), lines.start))
            if (self._write_dirty(slice(lines.stop, lines.stop + width)) or before) and TARGETED_HOOK is not None:
                TARGETED_HOOK(self)
        if self._peers is not None:
            self._peers.land(lines, self.host)

    def _refetch(self, lines: slice) -> None:
        """Load lines from memory: one read of memory, so cache and clean copy agree even
        while another process writes those lines back."""
        self._cache[lines] = self._mem[lines]
        self._clean[lines] = self._cache[lines]

    def _evict_some(self, near: slice) -> None:
        """Now and then a random line leaves the cache: written back if dirty, refetched
        (one near the call's lines with ``EVICT_NEAR``)."""
        if self._rng.random() >= self._rate:
            return
        self.evictions += 1
        if self._near:
            low = max(near.start - self._near, 0)
            line = self._rng.randrange(low, min(near.stop + self._near, len(self._mem)))
        else:
            line = self._rng.randrange(len(self._mem))
        one = slice(line, line + 1)
        self._write_dirty(one)
        self._refetch(one)

    def close(self) -> None:
        """Unmap. With ``LIMBO``, dirty lines not written back stay behind (to land later)
        while the memory's segment exists; else they are dropped."""
        own = self._own
        keep = False
        if own is not None:
            keep = bool((self._cache != self._clean).any()) and own.memory_exists()
        if self._peers is not None:
            self._peers.close()
        del self._mem, self._cache, self._clean
        if own is not None:
            own.close(keep)
        else:
            self.cache.close()
            self._clean_map.close()
        self.memory.close()


class _OwnCache:
    """This process's cache and clean copy in a file beside the memory (``LIMBO``), locked
    (flock) while this process runs: a lock others can take says its owner is gone."""

    def __init__(self, path: str, size: int, host: str) -> None:
        self.segment = SHM_DIR + path
        self.name = f"{path[1:]}{_SIDE}c.{host}.{os.getpid()}.{secrets.token_hex(4)}"
        self.file = f"{SHM_DIR}/{self.name}"
        self.fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)  # before anyone can learn the name
            os.ftruncate(self.fd, 2 * size)
            self.cache = mmap.mmap(self.fd, size, offset=0)
            self.clean = mmap.mmap(self.fd, size, offset=size)
        except BaseException:
            os.unlink(self.file)
            os.close(self.fd)
            raise

    def memory_exists(self) -> bool:
        return os.path.exists(self.segment)

    def close(self, keep: bool) -> None:
        """Unmap; keep the file (its dirty lines) for others to land, or remove it."""
        self.cache.close()
        self.clean.close()
        if not keep:
            _unlink(self.file)
        os.close(self.fd)  # (the lock goes with it: the others now see this cache's owner gone)


class _Gone:
    """A gone process's cache file, mapped: its dirty lines wait to land."""

    def __init__(self, name: str, fd: int, size: int, seen: float) -> None:
        import numpy as np

        self.name, self.fd, self.seen = name, fd, seen
        self.host = name.split(_SIDE + "c.", 1)[1].split(".", 1)[0]
        self.maps = (mmap.mmap(fd, size, offset=0), mmap.mmap(fd, size, offset=size))
        self.cache = np.frombuffer(self.maps[0], dtype=np.uint64).reshape(-1, LINE // 8)
        self.clean = np.frombuffer(self.maps[1], dtype=np.uint64).reshape(-1, LINE // 8)

    def close(self) -> None:
        del self.cache, self.clean
        for m in self.maps:
            m.close()
        os.close(self.fd)


class _Peers:
    """The other processes' caches of one simulated region (``LIMBO``): learnt from the
    region's registry file (each appends its cache file's name), watched through their locks,
    and the dirty lines of gone ones landed into memory under the registry's lock (once each:
    a landed line is marked clean in the gone cache's own file)."""

    def __init__(self, path: str, own: str, mem: "npt.NDArray[np.uint64]") -> None:
        self._mem = mem
        self._size = mem.nbytes
        self._own = own
        self.registry = f"{SHM_DIR}/{path[1:]}{_SIDE}peers"
        self._fd = os.open(self.registry, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self._read = 0
        self._live: dict[str, int] = {}
        self._gone: dict[str, _Gone] = {}
        self._lock = threading.Lock()  # (a region's hooks may be called from several threads)

    def announce(self, name: str) -> None:
        """Tell the region's other processes of our cache file (one append: atomic)."""
        os.write(self._fd, (name + "\n").encode())

    def _look(self) -> None:
        """New peers from the registry; live ones whose lock is free now are gone."""
        end = os.fstat(self._fd).st_size
        if end > self._read:
            text = os.pread(self._fd, end - self._read, self._read).decode()
            complete = text.rpartition("\n")[0]
            self._read += len(complete) + 1 if complete else 0
            for name in complete.split("\n") if complete else ():
                if name != self._own and name not in self._live and name not in self._gone:
                    try:
                        self._live[name] = os.open(f"{SHM_DIR}/{name}", os.O_RDWR)
                    except FileNotFoundError:
                        pass  # closed cleanly (or landed and removed) before we looked
        for name, fd in list(self._live.items()):
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner runs
            del self._live[name]
            if os.fstat(fd).st_size != 2 * self._size:
                os.close(fd)
                continue
            self._gone[name] = _Gone(name, fd, self._size, time.monotonic())

    def land(self, lines: slice, host: str) -> None:
        """Land gone caches' dirty lines: of ``host`` in ``lines``; of every host all of them
        once LIMBO seconds passed since we saw their owner gone."""
        with self._lock:
            self._land_due(lines, host)

    def _land_due(self, lines: slice, host: str) -> None:
        self._look()
        if not self._gone:
            return
        now = time.monotonic()
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            for name, gone in list(self._gone.items()):
                if now >= gone.seen + LIMBO:
                    self._land(gone, slice(0, len(self._mem)))
                    del self._gone[name]
                    _unlink(f"{SHM_DIR}/{name}")
                    gone.close()
                elif gone.host == host:
                    self._land(gone, lines)
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def _land(self, gone: _Gone, lines: slice) -> None:
        cache, clean = gone.cache[lines], gone.clean[lines]
        dirty = (cache != clean).any(axis=1)
        if dirty.any():
            self._mem[lines][dirty] = cache[dirty]
            clean[dirty] = cache[dirty]

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        for fd in self._live.values():
            os.close(fd)
        for gone in self._gone.values():
            gone.close()
        self._live, self._gone = {}, {}
        os.close(self._fd)


def side_files(path: str) -> list[str]:
    """The files ``LIMBO`` keeps beside the simulated region ``path`` (``/cxlrpc.sim.NAME``)."""
    prefix = path[1:] + _SIDE
    try:
        return [f"{SHM_DIR}/{n}" for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except FileNotFoundError:
        return []


def remove_side_files(path: str) -> None:
    """Remove ``LIMBO``'s files of the region ``path`` (its memory goes: their lines with it)."""
    for file in side_files(path):
        _unlink(file)


def is_side_file(name: str) -> bool:
    """Is the /dev/shm entry ``name`` a simulator's side file (no region of its own)?"""
    return _SIDE in name


def _unlink(file: str) -> None:
    try:
        os.unlink(file)
    except FileNotFoundError:
        pass


def _anonymous(size: int) -> mmap.mmap:
    """Private memory for a cache copy, on huge pages where the kernel allows (a simulated
    region of 100+ MiB then maps in a fraction of the time 4 KiB faults take)."""
    area = mmap.mmap(-1, size)
    try:
        area.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    return area
