"""A structural stand-in for the parts of LMCache (LMCache/LMCache, lmcache/v1/...) that a
remote connector touches, with numpy in place of torch. Installed into ``sys.modules`` by the
tests only (:func:`install`); never shipped.

Written from LMCache's sources:
- ``lmcache/v1/storage_backend/connector/base_connector.py``: ``RemoteConnector`` (its
  ``__init__(config, metadata)`` deriving save_chunk_meta / meta_shapes / meta_dtypes /
  meta_fmt / full_chunk_size_bytes / single_token_size / remote_metadata_bytes,
  ``reshape_partial_chunk``, the abstract and default methods, their signatures);
- ``lmcache/v1/storage_backend/connector/__init__.py``: ``ConnectorAdapter``,
  ``ConnectorContext``, ``ConnectorManager`` (built-ins, then ``remote_storage_plugins`` with
  ``extra_config["remote_storage_plugin.<name>.module_path" / ".class_name"]``),
  ``CreateConnector`` (wraps in ``InstrumentedRemoteConnector``);
- ``.../connector/instrumented_connector.py``: drops the MemoryObj reference after put and
  batched_put;
- ``lmcache/v1/storage_backend/remote_backend.py``: how ``RemoteBackend`` drives a connector
  from its worker threads (``asyncio.run_coroutine_threadsafe`` on the storage loop,
  ``exists_sync`` under ``use_exists_sync``, ``batched_contains`` when supported, ...);
- ``lmcache/v1/protocol.py`` (``RemoteMetadata``), ``lmcache/utils.py`` (``CacheEngineKey``),
  ``lmcache/v1/memory_management.py`` (``MemoryObj``: byte_array as a ``<B`` memoryview over
  the raw data, tensor, meta, get_shapes/get_dtypes/get_memory_format/get_size, ref counts).
The serialized RemoteMetadata layout here is the stand-in's own (LMCache's differs).
"""
from __future__ import annotations

import abc
import asyncio
import ctypes
import enum
import importlib
import struct
import sys
import threading
import types
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, List, Optional

import numpy as np

# ---- lmcache.utils ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheEngineKey:
    fmt: str
    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: str = "half"

    def to_string(self) -> str:
        return (f"{self.fmt}@{self.model_name}@{self.world_size}@{self.worker_id}"
                f"@{self.chunk_hash:x}@{self.dtype}")

    def with_new_worker_id(self, worker_id: int) -> "CacheEngineKey":
        return CacheEngineKey(self.fmt, self.model_name, self.world_size, worker_id,
                              self.chunk_hash, self.dtype)


# ---- lmcache.v1.memory_management ------------------------------------------------------------


class MemoryFormat(enum.IntEnum):
    UNDEFINED = 0
    KV_2LTD = 1
    KV_T2D = 2
    KV_MLA_FMT = 4


@dataclass
class MemoryObjMetadata:
    shape: tuple
    dtype: Any
    address: int
    phy_size: int
    ref_count: int
    fmt: MemoryFormat = MemoryFormat.UNDEFINED
    shapes: list = field(default_factory=list)
    dtypes: list = field(default_factory=list)


class MemoryObj:
    """A chunk buffer from the allocator: ``raw_data`` is a numpy uint8 array (torch's
    ``raw_data`` uint8 tensor); ``byte_array`` a ``<B`` memoryview over it, as LMCache makes
    with ctypes from ``data_ptr()``; ``tensor`` the typed view."""

    def __init__(self, allocator: "CPUAllocator", shapes: list, dtypes: list,
                 fmt: MemoryFormat) -> None:
        self.allocator = allocator
        nbytes = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in zip(shapes, dtypes))
        self._backing = np.zeros(nbytes, np.uint8)
        self.raw_data = self._backing
        self.meta = MemoryObjMetadata(tuple(shapes[0]), dtypes[0], self._backing.ctypes.data,
                                      nbytes, 1, fmt, [tuple(s) for s in shapes], list(dtypes))
        self.valid = True

    @property
    def byte_array(self) -> memoryview:
        n = self.raw_data.nbytes
        return memoryview((ctypes.c_ubyte * n).from_address(self.raw_data.ctypes.data))

    @property
    def tensor(self) -> Optional[np.ndarray]:
        if not self.valid:
            return None
        n = int(np.prod(self.meta.shape)) * np.dtype(self.meta.dtype).itemsize
        return self.raw_data[:n].view(self.meta.dtype).reshape(self.meta.shape)

    @property
    def raw_tensor(self) -> np.ndarray:
        return self.raw_data

    def get_size(self) -> int:
        return self.raw_data.nbytes

    def get_shape(self) -> tuple:
        return self.meta.shape

    def get_shapes(self) -> list:
        return list(self.meta.shapes) or [self.meta.shape]

    def get_dtype(self) -> Any:
        return self.meta.dtype

    def get_dtypes(self) -> list:
        return list(self.meta.dtypes) or [self.meta.dtype]

    def get_memory_format(self) -> MemoryFormat:
        return self.meta.fmt

    def is_valid(self) -> bool:
        return self.valid

    def get_ref_count(self) -> int:
        return self.meta.ref_count

    def ref_count_up(self) -> None:
        self.meta.ref_count += 1

    def ref_count_down(self) -> None:
        assert self.meta.ref_count > 0, "ref count underflow"
        self.meta.ref_count -= 1
        if self.meta.ref_count == 0:
            self.valid = False
            self.allocator.free(self)


class CPUAllocator:
    """Hands out MemoryObjs up to ``capacity`` bytes; counts the live ones."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.live: set[int] = set()
        self.lock = threading.Lock()

    def allocate(self, shapes: list, dtypes: list, fmt: MemoryFormat) -> Optional[MemoryObj]:
        obj = MemoryObj(self, shapes, dtypes, fmt)
        with self.lock:
            if self.used + obj.get_size() > self.capacity:
                return None
            self.used += obj.get_size()
            self.live.add(id(obj))
        return obj

    def free(self, obj: MemoryObj) -> None:
        with self.lock:
            self.live.discard(id(obj))
            self.used -= obj.get_size()


# ---- lmcache.v1.config / lmcache.v1.metadata -------------------------------------------------


@dataclass
class LMCacheEngineConfig:
    chunk_size: int = 256
    remote_url: Optional[str] = None
    remote_serde: str = "naive"
    remote_storage_plugins: Optional[list] = None
    extra_config: Optional[dict] = None
    use_layerwise: bool = False
    blocking_timeout_secs: float = 10.0

    @staticmethod
    def from_dict(d: dict) -> "LMCacheEngineConfig":
        known = {f for f in LMCacheEngineConfig.__dataclass_fields__}
        return LMCacheEngineConfig(**{k: v for k, v in d.items() if k in known})

    def get_extra_config_value(self, key: str, default: Any = None) -> Any:
        return (self.extra_config or {}).get(key, default)


@dataclass
class LMCacheMetadata:
    """kv_shape = (num_layer, 2, chunk_size, num_kv_head, head_size), as LMCache's."""

    model_name: str
    world_size: int
    worker_id: int
    kv_dtype: Any
    kv_shape: tuple
    use_mla: bool = False

    @property
    def chunk_size(self) -> int:
        return self.kv_shape[2]

    def get_shapes(self) -> list:
        L, two, T, H, D = self.kv_shape
        return [(two, L, T, H * D)]

    def get_dtypes(self) -> list:
        return [self.kv_dtype]

    def get_num_groups(self) -> int:
        return 1


def get_size_bytes(shapes: list, dtypes: list) -> int:
    return sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in zip(shapes, dtypes))


# ---- lmcache.v1.protocol ---------------------------------------------------------------------

_DTYPES = [np.dtype(t) for t in ("float16", "float32", "uint8", "int8", "float64")]
_MAX_DIMS = 4
_num_groups = 1


def init_remote_metadata_info(num_groups: int) -> None:
    global _num_groups
    _num_groups = num_groups


def get_remote_metadata_bytes() -> int:
    return 16 + _num_groups * (4 + 4 * _MAX_DIMS)


class RemoteMetadata:
    def __init__(self, length: int, shapes: list, dtypes: list, fmt: MemoryFormat) -> None:
        self.length = length
        self.shapes = [tuple(s) for s in shapes]
        self.dtypes = [np.dtype(d) for d in dtypes]
        self.fmt = MemoryFormat(fmt)

    def serialize(self) -> bytes:
        out = struct.pack("<qii", self.length, int(self.fmt), len(self.shapes))
        for shape, dtype in zip(self.shapes, self.dtypes):
            dims = list(shape) + [0] * (_MAX_DIMS - len(shape))
            out += struct.pack("<i" + "i" * _MAX_DIMS, _DTYPES.index(dtype), *dims)
        return out.ljust(get_remote_metadata_bytes(), b"\0")

    @staticmethod
    def deserialize(buf: Any) -> "RemoteMetadata":
        buf = bytes(buf)
        length, fmt, n = struct.unpack_from("<qii", buf, 0)
        shapes, dtypes = [], []
        for g in range(n):
            code, *dims = struct.unpack_from("<i" + "i" * _MAX_DIMS, buf, 16 + g * (4 + 4 * _MAX_DIMS))
            shapes.append(tuple(d for d in dims if d))
            dtypes.append(_DTYPES[code])
        return RemoteMetadata(length, shapes, dtypes, MemoryFormat(fmt))


# ---- lmcache.v1.storage_backend.connector.base_connector -------------------------------------


def resolve_save_chunk_meta(config: LMCacheEngineConfig) -> bool:
    extra = config.extra_config
    if extra is not None and "save_chunk_meta" in extra:
        return bool(extra["save_chunk_meta"])
    return True


class RemoteConnector(metaclass=abc.ABCMeta):
    def __init__(self, config: LMCacheEngineConfig, metadata: Optional[LMCacheMetadata]):
        assert metadata is not None
        self.save_chunk_meta: bool = resolve_save_chunk_meta(config)
        self.meta_shapes = metadata.get_shapes()
        self.meta_dtypes = metadata.get_dtypes()
        self.meta_fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
        self.full_chunk_size_bytes = get_size_bytes(self.meta_shapes, self.meta_dtypes)
        assert self.full_chunk_size_bytes % metadata.chunk_size == 0
        self.single_token_size = self.full_chunk_size_bytes // metadata.chunk_size
        init_remote_metadata_info(metadata.get_num_groups())
        self.remote_metadata_bytes = get_remote_metadata_bytes()

    def reshape_partial_chunk(self, memory_obj: MemoryObj, bytes_read: int) -> MemoryObj:
        if (bytes_read == 0 or bytes_read % self.single_token_size != 0
                or bytes_read > self.full_chunk_size_bytes):
            raise ValueError(f"bytes_read: {bytes_read} is illegal, single_token_size: "
                             f"{self.single_token_size}, full_chunk_size_bytes: "
                             f"{self.full_chunk_size_bytes}")
        if bytes_read == self.full_chunk_size_bytes:
            return memory_obj
        shape = list(memory_obj.meta.shape)
        shape[2] = bytes_read // self.single_token_size  # as LMCache does, dim 2 is tokens
        memory_obj.raw_data = memory_obj.raw_data[:bytes_read]
        memory_obj.meta.shape = tuple(shape)
        if memory_obj.meta.shapes:
            memory_obj.meta.shapes = [tuple(shape)]
        return memory_obj

    def post_init(self):
        pass

    @abc.abstractmethod
    async def exists(self, key: CacheEngineKey) -> bool: ...

    @abc.abstractmethod
    def exists_sync(self, key: CacheEngineKey) -> bool: ...

    @abc.abstractmethod
    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]: ...

    @abc.abstractmethod
    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj): ...

    @abc.abstractmethod
    async def list(self) -> List[str]: ...

    @abc.abstractmethod
    async def close(self): ...

    def support_ping(self) -> bool:
        return False

    async def ping(self) -> int:
        raise NotImplementedError

    def support_batched_get(self) -> bool:
        return False

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        raise NotImplementedError

    def support_batched_put(self) -> bool:
        return False

    def requires_put_completion(self) -> bool:
        return False

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]):
        raise NotImplementedError

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey],
                                     pin: bool = False) -> int:
        results = await asyncio.gather(*(self.exists(k) for k in keys))
        return results.index(False) if False in results else len(results)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str,
                                       keys: List[CacheEngineKey]) -> List[MemoryObj]:
        raise NotImplementedError

    def remove_sync(self, key: CacheEngineKey) -> bool:
        raise NotImplementedError

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        raise NotImplementedError

    def support_batched_contains(self) -> bool:
        return False


# ---- lmcache.v1.storage_backend.connector ----------------------------------------------------


class LocalCPUBackend:
    """What connectors use of LMCache's LocalCPUBackend: ``allocate``, config, metadata."""

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheMetadata,
                 capacity: int = 64 << 20) -> None:
        self.config = config
        self.metadata = metadata
        self.memory_allocator = CPUAllocator(capacity)

    def allocate(self, shapes: Any, dtypes: Any, fmt: MemoryFormat = MemoryFormat.UNDEFINED,
                 **kwargs: Any) -> Optional[MemoryObj]:
        if not isinstance(dtypes, list):  # the single-group form: allocate(shape, dtype, fmt)
            shapes, dtypes = [shapes], [dtypes]
        return self.memory_allocator.allocate(shapes, dtypes, fmt)


class ConnectorContext:
    def __init__(self, url, loop, local_cpu_backend, config, metadata, plugin_name=None):
        self.url = url
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.config = config
        self.metadata = metadata
        self.plugin_name = plugin_name


class ConnectorAdapter(abc.ABC):
    def __init__(self, schema: str = "") -> None:
        self.schema = schema

    def can_parse(self, url: str) -> bool:
        return self.schema != "" and url.startswith(self.schema)

    @abc.abstractmethod
    def create_connector(self, context: ConnectorContext) -> RemoteConnector: ...


class ConnectorManager:
    def __init__(self, url, loop, local_cpu_backend, config=None, metadata=None,
                 plugin_name=None) -> None:
        self.context = ConnectorContext(url, loop, local_cpu_backend, config, metadata,
                                        plugin_name)
        self.adapters: List[ConnectorAdapter] = []
        self._remote_adapters_plugin_launcher(config)

    def _remote_adapters_plugin_launcher(self, config: LMCacheEngineConfig) -> None:
        if config is None:
            return
        for plugin in set(config.remote_storage_plugins or []):
            extra = config.extra_config
            if extra is None:
                continue
            module_path = extra.get(f"remote_storage_plugin.{plugin}.module_path")
            class_name = extra.get(f"remote_storage_plugin.{plugin}.class_name")
            if not module_path or not class_name:
                continue
            module = importlib.import_module(module_path)
            adapter = getattr(module, class_name)()
            if isinstance(adapter, ConnectorAdapter):
                self.adapters.append(adapter)

    def create_connector(self) -> RemoteConnector:
        for adapter in self.adapters:
            if adapter.can_parse(self.context.url):
                return adapter.create_connector(self.context)
        raise ValueError(f"No adapter found for URL: {self.context.url}")


class InstrumentedRemoteConnector(RemoteConnector):
    def __init__(self, connector: RemoteConnector):
        self._connector = connector

    async def put(self, key, memory_obj) -> None:
        try:
            await self._connector.put(key, memory_obj)
        finally:
            memory_obj.ref_count_down()

    async def get(self, key):
        return await self._connector.get(key)

    async def exists(self, key) -> bool:
        return await self._connector.exists(key)

    def exists_sync(self, key) -> bool:
        return self._connector.exists_sync(key)

    async def list(self):
        return await self._connector.list()

    async def close(self) -> None:
        await self._connector.close()

    def getWrappedConnector(self) -> RemoteConnector:
        return self._connector

    def support_ping(self) -> bool:
        return self._connector.support_ping()

    async def ping(self) -> int:
        return await self._connector.ping()

    def support_batched_put(self) -> bool:
        return self._connector.support_batched_put()

    def support_batched_get(self) -> bool:
        return self._connector.support_batched_get()

    def support_batched_async_contains(self) -> bool:
        return self._connector.support_batched_async_contains()

    async def batched_async_contains(self, lookup_id, keys, pin=False) -> int:
        return await self._connector.batched_async_contains(lookup_id, keys, pin)

    def support_batched_get_non_blocking(self) -> bool:
        return self._connector.support_batched_get_non_blocking()

    async def batched_get_non_blocking(self, lookup_id, keys):
        return await self._connector.batched_get_non_blocking(lookup_id, keys)

    async def batched_get(self, keys):
        return await self._connector.batched_get(keys)

    async def batched_put(self, keys, memory_objs):
        try:
            await self._connector.batched_put(keys, memory_objs)
        finally:
            for memory_obj in memory_objs:
                memory_obj.ref_count_down()

    def remove_sync(self, key) -> bool:
        return self._connector.remove_sync(key)

    def batched_contains(self, keys) -> int:
        return self._connector.batched_contains(keys)

    def support_batched_contains(self) -> bool:
        return self._connector.support_batched_contains()

    def reshape_partial_chunk(self, memory_obj, bytes_read):
        return self._connector.reshape_partial_chunk(memory_obj, bytes_read)

    def post_init(self):
        return self._connector.post_init()


def CreateConnector(url, loop, local_cpu_backend, config=None, metadata=None,
                    plugin_name=None) -> InstrumentedRemoteConnector:
    if "://" not in url:
        raise ValueError(f"Invalid remote url {url}: missing scheme")
    manager = ConnectorManager(url, loop, local_cpu_backend, config, metadata, plugin_name)
    connector = manager.create_connector()
    connector.post_init()
    return InstrumentedRemoteConnector(connector)


# ---- lmcache.v1.storage_backend.remote_backend (the driver) ----------------------------------


class RemoteBackend:
    """Drives the connector as LMCache's RemoteBackend does: a storage event loop on its own
    thread, blocking callers using run_coroutine_threadsafe (naive serde: no conversion)."""

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheMetadata,
                 loop: asyncio.AbstractEventLoop, local_cpu_backend: LocalCPUBackend) -> None:
        self.config = config
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.blocking_timeout_secs = config.blocking_timeout_secs
        self.connection = CreateConnector(config.remote_url, loop, local_cpu_backend, config,
                                          metadata)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.blocking_timeout_secs)

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        if self.config.get_extra_config_value("use_exists_sync", False):
            return self.connection.exists_sync(key)
        return self._run(self.connection.exists(key))

    def batched_contains(self, keys: List[CacheEngineKey], pin: bool = False) -> int:
        if not self.connection.support_batched_contains():
            for i, key in enumerate(keys):
                if not self.contains(key):
                    return i
            return len(keys)
        return self.connection.batched_contains(keys)

    def submit_put_task(self, key: CacheEngineKey, memory_obj: MemoryObj) -> Future:
        memory_obj.ref_count_up()
        return asyncio.run_coroutine_threadsafe(self.connection.put(key, memory_obj), self.loop)

    def batched_submit_put_task(self, keys, memory_objs) -> Optional[Future]:
        if not self.connection.support_batched_put():
            for key, obj in zip(keys, memory_objs):
                self.submit_put_task(key, obj)
            return None
        for obj in memory_objs:
            obj.ref_count_up()
        return asyncio.run_coroutine_threadsafe(self.connection.batched_put(keys, memory_objs),
                                                self.loop)

    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return self._run(self.connection.get(key))

    def batched_get_blocking(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        if self.connection.support_batched_get():
            return self._run(self.connection.batched_get(keys))
        return [self.get_blocking(k) for k in keys]

    def batched_async_contains(self, lookup_id: str, keys, pin: bool = False) -> int:
        assert self.connection.support_batched_async_contains()
        return self._run(self.connection.batched_async_contains(lookup_id, keys, pin))

    def batched_get_non_blocking(self, lookup_id: str, keys) -> List[MemoryObj]:
        return self._run(self.connection.batched_get_non_blocking(lookup_id, keys))

    def remove(self, key, force: bool = True) -> bool:
        return self.connection.remove_sync(key)

    def close(self) -> None:
        self._run(self.connection.close())


class StorageLoop:
    """The storage event loop on its own thread (LMCache's StorageManager runs one)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


# ---- installing it ---------------------------------------------------------------------------

_MODULES = {
    "lmcache": {},
    "lmcache.utils": {"CacheEngineKey": CacheEngineKey},
    "lmcache.logging": {"init_logger": __import__("logging").getLogger},
    "lmcache.v1": {},
    "lmcache.v1.config": {"LMCacheEngineConfig": LMCacheEngineConfig},
    "lmcache.v1.metadata": {"LMCacheMetadata": LMCacheMetadata},
    "lmcache.v1.memory_management": {"MemoryObj": MemoryObj, "MemoryFormat": MemoryFormat},
    "lmcache.v1.protocol": {"RemoteMetadata": RemoteMetadata,
                            "init_remote_metadata_info": init_remote_metadata_info,
                            "get_remote_metadata_bytes": get_remote_metadata_bytes},
    "lmcache.v1.storage_backend": {},
    "lmcache.v1.storage_backend.local_cpu_backend": {"LocalCPUBackend": LocalCPUBackend},
    "lmcache.v1.storage_backend.connector.base_connector": {"RemoteConnector": RemoteConnector},
    "lmcache.v1.storage_backend.connector": {
        "ConnectorAdapter": ConnectorAdapter, "ConnectorContext": ConnectorContext,
        "ConnectorManager": ConnectorManager, "CreateConnector": CreateConnector,
        "InstrumentedRemoteConnector": InstrumentedRemoteConnector, "RemoteConnector": RemoteConnector},
    "lmcache.v1.storage_backend.remote_backend": {"RemoteBackend": RemoteBackend},
}


def install(monkeypatch: Any) -> None:
    """Put the stand-in modules into ``sys.modules`` for one test (``monkeypatch`` undoes it)."""
    for name, attrs in _MODULES.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        module.__path__ = []  # a package, so submodules resolve through sys.modules
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "kvservice.integrations.lmcache", raising=False)  # import afresh
