"""Mooncake Store's Python API (``mooncake.store.MooncakeDistributedStore``) on kvservice.

Method names, keyword names, return values and error codes follow Mooncake's binding
(``mooncake-integration/store/store_py.cpp``) and its docs: ``0`` is success, failures are
Mooncake's negative ``ErrorCode`` values (:class:`ErrorCode`), getters return ``b""`` / ``None``
when a key is missing. The one configuration change: ``setup``'s ``master_server_addr`` (or the
dict form's ``master_server_addr`` / ``master_server_address``) is the kvservice URL
(``shm://NAME`` or ``file:///PATH``); the other arguments are accepted and validated as Mooncake
does, then ignored (one shared pool: no segments to mount, no transport to pick).

Mooncake's API is synchronous, so this is built on :class:`kvservice.SyncKVClient`; calls on one
store are serialized by a lock (engines call it from worker threads). Differences from Mooncake
are listed in ``SEMANTIC_DIFFERENCES`` (and the README).
"""
from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
import logging
import mmap
import os
import re
import threading
import time
import weakref
from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import numpy as np

import cxlrpc
from cxlrpc.region import RegionError, parse_url
from kvservice.client import KeyNotFound, SyncKVClient
from kvservice.index import LEASED, REMOVED
from kvservice.keys import normalize_key
from kvservice.pool import Block, LeaseExpired

logger = logging.getLogger("kvservice.compat.mooncake")

__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction", "BufferHandle",
           "ErrorCode", "MooncakeHostMemAllocator", "DEFAULT_KV_LEASE_TTL", "parse_segment_size",
           "memory_problem"]

#: Mooncake's default read lease (``DEFAULT_DEFAULT_KV_LEASE_TTL`` = 5000 ms in types.h): after a
#: read, a non-forced remove of the object fails with OBJECT_HAS_LEASE for this long.
DEFAULT_KV_LEASE_TTL = 5.0

#: The shortest lease a copying read asks for: time enough to copy a value out of the pool.
_COPY_LEASE_S = 0.25
_DEFAULT_SEGMENT = 16 << 20      # DEFAULT_GLOBAL_SEGMENT_SIZE / DEFAULT_LOCAL_BUFFER_SIZE
_MIN_SEGMENT = 1 << 10           # MIN_SEGMENT_SIZE (1 KB); 0 means "contribute none"
_MAX_SEGMENT = 1 << 40           # MAX_SEGMENT_SIZE (1 TB)
_PROTOCOLS = frozenset({"tcp", "rdma", "efa", "nvmeof", "nvlink", "nvlink_intra", "hip", "barex",
                        "cxl", "ascend", "ub", "ubshmem", "maca", "sunrise_link", "rpc_only"})
_SIZE_SUFFIXES = (("kb", 1 << 10), ("mb", 1 << 20), ("gb", 1 << 30), ("tb", 1 << 40),
                  ("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40), ("b", 1))


class ErrorCode(IntEnum):
    """Mooncake's ``ErrorCode`` values (mooncake-store/include/types.h) this facade returns."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10          # destination buffer too small
    NO_AVAILABLE_HANDLE = -200     # no space (kvservice ResourceExhausted / quota)
    INVALID_KEY = -400
    INVALID_PARAMS = -600          # bad argument, or the store is not set up
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706        # remove of a read-leased object without force
    LEASE_EXPIRED = -707           # a read's lease lapsed and its block was reused
    TRANSFER_FAIL = -800           # address not inside a registered buffer
    RPC_FAIL = -900                # the kvservice server is unreachable


def _code(exc: BaseException) -> int:
    """The Mooncake error code for a kvservice exception."""
    if isinstance(exc, KeyNotFound):
        return ErrorCode.OBJECT_NOT_FOUND
    if isinstance(exc, LeaseExpired):
        return ErrorCode.LEASE_EXPIRED
    if isinstance(exc, cxlrpc.ResourceExhausted):
        return ErrorCode.NO_AVAILABLE_HANDLE
    if isinstance(exc, (cxlrpc.InvalidArgument, ValueError, TypeError)):
        return ErrorCode.INVALID_PARAMS
    if isinstance(exc, cxlrpc.NotFound):
        return ErrorCode.OBJECT_NOT_FOUND
    if isinstance(exc, (cxlrpc.RpcError, RegionError, OSError)):
        return ErrorCode.RPC_FAIL
    return ErrorCode.INTERNAL_ERROR


def parse_segment_size(value: Any) -> int:
    """A size as Mooncake's ``mooncake_config._parse_segment_size`` reads it: an int, or a
    string like ``"16MB"``, ``"16 mb"``, ``"1.5GB"``, ``"4096"`` (binary units)."""
    if isinstance(value, bool):
        raise TypeError("a size must be an int or a string, not a bool")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        s = value.strip().lower()
        if not s:
            raise ValueError("invalid segment size: empty string")
        for suffix, multiplier in _SIZE_SUFFIXES:
            if s.endswith(suffix):
                num = s[:-len(suffix)].strip()
                if not num:
                    raise ValueError(f"invalid segment size: missing number before {suffix!r}")
                return int(float(num) * multiplier)
        return int(float(s))
    return int(value)


class SoftPinAction(IntEnum):
    """Mooncake 0.3.13's soft-pin request of a put (``ReplicateConfig.soft_pin_action``)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicateConfig:
    """Mooncake 0.3.13's replication settings, with its fields and defaults. kvservice has one
    pool, so replicas, pins, groups and placement hints are accepted and ignored; what is
    checked, as Mooncake does: ``soft_pin_ttl_ms`` comes only with ``ENABLE``, and
    ``group_ids`` has one entry per key of the put."""

    __slots__ = ("replica_num", "nof_replica_num", "dfs_replica_num", "soft_pin_action",
                 "soft_pin_ttl_ms", "with_hard_pin", "preferred_segment", "preferred_segments",
                 "preferred_nof_segments", "prefer_alloc_in_same_node", "group_ids")

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: int | None = None
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.prefer_alloc_in_same_node = False
        self.group_ids: list[str] | None = None

    def problem(self, n_keys: int) -> str | None:
        """Why Mooncake would refuse a put of ``n_keys`` keys with this config, or None."""
        if self.group_ids is not None and len(self.group_ids) != n_keys:
            return f"{len(self.group_ids)} group_ids for {n_keys} keys (one per key)"
        if self.soft_pin_ttl_ms is not None and self.soft_pin_action != SoftPinAction.ENABLE:
            return "soft_pin_ttl_ms is only valid with soft_pin_action=ENABLE"
        if self.soft_pin_ttl_ms is not None and self.soft_pin_ttl_ms <= 0:
            return "soft_pin_ttl_ms must be positive"
        return None

    def __str__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else self.soft_pin_ttl_ms
        return (f"ReplicateConfig: {{ replica_num: {self.replica_num}, soft_pin_action: "
                f"{SoftPinAction(self.soft_pin_action).name}, soft_pin_ttl_ms: {ttl}, "
                f"with_hard_pin: {int(self.with_hard_pin)}, preferred_segments: "
                f"{self.preferred_segments}, group_ids: {self.group_ids} }}")

    __repr__ = __str__


def _config_code(config: Any, n_keys: int) -> int:
    """INVALID_PARAMS for a config Mooncake refuses for a put of ``n_keys`` keys, else OK."""
    problem = config.problem(n_keys) if isinstance(config, ReplicateConfig) else None
    if problem is not None:
        logger.error("invalid ReplicateConfig: %s", problem)
        return ErrorCode.INVALID_PARAMS
    return ErrorCode.OK


class BufferHandle:
    """What ``get_buffer`` returns: the value in place in the pool (zero-copy), with Mooncake's
    ``ptr()``, ``size()``, ``len()`` and the buffer protocol (``memoryview(h)``,
    ``np.array(h, copy=False)``, ``torch.frombuffer(h, ...)``). It holds a kvservice lease until
    :meth:`close` (or ``with``, or garbage collection); :meth:`check` raises LeaseExpired if the
    lease lapsed and the pool reused the bytes. Views taken from it must not be read after close.
    """

    __slots__ = ()  # the concrete classes are ctypes arrays mixing this in; see _handle_type

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
def _handle_type(size: int) -> type:
    """A BufferHandle class over ``size`` bytes (ctypes arrays carry their length in the type)."""
    return type("BufferHandle", (BufferHandle, ctypes.c_ubyte * size), {})


def _make_handle(block: Block, on_close: Any) -> BufferHandle:
    keep = block.array()  # a numpy view of the pool: keeps the mapping alive while we exist
    handle = _handle_type(block.size).from_address(keep.ctypes.data)
    handle._keep = keep
    handle._block = block
    handle._done = weakref.finalize(handle, _close_block, block, on_close)
    return handle


def _close_block(block: Block, on_close: Any) -> None:
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
        ptr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
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
        return memoryview(np.frombuffer(raw, dtype=np.uint8))


class MooncakeDistributedStore:
    """Mooncake Store's client API on a kvservice server (see the module docstring)."""

    def __init__(self, *, namespace: str = "", kv_lease_ttl: float = DEFAULT_KV_LEASE_TTL,
                 buffer_lease_s: float | None = 60.0) -> None:
        """Mooncake's constructor takes no arguments; the keyword-only ones are kvservice's:
        the namespace keys live in, the read-lease time that makes a non-forced remove fail
        with OBJECT_HAS_LEASE, and the kvservice lease a get_buffer handle asks for (the
        server caps it at its ``max_lease_s``; None: the server's default)."""
        self._namespace = namespace
        self._kv_lease_ttl = kv_lease_ttl
        self._buffer_lease_s = buffer_lease_s
        self._kv: SyncKVClient | None = None
        self._lock = threading.RLock()
        self._hostname = ""
        self._local_buffer = 0  # local_buffer_size of setup: 0 refuses the copying calls
        self._registered = _Registered()
        self._lease_until: dict[str, float] = {}  # key -> end of the read lease we granted
        self._handles: dict[str, int] = {}        # key -> open get_buffer handles
        self._known: dict[str, None] = {}         # keys seen (put or read): remove_by_regex/all

    # ---- setup ----------------------------------------------------------------------------

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """Connect to the kvservice server at ``master_server_addr``; 0 or an error code.
        Positional/keyword form ``setup(local_hostname, metadata_server, global_segment_size=16MB,
        local_buffer_size=16MB, protocol="tcp", rdma_devices="", master_server_addr, engine=None,
        enable_ssd_offload=False, ssd_offload_path="", tenant_id="default",
        enable_client_http_server=False, client_http_port=9300)`` (0.3.13's; the SSD, tenant and
        HTTP arguments are type-checked and ignored: the kvservice server owns storage tiers and
        namespaces) or ``setup(config_dict)`` with Mooncake's keys (values read as strings)."""
        return int(self._setup_args(*args, **kwargs))

    def _setup_args(self, local_hostname: Any = None, metadata_server: str | None = None,
              global_segment_size: Any = _DEFAULT_SEGMENT,
              local_buffer_size: Any = _DEFAULT_SEGMENT, protocol: str = "tcp",
              rdma_devices: str = "", master_server_addr: str = "127.0.0.1:50051",
              engine: Any = None, enable_ssd_offload: bool = False, ssd_offload_path: str = "",
              tenant_id: str = "default", enable_client_http_server: bool = False,
              client_http_port: int = 9300) -> int:
        if isinstance(local_hostname, dict):
            if metadata_server is not None:
                raise TypeError("setup(config) takes the config dict alone")
            return self._setup_dict(local_hostname)
        for name, value in (("local_hostname", local_hostname), ("metadata_server", metadata_server),
                            ("protocol", protocol), ("rdma_devices", rdma_devices),
                            ("master_server_addr", master_server_addr),
                            ("ssd_offload_path", ssd_offload_path), ("tenant_id", tenant_id)):
            if not isinstance(value, str):
                raise TypeError(f"setup(): {name} must be a str, not {type(value).__name__}")
        for name, value in (("enable_ssd_offload", enable_ssd_offload),
                            ("enable_client_http_server", enable_client_http_server)):
            if not isinstance(value, bool):
                raise TypeError(f"setup(): {name} must be a bool, not {type(value).__name__}")
        if isinstance(client_http_port, bool) or not isinstance(client_http_port, int):
            raise TypeError("setup(): client_http_port must be an int")
        sizes = []
        for name, value in (("global_segment_size", global_segment_size),
                            ("local_buffer_size", local_buffer_size)):
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise TypeError(f"setup(): {name} must be an int, not {type(value).__name__}")
            try:
                size = parse_segment_size(value)
            except ValueError as exc:
                logger.error("invalid %s %r: %s", name, value, exc)
                return ErrorCode.INVALID_PARAMS
            if size < 0:
                raise TypeError(f"setup(): {name} must be non-negative")  # pybind: size_t
            sizes.append(size)
        return self._setup(local_hostname, metadata_server, sizes[0], sizes[1], protocol,
                           master_server_addr)

    def _setup_dict(self, config: dict) -> int:
        conf = {str(k): str(v) for k, v in config.items()}  # Mooncake str()s every value
        sizes = []
        for name in ("global_segment_size", "local_buffer_size"):
            text = conf.get(name)
            if text is None:
                sizes.append(_DEFAULT_SEGMENT)
                continue
            try:
                size = parse_segment_size(text)
            except ValueError:
                size = -1
            if size < 0:
                logger.error("invalid %s %r", name, text)
                return ErrorCode.INVALID_PARAMS
            sizes.append(size)
        return self._setup(conf.get("local_hostname", ""), conf.get("metadata_server", ""),
                           sizes[0], sizes[1], conf.get("protocol", "tcp"),
                           conf.get("master_server_addr",
                                    conf.get("master_server_address", "127.0.0.1:50051")))

    def _setup(self, local_hostname: str, metadata_server: str, global_segment_size: int,
               local_buffer_size: int, protocol: str, url: str) -> int:
        if not local_hostname:
            logger.error("missing required config: local_hostname")
            return ErrorCode.INVALID_PARAMS
        if not metadata_server:
            logger.error("missing required config: metadata_server")
            return ErrorCode.INVALID_PARAMS
        for name, size in (("global_segment_size", global_segment_size),
                           ("local_buffer_size", local_buffer_size)):
            if size != 0 and not _MIN_SEGMENT <= size <= _MAX_SEGMENT:
                logger.error("invalid %s: %d, must be 0 or between %d and %d", name, size,
                             _MIN_SEGMENT, _MAX_SEGMENT)
                return ErrorCode.INVALID_PARAMS
        if protocol.lower() not in _PROTOCOLS:
            logger.error("invalid protocol %r", protocol)
            return ErrorCode.INVALID_PARAMS
        try:
            parse_url(url)
        except (ValueError, RegionError) as exc:
            logger.error("master_server_addr %r is not a kvservice URL (shm://NAME or "
                         "file:///PATH): %s", url, exc)
            return ErrorCode.INVALID_PARAMS
        with self._lock:
            self._close_client()
            try:
                self._kv = SyncKVClient.connect(url)
            except Exception as exc:  # no server there, or a stale region
                logger.error("cannot connect to kvservice at %s: %s", url, exc)
                return ErrorCode.RPC_FAIL
            self._hostname = local_hostname if ":" in local_hostname else \
                f"{local_hostname}:{_segment_port()}"
            self._local_buffer = local_buffer_size
        return ErrorCode.OK

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Mooncake's dummy client (SGLang's standalone-storage mode) attaches to a store
        process at ``server_address``; here the same connection as ``setup``: the address is
        the kvservice URL (SGLang: ``client_server_address``). A ``host:port`` gets
        INVALID_PARAMS with a log saying so (kvservice has no store process to attach to)."""
        return int(self._setup("localhost", "P2PHANDSHAKE", int(mem_pool_size),
                               int(local_buffer_size), "tcp", server_address))

    def alloc_from_mem_pool(self, size: int) -> int:
        """Mooncake: memory from a dummy client's shared pool, 0 (null) on other clients. The
        facade has no such pool (the engine's memory stays its own): always 0; allocate with
        :class:`MooncakeHostMemAllocator` and register_buffer instead."""
        return 0

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = _DEFAULT_SEGMENT) -> int:
        return int(ErrorCode.INVALID_PARAMS)  # needs a master address; use setup()

    def close(self) -> int:
        with self._lock:
            self._close_client()
        return 0

    def _close_client(self) -> None:
        if self._kv is not None:
            kv, self._kv = self._kv, None
            try:
                kv.close()
            except Exception as exc:  # pragma: no cover - a failing unmap
                logger.warning("closing the kvservice client: %s", exc)

    def __del__(self) -> None:
        try:
            self._close_client()
        except Exception:
            pass

    def get_hostname(self) -> str:
        return self._hostname

    def health_check(self) -> int:
        """0 if the server answers; INVALID_PARAMS before setup, RPC_FAIL if unreachable."""
        with self._lock:
            if self._kv is None:
                return int(ErrorCode.INVALID_PARAMS)
            try:
                self._kv.stats(self._namespace)
            except Exception as exc:
                return int(_code(exc))
        return 0

    # ---- internals ------------------------------------------------------------------------

    def _client(self) -> SyncKVClient:
        if self._kv is None:
            raise _NotSetUp
        return self._kv

    def _buffered(self) -> SyncKVClient:
        """The client, for a call Mooncake stages through its local buffer."""
        kv = self._client()
        if not self._local_buffer:
            raise _NoLocalBuffer
        return kv

    def _note_read(self, key: str) -> None:
        self._known[key] = None
        if self._kv_lease_ttl > 0:
            self._lease_until[key] = time.monotonic() + self._kv_lease_ttl

    def _leased(self, key: str) -> bool:
        if self._handles.get(key):
            return True
        until = self._lease_until.get(key)
        if until is None:
            return False
        if until <= time.monotonic():
            del self._lease_until[key]
            return False
        return True

    def _leases(self, keys: Sequence[str], lease_s: float | None = None) -> list[Block | None]:
        """Leases on ``keys``. The read lease (``hold``) blocks removal and eviction for
        kv_lease_ttl, for every client. A copying read asks for a lease of that length too, so
        the server ends it then even if our release is still queued in the client (with the
        server's default lease, another store's remove stayed blocked 10 s)."""
        if lease_s is None:
            lease_s = max(self._kv_lease_ttl, _COPY_LEASE_S)
        blocks = self._client().batch_get(keys, self._namespace, lease_s, self._kv_lease_ttl)
        for key, block in zip(keys, blocks):
            if block is not None:
                self._note_read(key)
        return blocks

    def _exists(self, key: str) -> bool:
        return self._client().exists(key, self._namespace)

    def _store(self, keys: Sequence[str], values: Sequence[Any], overwrite: bool) -> list[int]:
        """Store each value (skipping keys that exist unless ``overwrite``); a code per key."""
        kv = self._client()
        codes = [ErrorCode.OK] * len(keys)
        todo: dict[str, Any] = {}
        for i, (key, value) in enumerate(zip(keys, values)):
            if not isinstance(key, str) or not key:
                codes[i] = ErrorCode.INVALID_PARAMS
            elif isinstance(value, int):  # an error code from a registered-address lookup
                codes[i] = value
            elif len(value) == 0:
                codes[i] = ErrorCode.INVALID_PARAMS  # kvservice stores no empty values
            elif key not in todo or overwrite:
                todo[key] = value  # a repeated key without overwrite keeps its first value
        if not todo:
            return codes
        if_absent = not overwrite  # decided atomically by the server (OBJECT_ALREADY_EXISTS is 0)
        try:
            kv.batch_put(todo, self._namespace, if_absent=if_absent)
        except Exception as exc:
            if len(todo) == 1:
                err = _code(exc)
                return [err if k in todo else c for k, c in zip(keys, codes)]
            for key, value in todo.items():  # all or none was reserved: retry one by one
                try:
                    kv.put(key, value, self._namespace, if_absent=if_absent)
                except Exception as one:
                    codes[keys.index(key)] = _code(one)
        for key in todo:
            self._known[key] = None
        return codes

    def _guard(self, fallback: Any, fn: Any, *args: Any) -> Any:
        with self._lock:
            try:
                return _plain(fn(*args))
            except _NotSetUp:
                logger.error("Client is not initialized")
                code = ErrorCode.INVALID_PARAMS
            except _NoLocalBuffer:
                logger.error("no local buffer (local_buffer_size=0): use the registered-buffer calls")
                code = ErrorCode.INVALID_PARAMS
            except Exception as exc:
                code = _code(exc)
                if code == ErrorCode.INTERNAL_ERROR:
                    logger.exception("kvservice call failed")
        return _plain(fallback(code) if callable(fallback) else code)

    # ---- puts -----------------------------------------------------------------------------

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` (bytes-like) unless ``key`` exists (then 0, the old value stays)."""
        value = _bytes(value)  # TypeError for a non-buffer, as pybind's py::buffer
        return self._guard(ErrorCode.INVALID_PARAMS, self._put_copy, [key], [value], False, config)

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value``, replacing any existing one."""
        value = _bytes(value)
        return self._guard(ErrorCode.INVALID_PARAMS, self._put_copy, [key], [value], True, config)

    def put_batch(self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None) -> int:
        """Store several values (no overwrite); 0, or the first failing key's code."""
        return self._guard(ErrorCode.INVALID_PARAMS, self._put_copy, keys, values, False, config)

    def upsert_batch(self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None) -> int:
        return self._guard(ErrorCode.INVALID_PARAMS, self._put_copy, keys, values, True, config)

    def _put_copy(self, keys: list[str], values: list[Any], overwrite: bool, config: Any) -> int:
        """A put staged through Mooncake's local buffer: 0, or the first failing key's code."""
        if len(keys) != len(values):
            return ErrorCode.INVALID_PARAMS
        if _config_code(config, len(keys)):
            return ErrorCode.INVALID_PARAMS
        self._buffered()
        codes = self._store(list(keys), [_bytes(v) for v in values], overwrite)
        return next((c for c in codes if c != ErrorCode.OK), ErrorCode.OK)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of ``parts`` (1-D bytes-like); an empty total stores nothing."""
        return self._guard(ErrorCode.INVALID_PARAMS, self._parts, key, [_part(p) for p in parts],
                           False, config)

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        return self._guard(ErrorCode.INVALID_PARAMS, self._parts, key, [_part(p) for p in parts],
                           True, config)

    def _parts(self, key: str, views: list, overwrite: bool, config: Any) -> int:
        if sum(len(v) for v in views) == 0:
            return ErrorCode.OK  # as Mooncake: a warning, nothing stored
        return self._put_copy([key], [b"".join(views)], overwrite, config)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """Store ``size`` bytes at ``buffer_ptr`` (inside a registered buffer), no overwrite."""
        return self._guard(ErrorCode.INVALID_PARAMS,
                           lambda: self._put_from_many([key], [buffer_ptr], [size], False, config)[0])

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self._guard(ErrorCode.INVALID_PARAMS,
                           lambda: self._put_from_many([key], [buffer_ptr], [size], True, config)[0])

    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        """Store each registered range under its key (no overwrite); a code per key."""
        return self._guard(lambda c: [c] * len(keys), self._put_from_many, keys, buffer_ptrs, sizes, False,
                           config)

    def batch_upsert_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                          config: ReplicateConfig | None = None) -> list[int]:
        return self._guard(lambda c: [c] * len(keys), self._put_from_many, keys, buffer_ptrs, sizes, True,
                           config)

    def _put_from_many(self, keys, buffer_ptrs, sizes, overwrite: bool, config: Any) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes) or _config_code(config, len(keys)):
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        views = [self._registered.view(p, s) for p, s in zip(buffer_ptrs, sizes)]
        return self._store(list(keys), views, overwrite)

    def batch_put_from_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        """Store each key's buffers, concatenated (one copy through a bounce buffer)."""
        def run() -> list[int]:
            if not len(keys) == len(all_buffer_ptrs) == len(all_sizes) or _config_code(config, len(keys)):
                return [ErrorCode.INVALID_PARAMS] * len(keys)
            values: list[Any] = []
            for ptrs, sizes in zip(all_buffer_ptrs, all_sizes):
                views = [self._registered.view(p, s) for p, s in zip(ptrs, sizes)]
                bad = next((v for v in views if isinstance(v, int)), None)
                values.append(bad if bad is not None or len(ptrs) != len(sizes)
                              else b"".join(views))
            return self._store(list(keys), values, False)
        return self._guard(lambda c: [c] * len(keys), run)

    # ---- reads ----------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """A copy of the value; ``b""`` if missing (or on error)."""
        return self._guard(lambda c: [b""], self._get_bytes, [key])[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        """Copies of the values; ``b""`` for each missing key."""
        return self._guard(lambda c: [b""] * len(keys), self._get_bytes, list(keys))

    def _get_bytes(self, keys: list[str]) -> list[bytes]:
        self._buffered()
        out: list[bytes] = []
        for block in self._leases(keys):
            if block is None:
                out.append(b"")
                continue
            with block:
                try:
                    out.append(block.tobytes())
                except LeaseExpired:
                    out.append(b"")
        return out

    def get_size(self, key: str) -> int:
        """The value's size in bytes; OBJECT_NOT_FOUND (-704) if missing."""
        def run() -> int:
            (block,) = self._leases([key])
            if block is None:
                return ErrorCode.OBJECT_NOT_FOUND
            with block:
                return block.size
        return self._guard(ErrorCode.INVALID_PARAMS, run)

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value in place (zero-copy :class:`BufferHandle`); None if missing."""
        return self._guard(lambda c: None, lambda: self._buffers([key])[0])

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        return self._guard(lambda c: [None] * len(keys), self._buffers, list(keys))

    def _buffers(self, keys: list[str]) -> list[BufferHandle | None]:
        try:
            blocks = self._leases(keys, self._buffer_lease_s)
        except cxlrpc.InvalidArgument:  # longer than the server's max_lease_s
            blocks = self._leases(keys)
        out: list[BufferHandle | None] = []
        for key, block in zip(keys, blocks):
            if block is None:
                out.append(None)
                continue
            self._handles[key] = self._handles.get(key, 0) + 1
            out.append(_make_handle(block, functools.partial(self._handle_closed, key)))
        return out

    def _handle_closed(self, key: str) -> None:
        n = self._handles.get(key, 0) - 1
        if n > 0:
            self._handles[key] = n
        else:
            self._handles.pop(key, None)
        self._note_read(key)  # the read lease runs on from the handle's end, as a fresh read

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Copy the value into the registered buffer at ``buffer_ptr``; its size, or a code."""
        return self._guard(ErrorCode.INVALID_PARAMS,
                           lambda: self._get_into_many([key], [buffer_ptr], [size])[0])

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        """``get_into`` for each key (one RPC); bytes read or a negative code per key."""
        return self._guard(lambda c: [c] * len(keys), self._get_into_many, list(keys),
                           list(buffer_ptrs), list(sizes))

    def _get_into_many(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        if not len(keys) == len(ptrs) == len(sizes):
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        dsts = [self._registered.view(p, s) for p, s in zip(ptrs, sizes)]
        results: list[int] = [d if isinstance(d, int) else 0 for d in dsts]
        wanted = [i for i, d in enumerate(dsts) if not isinstance(d, int)]
        blocks = self._leases([keys[i] for i in wanted]) if wanted else []
        for i, block in zip(wanted, blocks):
            if block is None:
                results[i] = ErrorCode.OBJECT_NOT_FOUND
                continue
            with block:
                if block.size > len(dsts[i]):
                    results[i] = ErrorCode.INVALID_PARAMS  # as Mooncake: the size is wrong
                    continue
                try:
                    results[i] = block.copy_into(dsts[i])
                except LeaseExpired:
                    results[i] = ErrorCode.LEASE_EXPIRED
        return results

    def batch_get_into_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Scatter each value over its buffers in order; bytes read or a code per key."""
        def run() -> list[int]:
            if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
                return [ErrorCode.INVALID_PARAMS] * len(keys)
            results: list[int] = []
            for key, block, ptrs, sizes in zip(keys, self._leases(list(keys)), all_buffer_ptrs, all_sizes):
                if block is None:
                    results.append(ErrorCode.OBJECT_NOT_FOUND)
                    continue
                with block:
                    results.append(self._scatter(block, ptrs, sizes))
            return results
        return self._guard(lambda c: [c] * len(keys), run)

    def _scatter(self, block: Block, ptrs: list[int], sizes: list[int]) -> int:
        if len(ptrs) != len(sizes):
            return ErrorCode.INVALID_PARAMS
        dsts = [self._registered.view(p, s) for p, s in zip(ptrs, sizes)]
        bad = next((d for d in dsts if isinstance(d, int)), None)
        if bad is not None:
            return bad
        if sum(len(d) for d in dsts) < block.size:
            return ErrorCode.INVALID_PARAMS  # as Mooncake
        try:
            src, done = block.view(), 0
            for dst in dsts:
                n = min(len(dst), block.size - done)
                dst[:n] = src[done:done + n]
                done += n
            block.check()
        except LeaseExpired:
            return ErrorCode.LEASE_EXPIRED
        return block.size

    def get_into_ranges(self, buffer_ptrs: list[int], all_keys: list[list[str]],
                        all_dst_offsets: list[list[list[int]]],
                        all_src_offsets: list[list[list[int]]],
                        all_sizes: list[list[list[int]]]) -> list[list[list[int]]]:
        """Copy byte ranges of values into registered buffers; bytes or a code per fragment
        (INVALID_PARAMS, as Mooncake, for a range outside the object or the registered buffer,
        and for an unregistered buffer)."""
        def shaped(code: int) -> list[list[list[int]]]:
            return [[[code] * len(frag) for frag in (sizes if isinstance(sizes, list) else [])]
                    for sizes in all_sizes]
        if not len(buffer_ptrs) == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets) == len(all_sizes):
            return [[[int(ErrorCode.INVALID_PARAMS)]] for _ in buffer_ptrs]  # Mooncake's shape
        return self._guard(shaped, self._ranges, buffer_ptrs, all_keys, all_dst_offsets,
                           all_src_offsets, all_sizes)

    def _ranges(self, buffer_ptrs, all_keys, all_dst, all_src, all_sizes) -> list[list[list[int]]]:
        unique = list(dict.fromkeys(k for keys in all_keys for k in keys))
        blocks = dict(zip(unique, self._leases(unique))) if unique else {}
        try:
            out: list[list[list[int]]] = []
            for ptr, keys, dsts, srcs, sizes in zip(buffer_ptrs, all_keys, all_dst, all_src, all_sizes):
                room = self._registered.room(ptr) if isinstance(ptr, int) and ptr > 0 else -1
                per_buffer: list[list[int]] = []
                if not len(keys) == len(dsts) == len(srcs) == len(sizes):
                    out.append([[ErrorCode.INVALID_PARAMS] * len(s) for s in sizes])
                    continue
                for key, d_offs, s_offs, lens in zip(keys, dsts, srcs, sizes):
                    if not len(d_offs) == len(s_offs) == len(lens):
                        per_buffer.append([ErrorCode.INVALID_PARAMS] * len(lens))
                        continue
                    block = blocks.get(key)
                    frags = []
                    for d, s, n in zip(d_offs, s_offs, lens):
                        frags.append(self._fragment(block, ptr, room, d, s, n))
                    per_buffer.append(frags)
                out.append(per_buffer)
            return out
        finally:
            for block in blocks.values():
                if block is not None:
                    block.release()

    def _fragment(self, block: Block | None, ptr: int, room: int, d: int, s: int, n: int) -> int:
        if block is None:
            return ErrorCode.OBJECT_NOT_FOUND
        if room < 0 or min(d, s, n) < 0 or s + n > block.size or d + n > room:
            return ErrorCode.INVALID_PARAMS
        if n == 0:
            return 0
        dst = self._registered.view(ptr + d, n)
        try:
            dst[:] = block.view()[s:s + n]
            block.check()
        except LeaseExpired:
            return ErrorCode.LEASE_EXPIRED
        return n

    # ---- existence and removal ------------------------------------------------------------

    def is_exist(self, key: str) -> int:
        """1 if ``key`` exists, 0 if not, a negative code on error."""
        return self._guard(ErrorCode.INVALID_PARAMS, lambda: self._exist_code(key))

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """1/0 per key (one RPC), or a negative code for each."""
        return self._guard(lambda c: [c] * len(keys), self._exist_codes, keys)

    def _exist_codes(self, keys: list[str]) -> list[int]:
        valid = [isinstance(k, str) and _valid_key(k) for k in keys]
        found = iter(self._client().batch_exists([k for k, ok in zip(keys, valid) if ok], self._namespace))
        return [(1 if next(found) else 0) if ok else int(ErrorCode.INVALID_PARAMS) for ok in valid]

    def _exist_code(self, key: str) -> int:
        try:
            found = self._exists(key)
        except (ValueError, TypeError):
            return ErrorCode.INVALID_PARAMS
        if found:
            self._known[key] = None
        return 1 if found else 0

    def remove(self, key: str, force: bool = False) -> int:
        """Remove ``key``: 0, OBJECT_NOT_FOUND, or OBJECT_HAS_LEASE while a read lease holds it
        (unless ``force``; readers holding a buffer keep their bytes either way)."""
        return self._guard(ErrorCode.INVALID_PARAMS, self._remove_one, key, force)

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        return self._guard(lambda c: [c] * len(keys),
                           lambda: [self._remove_one(k, force) for k in keys])

    def _remove_one(self, key: str, force: bool) -> int:
        kv = self._client()
        if not force and self._leased(key):
            return ErrorCode.OBJECT_HAS_LEASE if kv.exists(key, self._namespace) else ErrorCode.OBJECT_NOT_FOUND
        (status,) = kv.batch_remove([key], self._namespace, force)  # the server sees every client's leases
        if status == LEASED:
            return ErrorCode.OBJECT_HAS_LEASE
        self._known.pop(key, None)
        self._lease_until.pop(key, None)
        return ErrorCode.OK if status == REMOVED else ErrorCode.OBJECT_NOT_FOUND

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Remove every key of the store's namespace in which ``regex_pattern`` finds a match
        (``re.search``), except keys a client holds a lease on unless ``force``; how many, or a
        code. (The read-lease window after a ``get`` protects a key from ``remove`` only.)"""
        try:
            re.compile(regex_pattern)
        except (re.error, TypeError):
            return int(ErrorCode.INVALID_PARAMS)
        return self._guard(ErrorCode.INVALID_PARAMS, self._remove_matching, regex_pattern, force)

    def remove_all(self, force: bool = False) -> int:
        """Remove every key of the store's namespace (see remove_by_regex); how many."""
        return self._guard(ErrorCode.INVALID_PARAMS, self._remove_matching, None, force)

    def _remove_matching(self, pattern: str | None, force: bool) -> int:
        n = self._client().remove_matching(pattern, self._namespace, force)
        self._known = {k: None for k in self._known if pattern is not None and not re.search(pattern, k)}
        return n

    # ---- registered memory ----------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Allow put_from/get_into on ``[buffer_ptr, buffer_ptr+size)``. The facade copies
        with the CPU, so device memory (a GPU KV cache) or memory this process cannot read and
        write is refused with INVALID_PARAMS (then transfers on it get TRANSFER_FAIL), never
        dereferenced."""
        if isinstance(buffer_ptr, bool) or not isinstance(buffer_ptr, int) or buffer_ptr <= 0 \
                or isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            return int(ErrorCode.INVALID_PARAMS)
        problem = memory_problem(buffer_ptr, size)
        if problem is not None:
            logger.error("register_buffer(%#x, %d) refused: %s", buffer_ptr, size, problem)
            return int(ErrorCode.INVALID_PARAMS)
        with self._lock:
            self._registered.add(buffer_ptr, size)
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        with self._lock:
            return 0 if self._registered.remove(buffer_ptr) else int(ErrorCode.INVALID_PARAMS)


def _plain(result: Any) -> Any:
    """Codes as plain ints (Mooncake returns int, not an enum), through nested lists."""
    if isinstance(result, IntEnum):
        return int(result)
    if isinstance(result, list):
        return [_plain(r) for r in result]
    return result


_PORTS = itertools.count(12300 + os.getpid() % 20000)


def _segment_port() -> int:
    """A port number for get_hostname's ``host:port`` (Mooncake: its transfer engine's port;
    here only a distinct name per store, since nothing listens)."""
    return next(_PORTS)


def _valid_key(key: str) -> bool:
    """kvservice takes the key (non-empty, at most MAX_KEY_BYTES in UTF-8)."""
    try:
        normalize_key(key)
    except (ValueError, TypeError):
        return False
    return True


class _NoLocalBuffer(Exception):
    """A copying call on a store set up with local_buffer_size=0 (Mooncake: INVALID_PARAMS)."""


class _NotSetUp(Exception):
    """A call before setup() (Mooncake: "Client is not initialized")."""


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
        return memoryview(np.frombuffer(view, dtype=np.uint8))


def _part(value: Any) -> memoryview:
    view = memoryview(value)
    if view.ndim != 1 or view.itemsize != 1:
        raise RuntimeError("parts must be 1-D bytes-like")  # Mooncake's std::runtime_error
    return view


#: Where this facade knowingly differs from Mooncake Store (the README has the table).
SEMANTIC_DIFFERENCES = {
    "setup": "master_server_addr is a kvservice URL; other arguments validated then ignored; "
             "size strings ('16MB', '16 MB', '1.5GB') accepted in both forms",
    "ReplicateConfig": "accepted, ignored (one pool: no replicas, pins or placement)",
    "put no-overwrite": "exists-then-put on the client: two writers racing on a new key may "
                        "both write (last commit wins)",
    "read leases": "OBJECT_HAS_LEASE only for reads through this store object (kvservice "
                   "does not report other clients' leases)",
    "remove_by_regex/remove_all": "only keys this store object put or read",
    "get_buffer": "zero-copy view of the pool under a kvservice lease (Mooncake copies into "
                  "its local buffer); check() raises LeaseExpired if held past the lease",
    "empty values": "put of b'' returns INVALID_PARAMS (kvservice stores no empty values)",
    "unregistered address": "TRANSFER_FAIL (-800) instead of undefined behaviour",
    "concurrency": "calls on one store object are serialized by a lock",
}
