"""A structural stand-in for the parts of SGLang (sgl-project/sglang, python/sglang/srt/...)
that a HiCache storage backend touches, with numpy in place of torch. Installed into
``sys.modules`` by the tests only (:func:`install`); never shipped.

Written from SGLang's sources:
- ``mem_cache/hicache_storage.py``: ``HiCacheStorageConfig`` (fields), ``HiCacheStorageExtraInfo``,
  ``HiCacheStorage`` (abstract get/batch_get/set/batch_set/exists, batch_exists's leading-prefix
  count, batch_get_v1/batch_set_v1, register_mem_pool_host, clear, get_stats);
- ``mem_cache/storage/backend_factory.py``: ``StorageBackendFactory`` ("dynamic": backend_name,
  module_path, class_name from extra_config; issubclass check; ``backend_class(storage_config,
  kwargs)``);
- ``managers/cache_controller.py``: how HiCacheController calls a backend (attach:
  create_backend then register_mem_pool_host; ``_storage_hit_query``: batch_exists over the
  page-hash chain in STORAGE_BATCH_SIZE batches; ``_generic_page_get``: batch_get into
  ``get_dummy_flat_data_page()`` pages then ``set_from_flat_data_page``; ``_generic_page_set``:
  batch_set of ``get_data_page`` pages; with extra_config interface_v1, batch_get_v1 /
  batch_set_v1 over host indices);
- ``mem_cache/memory_pool_host.py``: a page-first MHA host pool (kv_buffer (2, size, layers,
  heads, dim); ``get_page_buffer_meta``: a K and a V pointer per page);
- ``metrics/collector.py``: ``StorageMetrics``.
"""
from __future__ import annotations

import abc
import hashlib
import importlib
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

STORAGE_BATCH_SIZE = 128

# ---- sglang.srt.mem_cache.hicache_storage ----------------------------------------------------


@dataclass
class HiCacheStorageConfig:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int
    is_mla_model: bool
    enable_storage_metrics: bool
    is_page_first_layout: bool
    model_name: Optional[str]
    dp_rank: int = 0
    dp_size: int = 1
    tp_lcm_size: Optional[int] = None
    should_split_heads: bool = False
    extra_config: Optional[dict] = None


@dataclass
class HiCacheStorageExtraInfo:
    prefix_keys: Optional[List[str]] = None
    extra_info: Optional[dict] = None


class HiCacheStorage(abc.ABC):
    def register_mem_pool_host(self, mem_pool_host: Any):
        self.mem_pool_host = mem_pool_host

    def batch_get_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        raise NotImplementedError()

    def batch_set_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        raise NotImplementedError()

    @abc.abstractmethod
    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Any: ...

    @abc.abstractmethod
    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> Any: ...

    @abc.abstractmethod
    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool: ...

    @abc.abstractmethod
    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool: ...

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        for i in range(len(keys)):
            if not self.exists(keys[i]):
                return i
        return len(keys)

    def clear(self) -> None:
        pass

    def get_stats(self):
        return None


# ---- sglang.srt.metrics.collector ------------------------------------------------------------


@dataclass
class StorageMetrics:
    prefetch_pgs: List[int] = field(default_factory=list)
    backup_pgs: List[int] = field(default_factory=list)
    prefetch_bandwidth: List[float] = field(default_factory=list)
    backup_bandwidth: List[float] = field(default_factory=list)


# ---- sglang.srt.mem_cache.storage.backend_factory --------------------------------------------


class StorageBackendFactory:
    _registry: Dict[str, Dict[str, Any]] = {}

    @staticmethod
    def _load_backend_class(module_path: str, class_name: str, backend_name: str):
        module = importlib.import_module(module_path)
        backend_class = getattr(module, class_name)
        if not issubclass(backend_class, HiCacheStorage):
            raise TypeError(f"Backend class {class_name} must inherit from HiCacheStorage")
        return backend_class

    @classmethod
    def create_backend(cls, backend_name: str, storage_config: HiCacheStorageConfig,
                       mem_pool_host: Any, **kwargs) -> HiCacheStorage:
        if backend_name == "dynamic" and storage_config.extra_config is not None:
            return cls._create_dynamic_backend(storage_config.extra_config, storage_config,
                                               mem_pool_host, **kwargs)
        raise ValueError(f"Unknown storage backend '{backend_name}'.")

    @classmethod
    def _create_dynamic_backend(cls, backend_config, storage_config, mem_pool_host, **kwargs):
        for name in ("backend_name", "module_path", "class_name"):
            if name not in backend_config:
                raise ValueError(f"Missing required field '{name}' in backend config for "
                                 f"'dynamic' backend")
        backend_class = cls._load_backend_class(backend_config["module_path"],
                                                backend_config["class_name"],
                                                backend_config["backend_name"])
        return backend_class(storage_config, kwargs)


# ---- sglang.srt.mem_cache.memory_pool_host (page-first MHA) ----------------------------------


class HostKVCache:
    def __init__(self, size: int, page_size: int, layer_num: int, head_num: int, head_dim: int,
                 dtype: Any = np.float16) -> None:
        self.layout = "page_first"
        self.size = size
        self.page_size = page_size
        self.layer_num = layer_num
        self.head_num = head_num
        self.head_dim = head_dim
        self.dtype = np.dtype(dtype)
        self.kv_buffer = np.zeros((2, size, layer_num, head_num, head_dim), self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> np.ndarray:
        page = np.ascontiguousarray(self.kv_buffer[:, index:index + self.page_size])
        return page.reshape(-1) if flat else page

    def get_dummy_flat_data_page(self) -> np.ndarray:
        return np.zeros((2, self.page_size, self.layer_num, self.head_num, self.head_dim),
                        self.dtype).reshape(-1)

    def set_from_flat_data_page(self, index: int, data_page: np.ndarray) -> None:
        self.kv_buffer[:, index:index + self.page_size] = data_page.reshape(
            2, self.page_size, self.layer_num, self.head_num, self.head_dim)

    def get_page_buffer_meta(self, indices: Any):
        assert len(indices) % self.page_size == 0
        base = self.kv_buffer.ctypes.data
        per_token = self.layer_num * self.head_num * self.head_dim * self.dtype.itemsize
        v_offset = self.size * per_token
        ptrs = []
        idx = [int(i) for i in indices]
        for i in range(0, len(idx), self.page_size):
            k_ptr = base + idx[i] * per_token
            ptrs += [k_ptr, k_ptr + v_offset]
        return ptrs, [per_token * self.page_size] * len(ptrs)


# ---- the controller's calls (managers/cache_controller.py) -----------------------------------


def get_hash_str(token_ids: List[int], prior_hash: Optional[str], page_size: int) -> List[str]:
    """A page-hash chain over full pages (SGLang chains SHA-256 over each page's tokens)."""
    out, prev = [], prior_hash
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        h = hashlib.sha256()
        if prev:
            h.update(bytes.fromhex(prev))
        h.update(np.asarray(token_ids[start:start + page_size], np.int64).tobytes())
        prev = h.hexdigest()
        out.append(prev)
    return out


class Controller:
    """The HiCacheController storage paths, synchronous (SGLang runs them on its threads)."""

    def __init__(self, storage_backend: str, extra_config: dict, host_pool: HostKVCache,
                 model_name: str = "Qwen/Qwen3-0.6B", tp_rank: int = 0, tp_size: int = 1,
                 enable_storage_metrics: bool = False) -> None:
        self.page_size = host_pool.page_size
        self.storage_host_pool = host_pool
        self.storage_config = HiCacheStorageConfig(
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
            attn_cp_size=1, is_mla_model=False, enable_storage_metrics=enable_storage_metrics,
            is_page_first_layout=True, model_name=model_name, extra_config=dict(extra_config))
        self.storage_backend = StorageBackendFactory.create_backend(
            storage_backend, self.storage_config, host_pool)
        self.storage_backend.register_mem_pool_host(host_pool)
        if storage_backend == "dynamic" and bool(self.storage_config.extra_config.get(
                "interface_v1", 0)):
            self.page_get_func, self.page_set_func = self._page_get_zero_copy, self._page_set_zero_copy
        else:
            self.page_get_func, self.page_set_func = self._generic_page_get, self._generic_page_set

    def storage_hit_query(self, token_ids: List[int]) -> List[str]:
        hashes = get_hash_str(token_ids, None, self.page_size)
        hits: List[str] = []
        for start in range(0, len(hashes), STORAGE_BATCH_SIZE):
            batch = hashes[start:start + STORAGE_BATCH_SIZE]
            n = self.storage_backend.batch_exists(batch, HiCacheStorageExtraInfo())
            hits += batch[:n]
            if n < len(batch):
                break
        return hits

    def _generic_page_get(self, hash_values, host_indices, extra_info=None) -> int:
        dummy = [self.storage_host_pool.get_dummy_flat_data_page() for _ in hash_values]
        page_data = self.storage_backend.batch_get(hash_values, dummy)
        if page_data is None:
            return 0
        count = 0
        for i in range(len(hash_values)):
            if page_data[i] is None:
                break
            self.storage_host_pool.set_from_flat_data_page(host_indices[i * self.page_size],
                                                           page_data[i])
            count += 1
        return count

    def _page_get_zero_copy(self, hash_values, host_indices, extra_info=None) -> int:
        results = self.storage_backend.batch_get_v1(hash_values, host_indices, extra_info)
        inc = 0
        for ok in results:
            if not ok:
                break
            inc += 1
        return inc

    def _generic_page_set(self, hash_values, host_indices, extra_info=None) -> bool:
        data = [self.storage_host_pool.get_data_page(host_indices[i * self.page_size])
                for i in range(len(hash_values))]
        return self.storage_backend.batch_set(hash_values, data)

    def _page_set_zero_copy(self, hash_values, host_indices, extra_info=None) -> bool:
        return all(self.storage_backend.batch_set_v1(hash_values, host_indices, extra_info))

    def backup(self, token_ids: List[int], host_indices: np.ndarray) -> int:
        """Write the pages of ``token_ids`` (held at ``host_indices``); tokens written."""
        hashes = get_hash_str(token_ids, None, self.page_size)
        done = 0
        for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
            batch = hashes[i:i + STORAGE_BATCH_SIZE]
            idx = host_indices[i * self.page_size:(i + len(batch)) * self.page_size]
            if not self.page_set_func(batch, idx, HiCacheStorageExtraInfo()):
                break
            done += len(batch) * self.page_size
        return done

    def prefetch(self, token_ids: List[int], host_indices: np.ndarray) -> int:
        """Query the hit prefix, then load it into ``host_indices``; tokens loaded."""
        hashes = self.storage_hit_query(token_ids)
        done = 0
        for i in range(0, len(hashes), STORAGE_BATCH_SIZE):
            batch = hashes[i:i + STORAGE_BATCH_SIZE]
            idx = host_indices[i * self.page_size:(i + len(batch)) * self.page_size]
            got = self.page_get_func(batch, idx, HiCacheStorageExtraInfo())
            done += got * self.page_size
            if got != len(batch):
                break
        return done


# ---- installing it ---------------------------------------------------------------------------

_MODULES = {
    "sglang": {},
    "sglang.srt": {},
    "sglang.srt.mem_cache": {},
    "sglang.srt.mem_cache.hicache_storage": {
        "HiCacheStorage": HiCacheStorage, "HiCacheStorageConfig": HiCacheStorageConfig,
        "HiCacheStorageExtraInfo": HiCacheStorageExtraInfo, "STORAGE_BATCH_SIZE": STORAGE_BATCH_SIZE},
    "sglang.srt.mem_cache.storage": {"StorageBackendFactory": StorageBackendFactory},
    "sglang.srt.mem_cache.storage.backend_factory": {"StorageBackendFactory": StorageBackendFactory},
    "sglang.srt.mem_cache.memory_pool_host": {"HostKVCache": HostKVCache},
    "sglang.srt.metrics": {},
    "sglang.srt.metrics.collector": {"StorageMetrics": StorageMetrics},
}


def install(monkeypatch: Any) -> None:
    """Put the stand-in modules into ``sys.modules`` for one test (``monkeypatch`` undoes it)."""
    for name, attrs in _MODULES.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        module.__path__ = []
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "kvservice.integrations.sglang", raising=False)  # import afresh
