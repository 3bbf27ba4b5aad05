"""Memory the facade reads and writes for an engine: registered ranges (never device memory),
zero-copy handles on the pool, Mooncake's host allocator, and put values as bytes."""
from __future__ import annotations

import bisect
import ctypes
import functools
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from kvservice.compat.mooncake.config import ErrorCode
from kvservice.pool import Block

if TYPE_CHECKING:  # each concrete handle class is a ctypes array too (see _handle_type)
    _HandleBase = ctypes.Array[ctypes.c_ubyte]
else:
    _HandleBase = object


class BufferHandle(_HandleBase):
    """What ``get_buffer`` returns: the value in place in the pool (zero-copy), with Mooncake's
    ``ptr()``, ``size()``, ``len()`` and the buffer protocol (``memoryview(h)``,
    ``np.array(h, copy=False)``, ``torch.frombuffer(h, ...)``). It holds a kvservice lease until
    ``close`` (or ``with``, or garbage collection); ``check`` raises LeaseExpired if the
    lease lapsed and the pool reused the bytes. Views taken from it must not be read after close.
    """

    __slots__ = ()  # the concrete classes are ctypes arrays mixing this in; see _handle_type
    if TYPE_CHECKING:  # set by _make_handle
        _keep: npt.NDArray[Any]
        _block: Block
        _done: weakref.finalize[[Block, Callable[[], None]], BufferHandle]

    def ptr(self) -> int:
        return ctypes.addressof(self)

    def size(self) -> int:
        return len(self)

    def check(self) -> None:
        self._block.check()

    def close(self) -> None:
        """End the lease (idempotent)."""
        self._done()

    @property
    def closed(self) -> bool:
        return self._block.released

    def __enter__(self) -> "BufferHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __bool__(self) -> bool:  # Mooncake's handle is truthy whenever it exists
        return True

    def __repr__(self) -> str:
        return f"<BufferHandle size={len(self)}{' closed' if self.closed else ''}>"


@functools.lru_cache(maxsize=512)
def _handle_type(size: int) -> type[BufferHandle]:
    """A BufferHandle class over ``size`` bytes (ctypes arrays carry their length in the type)."""
    return cast("type[BufferHandle]", type("BufferHandle", (BufferHandle, ctypes.c_ubyte * size), {}))


def _make_handle(block: Block, on_close: Callable[[], None]) -> BufferHandle:
    keep = block.array()  # a numpy view of the pool: keeps the mapping alive while we exist
    handle = _handle_type(block.size).from_address(keep.ctypes.data)
    handle._keep = keep
    handle._block = block
    handle._done = weakref.finalize(handle, _close_block, block, on_close)
    return handle


def _close_block(block: Block, on_close: Callable[[], None]) -> None:
    block.release()
    on_close()


_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, _CU_MEMORYTYPE_HOST = 2, 1


def _device_memory(addr: int) -> bool:
    """True if CUDA says ``addr`` is device (or array) memory. Asked only when the CUDA driver
    is already loaded in this process (``RTLD_NOLOAD``): without it no device pointer exists."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    kind = ctypes.c_uint(0)
    rc = cuda.cuPointerGetAttribute(ctypes.byref(kind), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                    ctypes.c_uint64(addr))
    return rc == 0 and kind.value != _CU_MEMORYTYPE_HOST  # rc != 0: not CUDA's (plain host)


def _host_writable(addr: int, size: int) -> bool:
    """True if ``[addr, addr+size)`` is covered by readable and writable mappings of this
    process (``/proc/self/maps``): what the facade may read and write from the CPU. Device
    memory under CUDA's unified addressing is reserved without access, so it fails here too."""
    end, at = addr + size, addr
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, perms = line.split(None, 2)[:2]
                lo, hi = (int(x, 16) for x in span.split("-"))
                if hi <= at:
                    continue
                if lo > at or perms[:2] != "rw":
                    return False
                at = hi
                if at >= end:
                    return True
    except OSError:  # no procfs: trust the caller, as Mooncake does
        return True
    return False


def memory_problem(addr: int, size: int) -> str | None:
    """Why the facade must not touch ``[addr, addr+size)`` from the CPU, or None if it may."""
    if _device_memory(addr):
        return "device memory (the facade copies from the CPU; register host memory)"
    if not _host_writable(addr, size):
        return "not readable and writable host memory of this process"
    return None


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class MooncakeHostMemAllocator:
    """Mooncake's host allocator (SGLang's ``MooncakeHostTensorAllocator`` allocates its host KV
    pool with it): ``alloc(size)`` maps ``size`` bytes of shared anonymous memory and returns
    the address; ``free(ptr)`` unmaps it (0, or INVALID_PARAMS for an address it did not
    give). Mooncake maps memory its store process can reach; with kvservice the engine's
    registered memory stays private, so plain shared anonymous memory is what it needs."""

    def __init__(self) -> None:
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()

    def alloc(self, size: int) -> int:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise RuntimeError("Failed to map shared memory: Invalid argument")  # as Mooncake
        ptr: int = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                         mmap.MAP_SHARED | mmap.MAP_ANONYMOUS, -1, 0)
        if ptr in (None, _MAP_FAILED):
            raise RuntimeError(f"Failed to map shared memory: {os.strerror(ctypes.get_errno())}")
        with self._lock:
            self._sizes[ptr] = size
        return ptr

    def free(self, ptr: int) -> int:
        with self._lock:
            size = self._sizes.pop(ptr, None)
        if size is None:
            return int(ErrorCode.INVALID_PARAMS)
        _libc.munmap(ptr, size)
        return 0


class _Registered:
    """Address ranges given to register_buffer, and memoryviews over sub-ranges of them."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._sizes: dict[int, int] = {}

    def add(self, addr: int, size: int) -> None:
        if addr not in self._sizes:
            bisect.insort(self._starts, addr)
        self._sizes[addr] = size

    def remove(self, addr: int) -> bool:
        if self._sizes.pop(addr, None) is None:
            return False
        self._starts.remove(addr)
        return True

    def room(self, addr: int) -> int:
        """Bytes from ``addr`` to the end of the registered range holding it; -1 if none does."""
        i = bisect.bisect_right(self._starts, addr)
        # ranges may overlap: take the one reaching furthest (few ranges are registered)
        best = max((s + self._sizes[s] - addr for s in self._starts[:i]), default=-1)
        return best if best > 0 else -1

    def views(self, addrs: list[int], sizes: list[int]) -> list[memoryview] | int:
        """``view`` of each range (pairs of ``addrs`` and ``sizes``), or the first error code."""
        views = [self.view(p, s) for p, s in zip(addrs, sizes)]
        bad = next((v for v in views if isinstance(v, int)), None)
        return bad if bad is not None else cast("list[memoryview]", views)

    def view(self, addr: int, size: int) -> memoryview | int:
        """A writable byte view of ``[addr, addr+size)``, or an error code."""
        if not isinstance(addr, int) or not isinstance(size, int) or addr <= 0 or size < 0:
            return ErrorCode.INVALID_PARAMS
        room = self.room(addr)
        if room < 0:
            return ErrorCode.TRANSFER_FAIL
        if size > room:
            return ErrorCode.BUFFER_OVERFLOW
        if size == 0:
            return memoryview(bytearray(0))
        raw = (ctypes.c_char * size).from_address(addr)
        return np.frombuffer(memoryview(raw), dtype=np.uint8).data


def _bytes(value: Any) -> Any:
    """A put value as a flat byte view (any buffer-protocol object, like Mooncake's py::buffer)."""
    view = memoryview(value)
    if not view.c_contiguous:
        raise ValueError("value must be C-contiguous")
    if view.format == "B" and view.ndim == 1:
        return view
    try:
        return view.cast("B")
    except TypeError:  # a format with a byte-order prefix ('<B' of ctypes): go through numpy
        return np.frombuffer(view, dtype=np.uint8).data


def _part(value: Any) -> memoryview:
    view = memoryview(value)
    if view.ndim != 1 or view.itemsize != 1:
        raise RuntimeError("parts must be 1-D bytes-like")  # Mooncake's std::runtime_error
    return view
