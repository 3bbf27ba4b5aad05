"""MooncakeDistributedStore: setup, existence and removal, registered memory (its transfers in
transfers.py, its connection and bookkeeping in session.py)."""
from __future__ import annotations

import logging
import re
from typing import Any

from cxlrpc.region import RegionError, parse_url
from kvservice.client import SyncKVClient
from kvservice.compat.mooncake.config import (_DEFAULT_SEGMENT, _MAX_SEGMENT, _MIN_SEGMENT,
                                              _PROTOCOLS, ErrorCode, _code, _segment_port,
                                              parse_segment_size)
from kvservice.compat.mooncake.memory import memory_problem
from kvservice.compat.mooncake.transfers import _Transfers
from kvservice.index import LEASED, REMOVED
from kvservice.keys import normalize_key

logger = logging.getLogger("kvservice.compat.mooncake")


class MooncakeDistributedStore(_Transfers):
    """Mooncake Store's client API on a kvservice server (see the module docstring)."""

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
        assert metadata_server is not None  # (a str: checked above)
        return self._setup(local_hostname, metadata_server, sizes[0], sizes[1], protocol,
                           master_server_addr)

    def _setup_dict(self, config: dict[Any, Any]) -> int:
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
        ``MooncakeHostMemAllocator`` and register_buffer instead."""
        return 0

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = _DEFAULT_SEGMENT) -> int:
        return int(ErrorCode.INVALID_PARAMS)  # needs a master address; use setup()

    def close(self) -> int:
        with self._lock:
            self._close_client()
        return 0

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
        return self._client().remove_matching(pattern, self._namespace, force)

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


def _valid_key(key: str) -> bool:
    """kvservice takes the key (non-empty, at most MAX_KEY_BYTES in UTF-8)."""
    try:
        normalize_key(key)
    except (ValueError, TypeError):
        return False
    return True
