"""SGLang HiCache storage backend (L3) on kvservice.

SGLang loads it as a dynamic backend (``StorageBackendFactory._create_dynamic_backend``, which
calls ``KVServiceHiCacheStorage(storage_config, kwargs)``)::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvservice",
            "module_path": "kvservice.integrations.sglang",
            "class_name": "KVServiceHiCacheStorage",
            "url": "kvservice://kv", "namespace": "sglang", "interface_v1": 1}'

``url`` takes the forms of :func:`kvservice.integrations.parse_service_url` (default
``kvservice://kv``); ``namespace`` defaults to ``sglang``. It implements SGLang's
``HiCacheStorage`` (``python/sglang/srt/mem_cache/hicache_storage.py``), which SGLang calls
synchronously from its prefetch and backup threads, over one blocking
:class:`~kvservice.SyncKVClient` (its RPCs are serialised per client; copies run unlocked).

A page is stored under its SGLang page hash plus a rank suffix (as SGLang's file backend names
its files: ``_{model}``, then ``_{tp_rank}_{tp_size}`` unless the model is MLA, ``_{pp_size}_
{pp_rank}`` with pipeline parallelism, ``_cp{rank}_{size}`` with context parallelism); its value
is the host pool's flat data page (``get_data_page(i, flat=True)``). SGLang reaches it two ways:

- the generic path (default for dynamic backends): ``batch_get(keys, dummy_pages)`` copies each
  value into the flat page tensors SGLang hands in, ``batch_set(keys, pages)`` stores them;
- the zero-copy path (``"interface_v1": 1`` in the extra config): ``batch_get_v1`` /
  ``batch_set_v1`` copy between the pool and the host KV buffer in place, through the page
  pointers of ``mem_pool_host.get_page_buffer_meta`` (a page's buffers, in that order, are its
  flat data page in the page-first layouts SGLang's zero-copy backends require).

Either way one ``batch_get`` RPC leases a whole batch and one copy moves each page;
``batch_exists`` is one ``lookup_prefix`` RPC.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, List, Optional

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

import cxlrpc
from kvservice.client import SyncKVClient
from kvservice.integrations import parse_service_url, readable_bytes, writable_bytes
from kvservice.pool import Block, LeaseExpired

logger = logging.getLogger(__name__)

DEFAULT_URL = "kvservice://kv"
DEFAULT_NAMESPACE = "sglang"
# clear() removes the keys this process stored; it remembers at most this many (oldest dropped)
TRACKED_KEYS = 1 << 20


def _key_suffix(config: HiCacheStorageConfig | None) -> str:
    if config is None:
        return ""
    model = "-".join(config.model_name.split("/")) if config.model_name else ""
    suffix = f"_{model}"
    if not config.is_mla_model:
        suffix += f"_{config.tp_rank}_{config.tp_size}"
    if config.pp_size > 1:
        suffix += f"_{config.pp_size}_{config.pp_rank}"
    if getattr(config, "attn_cp_size", 1) > 1:
        suffix += f"_cp{config.attn_cp_rank}_{config.attn_cp_size}"
    return suffix


class KVServiceHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over a kvservice (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig | None = None,
                 kwargs: dict | None = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        parsed = parse_service_url(str(extra.get("url", DEFAULT_URL)))
        self.storage_config = storage_config
        self.service_url = parsed.url
        self.namespace = str(extra.get("namespace") or parsed.namespace or DEFAULT_NAMESPACE)
        self.ttl = parsed.ttl
        self.lease_s = parsed.lease_s
        self.suffix = _key_suffix(storage_config)
        self.enable_storage_metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self.kv = SyncKVClient.connect(self.service_url)
        self._lock = threading.Lock()
        self._stored: dict[str, None] = {}  # insertion-ordered set of keys stored here
        self._metrics = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                         "backup_bandwidth": []}
        self._closed = False

    # ---- helpers -------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return key + self.suffix

    def _remember(self, keys: Sequence[str]) -> None:
        with self._lock:
            for k in keys:
                self._stored[k] = None
            while len(self._stored) > TRACKED_KEYS:
                del self._stored[next(iter(self._stored))]

    def _record(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        if not self.enable_storage_metrics or pages == 0:
            return
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    @staticmethod
    def _fill(block: Block, dst: memoryview) -> bool:
        """Copy a leased block into ``dst`` (it must be exactly the value's size); ends the
        lease. False, logged, when it does not fit or its lease lapsed during the copy."""
        with block:
            if block.size != len(dst):
                logger.warning("stored page is %d bytes, the target %d", block.size, len(dst))
                return False
            try:
                block.copy_into(dst)
            except LeaseExpired:
                logger.warning("lease lapsed while reading a page: treated as a miss")
                return False
        return True

    def _target(self, location: Any, size: Any) -> tuple[Any, memoryview]:
        if location is None:
            pool = getattr(self, "mem_pool_host", None)
            if pool is None:
                raise ValueError("get needs a target_location (or a registered host pool)")
            location = pool.get_dummy_flat_data_page()
        if isinstance(size, (list, tuple)):
            size = sum(size)
        return location, writable_bytes(location, size)

    def _source(self, value: Any, location: Any, size: Any) -> memoryview:
        if value is not None:
            return readable_bytes(value)
        if location is None:
            raise ValueError("set needs a value (or a target_location with target_sizes)")
        if isinstance(size, (list, tuple)):
            size = sum(size)
        return readable_bytes(location, size)

    # ---- HiCacheStorage: the generic interface ----------------------------------------------
    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Any | None:
        """Copy ``key``'s page into ``target_location`` (a CPU tensor or buffer, or an address
        with ``target_sizes`` bytes) and return it; None on a miss."""
        return self.batch_get([key], None if target_location is None else [target_location],
                              None if target_sizes is None else [target_sizes])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Any | None]:
        """One RPC leases every page; each hit is copied into its target (returned), each miss
        or failed copy is None."""
        if not keys:
            return []
        locations = list(target_locations) if target_locations is not None else [None] * len(keys)
        sizes = list(target_sizes) if target_sizes is not None else [None] * len(keys)
        if not len(locations) == len(sizes) == len(keys):
            raise ValueError(f"{len(keys)} keys, {len(locations)} targets, {len(sizes)} sizes")
        start = time.perf_counter()
        try:
            blocks = self.kv.batch_get([self._key(k) for k in keys], self.namespace, self.lease_s)
        except cxlrpc.RpcError as exc:
            logger.warning("kvservice batch_get failed: %s", exc)
            return [None] * len(keys)
        out: list[Any | None] = []
        nbytes = 0
        for i, block in enumerate(blocks):
            if block is None:
                out.append(None)
                continue
            try:
                location, dst = self._target(locations[i], sizes[i])
            except Exception:
                for b in blocks[i:]:
                    if b is not None:
                        b.release()
                raise
            ok = self._fill(block, dst)
            nbytes += len(dst) if ok else 0
            out.append(location if ok else None)
        self._record("prefetch", sum(o is not None for o in out), nbytes,
                     time.perf_counter() - start)
        return out

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Store a page: ``value`` (a CPU tensor or buffer), or ``target_sizes`` bytes at the
        address ``target_location``. True once every reader can see it."""
        return self.batch_set([key], None if value is None else [value],
                              None if target_location is None else [target_location],
                              None if target_sizes is None else [target_sizes])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Store the pages with one reservation RPC and one commit (all or none)."""
        if not keys:
            return True
        n = len(keys)
        values = list(values) if values is not None else [None] * n
        locations = list(target_locations) if target_locations is not None else [None] * n
        sizes = list(target_sizes) if target_sizes is not None else [None] * n
        if not len(values) == len(locations) == len(sizes) == n:
            raise ValueError(f"{n} keys, {len(values)} values, {len(locations)} targets")
        try:
            items = {self._key(k): self._source(v, loc, s)
                     for k, v, loc, s in zip(keys, values, locations, sizes)}
        except (TypeError, ValueError) as exc:
            logger.error("cannot store pages: %s", exc)
            return False
        return self._put(items, "backup")

    def _put(self, items: dict[str, Any], kind: str) -> bool:
        start = time.perf_counter()
        try:
            self.kv.batch_put(items, self.namespace, self.ttl)
        except (cxlrpc.RpcError, ValueError) as exc:  # ResourceExhausted: the pool is full
            logger.warning("kvservice batch_put of %d pages failed: %s", len(items), exc)
            return False
        self._remember(list(items))
        self._record(kind, len(items), sum(len(memoryview(v)) for v in items.values()),
                     time.perf_counter() - start)
        return True

    def exists(self, key: str) -> bool:
        try:
            return self.kv.exists(self._key(key), self.namespace)
        except cxlrpc.RpcError as exc:  # SGLang's prefetch thread does not survive a raise
            logger.warning("kvservice exists failed: %s", exc)
            return False

    def batch_exists(self, keys: List[str], extra_info: Optional[Any] = None) -> int:
        """How many leading pages are stored: one lookup_prefix RPC (0 if the service fails)."""
        if not keys:
            return 0
        try:
            return self.kv.lookup_keys([self._key(k).encode() for k in keys], self.namespace)
        except cxlrpc.RpcError as exc:
            logger.warning("kvservice lookup_prefix failed: %s", exc)
            return 0

    # ---- HiCacheStorage: the zero-copy interface (extra config "interface_v1": 1) -----------
    def _page_buffers(self, keys: List[str], host_indices: Any) -> list[list[memoryview]]:
        pool = self.mem_pool_host
        page_size = getattr(pool, "page_size", 1) or 1
        if len(host_indices) != len(keys) * page_size:
            raise ValueError(f"{len(host_indices)} host indices for {len(keys)} pages of "
                             f"{page_size}")
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        if not ptrs or len(ptrs) % len(keys) or len(ptrs) != len(sizes):
            raise ValueError(f"host pool gave {len(ptrs)} buffers for {len(keys)} pages")
        per = len(ptrs) // len(keys)
        views = [writable_bytes(int(p), int(s)) for p, s in zip(ptrs, sizes)]
        return [views[i * per:(i + 1) * per] for i in range(len(keys))]

    def batch_get_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Optional[Any] = None) -> List[bool]:
        """Copy each stored page straight into the host KV buffer; one bool per page."""
        if not keys:
            return []
        pages = self._page_buffers(keys, host_indices)
        start = time.perf_counter()
        try:
            blocks = self.kv.batch_get([self._key(k) for k in keys], self.namespace, self.lease_s)
        except cxlrpc.RpcError as exc:
            logger.warning("kvservice batch_get failed: %s", exc)
            return [False] * len(keys)
        results: list[bool] = []
        nbytes = 0
        for block, parts in zip(blocks, pages):
            if block is None:
                results.append(False)
                continue
            with block:
                total = sum(map(len, parts))
                if block.size != total:
                    logger.warning("stored page is %d bytes, the host page %d", block.size, total)
                    results.append(False)
                    continue
                try:
                    src, pos = block.view(), 0
                    for part in parts:
                        part[:] = src[pos:pos + len(part)]
                        pos += len(part)
                    block.check()
                except LeaseExpired:
                    results.append(False)
                    continue
            results.append(True)
            nbytes += total
        self._record("prefetch", sum(results), nbytes, time.perf_counter() - start)
        return results

    def batch_set_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Optional[Any] = None) -> List[bool]:
        """Store each page from the host KV buffer (one RPC pair for the batch; a page held in
        several buffers, K and V, is gathered into one value first)."""
        if not keys:
            return []
        pages = self._page_buffers(keys, host_indices)
        items = {self._key(k): parts[0] if len(parts) == 1 else b"".join(parts)
                 for k, parts in zip(keys, pages)}
        return [self._put(items, "backup")] * len(keys)

    # ---- HiCacheStorage: housekeeping ------------------------------------------------------
    def clear(self) -> bool:
        """Remove the pages this process stored (kvservice has no namespace-wide clear: pages
        stored by other processes stay until evicted)."""
        with self._lock:
            keys, self._stored = list(self._stored), {}
        try:
            for k in keys:
                self.kv.remove(k, self.namespace)
        except cxlrpc.RpcError as exc:
            logger.error("clearing kvservice pages failed: %s", exc)
            return False
        return True

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (with ``enable_storage_metrics``),
        else None. ``kv_stats()`` gives the service's own counters."""
        if not self.enable_storage_metrics:
            return None
        from sglang.srt.metrics.collector import StorageMetrics

        with self._lock:
            metrics, self._metrics = self._metrics, {k: [] for k in self._metrics}
        return StorageMetrics(**metrics)

    def kv_stats(self) -> dict[str, Any]:
        """The service's hits, misses, evictions and usage for this backend's namespace."""
        return self.kv.stats(self.namespace)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.kv.close()
