"""A region's file cut short under its mappings (``ftruncate``), noticed before it is touched.

Whoever may open a region's file for writing may also truncate it, and then every process
mapping it dies of SIGBUS on its next touch of a page past the new end. No mapping can be
shielded from that (a tmpfs file or POSIX shm segment takes no seals; only a DAX device cannot
be truncated at all), so a region opened by anyone who may truncate it is a trust boundary.
What a process can do is look before it touches: ``SizeGuard.short`` costs one ``fstat``,
and the owner's ``SizeGuard.restore`` grows the file back (the cut pages read as zeros,
garbage the layers above survive), after which nobody faults on it. A truncation between a
look and a touch still raises SIGBUS.
"""
from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable

logger = logging.getLogger("cxlrpc.region")


class SizeGuard:
    """Looks at the size of the file behind one mapped region (it owns the descriptor)."""

    __slots__ = ("url", "_fd", "_end", "_lock")

    def __init__(self, fd: int, end: int, url: str) -> None:
        """``fd``: the region's file (or -1: nothing to look at); ``end``: the file size the
        mapping needs (a sub-region's offset plus its size)."""
        self.url = url
        self._end = end
        self._lock = threading.Lock()  # the region's close may race a watcher thread's look
        self._fd = -1
        if fd >= 0:
            if stat.S_ISREG(os.fstat(fd).st_mode):  # a device cannot be cut (nor sized by fstat)
                self._fd = fd
            else:
                os.close(fd)

    def short(self) -> int | None:
        """The file's size when it no longer holds the whole region (touching past it raises
        SIGBUS), else None."""
        with self._lock:
            if self._fd < 0:
                return None
            size = os.fstat(self._fd).st_size
        return size if size < self._end else None

    def restore(self) -> bool:
        """Owner: grow the file back to hold the region (never shrinking it: another
        sub-region may lie past ours); its cut pages read as zeros. Whether it holds it now."""
        with self._lock:
            if self._fd < 0:
                return False
            try:
                os.posix_fallocate(self._fd, 0, self._end)
            except OSError as exc:
                logger.error("region %s: cannot grow its file back to %d bytes: %s", self.url,
                             self._end, exc)
            return os.fstat(self._fd).st_size >= self._end

    def exposed(self) -> str | None:
        """Why a process other than ours may truncate the file (its owner, its mode), or None."""
        with self._lock:
            if self._fd < 0:
                return None
            st = os.fstat(self._fd)
        if st.st_uid != os.geteuid():
            return f"it is owned by uid {st.st_uid}, not this process's {os.geteuid()}"
        if st.st_mode & 0o022:
            return f"its group or others may write it (mode {stat.S_IMODE(st.st_mode):o})"
        return None

    def close(self) -> None:
        """Close the descriptor (with the region): from here there is nothing to look at."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def cut_message(url: str, size: int) -> str:
    """What a cut region is called in errors and logs."""
    return (f"region {url}'s file was truncated to {size} bytes by another process (anyone who "
            f"may write the file may do so: see the docs on trust)")


class TruncationWatch:
    """An owner's look at the files of its regions: a cut one is grown back at once (so no
    process faults on it any more) and reported once through ``on_cut(message)``. Looked
    from the heartbeat thread and the serving loop alike (one ``fstat`` a region)."""

    def __init__(self, on_cut: Callable[[str], None] = lambda message: None) -> None:
        self._guards: list[SizeGuard] = []
        #: told (from the thread that looked) once a region was found cut
        self.on_cut = on_cut
        self._lock = threading.Lock()
        #: the report, once a region was found cut
        self.cut: str | None = None

    def add(self, guard: SizeGuard) -> None:
        """Watch one more region; a warning when others may truncate its file."""
        exposed = guard.exposed()
        if exposed is not None:
            logger.warning("region %s: %s; any process that may write it may truncate it, and "
                           "every process mapping it then dies of SIGBUS unless the truncation "
                           "is noticed first", guard.url, exposed)
        self._guards.append(guard)

    def check(self) -> bool:
        """Whether a region was found cut (now or before); a cut one is grown back here."""
        if self.cut is not None:
            return True
        for guard in self._guards:
            size = guard.short()
            if size is None:
                continue
            restored = guard.restore()
            with self._lock:
                if self.cut is not None:
                    return True
                self.cut = cut_message(guard.url, size) + (
                    "; its size was restored (the cut bytes read as zeros) and the server stops"
                    if restored else "; its size could not be restored")
            logger.error("%s", self.cut)
            self.on_cut(self.cut)
            return True
        return False
