"""LMCache remote connector on kvservice, loaded through LMCache's remote-storage plugins.

Plugin mode, as LMCache 0.5.6 documents remote storage (no ``remote_url``)::

    remote_serde: "naive"
    remote_storage_plugins: ["kvservice"]          # or kvservice.NAME (one backend each)
    extra_config:
      remote_storage_plugin.kvservice.module_path: kvservice.integrations.lmcache
      remote_storage_plugin.kvservice.class_name: KVServiceConnectorAdapter
      remote_storage_plugin.kvservice.url: "kvservice://kv?namespace=llama-8b"

LMCache builds one ``RemoteBackend`` per plugin and asks for the URL ``plugin://<name>``; the
adapter takes the service URL from ``remote_storage_plugin.<name>.url`` (LMCache has no standard
key for a plugin's URL; its built-ins each read their own). The plugin name must be
``kvservice`` or ``kvservice.<instance>``: the adapter is built without its name, and matches
``plugin://`` URLs by that type. ``class_name: KVServiceConnector`` works too (LMCache then wraps
the class in its ``DynamicConnectorAdapter``, which passes no name: the connector finds the one
plugin naming it).

Legacy mode: ``remote_url: "kvservice://kv?namespace=..."`` with the same plugin entry but no
``remote_storage_plugin.kvservice.url``. LMCache needs the plugin entry to load the adapter, and
builds a remote backend for it as well as for ``remote_url``; the plugin's backend refuses to be
built (an ``IrrecoverableException``, which LMCache logs as "Failed to create remote backend for
plugin kvservice"), so exactly one backend writes. A configuration naming a kvservice both ways
fails the engine's creation: every write would be doubled.

It implements LMCache's ``RemoteConnector`` (``.../connector/base_connector.py``): the async
methods run on LMCache's storage event loop (``ConnectorContext.loop``, which LMCache drives
with ``asyncio.run_coroutine_threadsafe`` from its worker threads), over one asyncio
``kvservice.KVClient`` living on that loop; the synchronous ones (``exists_sync``,
``batched_contains``, ``remove_sync``) submit to the same loop and wait, as LMCache's redis
connector does.

Values: a chunk is stored under ``CacheEngineKey.to_string()`` in the namespace (the URL's
``?namespace=``, else ``extra_config["kvservice.namespace"]``, else ``lmcache``; ``?ttl=`` and
``?lease_s=`` set a TTL on every chunk and the lease a read takes). With ``save_chunk_meta``
(LMCache's default) a value is LMCache's ``RemoteMetadata`` header (``remote_metadata_bytes``
long) followed by the KV bytes, the layout LMCache's fs/mooncake connectors use; with
``extra_config.save_chunk_meta: false`` it is the KV bytes alone, shaped on read from the
engine metadata (``reshape_partial_chunk`` for a partial last chunk). Puts are written straight
into the pool (``begin_put``) and gets copy the leased block straight into a ``MemoryObj``
allocated from ``local_cpu_backend.allocate`` (LMCache's allocator, told not to wait: a hit with
no room is a miss), so each direction costs one memory copy. LMCache's default chunk hash is
Python's ``hash``: of token-id tuples in 0.5.6, which no seed changes; run engines that share
chunks with one ``PYTHONHASHSEED`` all the same, in case a configuration hashes strings.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any, List, Optional

from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvservice.client import KeyNotFound, KVClient
from kvservice.integrations import SCHEME, parse_service_url, writable_bytes
from kvservice.pool import Block, LeaseExpired

logger = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "lmcache"
CONNECT_TIMEOUT_S = 30.0
PLUGIN_TYPE = "kvservice"
PLUGIN_SCHEME = "plugin://"


def _config_error(message: str) -> Exception:
    """LMCache's ``IrrecoverableException``: its RemoteBackend re-raises it from
    init_connection (other errors it logs and retries), so no backend is built on a bad
    configuration."""
    error: Exception = IrrecoverableException(message)
    return error


def _plugin_key(plugin: str, field: str) -> str:
    return f"remote_storage_plugin.{plugin}.{field}"


def _is_service_url(url: Any) -> bool:
    try:
        parse_service_url(url)
    except Exception:
        return False
    return True


def _our_plugins(config: Any, class_name: str | None = None) -> list[str]:
    """The ``remote_storage_plugins`` entries whose module_path is this module (and, if given,
    whose class_name is ``class_name``)."""
    extra = getattr(config, "extra_config", None) or {}
    return [p for p in (getattr(config, "remote_storage_plugins", None) or [])
            if extra.get(_plugin_key(p, "module_path")) == __name__
            and (class_name is None or extra.get(_plugin_key(p, "class_name")) == class_name)]


def resolve_service_url(url: str | None, config: Any, plugin_name: str | None = None,
                        class_name: str | None = None) -> str:
    """The kvservice URL a connector LMCache asks for serves: ``url`` itself for a legacy
    ``remote_url``, ``remote_storage_plugin.<name>.url`` for ``plugin://<name>`` (``url`` None:
    the one plugin whose class_name is ``class_name``). A configuration that would build a
    dead or a second backend on kvservice raises ``IrrecoverableException``, which keeps
    LMCache from building that backend."""
    extra = getattr(config, "extra_config", None) or {}
    remote_url = getattr(config, "remote_url", None)
    if url is None:
        named = _our_plugins(config, class_name)
        if len(named) != 1:
            raise _config_error(
                f"kvservice: {class_name} was built without a URL or plugin name, and "
                f"{len(named)} remote_storage_plugins name it ({named}); name exactly one, or "
                f"use class_name: KVServiceConnectorAdapter")
        plugin_name = named[0]
    elif url.startswith(PLUGIN_SCHEME):
        plugin_name = plugin_name or url[len(PLUGIN_SCHEME):]
    else:  # legacy remote_url
        doubled = [p for p in _our_plugins(config) if extra.get(_plugin_key(p, "url"))]
        if doubled:
            raise _config_error(
                f"kvservice: remote_url {url!r} and remote_storage_plugin.{doubled[0]}.url both "
                f"name a kvservice: LMCache would write every chunk twice; drop remote_url")
        return url
    service: str | None = extra.get(_plugin_key(plugin_name, "url"))
    if service:
        return service
    if _is_service_url(remote_url):
        raise _config_error(
            f"kvservice: plugin {plugin_name!r} has no {_plugin_key(plugin_name, 'url')}; "
            f"remote_url {remote_url!r} serves kvservice (legacy mode), so no backend is built "
            f"for the plugin")
    raise _config_error(
        f"kvservice: plugin {plugin_name!r} needs its service URL in extra_config "
        f"{_plugin_key(plugin_name, 'url')} (e.g. kvservice://NAME)")


def _remote_metadata() -> Any:
    from lmcache.v1.protocol import RemoteMetadata

    return RemoteMetadata


def _byte_array(memory_obj: Any) -> memoryview:
    return writable_bytes(memory_obj.byte_array)


class KVServiceConnector(RemoteConnector):
    """An LMCache ``RemoteConnector`` over a kvservice (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any,
                 config: Any = None, url: str | None = None, metadata: Any = None,
                 plugin_name: str | None = None) -> None:
        """``url``: a kvservice URL, ``plugin://<name>``, or None (built by LMCache's
        ``DynamicConnectorAdapter``): see ``resolve_service_url``."""
        if metadata is None:
            metadata = getattr(local_cpu_backend, "metadata", None)
        if config is None:
            config = getattr(local_cpu_backend, "config", None)
        # the base sets save_chunk_meta, meta_shapes/dtypes/fmt, full_chunk_size_bytes,
        # single_token_size and remote_metadata_bytes from the engine config and metadata
        super().__init__(config, metadata)
        url = resolve_service_url(url, config, plugin_name, type(self).__name__)
        try:
            parsed = parse_service_url(url)
        except Exception as exc:  # a configuration error: LMCache should not retry it
            raise _config_error(f"kvservice: bad service URL {url!r}: {exc}") from exc
        extra = getattr(config, "extra_config", None) or {}
        self.url = url
        self.service_url = parsed.url
        self.namespace = parsed.namespace or extra.get("kvservice.namespace") or DEFAULT_NAMESPACE
        self.ttl = parsed.ttl
        self.lease_s = parsed.lease_s
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self._kv: KVClient | None = None
        self._connecting: asyncio.Future[KVClient] | None = None
        self._closed = False
        if loop.is_running() and not self._on_loop():
            # connect now, so a bad URL or an absent server fails LMCache's init_connection
            asyncio.run_coroutine_threadsafe(self._client(), loop).result(CONNECT_TIMEOUT_S)

    # ---- plumbing ------------------------------------------------------------------------
    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    async def _client(self) -> KVClient:
        if self._closed:
            raise RuntimeError("kvservice connector is closed")
        if self._kv is None:
            if self._connecting is None:
                self._connecting = asyncio.ensure_future(KVClient.connect(self.service_url))
            try:
                self._kv = await asyncio.shield(self._connecting)
            except BaseException:
                if self._connecting.done():
                    self._connecting = None  # a failed connect is retried by the next call
                raise
        return self._kv

    def _sync(self, coro: Any, timeout: float | None = None) -> Any:
        """Run ``coro`` on the connector's loop from another thread and wait for it."""
        if self._on_loop():
            coro.close()
            raise RuntimeError("a synchronous connector method was called on its event loop")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def _key(self, key: Any) -> str:
        text: str = key.to_string()
        return text

    # ---- reads ---------------------------------------------------------------------------
    def _allocate_for(self, view: memoryview) -> tuple[Any, memoryview] | None:
        """A MemoryObj from LMCache's allocator for the stored value ``view``, and the part of
        ``view`` holding the KV bytes; None if the allocator has no room."""
        if self.save_chunk_meta:
            n = self.remote_metadata_bytes
            if len(view) < n:
                raise ValueError(f"value of {len(view)} bytes is shorter than its metadata")
            md = _remote_metadata().deserialize(view[:n])
            if md.length > len(view) - n:
                raise ValueError(f"metadata says {md.length} bytes, the value holds {len(view) - n}")
            obj = self._allocate(md.shapes, md.dtypes, md.fmt)
            return None if obj is None else (obj, view[n:n + md.length])
        obj = self._allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
        return None if obj is None else (obj, view)

    def _allocate(self, shapes: Any, dtypes: Any, fmt: Any) -> Any:
        """LMCache's allocate without its busy loop: the loop sleeps on the storage event
        loop until memory frees, and nothing on that loop can free it (a hang); a hit with no
        room is a miss."""
        return self.local_cpu_backend.allocate(shapes, dtypes, fmt, busy_loop=False)

    def _read_block(self, block: Block, key: Any) -> Any:
        """Copy a leased block into a fresh MemoryObj (None on a miss); ends the lease."""
        obj = None
        try:
            with block:
                got = self._allocate_for(block.view())
                if got is None:
                    logger.warning("LMCache allocator is full: dropping remote hit %s", key)
                    return None
                obj, data = got
                dst = _byte_array(obj)
                if len(data) > len(dst):
                    raise ValueError(f"stored {len(data)} bytes do not fit the {len(dst)}-byte "
                                     f"buffer LMCache allocated")
                dst[:len(data)] = data
                block.check()  # after the copy: a lapsed, reused lease raises here
                if not self.save_chunk_meta:
                    obj = self.reshape_partial_chunk(obj, len(data))
                return obj
        except LeaseExpired:
            logger.warning("lease on %s lapsed while reading it: treated as a miss", key)
        except Exception as exc:
            logger.error("bad value for %s in kvservice: %s", key, exc)
        if obj is not None:
            obj.ref_count_down()
        return None

    async def get(self, key: Any) -> Optional[Any]:
        kv = await self._client()
        try:
            block = await kv.get(self._key(key), self.namespace, self.lease_s)
        except KeyNotFound:
            return None
        return self._read_block(block, key)

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[Any]) -> List[Optional[Any]]:
        if not keys:
            return []
        kv = await self._client()
        blocks = await kv.batch_get([self._key(k) for k in keys], self.namespace, self.lease_s)
        return [None if b is None else self._read_block(b, k) for k, b in zip(keys, blocks)]

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[Any]) -> List[Any]:
        """The leading run of hits (LMCache's contract): leases past the first miss are
        released unread."""
        if not keys:
            return []
        kv = await self._client()
        blocks = await kv.batch_get([self._key(k) for k in keys], self.namespace, self.lease_s)
        out: list[Any] = []
        for key, block in zip(keys, blocks):
            if block is None:
                break
            obj = self._read_block(block, key)  # ends this block's lease
            if obj is None:
                break
            out.append(obj)
        for block in blocks[len(out):]:
            if block is not None:
                block.release()
        return out

    # ---- writes --------------------------------------------------------------------------
    async def _put_one(self, kv: KVClient, key: Any, memory_obj: Any) -> None:
        data = _byte_array(memory_obj)
        if not self.save_chunk_meta:
            await kv.put(self._key(key), data, self.namespace, self.ttl)
            return
        header = _remote_metadata()(len(data), memory_obj.get_shapes(), memory_obj.get_dtypes(),
                                    memory_obj.get_memory_format()).serialize()
        pending = await kv.begin_put(self._key(key), len(header) + len(data), self.namespace,
                                     self.ttl)
        try:
            dst = pending.view()
            dst[:len(header)] = header
            dst[len(header):] = data
        except BaseException:
            await pending.abort()
            raise
        await pending.commit()

    async def put(self, key: Any, memory_obj: Any) -> None:
        # LMCache's InstrumentedRemoteConnector drops the MemoryObj's reference afterwards
        await self._put_one(await self._client(), key, memory_obj)

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[Any], memory_objs: List[Any]) -> None:
        if len(keys) != len(memory_objs):
            raise ValueError(f"{len(keys)} keys for {len(memory_objs)} memory objects")
        if not keys:
            return
        kv = await self._client()
        if not self.save_chunk_meta:  # one reservation and one commit for the whole batch
            await kv.batch_put({self._key(k): _byte_array(o) for k, o in zip(keys, memory_objs)},
                               self.namespace, self.ttl)
            return
        results = await asyncio.gather(*(self._put_one(kv, k, o)
                                         for k, o in zip(keys, memory_objs)),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    # ---- lookups -------------------------------------------------------------------------
    async def exists(self, key: Any) -> bool:
        kv = await self._client()
        return await kv.exists(self._key(key), self.namespace)

    def exists_sync(self, key: Any) -> bool:
        return bool(self._sync(self.exists(key)))

    async def _leading(self, keys: List[Any]) -> int:
        if not keys:
            return 0
        kv = await self._client()
        return await kv.lookup_keys([self._key(k).encode() for k in keys], self.namespace)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[Any]) -> int:
        """Hit chunks by prefix match: one lookup_prefix RPC over the keys."""
        return int(self._sync(self._leading(keys)))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[Any],
                                     pin: bool = False) -> int:
        # pin: kvservice pins by lease, which only a get takes; LMCache's remote backend
        # ignores pin for remote storage as well
        return await self._leading(keys)

    async def _remove(self, key: Any) -> bool:
        kv = await self._client()
        return await kv.remove(self._key(key), self.namespace)

    def remove_sync(self, key: Any) -> bool:
        return bool(self._sync(self._remove(key)))

    async def list(self) -> List[str]:
        """kvservice does not enumerate keys: always empty."""
        return []

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the service answers, 1 otherwise."""
        try:
            kv = await self._client()
            await kv.stats(self.namespace)
            return 0
        except Exception as exc:
            logger.warning("kvservice ping failed: %s", exc)
            return 1

    async def close(self) -> None:
        self._closed = True
        kv, self._kv = self._kv, None
        if kv is None and self._connecting is not None:
            try:
                kv = await self._connecting
            except Exception:
                kv = None
        self._connecting = None
        if kv is not None:
            await kv.close()

    def __repr__(self) -> str:
        return f"<KVServiceConnector {self.service_url} ns={self.namespace!r}>"


class KVServiceConnectorAdapter(ConnectorAdapter):
    """LMCache adapter for ``kvservice://`` URLs and ``plugin://kvservice[.NAME]`` (name it in
    ``remote_storage_plugins``)."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        if url.startswith(PLUGIN_SCHEME):
            return url[len(PLUGIN_SCHEME):].split(".", 1)[0] == PLUGIN_TYPE
        return url.startswith(self.schema)

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        logger.info("Creating kvservice connector for URL: %s", context.url)
        return KVServiceConnector(context.loop, context.local_cpu_backend, context.config,
                                  url=context.url, metadata=getattr(context, "metadata", None),
                                  plugin_name=getattr(context, "plugin_name", None))
