"""kvservice as SGLang 0.5.23's HiCache storage, driven by the real package (CPU).

SGLang's own backend factory builds the backend from the README's ``--hicache-storage-backend-
extra-config`` JSON (parsed by SGLang), over SGLang's real host pools (MHA and MLA, each storage
layout), and SGLang's cache-controller methods move the pages. ``sglang_engine`` explains how
SGLang is imported without torchvision.
"""
from __future__ import annotations

import asyncio
import sys
import time
import types
from pathlib import Path

import pytest

import sglang_engine as eng
from procs import run_json
from kvservice import KVClient, KVServer
from kvservice.keys import MAX_KEY_BYTES

pytestmark = pytest.mark.engines

MiB = 1 << 20
P = eng.PAGE
run = asyncio.to_thread

eng.load_sglang()
import torch  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, PoolHitPolicy,  # noqa: E402
                                                  PoolName, PoolTransfer)
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from kvservice.integrations.sglang import (KVServiceHiCacheStorage,  # noqa: E402
                                           storage_metrics_class)


def page(pool, slot: int) -> bytes:
    return pool.get_data_page(slot, flat=True).view(-1).view(torch.uint8).numpy().tobytes()


def raw(pool) -> bytes:
    from kvservice.integrations.sglang import _tensors
    return b"".join(t.view(-1).view(torch.uint8).numpy().tobytes()
                    for t in _tensors(pool.kv_buffer))


def attach(url: str, pool, kind: str = "mha", v1: bool = True, **kw) -> KVServiceHiCacheStorage:
    storage = eng.backend(url, kind, v1, **kw)
    storage.register_mem_pool_host(pool)
    return storage


# ---- two engine processes --------------------------------------------------------------------

@pytest.mark.timeout(300)
async def test_pages_round_trip_across_two_processes(url, tmp_path):
    """A writer process backs up 8 pages per (pool kind, layout, path) through SGLang's own
    HiCacheController (its backup thread); a fresh reader process with its own controller and
    pools prefetches them (its prefetch and I/O threads): same bytes, page by page. Plus a
    hybrid SWA model's KV and sliding-window pages through the v2 calls."""
    async with KVServer(url, pool_size=64 * MiB):
        summaries = {}
        for role in ("write", "read"):
            summaries[role] = await run_json([str(Path(eng.__file__)), role, url, str(tmp_path)],
                                             240)
    combos = [f"{k}-{lay}-{p}" for k in eng.KINDS for lay in eng.LAYOUTS for p in eng.PATHS]
    assert sorted(summaries["write"]) == sorted(combos + ["swa-hybrid"]) == sorted(
        summaries["read"])
    for name in combos:
        # SGLang's controller derived MLA from the device pool, picked its page functions
        # from "interface_v1", and its threads stored, found and loaded every page
        facts = {"mla": name.startswith("mla"), "zero_copy": name.endswith("interface_v1")}
        assert summaries["write"][name] == {"stored": eng.PAGES, **facts}, name
        assert summaries["read"][name] == {"hit": eng.PAGES, "read": eng.PAGES, **facts}, name
    n, w = eng.PAGES, eng.SWA_PAGES
    assert summaries["write"]["swa-hybrid"] == {"stored": n, "swa_stored": w}
    assert summaries["read"]["swa-hybrid"] == {"hit": n, "swa_hit": n, "read": n, "swa_read": w}
    pages, compared = eng.compare_pages(
        tmp_path, [(c, n) for c in combos] + [("swa-hybrid-kv", n), ("swa-hybrid-swa", w)])
    print(f"\n{len(combos)} combinations x {n} pages + a hybrid SWA model ({n} KV, {w} SWA "
          f"pages): {pages} pages, {compared} bytes compared")


# ---- the factory, the paths, every method ----------------------------------------------------

async def test_factory_builds_backend_from_extra_config(url, name):
    async with KVServer(url, pool_size=8 * MiB):
        s = await run(eng.backend, url, "mha", True, namespace="sglang-test")
        try:
            assert type(s) is KVServiceHiCacheStorage and isinstance(s, HiCacheStorage)
            assert (s.service_url, s.namespace) == (url, "sglang-test")
            assert s.storage_config.extra_config["interface_v1"] == 1
            assert s.suffix == "_Qwen-Qwen3-0.6B_0_1"  # SGLang's file-backend naming
        finally:
            await run(s.close)
        mla = await run(eng.backend, url, "mla", False)
        try:
            assert mla.suffix == "_Qwen-Qwen3-0.6B" and mla.tp_suffix == "_Qwen-Qwen3-0.6B_0_1"
            # pool pages are named as SGLang's file backend names them (Mamba state per rank)
            assert [mla._key("h", n) for n in (PoolName.KV, PoolName.SWA, PoolName.MAMBA)] == [
                "h_Qwen-Qwen3-0.6B", "h.swa_Qwen-Qwen3-0.6B", "h.mamba_Qwen-Qwen3-0.6B_0_1"]
        finally:
            await run(mla.close)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
async def test_zero_copy_and_generic_paths_share_pages(url, layout):
    """In the page-first layouts a page written through batch_set_v1 reads back through the
    generic batch_get (and the reverse): the stored value is the flat data page."""
    async with KVServer(url, pool_size=16 * MiB):
        src, dst = eng.host_pool("mha", layout), eng.host_pool("mha", layout)
        eng.fill(src, seed=7)
        s = await run(attach, url, src)
        try:
            hashes = get_storage_hash_str(list(range(4 * P)), None, P)
            assert await run(s.batch_set_v1, hashes[:2], torch.arange(0, 2 * P)) == [True] * 2
            assert await run(s.batch_set, hashes[2:], [src.get_data_page(i * P) for i in (2, 3)])
            ctrl = eng.controller(dst, s)
            got = await run(HiCacheController._generic_page_get, ctrl, eng._Op(), hashes,
                            torch.arange(8 * P, 12 * P))
            assert got == 4
            assert [page(dst, (8 + i) * P) for i in range(4)] == [page(src, i * P)
                                                                   for i in range(4)]
        finally:
            await run(s.close)


async def test_every_method(url, name):
    async with KVServer(url, pool_size=16 * MiB):
        pool = eng.host_pool("mha", "page_first")
        eng.fill(pool, seed=3)
        s = await run(attach, url, pool, v1=False, enable_storage_metrics=True,
                      namespace="sglang-test")

        def calls():
            p0 = pool.get_data_page(0)
            assert s.set("p0", p0) is True
            assert s.exists("p0") and not s.exists("nope")
            out = pool.get_dummy_flat_data_page()
            assert s.get("p0", out) is out and page_of(out) == page_of(p0)
            assert s.get("nope", pool.get_dummy_flat_data_page()) is None
            assert page_of(s.get("p0")) == page_of(p0)  # no target: a dummy page of the host pool
            buf = torch.zeros(p0.numel() * p0.element_size(), dtype=torch.uint8)
            assert s.get("p0", buf.data_ptr(), buf.numel()) == buf.data_ptr()  # address form
            assert buf.numpy().tobytes() == page(pool, 0)
            assert s.set("p-raw", None, p0.data_ptr(), buf.numel())
            assert page_of(s.get("p-raw", pool.get_dummy_flat_data_page())) == page(pool, 0)

            pages = [pool.get_data_page(i * P) for i in range(1, 5)]
            assert s.batch_set(["p1", "p2", "p3", "p4"], pages) is True
            got = s.batch_get(["p1", "p2", "gone", "p3", "p4"],
                              [pool.get_dummy_flat_data_page() for _ in range(5)])
            assert got[2] is None
            assert [page_of(g) for g in got[:2] + got[3:]] == [page_of(p) for p in pages]
            assert s.batch_get([], []) == [] and s.batch_set([], []) is True
            assert s.batch_exists(["p0", "p1", "p2", "gone", "p3"]) == 3
            assert s.batch_exists([]) == 0

            stats = s.get_stats()
            assert isinstance(stats, storage_metrics_class())
            assert sum(stats.backup_pgs) == 6 and sum(stats.prefetch_pgs) >= 6
            assert all(bw > 0 for bw in stats.backup_bandwidth)
            assert s.get_stats().backup_pgs == []  # reset by each call
            assert s.kv_stats()["namespaces"]["sglang-test"]
            assert s.clear() is True
            assert s.batch_exists(["p0", "p1"]) == 0 and not s.exists("p-raw")
            s.close()
            s.close()  # idempotent

        await run(calls)


def page_of(t) -> bytes:
    return t.view(-1).view(torch.uint8).numpy().tobytes()


def test_storage_metrics_from_either_module(monkeypatch):
    """StorageMetrics comes from sglang.srt.observability.metrics_collector (0.5.23) and, on
    an SGLang without it, from sglang.srt.metrics.collector."""
    from sglang.srt.observability.metrics_collector import StorageMetrics

    assert storage_metrics_class() is StorageMetrics
    assert "sglang.srt.metrics.collector" not in sys.modules
    old = types.ModuleType("sglang.srt.metrics.collector")
    old.StorageMetrics = type("StorageMetrics", (), {})
    monkeypatch.setitem(sys.modules, "sglang.srt.observability.metrics_collector", None)
    monkeypatch.setitem(sys.modules, "sglang.srt.metrics", types.ModuleType("sglang.srt.metrics"))
    monkeypatch.setitem(sys.modules, "sglang.srt.metrics.collector", old)
    assert storage_metrics_class() is old.StorageMetrics


async def test_metrics_off_and_pool_full(url):
    """Without storage metrics get_stats is None; a full pool fails a set (False)."""
    async with KVServer(url, pool_size=1 * MiB):
        pool = eng.host_pool("mla", "page_first")
        s = await run(attach, url, pool, kind="mla")

        def calls():
            assert s.get_stats() is None
            assert s.set("too-big", torch.zeros(2 * MiB, dtype=torch.uint8)) is False
            assert not s.exists("too-big")
            s.close()

        await run(calls)


async def test_file_region(tmp_path):
    path = tmp_path / "kv.region"
    async with KVServer(f"file://{path}", pool_size=8 * MiB):
        pool = eng.host_pool("mha", "layer_first")
        eng.fill(pool, seed=5)
        s = await run(attach, f"file://{path}", pool)
        try:
            assert s.service_url == f"file://{path}"
            hashes = get_storage_hash_str(list(range(2 * P)), None, P)
            assert await run(s.batch_set_v1, hashes, torch.arange(2 * P)) == [True, True]
            assert await run(s.batch_exists, hashes) == 2
        finally:
            await run(s.close)


async def test_service_gone(url):
    """Once the service is gone the backend reports misses and failed writes, never raises
    into SGLang's storage threads."""
    pool = eng.host_pool("mha", "page_first")
    server = KVServer(url, pool_size=8 * MiB)
    await server.start()
    try:
        s = await run(attach, url, pool)
        assert await run(s.set, "p", pool.get_data_page(0))
    finally:
        await server.close()

    def calls():
        assert s.batch_exists(["p"]) == 0 and s.exists("p") is False
        assert s.batch_get(["p"], [pool.get_dummy_flat_data_page()]) == [None]
        assert s.set("q", pool.get_data_page(P)) is False
        assert s.batch_get_v1(["p"], torch.arange(P)) == [False]
        assert s.batch_set_v1(["p"], torch.arange(P)) == [False]
        s.close()

    await run(calls)


# ---- SGLang's own controller and its storage threads -----------------------------------------

def _threads(ctrl) -> list:
    return [ctrl.prefetch_thread, ctrl.prefetch_io_aux_thread, ctrl.prefetch_sync_thread,
            ctrl.backup_thread]


@pytest.mark.timeout(120)
async def test_controller_backup_and_prefetch_interleaved(url):
    """SGLang's backup thread stores 12 sequences while its prefetch and I/O threads load each
    finished one back (all on one backend): every page lands with its bytes."""
    async with KVServer(url, pool_size=32 * MiB):
        def engine_run():
            with eng.engine(url, "mha", "page_first_direct", True) as ctrl:
                pool = ctrl.mem_pool_host
                seqs = [list(range(i * 1000, i * 1000 + 2 * P)) for i in range(12)]
                slots = [pool.alloc(2 * P) for _ in range(12)]  # prefetches get other slots
                eng.fill(pool, seed=41)
                ops = [ctrl.write_storage(slots[i], seqs[i],
                                          hash_value=get_storage_hash_str(seqs[i], None, P))
                       for i in range(12)]
                done = set()
                for i in range(12):
                    while ops[i] not in done:  # acks come in order; prefetch as each lands
                        done.add(eng._wait(ctrl.ack_backup_queue, lambda o: True,
                                           time.monotonic() + 30).id)
                    hit, loaded, idx = eng.prefetch(ctrl, f"r{i}", seqs[i])
                    assert (hit, loaded) == (2 * P, 2 * P), i
                    assert not set(idx.tolist()) & set(torch.cat(slots).tolist())
                    assert [page(pool, int(j)) for j in idx[::P]] == [
                        page(pool, int(j)) for j in slots[i][::P]], i
                    pool.free(idx)
                assert all(t.is_alive() for t in _threads(ctrl))

        await run(engine_run)


@pytest.mark.timeout(120)
async def test_controller_threads_survive_service_loss(url):
    """With the service gone SGLang's threads go on: a backup stores nothing, a prefetch finds
    nothing, no thread dies, detach closes the backend."""
    server = KVServer(url, pool_size=16 * MiB)
    await server.start()
    loop = asyncio.get_running_loop()
    closed = False

    def engine_run():
        nonlocal closed
        with eng.engine(url, "mla", "layer_first", False) as ctrl:
            eng.fill(ctrl.mem_pool_host, seed=51)
            a, b = list(range(4 * P)), list(range(900, 900 + 4 * P))
            assert eng.backup(ctrl, a, torch.arange(4 * P)) == 4 * P
            assert eng.prefetch(ctrl, "before", a)[:2] == (4 * P, 4 * P)
            asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
            closed = True
            assert eng.backup(ctrl, b, torch.arange(4 * P, 8 * P)) == 0
            assert eng.prefetch(ctrl, "after", a) == (0, 0, None)
            assert all(t.is_alive() for t in _threads(ctrl))
            backend = ctrl.storage_backend
        assert backend._closed and ctrl.storage_backend is None

    try:
        await run(engine_run)
    finally:
        if not closed:
            await server.close()


# ---- hybrid pools: the v2 interface ----------------------------------------------------------

class _NoPageMeta:
    page_size = P


class _FailingPageMeta:
    """A pool whose page description fails (as SGLang's Mamba pool with slot side states
    does): refused at registration, not on the first transfer."""
    page_size = P

    def get_page_buffer_meta(self, indices):
        raise NotImplementedError("no zero-copy for this pool")


async def test_v2_hybrid_pools_round_trip(url):
    """SGLang's host pool group of a hybrid SWA model (a real SWAKVPool's full and SWA
    sub-pools), registered as its hybrid controller does: batch_set_v2 stores both pools' pages,
    a fresh backend over a fresh group finds them (batch_exists_v2, per hit policy) and loads
    them (batch_get_v2), byte for byte; what it cannot serve is refused, logged."""
    async with KVServer(url, pool_size=32 * MiB):
        group = eng.hybrid_swa_group()
        kv, swa = group.get_pool(PoolName.KV), group.get_pool(PoolName.SWA)
        eng.fill(kv, seed=11)
        eng.fill(swa, seed=12)
        w = eng.attach_group(await run(eng.backend, url, "mha", True), group)
        r = None
        try:
            with pytest.raises(TypeError, match="get_page_buffer_meta"):
                w.register_mem_host_pool_v2(_NoPageMeta(), PoolName.MAMBA)
            with pytest.raises(TypeError, match="cannot move its pages"):
                w.register_mem_host_pool_v2(_FailingPageMeta(), PoolName.MAMBA)
            hashes = get_storage_hash_str(list(range(6 * P)), None, P)
            src = torch.arange(P, 7 * P)
            res = await run(w.batch_set_v2, [
                PoolTransfer(PoolName.KV, host_indices=src, keys=hashes),
                PoolTransfer(PoolName.SWA, host_indices=src[:2 * P], keys=hashes[-2:]),
                PoolTransfer(PoolName.MAMBA, host_indices=src[:P], keys=hashes[:1])])
            assert res == {PoolName.KV: [True] * 6, PoolName.SWA: [True] * 2,
                           PoolName.MAMBA: [False]}  # never registered: refused, logged
            # SWA slots past its pool (68 slots; slot 68 of K would be V's slot 0) are refused,
            # and the pool is left as it was
            before, past = raw(swa), torch.arange(swa.size, swa.size + P)
            assert (await run(w.batch_get_v2, [PoolTransfer(PoolName.SWA, host_indices=past,
                                                             keys=hashes[-1:])])
                    == {PoolName.SWA: [False]})
            assert raw(swa) == before

            group2 = eng.hybrid_swa_group()
            kv2, swa2 = group2.get_pool(PoolName.KV), group2.get_pool(PoolName.SWA)
            r = eng.attach_group(await run(eng.backend, url, "mha", True), group2)
            trailing = PoolTransfer(PoolName.SWA, keys=hashes[-2:],
                                    hit_policy=PoolHitPolicy.TRAILING_PAGES)
            hit = await run(r.batch_exists_v2, hashes, [trailing])
            assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (6, [6])
            assert hit.extra_pool_hit_pages == {PoolName.KV: 6, PoolName.SWA: 6}
            every = PoolTransfer(PoolName.SWA, keys=hashes, hit_policy=PoolHitPolicy.ALL_PAGES)
            assert (await run(r.batch_exists_v2, hashes, [every])).kv_hit_pages == 0
            assert (await run(r.batch_exists_v2, hashes, [])).kv_hit_pages == 6
            with pytest.raises(ValueError, match="hit policy"):
                await run(r.batch_exists_v2, hashes, [PoolTransfer(
                    PoolName.SWA, keys=hashes, hit_policy=PoolHitPolicy.BLOCK_GROUPS)])

            dst = torch.arange(20 * P, 26 * P)
            got = await run(r.batch_get_v2, [
                PoolTransfer(PoolName.KV, host_indices=dst, keys=hashes),
                PoolTransfer(PoolName.SWA, host_indices=dst[:2 * P] - 10 * P, keys=hashes[-2:])])
            assert got == {PoolName.KV: [True] * 6, PoolName.SWA: [True] * 2}
            assert [page(kv2, (20 + i) * P) for i in range(6)] == [page(kv, (1 + i) * P)
                                                                   for i in range(6)]
            assert [page(swa2, (10 + i) * P) for i in range(2)] == [page(swa, (1 + i) * P)
                                                                    for i in range(2)]
            # the KV pool's v2 pages are its v1 pages: one key per page hash
            assert await run(r.batch_get_v1, hashes[:1], torch.arange(30 * P, 31 * P)) == [True]
            assert page(kv2, 30 * P) == page(kv, P)
        finally:
            await run(w.close)
            if r is not None:
                await run(r.close)


async def test_v2_mamba_state_round_trip(url):
    """A hybrid Mamba model: KV pages through the zero-copy path, the last page's Mamba state
    (a real MambaPoolHost: conv and temporal buffers, one slot a page) through the v2 calls,
    stored per TP rank as SGLang's file backend names it; a fresh backend over fresh pools
    finds the prefix only while that trailing state is stored, and loads the same bytes."""
    async with KVServer(url, pool_size=16 * MiB), KVClient.connect(url) as client:
        kv, mamba = eng.host_pool("mha", "page_first"), eng.mamba_host_pool()
        eng.fill(kv, seed=31)
        eng.fill(mamba, seed=32)
        w = await run(attach, url, kv)
        r = None
        try:
            w.register_mem_host_pool_v2(kv, PoolName.KV)
            w.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
            hashes = get_storage_hash_str(list(range(50_000, 50_000 + 4 * P)), None, P)
            state = PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([3]),
                                 keys=hashes[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
            assert await run(w.batch_set_v1, hashes, torch.arange(4 * P)) == [True] * 4
            assert await run(w.batch_set_v2, [state]) == {PoolName.MAMBA: [True]}
            assert await client.exists(f"{hashes[-1]}.mamba{w.tp_suffix}", "sglang")

            kv2, mamba2 = eng.host_pool("mha", "page_first"), eng.mamba_host_pool()
            r = await run(attach, url, kv2)
            r.register_mem_host_pool_v2(kv2, PoolName.KV)
            r.register_mem_host_pool_v2(mamba2, PoolName.MAMBA)
            probe = PoolTransfer(PoolName.MAMBA, keys=hashes[-1:],
                                 hit_policy=PoolHitPolicy.TRAILING_PAGES)
            hit = await run(r.batch_exists_v2, hashes, [probe])
            assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (4, [4])
            assert hit.extra_pool_hit_pages[PoolName.MAMBA] == 4
            load = PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([6]), keys=hashes[-1:])
            assert await run(r.batch_get_v2, [load]) == {PoolName.MAMBA: [True]}
            assert page(mamba2, 6) == page(mamba, 3) and any(page(mamba, 3))
            # without the trailing state no prefix is restorable
            assert await client.remove(f"{hashes[-1]}.mamba{w.tp_suffix}", "sglang")
            hit = await run(r.batch_exists_v2, hashes, [probe])
            assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (0, [])
            assert await run(r.batch_get_v2, [load]) == {PoolName.MAMBA: [False]}
        finally:
            await run(w.close)
            if r is not None:
                await run(r.close)


# ---- bad input from the engine ---------------------------------------------------------------

async def test_bad_input_is_refused_not_crashed(url):
    async with KVServer(url, pool_size=16 * MiB), KVClient.connect(url) as client:
        pool = eng.host_pool("mha", "page_first")
        eng.fill(pool, seed=21)
        s = await run(attach, url, pool)

        def calls():
            hashes = get_storage_hash_str(list(range(2 * P)), None, P)
            assert s.batch_set_v1(hashes, torch.arange(2 * P)) == [True, True]
            before = raw(pool)
            # host indices past the pool (slot `size` of K is V's slot 0 in this layout),
            # negative, or not one page per key: refused, and the pool is left untouched
            assert s.batch_get_v1(hashes[:1], torch.arange(pool.size, pool.size + P)) == [False]
            assert s.batch_get_v1(hashes[:1], torch.arange(-P, 0)) == [False]
            assert s.batch_get_v1(hashes, torch.arange(P)) == [False, False]
            assert s.batch_set_v1(["x"], torch.arange(pool.size, pool.size + P)) == [False]
            assert raw(pool) == before

            # a target of the wrong size is a miss, and stays as it was
            small = torch.full((pool.get_dummy_flat_data_page().numel() - 1,), 7,
                               dtype=pool.dtype)
            assert s.get(hashes[0], small) is None
            assert bool((small == 7).all())

            # a key over kvservice's limit is a miss / a failed write, and ends a prefix
            long = "k" * MAX_KEY_BYTES
            assert s.set(long, pool.get_data_page(0)) is False
            assert s.get(long, pool.get_dummy_flat_data_page()) is None
            assert s.exists(long) is False
            assert s.batch_exists([hashes[0], long, hashes[1]]) == 1
            assert s.batch_set_v1([long], torch.arange(P)) == [False]
            assert s.batch_get_v1([hashes[0], long], torch.arange(4 * P, 6 * P)) == [True, False]

            s.close()
            for call in (lambda: s.get(hashes[0]), lambda: s.set("y", pool.get_data_page(0)),
                         lambda: s.exists(hashes[0]), lambda: s.batch_exists(hashes),
                         lambda: s.batch_get_v1(hashes, torch.arange(2 * P)),
                         lambda: s.batch_set_v1(hashes, torch.arange(2 * P)),
                         lambda: s.batch_set_v2([]), lambda: s.clear()):
                with pytest.raises(RuntimeError, match="closed"):
                    call()

        await run(calls)
        # the service is fine afterwards
        assert await client.exists(hashes_key(pool, s), "sglang")


def hashes_key(pool, s) -> str:
    return get_storage_hash_str(list(range(2 * P)), None, P)[0] + s.suffix
