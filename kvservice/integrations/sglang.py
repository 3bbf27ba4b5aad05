"""SGLang HiCache storage backend (L3) on kvservice.

SGLang loads it as a dynamic backend (``StorageBackendFactory._create_dynamic_backend``, which
calls ``KVServiceHiCacheStorage(storage_config, kwargs)``)::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvservice",
            "module_path": "kvservice.integrations.sglang",
            "class_name": "KVServiceHiCacheStorage",
            "url": "kvservice://kv", "namespace": "sglang", "interface_v1": 1}'

``url`` takes the forms of ``kvservice.integrations.parse_service_url`` (default
``kvservice://kv``); ``namespace`` defaults to ``sglang``. It implements SGLang's
``HiCacheStorage`` (``python/sglang/srt/mem_cache/hicache_storage.py``), which SGLang calls
synchronously from its prefetch and backup threads, over one blocking
``kvservice.SyncKVClient`` (its RPCs are serialised per client; copies run unlocked).

A page is stored under its SGLang page hash plus a rank suffix (as SGLang's file backend names
its files: ``_{model}``, then ``_{tp_rank}_{tp_size}`` unless the model is MLA, ``_{pp_size}_
{pp_rank}`` with pipeline parallelism, ``_cp{rank}_{size}`` with context parallelism); its value
is the host pool's flat data page (``get_data_page(i, flat=True)``). SGLang reaches it two ways:

- the generic path (default for dynamic backends): ``batch_get(keys, dummy_pages)`` copies each
  value into the flat page tensors SGLang hands in, ``batch_set(keys, pages)`` stores them;
- the zero-copy path (``"interface_v1": 1`` in the extra config): ``batch_get_v1`` /
  ``batch_set_v1`` copy between the pool and the host KV buffer in place, through the page
  pointers of ``mem_pool_host.get_page_buffer_meta``, stored in that order: the flat data
  page in every layout SGLang 0.5.23 stores from (``layer_first``, ``page_first``,
  ``page_first_direct``) but MHA's ``layer_first``, where K and V alternate per layer (so
  there the two paths do not read each other's pages).

Either way one ``batch_get`` RPC leases a whole batch and one copy moves each page;
``batch_exists`` is one ``lookup_prefix`` RPC.

Hybrid models (SWA, Mamba, DSA pools) attach every host pool with ``register_mem_host_pool_v2``
and move their pages with ``batch_set_v2`` / ``batch_get_v2`` / ``batch_exists_v2``: a page of
pool ``P`` is stored under ``{hash}.{P}`` (the KV pool's under ``{hash}``, so v1 and v2 share
it), copied through that pool's page buffers as in the zero-copy path.

Bad input from the engine never reaches memory it does not own: host indices outside the pool,
not one page per key, or page buffers the pool reports outside its own tensors fail the
transfer (all False, logged); a key longer than kvservice's limit and a target of the wrong
size are misses (None/False); a closed backend raises ``RuntimeError``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, List, Optional

import numpy as np
import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

import cxlrpc
from kvservice.client import SyncKVClient
from kvservice.integrations import parse_service_url, readable_bytes, writable_bytes
from kvservice.keys import MAX_KEY_BYTES
from kvservice.pool import Block, LeaseExpired

logger = logging.getLogger(__name__)

DEFAULT_URL = "kvservice://kv"
DEFAULT_NAMESPACE = "sglang"
# clear() removes the keys this process stored; it remembers at most this many (oldest dropped)
TRACKED_KEYS = 1 << 20


def storage_metrics_class() -> type:
    """SGLang's ``StorageMetrics``: in ``sglang.srt.observability.metrics_collector`` since
    SGLang moved it there, in ``sglang.srt.metrics.collector`` before."""
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except ModuleNotFoundError as exc:
        if exc.name not in ("sglang.srt.observability",
                            "sglang.srt.observability.metrics_collector"):
            raise
        from sglang.srt.metrics.collector import StorageMetrics
    metrics: type = StorageMetrics
    return metrics


def _tensors(obj: Any) -> list[Any]:
    """The tensors ``obj`` is or holds (a tensor, or a list/tuple of them)."""
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return [obj] if hasattr(obj, "data_ptr") and hasattr(obj, "element_size") else []


def _pool_ranges(pool: Any) -> list[tuple[int, int]]:
    """The address ranges of every CPU tensor or array a host pool holds (``kv_buffer``, and
    the other buffers some pools page from: Mamba's conv/temporal states, DSA's indexer)."""
    ranges = []
    for value in vars(pool).values():
        for t in _tensors(value):
            if t.device.type == "cpu":
                ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        for a in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(a, np.ndarray):
                ranges.append((a.ctypes.data, a.ctypes.data + a.nbytes))
    return ranges


def page_views(pool: Any, keys: Sequence[str], host_indices: Any) -> list[list[memoryview]]:
    """Each page's host buffers (``pool.get_page_buffer_meta``), checked to lie inside the
    pool's own tensors so that bad indices raise ``ValueError`` instead of touching memory the
    pool does not own (a pool without CPU tensors has no pages to give)."""
    page_size = getattr(pool, "page_size", 1) or 1
    n = len(host_indices)
    if n != len(keys) * page_size:
        raise ValueError(f"{n} host indices for {len(keys)} pages of {page_size}")
    if n:
        idx = host_indices if hasattr(host_indices, "min") else np.asarray(host_indices)
        lo, hi = int(idx.min()), int(idx.max())
        size = getattr(pool, "size", None)
        if lo < 0 or (size is not None and hi >= size):
            raise ValueError(f"host indices {lo}..{hi} outside the host pool of {size} slots")
    try:
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    except (NotImplementedError, AssertionError, ValueError) as exc:
        raise ValueError(f"{type(pool).__name__} cannot describe these pages: {exc!r}") from exc
    if not ptrs or len(ptrs) % len(keys) or len(ptrs) != len(sizes):
        raise ValueError(f"host pool gave {len(ptrs)} buffers for {len(keys)} pages")
    ranges = _pool_ranges(pool)
    views = []
    for p, sz in zip(ptrs, sizes):
        p, sz = int(p), int(sz)
        if not any(a <= p and p + sz <= b for a, b in ranges):
            raise ValueError(f"host page buffer {p:#x}+{sz} lies outside the host pool")
        views.append(writable_bytes(p, sz))
    per = len(ptrs) // len(keys)
    return [views[i * per:(i + 1) * per] for i in range(len(keys))]


def _key_suffix(config: HiCacheStorageConfig | None, per_tp_rank: bool = False) -> str:
    """SGLang's file-backend key suffix; ``per_tp_rank`` for TP-sharded state (Mamba) that
    keeps the TP rank even in MLA models."""
    if config is None:
        return ""
    model = "-".join(config.model_name.split("/")) if config.model_name else ""
    suffix = f"_{model}"
    if per_tp_rank or not config.is_mla_model:
        suffix += f"_{config.tp_rank}_{config.tp_size}"
    if config.pp_size > 1:
        suffix += f"_{config.pp_size}_{config.pp_rank}"
    if getattr(config, "attn_cp_size", 1) > 1:
        suffix += f"_cp{config.attn_cp_rank}_{config.attn_cp_size}"
    return suffix




def _copy_out(block: Block, parts: Sequence[memoryview]) -> bool:
    """Copy a leased block into a page's buffers (their sizes must add up to the block's);
    ends the lease. False, logged, on a size mismatch or a lease that lapsed mid-copy."""
    with block:
        total = sum(map(len, parts))
        if block.size != total:
            logger.warning("stored page is %d bytes, the target %d", block.size, total)
            return False
        try:
            src, pos = block.view(), 0
            for part in parts:
                part[:] = src[pos:pos + len(part)]
                pos += len(part)
            block.check()
        except LeaseExpired:
            logger.warning("lease lapsed while reading a page: treated as a miss")
            return False
    return True


class _KVServiceStorage(HiCacheStorage):
    """SGLang's single-pool ``HiCacheStorage`` calls over a kvservice: the generic and the
    zero-copy (v1) interfaces (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig | None = None,
                 kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        parsed = parse_service_url(str(extra.get("url", DEFAULT_URL)))
        self.storage_config = storage_config
        self.service_url = parsed.url
        self.namespace = str(extra.get("namespace") or parsed.namespace or DEFAULT_NAMESPACE)
        self.ttl = parsed.ttl
        self.lease_s = parsed.lease_s
        self.suffix = _key_suffix(storage_config)
        self.tp_suffix = _key_suffix(storage_config, per_tp_rank=True)
        self.enable_storage_metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self.kv = SyncKVClient.connect(self.service_url)
        self._lock = threading.Lock()
        self._stored: dict[str, None] = {}  # insertion-ordered set of keys stored here
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []}
        self._closed = False

    # ---- helpers -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the kvservice HiCache storage backend is closed")

    def _key(self, key: str, pool: Any = None) -> str | None:
        """The kvservice key of SGLang page hash ``key`` (of host pool ``pool``); None, logged,
        when it is over kvservice's key-length limit."""
        if pool is not None and pool != "kv":
            key = f"{key}.{pool}"
        full = key + (self.tp_suffix if pool == "mamba" else self.suffix)
        if len(full.encode()) > MAX_KEY_BYTES:
            logger.warning("key of %d bytes is over kvservice's %d: treated as a miss",
                           len(full.encode()), MAX_KEY_BYTES)
            return None
        return full

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

    def _lease(self, keys: Sequence[str | None]) -> list[Block | None]:
        """Lease the stored pages of ``keys`` with one RPC (None: a miss, a key over the limit,
        or every page when the service fails)."""
        self._check_open()
        valid = [k for k in keys if k is not None]
        if not valid:
            return [None] * len(keys)
        try:
            got = iter(self.kv.batch_get(valid, self.namespace, self.lease_s))
        except cxlrpc.RpcError as exc:
            logger.warning("kvservice batch_get failed: %s", exc)
            return [None] * len(keys)
        return [None if k is None else next(got) for k in keys]

    def _present(self, keys: Sequence[str | None]) -> list[bool]:
        """Which of ``keys`` are stored (one RPC; all False when the service fails)."""
        valid = [k for k in keys if k is not None]
        if not valid:
            return [False] * len(keys)
        try:
            found = iter(self.kv.batch_exists(valid, self.namespace))
        except cxlrpc.RpcError as exc:
            logger.warning("kvservice batch_exists failed: %s", exc)
            return [False] * len(keys)
        return [False if k is None else bool(next(found)) for k in keys]

    def _put(self, items: dict[str, Any], kind: str) -> bool:
        self._check_open()
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

    def _set_pages(self, keys: List[str | None], pages: List[List[memoryview]]) -> List[bool]:
        """Store pages held in host buffers (all or none; a page in several buffers, K and V,
        is gathered into one value first)."""
        if not keys:
            return []
        full = [k for k in keys if k is not None]
        if len(full) != len(keys):
            return [False] * len(keys)
        items = {k: parts[0] if len(parts) == 1 else b"".join(parts)
                 for k, parts in zip(full, pages)}
        return [self._put(items, "backup")] * len(keys)

    def _get_pages(self, keys: List[str | None], pages: List[List[memoryview]]) -> List[bool]:
        """Copy stored pages straight into host buffers; one bool per page."""
        if not keys:
            return []
        start = time.perf_counter()
        results = [block is not None and _copy_out(block, parts)
                   for block, parts in zip(self._lease(keys), pages)]
        self._record("prefetch", sum(results),
                     sum(sum(map(len, p)) for p, ok in zip(pages, results) if ok),
                     time.perf_counter() - start)
        return results

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
        or failed copy (a target of another size) is None."""
        self._check_open()
        if not keys:
            return []
        locations = list(target_locations) if target_locations is not None else [None] * len(keys)
        sizes = list(target_sizes) if target_sizes is not None else [None] * len(keys)
        if not len(locations) == len(sizes) == len(keys):
            raise ValueError(f"{len(keys)} keys, {len(locations)} targets, {len(sizes)} sizes")
        start = time.perf_counter()
        blocks = self._lease([self._key(k) for k in keys])
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
            ok = _copy_out(block, [dst])
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
        self._check_open()
        if not keys:
            return True
        n = len(keys)
        values = list(values) if values is not None else [None] * n
        locations = list(target_locations) if target_locations is not None else [None] * n
        sizes = list(target_sizes) if target_sizes is not None else [None] * n
        if not len(values) == len(locations) == len(sizes) == n:
            raise ValueError(f"{n} keys, {len(values)} values, {len(locations)} targets")
        full = [k for k in map(self._key, keys) if k is not None]
        if len(full) != n:
            return False
        try:
            items = {k: self._source(v, loc, s)
                     for k, v, loc, s in zip(full, values, locations, sizes)}
        except (TypeError, ValueError) as exc:
            logger.error("cannot store pages: %s", exc)
            return False
        return self._put(items, "backup")

    def exists(self, key: str) -> bool:
        self._check_open()
        return self._present([self._key(key)])[0]

    def batch_exists(self, keys: List[str], extra_info: Optional[Any] = None) -> int:
        """How many leading pages are stored: one lookup_prefix RPC (0 if the service fails;
        the prefix ends at a key over kvservice's limit)."""
        self._check_open()
        full: list[str] = []
        for k in keys:  # the prefix ends at a key over the limit
            key = self._key(k)
            if key is None:
                break
            full.append(key)
        if not full:
            return 0
        try:
            return self.kv.lookup_keys([k.encode() for k in full], self.namespace)
        except cxlrpc.RpcError as exc:
            logger.warning("kvservice lookup_prefix failed: %s", exc)
            return 0

    # ---- HiCacheStorage: the zero-copy interface (extra config "interface_v1": 1) -----------
    def _host_pages(self, keys: List[str], host_indices: Any) -> list[list[memoryview]] | None:
        try:
            return page_views(self.mem_pool_host, keys, host_indices)
        except ValueError as exc:
            logger.error("zero-copy transfer refused: %s", exc)
            return None

    def batch_get_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Optional[Any] = None) -> List[bool]:
        """Copy each stored page straight into the host KV buffer; one bool per page (all
        False, logged, for host indices that do not fit the pool)."""
        self._check_open()
        pages = self._host_pages(keys, host_indices) if keys else []
        if pages is None:
            return [False] * len(keys)
        return self._get_pages([self._key(k) for k in keys], pages)

    def batch_set_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Optional[Any] = None) -> List[bool]:
        """Store each page from the host KV buffer (one RPC pair for the batch)."""
        self._check_open()
        pages = self._host_pages(keys, host_indices) if keys else []
        if pages is None:
            return [False] * len(keys)
        return self._set_pages([self._key(k) for k in keys], pages)

    # ---- HiCacheStorage: housekeeping ------------------------------------------------------
    def clear(self) -> bool:
        """Remove the pages this process stored (kvservice has no namespace-wide clear: pages
        stored by other processes stay until evicted)."""
        self._check_open()
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
        metrics_cls = storage_metrics_class()
        with self._lock:
            metrics, self._metrics = self._metrics, {k: [] for k in self._metrics}
        return metrics_cls(**metrics)

    def kv_stats(self) -> dict[str, Any]:
        """The service's hits, misses, evictions and usage for this backend's namespace."""
        self._check_open()
        return self.kv.stats(self.namespace)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.kv.close()


class KVServiceHiCacheStorage(_KVServiceStorage):
    """SGLang ``HiCacheStorage`` over a kvservice, with the v2 calls of hybrid models: one host
    pool per ``PoolName``, each page copied through its pool's page buffers (see the module
    docstring)."""

    registered_pools: dict[Any, Any]

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Remember ``host_pool`` under its name. Refuses, at registration (SGLang's attach then
        fails with this error), a pool whose pages kvservice cannot move: no
        ``get_page_buffer_meta``, or one that fails for the pool's first page (e.g. a Mamba
        pool with slot side states)."""
        if not callable(getattr(host_pool, "get_page_buffer_meta", None)):
            raise TypeError(f"host pool {host_pool_name!s} ({type(host_pool).__name__}) has no "
                            "get_page_buffer_meta: kvservice cannot move its pages")
        page_size = getattr(host_pool, "page_size", 1) or 1
        try:
            page_views(host_pool, ["probe"], torch.arange(page_size))
        except ValueError as exc:
            raise TypeError(f"host pool {host_pool_name!s}: kvservice cannot move its pages: "
                            f"{exc}") from exc
        if not hasattr(self, "registered_pools"):
            self.registered_pools = {}
        self.registered_pools[host_pool_name] = host_pool

    def _pool_pages(self, transfer: Any) -> list[list[memoryview]] | None:
        pool = getattr(self, "registered_pools", {}).get(transfer.name)
        if pool is None:
            logger.error("no host pool registered as %s", transfer.name)
            return None
        if transfer.host_indices is None:
            logger.error("pool %s: a transfer without host indices", transfer.name)
            return None
        try:
            return page_views(pool, transfer.keys or [], transfer.host_indices)
        except ValueError as exc:
            logger.error("pool %s: %s", transfer.name, exc)
            return None

    def batch_set_v2(self, transfers: List[Any], extra_info: Optional[Any] = None
                     ) -> dict[str, List[bool]]:
        """Store each transfer's pages from its host pool; per pool, one bool per page."""
        return self._move_v2(transfers, self._set_pages)

    def batch_get_v2(self, transfers: List[Any], extra_info: Optional[Any] = None
                     ) -> dict[str, List[bool]]:
        """Copy each transfer's stored pages into its host pool; per pool, one bool per page."""
        return self._move_v2(transfers, self._get_pages)

    def _move_v2(self, transfers: List[Any],
                 move: Callable[[List[str | None], List[List[memoryview]]], List[bool]]
                 ) -> dict[str, List[bool]]:
        """``move`` (set or get) each transfer's pages under its pool's keys; a transfer whose
        pages cannot be described is all False."""
        self._check_open()
        out: dict[str, List[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            pages = self._pool_pages(t) if keys else []
            out[t.name] = ([False] * len(keys) if pages is None else
                           move([self._key(k, t.name) for k in keys], pages))
        return out

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[Any]] = None,
                        extra_info: Optional[Any] = None) -> Any:
        """The usable prefix: the stored KV prefix, cut by each pool's hit policy
        (``ALL_PAGES``: every page of the pool; ``TRAILING_PAGES``: the last
        ``len(transfer.keys)`` pages before each stop point). Other policies raise
        ``ValueError`` (SGLang logs it and treats the query as a miss)."""
        from sglang.srt.mem_cache.hicache_storage import (PoolHitPolicy, PoolName,
                                                          PoolTransferResult)

        kv_pages = self.batch_exists(keys)
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            present = self._present([self._key(k, t.name) for k in keys[:kv_pages]])
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                first_gap = present.index(False) if False in present else kv_pages
                ok = set(range(1, first_gap + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(t.keys or ()))
                ok = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - window):n])}
            else:
                raise ValueError(f"pool {t.name}: unsupported hit policy {t.hit_policy}")
            if ok:
                hits[t.name] = max(ok)
            restorable &= ok
        stops = sorted(restorable)
        return PoolTransferResult(stops[-1] if stops else 0, hits, stops)
