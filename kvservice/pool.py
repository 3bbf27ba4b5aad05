"""The pool region holding the values, and the views clients read and write it through.

The pool is a cxlrpc region (kind 2): the region header, then ``capacity`` bytes of blocks at
offsets the metadata server hands out. Every offset a client is given is range-checked here.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from cxlrpc.memory import fence
from cxlrpc.region import HEADER_SIZE, Region, RegionError, parse_url

POOL_KIND = 2


def pool_url_for(url: str) -> str:
    """The default pool URL beside a service URL: ``shm://kv`` -> ``shm://kv.pool``."""
    parse_url(url)
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

    def __init__(self, region: Region, capacity: int) -> None:
        if region.size < HEADER_SIZE + capacity:
            raise RegionError(f"pool {region.url} is {region.size} bytes, too small for {capacity}")
        self.region = region
        self.capacity = capacity
        self.data = region.buf[HEADER_SIZE:HEADER_SIZE + capacity]

    @classmethod
    def create(cls, url: str, capacity: int, mode: int = 0o600, stale_after: float = 2.0) -> "Pool":
        """Create the pool region, or take over one whose owner is gone or closed it."""
        region = Region.acquire(url, HEADER_SIZE + capacity, POOL_KIND, mode, stale_after)
        region.publish()
        return cls(region, capacity)

    @classmethod
    def open(cls, url: str, capacity: int, epoch: int) -> "Pool":
        """Map the pool a server advertised; RegionError unless its epoch matches (not a stale one)."""
        region = Region.open(url, kind=POOL_KIND)
        try:
            if region.epoch != epoch:
                raise RegionError(f"pool {url} has epoch {region.epoch}, the server expects {epoch}")
            return cls(region, capacity)
        except BaseException:
            region.close()
            raise

    def slice(self, offset: int, size: int) -> memoryview:
        """The ``size`` bytes at ``offset``; RegionError if the range is not inside the pool."""
        if not (0 <= offset and 0 < size and offset + size <= self.capacity):
            raise RegionError(f"block [{offset}, {offset}+{size}) is outside the pool of {self.capacity}")
        return self.data[offset:offset + size]

    def write(self, offset: int, data: memoryview) -> None:
        """Copy ``data`` into the block at ``offset`` and fence, before the commit publishes it."""
        dst = self.slice(offset, len(data))
        dst[:] = data
        dst.release()
        fence()

    def close(self) -> None:
        """Unmap (a view a user still holds keeps the mapping alive until it is dropped)."""
        self.data.release()
        self.region.close()

    def retire(self) -> None:
        """Owner only: mark the pool closed (a file pool is taken at once by the next server)
        and unlink it (shm)."""
        self.region.mark_closed()
        self.region.unlink()


class Block:
    """A leased value read in place: ``view()`` / ``array()``; use ``with`` to end the lease.

    After :meth:`release` every view handed out is released (using one raises ValueError); an
    array from :meth:`array` cannot be revoked and must not be read after the block ends.
    """

    def __init__(self, view: memoryview, version: int = 0,
                 on_release: Callable[[], None] | None = None) -> None:
        self._view: memoryview | None = view.toreadonly()
        self._views: list[memoryview] = [view]
        self.size = len(view)
        self.version = version
        self._on_release = on_release

    def view(self) -> memoryview:
        """A read-only memoryview of the value (into the pool: no copy)."""
        if self._view is None:
            raise ValueError("block already released")
        return self._view

    def array(self, dtype: Any = np.uint8, shape: Any = None) -> np.ndarray:
        """The value as a read-only numpy array (no copy), optionally reshaped."""
        view = self.view()[:]
        self._views.append(view)
        arr = np.frombuffer(view, dtype=dtype)
        return arr if shape is None else arr.reshape(shape)

    def tobytes(self) -> bytes:
        """A copy of the value."""
        return self.view().tobytes()

    def release(self) -> None:
        """End the lease (idempotent) and release the views into the pool."""
        if self._view is None:
            return
        views, self._views = [self._view, *self._views], []
        self._view = None
        for view in views:
            try:
                view.release()
            except BufferError:
                pass  # an array still exports it; see the class docstring
        if self._on_release is not None:
            self._on_release()

    def __enter__(self) -> "Block":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __len__(self) -> int:
        return self.size


class PendingPut:
    """A reserved, still invisible block: fill ``view()``/``array()`` in place, then commit."""

    def __init__(self, view: memoryview, commit: Callable[[], Any], abort: Callable[[], Any]) -> None:
        self._view = view
        self.size = len(view)
        self._commit = commit
        self._abort = abort

    def view(self) -> memoryview:
        """The writable block (into the pool)."""
        return self._view

    def array(self, dtype: Any = np.uint8, shape: Any = None) -> np.ndarray:
        """The block as a writable numpy array, optionally reshaped."""
        arr = np.frombuffer(self._view, dtype=dtype)
        return arr if shape is None else arr.reshape(shape)

    def commit(self) -> Any:
        """Publish the value (a coroutine on the asyncio client); the view is released."""
        self._end()
        fence()
        return self._commit()

    def abort(self) -> Any:
        """Drop the reservation (a coroutine on the asyncio client); the view is released."""
        self._end()
        return self._abort()

    def _end(self) -> None:
        try:
            self._view.release()
        except BufferError:
            pass  # an array from array() still exports it
