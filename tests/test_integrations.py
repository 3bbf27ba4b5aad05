"""The LMCache connector and the SGLang HiCache backend against a live kvservice.

Neither framework is installed: ``lmcache_standin`` and ``sglang_standin`` model the parts
they use (base classes, loaders, the callers' threading), numpy standing in for torch. Each
test loads its adapter through the framework's own config path (LMCache's
``remote_storage_plugins``; SGLang's ``dynamic`` backend). The server runs on the test's
event loop, so the frameworks' blocking calls run in ``asyncio.to_thread``.
"""
from __future__ import annotations

import asyncio
import sys

import numpy as np
import pytest

import lmcache_standin
import sglang_standin
from kvservice import KVClient, KVServer
from kvservice.integrations import parse_service_url

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
run = asyncio.to_thread

# ---- URLs ------------------------------------------------------------------------------------


def test_service_urls():
    assert parse_service_url("kvservice://kv").url == "shm://kv"
    u = parse_service_url("kvservice://file/dev/shm/x.region?namespace=m&ttl=30&lease_s=5")
    assert (u.url, u.namespace, u.ttl, u.lease_s) == ("file:///dev/shm/x.region", "m", 30.0, 5.0)
    assert parse_service_url("kvservice://?url=file:///tmp/r").url == "file:///tmp/r"
    assert parse_service_url("kvservice://?url=shm://a&namespace=n").namespace == "n"
    assert parse_service_url("shm://kv").url == "shm://kv"
    assert parse_service_url("file:///tmp/r?namespace=q").url == "file:///tmp/r"
    for bad in ("redis://x", "kvservice://", "kvservice://a/b", "kvservice://a?url=shm://b",
                "kvservice://a?bogus=1", "kvservice://a?ttl=zero", "kvservice://a?ttl=-1",
                "kvservice://file/rel?x=1", "kvservice://bad name"):
        with pytest.raises(Exception):
            parse_service_url(bad)


# ---- LMCache -----------------------------------------------------------------------------------

L, T, H, D = 2, 64, 4, 32  # a chunk: (2, L, T, H*D) float16 = 64 KiB (two-phase puts)
CHUNK = 2 * L * T * H * D * 2


def _forget(module: str) -> None:
    """Drop an adapter imported against a stand-in, so nothing outlives the test."""
    import kvservice.integrations as pkg

    sys.modules.pop(f"kvservice.integrations.{module}", None)
    pkg.__dict__.pop(module, None)


@pytest.fixture
def lmc(monkeypatch):
    lmcache_standin.install(monkeypatch)
    yield lmcache_standin
    _forget("lmcache")


def lmc_config(lmc, name: str, **extra):
    return lmc.LMCacheEngineConfig.from_dict({
        "chunk_size": T,
        "remote_url": f"kvservice://{name}?namespace=llama-test",
        "remote_serde": "naive",
        "remote_storage_plugins": ["kvservice"],
        "extra_config": {
            "remote_storage_plugin.kvservice.module_path": "kvservice.integrations.lmcache",
            "remote_storage_plugin.kvservice.class_name": "KVServiceConnectorAdapter",
            **extra,
        },
    })


class LMCacheHarness:
    """LMCache's pieces around the connector: storage loop, CPU allocator, RemoteBackend."""

    def __init__(self, lmc, config, capacity: int = 64 * MiB) -> None:
        self.lmc = lmc
        self.metadata = lmc.LMCacheMetadata("llama-test", 1, 0, np.float16, (L, 2, T, H, D))
        self.storage = lmc.StorageLoop()
        self.cpu = lmc.LocalCPUBackend(config, self.metadata, capacity)
        self.config = config
        self.backend = None

    async def __aenter__(self):
        try:
            self.backend = await run(self.lmc.RemoteBackend, self.config, self.metadata,
                                     self.storage.loop, self.cpu)
        except BaseException:
            self.storage.stop()
            raise
        return self

    async def __aexit__(self, *exc):
        try:
            await run(self.backend.close)
        finally:
            self.storage.stop()

    def key(self, i: int):
        return self.lmc.CacheEngineKey("vllm", "llama-test", 1, 0, 0xC0FFEE00 + i)

    def chunk(self, seed: int, tokens: int = T):
        """A MemoryObj from LMCache's allocator holding random KV data (ref count 1)."""
        obj = self.cpu.allocate([(2, L, tokens, H * D)], [np.float16],
                                self.lmc.MemoryFormat.KV_2LTD)
        obj.tensor[...] = np.random.default_rng(seed).standard_normal(obj.tensor.shape)
        return obj


@pytest.fixture(params=[True, False], ids=["chunk_meta", "no_chunk_meta"])
def save_chunk_meta(request):
    return request.param


async def test_lmcache_connector_loaded_from_plugin_config(lmc, url, name):
    """remote_storage_plugins + module_path/class_name builds our connector for kvservice://."""
    from kvservice.integrations.lmcache import KVServiceConnector, KVServiceConnectorAdapter

    async with KVServer(url, pool_size=16 * MiB):
        async with LMCacheHarness(lmc, lmc_config(lmc, name)) as h:
            conn = h.backend.connection
            assert isinstance(conn, lmc.InstrumentedRemoteConnector)
            inner = conn.getWrappedConnector()
            assert isinstance(inner, KVServiceConnector)
            assert isinstance(inner, lmc.RemoteConnector)
            assert (inner.service_url, inner.namespace) == (url, "llama-test")
            assert inner.save_chunk_meta and inner.remote_metadata_bytes > 0
            assert conn.support_batched_get() and conn.support_batched_put()
            assert conn.support_batched_contains() and conn.support_batched_async_contains()
            assert conn.support_batched_get_non_blocking() and conn.support_ping()
            assert await run(lambda: h.backend._run(conn.ping())) == 0
            assert await run(lambda: h.backend._run(conn.list())) == []
    adapter = KVServiceConnectorAdapter()
    assert adapter.can_parse("kvservice://kv") and not adapter.can_parse("redis://h:1")


async def test_lmcache_yaml_config(lmc, url, name):
    """The README's yaml lines, parsed, load the connector."""
    yaml = pytest.importorskip("yaml")
    text = f"""
chunk_size: {T}
remote_url: "kvservice://{name}?namespace=llama-8b"
remote_serde: "naive"
remote_storage_plugins: ["kvservice"]
extra_config:
  remote_storage_plugin.kvservice.module_path: kvservice.integrations.lmcache
  remote_storage_plugin.kvservice.class_name: KVServiceConnectorAdapter
"""
    config = lmc.LMCacheEngineConfig.from_dict(yaml.safe_load(text))
    async with KVServer(url, pool_size=16 * MiB):
        async with LMCacheHarness(lmc, config) as h:
            obj = h.chunk(1)
            await run(lambda: h.backend.submit_put_task(h.key(1), obj).result(10))
            assert await run(h.backend.contains, h.key(1))
            obj.ref_count_down()


async def test_lmcache_put_get_roundtrip(lmc, url, name, save_chunk_meta):
    async with KVServer(url, pool_size=16 * MiB), KVClient.connect(url) as kv:
        config = lmc_config(lmc, name, save_chunk_meta=save_chunk_meta)
        async with LMCacheHarness(lmc, config) as h:
            b = h.backend
            obj = h.chunk(7)
            expected = bytes(obj.byte_array)
            await run(lambda: b.submit_put_task(h.key(0), obj).result(10))
            assert obj.get_ref_count() == 1  # the connector's reference was dropped
            stored = await kv.get_bytes(h.key(0).to_string(), "llama-test")
            n = h.backend.connection.getWrappedConnector().remote_metadata_bytes
            assert stored[n:] == expected if save_chunk_meta else stored == expected

            assert await run(b.contains, h.key(0)) and not await run(b.contains, h.key(99))
            got = await run(b.get_blocking, h.key(0))
            assert got is not obj and bytes(got.byte_array) == expected
            assert got.get_shapes() == [(2, L, T, H * D)] and got.get_dtypes() == [np.float16]
            assert got.get_memory_format() == lmc.MemoryFormat.KV_2LTD
            np.testing.assert_array_equal(got.tensor, obj.tensor)
            assert await run(b.get_blocking, h.key(99)) is None  # a miss
            assert await run(b.remove, h.key(0)) is True
            assert await run(b.remove, h.key(0)) is False
            assert await run(b.get_blocking, h.key(0)) is None
            got.ref_count_down()
            obj.ref_count_down()
            assert not h.cpu.memory_allocator.live  # every MemoryObj went back


async def test_lmcache_batched(lmc, url, name, save_chunk_meta):
    async with KVServer(url, pool_size=32 * MiB):
        config = lmc_config(lmc, name, save_chunk_meta=save_chunk_meta)
        async with LMCacheHarness(lmc, config) as h:
            b = h.backend
            keys = [h.key(i) for i in range(6)]
            objs = [h.chunk(100 + i) for i in range(6)]
            expected = [bytes(o.byte_array) for o in objs]
            # store chunks 0, 1, 2, 4, 5: chunk 3 is missing
            stored = [0, 1, 2, 4, 5]
            fut = b.batched_submit_put_task([keys[i] for i in stored], [objs[i] for i in stored])
            await run(fut.result, 10)
            assert [o.get_ref_count() for o in objs] == [1] * 6

            assert await run(b.batched_contains, keys) == 3
            assert await run(b.batched_contains, keys[4:]) == 2
            assert await run(b.batched_contains, []) == 0
            assert await run(b.batched_async_contains, "req-1", keys) == 3
            assert await run(b.batched_async_contains, "req-2", keys[3:]) == 0

            got = await run(b.batched_get_blocking, keys)
            assert got[3] is None
            for i in stored:
                assert bytes(got[i].byte_array) == expected[i]
                got[i].ref_count_down()

            prefix = await run(b.batched_get_non_blocking, "req-3", keys)
            assert [bytes(o.byte_array) for o in prefix] == expected[:3]
            for o in prefix:
                o.ref_count_down()
            assert await run(b.batched_get_non_blocking, "req-4", keys[3:]) == []
            for o in objs:
                o.ref_count_down()
            assert not h.cpu.memory_allocator.live


async def test_lmcache_exists_sync_and_partial_chunk(lmc, url, name):
    """use_exists_sync routes contains through exists_sync; without chunk metadata a short
    last chunk comes back reshaped by reshape_partial_chunk."""
    async with KVServer(url, pool_size=16 * MiB):
        config = lmc_config(lmc, name, save_chunk_meta=False, use_exists_sync=True)
        async with LMCacheHarness(lmc, config) as h:
            b = h.backend
            part = h.chunk(5, tokens=T // 4)
            expected = bytes(part.byte_array)
            await run(lambda: b.submit_put_task(h.key(1), part).result(10))
            assert await run(b.contains, h.key(1)) and not await run(b.contains, h.key(2))
            got = await run(b.get_blocking, h.key(1))
            assert got.get_shape() == (2, L, T // 4, H * D)
            assert bytes(got.raw_data) == expected
            got.ref_count_down()
            part.ref_count_down()
            assert not h.cpu.memory_allocator.live


async def test_lmcache_allocator_full_is_a_miss(lmc, url, name):
    async with KVServer(url, pool_size=16 * MiB):
        async with LMCacheHarness(lmc, lmc_config(lmc, name), capacity=CHUNK) as h:
            obj = h.chunk(3)  # the allocator's only chunk
            await run(lambda: h.backend.submit_put_task(h.key(0), obj).result(10))
            assert await run(h.backend.get_blocking, h.key(0)) is None
            assert await run(h.backend.batched_get_blocking, [h.key(0)]) == [None]
            obj.ref_count_down()
            got = await run(h.backend.get_blocking, h.key(0))  # room again
            assert got is not None
            got.ref_count_down()
            assert not h.cpu.memory_allocator.live


async def test_lmcache_file_region(lmc, tmp_path):
    """kvservice://file/ABS/PATH reaches a service on a file:// region."""
    path = tmp_path / "kv.region"
    async with KVServer(f"file://{path}", pool_size=8 * MiB):
        config = lmc_config(lmc, "unused")
        config.remote_url = f"kvservice://file{path}?namespace=f"
        async with LMCacheHarness(lmc, config) as h:
            inner = h.backend.connection.getWrappedConnector()
            assert inner.service_url == f"file://{path}" and inner.namespace == "f"
            obj = h.chunk(9)
            await run(lambda: h.backend.submit_put_task(h.key(0), obj).result(10))
            got = await run(h.backend.get_blocking, h.key(0))
            assert bytes(got.byte_array) == bytes(obj.byte_array)
            got.ref_count_down()
            obj.ref_count_down()


async def test_lmcache_no_server(lmc, name):
    """An absent service fails the connector's creation (LMCache's init_connection logs it)."""
    storage = lmc.StorageLoop()
    try:
        config = lmc_config(lmc, name)
        metadata = lmc.LMCacheMetadata("m", 1, 0, np.float16, (L, 2, T, H, D))
        cpu = lmc.LocalCPUBackend(config, metadata)
        with pytest.raises(Exception):
            await run(lmc.RemoteBackend, config, metadata, storage.loop, cpu)
    finally:
        storage.stop()


# ---- SGLang ------------------------------------------------------------------------------------

PAGE = 16  # tokens a page; the host pool: 2 layers x 4 heads x 32 dim float16 = 16 KiB a page


@pytest.fixture
def sgl(monkeypatch):
    sglang_standin.install(monkeypatch)
    yield sglang_standin
    _forget("sglang")


def sgl_extra(name: str, **more):
    return {"backend_name": "kvservice", "module_path": "kvservice.integrations.sglang",
            "class_name": "KVServiceHiCacheStorage", "url": f"kvservice://{name}",
            "namespace": "sglang-test", **more}


def host_pool(sgl, pages: int = 64, seed: int | None = None):
    pool = sgl.HostKVCache(pages * PAGE, PAGE, layer_num=2, head_num=4, head_dim=32)
    if seed is not None:
        pool.kv_buffer[...] = np.random.default_rng(seed).standard_normal(pool.kv_buffer.shape)
    return pool


@pytest.fixture(params=[False, True], ids=["generic", "interface_v1"])
def interface_v1(request):
    return request.param


async def test_sglang_backend_loaded_dynamically(sgl, url, name):
    from kvservice.integrations.sglang import KVServiceHiCacheStorage

    async with KVServer(url, pool_size=16 * MiB):
        ctrl = await run(sgl.Controller, "dynamic", sgl_extra(name), host_pool(sgl), tp_rank=1,
                         tp_size=2)
        try:
            backend = ctrl.storage_backend
            assert isinstance(backend, KVServiceHiCacheStorage)
            assert isinstance(backend, sgl.HiCacheStorage)
            assert backend.mem_pool_host is ctrl.storage_host_pool
            assert (backend.service_url, backend.namespace) == (url, "sglang-test")
            assert backend.suffix == "_Qwen-Qwen3-0.6B_1_2"  # SGLang's file-backend naming
        finally:
            await run(ctrl.storage_backend.close)


async def test_sglang_backup_then_prefetch(sgl, url, name, interface_v1):
    """The controller's backup path stores pages, its prefetch path finds the hit prefix and
    loads it into another host pool: the same bytes."""
    extra = sgl_extra(name, interface_v1=int(interface_v1))
    async with KVServer(url, pool_size=32 * MiB), KVClient.connect(url) as kv:
        src = host_pool(sgl, seed=1)
        writer = await run(sgl.Controller, "dynamic", extra, src)
        dst = host_pool(sgl)
        reader = await run(sgl.Controller, "dynamic", extra, dst)
        try:
            tokens = list(range(10 * PAGE + 5))  # 10 full pages and a partial one
            src_idx = np.arange(3 * PAGE, 13 * PAGE)  # pages 3..12 of the source pool
            assert await run(writer.backup, tokens, src_idx) == 10 * PAGE
            assert len(await run(reader.storage_hit_query, tokens)) == 10
            dst_idx = np.arange(40 * PAGE, 50 * PAGE)
            assert await run(reader.prefetch, tokens, dst_idx) == 10 * PAGE
            np.testing.assert_array_equal(dst.kv_buffer[:, 40 * PAGE:50 * PAGE],
                                          src.kv_buffer[:, 3 * PAGE:13 * PAGE])
            # the stored value is the flat data page, whichever path wrote it
            page_hash = sgl.get_hash_str(tokens, None, PAGE)[0]
            value = await kv.get_bytes(page_hash + writer.storage_backend.suffix, "sglang-test")
            assert value == src.get_data_page(3 * PAGE).tobytes()

            # a missing middle page ends the hit prefix there
            hashes = sgl.get_hash_str(tokens, None, PAGE)
            assert await kv.remove(hashes[4] + writer.storage_backend.suffix, "sglang-test")
            assert await run(reader.storage_backend.batch_exists, hashes) == 4
            assert len(await run(reader.storage_hit_query, tokens)) == 4
            assert await run(reader.prefetch, tokens, dst_idx) == 4 * PAGE
            other = list(range(1000, 1000 + 3 * PAGE))
            assert await run(reader.prefetch, other, dst_idx) == 0  # nothing stored
        finally:
            await run(writer.storage_backend.close)
            await run(reader.storage_backend.close)


async def test_sglang_paths_interoperate(sgl, url, name):
    """Pages written through the zero-copy path read back through the generic one."""
    async with KVServer(url, pool_size=16 * MiB):
        src = host_pool(sgl, seed=2)
        v1 = await run(sgl.Controller, "dynamic", sgl_extra(name, interface_v1=1), src)
        dst = host_pool(sgl)
        generic = await run(sgl.Controller, "dynamic", sgl_extra(name), dst)
        try:
            tokens = list(range(4 * PAGE))
            idx = np.arange(0, 4 * PAGE)
            assert await run(v1.backup, tokens, idx) == 4 * PAGE
            assert await run(generic.prefetch, tokens, idx + 8 * PAGE) == 4 * PAGE
            np.testing.assert_array_equal(dst.kv_buffer[:, 8 * PAGE:12 * PAGE],
                                          src.kv_buffer[:, :4 * PAGE])
        finally:
            await run(v1.storage_backend.close)
            await run(generic.storage_backend.close)


async def test_sglang_every_method(sgl, url, name):
    async with KVServer(url, pool_size=16 * MiB):
        pool = host_pool(sgl, seed=3)
        ctrl = await run(sgl.Controller, "dynamic", sgl_extra(name), pool,
                         enable_storage_metrics=True)
        s = ctrl.storage_backend

        def calls():
            page = pool.get_data_page(0)
            assert s.set("p0", page) is True
            assert s.exists("p0") and not s.exists("nope")
            out = pool.get_dummy_flat_data_page()
            assert s.get("p0", out) is out
            np.testing.assert_array_equal(out, page)
            assert s.get("nope", pool.get_dummy_flat_data_page()) is None
            filled = s.get("p0")  # no target: a dummy page of the registered host pool
            np.testing.assert_array_equal(filled, page)
            assert s.get("p0", np.zeros(page.size - 1, page.dtype)) is None  # wrong size
            raw = np.zeros(page.nbytes, np.uint8)  # the pointer form (address + size)
            assert s.get("p0", raw.ctypes.data, page.nbytes) == raw.ctypes.data
            assert raw.tobytes() == page.tobytes()
            assert s.set("p-raw", None, page.ctypes.data, page.nbytes)
            assert s.get("p-raw", pool.get_dummy_flat_data_page()).tobytes() == page.tobytes()

            pages = [pool.get_data_page(i * PAGE) for i in range(1, 5)]
            assert s.batch_set(["p1", "p2", "p3", "p4"], pages) is True
            outs = [pool.get_dummy_flat_data_page() for _ in range(5)]
            got = s.batch_get(["p1", "p2", "gone", "p3", "p4"], outs)
            assert got[2] is None
            for g, p in zip([got[0], got[1], got[3], got[4]], pages):
                np.testing.assert_array_equal(g, p)
            assert s.batch_get([], []) == [] and s.batch_set([], []) is True
            assert s.batch_exists(["p0", "p1", "p2", "gone", "p3"]) == 3
            assert s.batch_exists([]) == 0

            stats = s.get_stats()
            assert isinstance(stats, sgl.StorageMetrics)
            assert sum(stats.backup_pgs) == 6 and sum(stats.prefetch_pgs) >= 6
            assert all(bw > 0 for bw in stats.backup_bandwidth)
            assert s.get_stats().backup_pgs == []  # reset by each call
            kv_stats = s.kv_stats()
            assert kv_stats["namespaces"]["sglang-test"]

            assert s.clear() is True
            assert s.batch_exists(["p0", "p1"]) == 0 and not s.exists("p-raw")
            s.close()
            s.close()  # idempotent

        await run(calls)


async def test_sglang_metrics_off_and_pool_full(sgl, url, name):
    """Without storage metrics get_stats is None; a full pool fails a set (False), not crash."""
    async with KVServer(url, pool_size=1 * MiB):
        pool = host_pool(sgl, seed=4)
        ctrl = await run(sgl.Controller, "dynamic", sgl_extra(name), pool)
        s = ctrl.storage_backend

        def calls():
            assert s.get_stats() is None
            big = np.zeros(2 * MiB, np.uint8)
            assert s.set("too-big", big) is False
            assert not s.exists("too-big")
            s.close()

        await run(calls)


async def test_sglang_file_region(sgl, tmp_path):
    path = tmp_path / "kv.region"
    async with KVServer(f"file://{path}", pool_size=8 * MiB):
        extra = sgl_extra("unused", url=f"kvservice://file{path}")
        pool = host_pool(sgl, seed=5)
        ctrl = await run(sgl.Controller, "dynamic", extra, pool)
        try:
            assert ctrl.storage_backend.service_url == f"file://{path}"
            assert await run(ctrl.backup, list(range(2 * PAGE)), np.arange(2 * PAGE)) == 2 * PAGE
        finally:
            await run(ctrl.storage_backend.close)


async def test_sglang_service_gone(sgl, url, name):
    """Once the service is gone the backend reports misses and failed writes, never raises
    into SGLang's storage threads."""
    server = KVServer(url, pool_size=8 * MiB)
    await server.start()
    try:
        pool = host_pool(sgl, seed=6)
        ctrl = await run(sgl.Controller, "dynamic", sgl_extra(name), pool)
        s = ctrl.storage_backend
        assert await run(s.set, "p", pool.get_data_page(0))
    finally:
        await server.close()

    def calls():
        assert s.batch_exists(["p"]) == 0 and s.exists("p") is False
        assert s.batch_get(["p"], [pool.get_dummy_flat_data_page()]) == [None]
        assert s.set("q", pool.get_data_page(PAGE)) is False
        assert s.batch_get_v1(["p"], np.arange(PAGE)) == [False]
        assert s.batch_set_v1(["p"], np.arange(PAGE)) == [False]
        s.close()

    await run(calls)


async def test_lmcache_service_gone(lmc, url, name):
    """A vanished service: ping reports it (LMCache's remote monitor polls ping), lookups
    raise for LMCache's RemoteBackend to log and treat as misses."""
    server = KVServer(url, pool_size=8 * MiB)
    await server.start()
    try:
        h = LMCacheHarness(lmc, lmc_config(lmc, name))
        await h.__aenter__()
    finally:
        await server.close()
    try:
        conn = h.backend.connection
        assert await run(lambda: h.backend._run(conn.ping())) == 1
        with pytest.raises(Exception):
            await run(h.backend.get_blocking, h.key(0))
    finally:
        await h.__aexit__(None, None, None)
