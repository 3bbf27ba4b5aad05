"""SGLang 0.5.23's own ``mooncake`` HiCache backend (``MooncakeStore``) on kvservice's Mooncake
facade through the shim, driven by the real package on the CPU (issue 39).

Two engine processes (``sglang_mooncake_engine``) run SGLang's ``HiCacheController`` with
``storage_backend="mooncake"``, configured as the README says (``MOONCAKE_MASTER=shm://NAME``);
in this process SGLang's ``MooncakeStore`` is built on the shim's ``mooncake.store`` to check
what a buggy engine or a lost service does. ``sglang_engine`` explains how SGLang is imported
without torchvision.
"""
from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from pathlib import Path

import pytest

import sglang_engine as eng
from procs import run_json
import sglang_mooncake_engine as mc
from kvservice import KVClient, KVServer
from kvservice.compat import mooncake_shim_path

pytestmark = pytest.mark.engines

MiB = 1 << 20
P = eng.PAGE
run = asyncio.to_thread

eng.load_sglang()
import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402


def _engine_env(url: str) -> dict[str, str]:
    """The README's configuration and nothing more: the shim first on PYTHONPATH, the
    kvservice URL as the Mooncake master; SGLang's other MOONCAKE_* defaults (protocol rdma,
    a 4 GB segment) are accepted by the facade and ignored."""
    tests = os.path.dirname(os.path.abspath(__file__))
    path = [mooncake_shim_path(), os.path.dirname(tests), tests, os.environ.get("PYTHONPATH", "")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in path if p), "MOONCAKE_MASTER": url}


@pytest.mark.timeout(300)
async def test_sglang_mooncake_backend_across_two_processes(url, tmp_path):
    """A writer process backs up 8 pages per (pool kind, layout) through SGLang's controller
    and its MooncakeStore on the facade (zero-copy batch_set_v1 from the registered host pool);
    a fresh reader process finds them (batch_exists, also cut at a missing key) and prefetches
    them (batch_get_v1 into slots its host pool allocates): same bytes, page by page. Also
    SGLang's standalone-storage mode (host pool from MooncakeHostTensorAllocator, setup_dummy
    at client_server_address), and a hybrid SWA model's KV and window pages (the v2 calls)."""
    async with KVServer(url, pool_size=64 * MiB), KVClient.connect(url) as client:
        summaries = {}
        for role in ("write", "read"):
            summaries[role] = await run_json([str(Path(mc.__file__)), role, url, str(tmp_path)],
                                             240, _engine_env(url))
        # SGLang's MHA pages are two objects (K and V), MLA pages one, named as SGLang names them
        # (prefixed by the model name, in the facade's default namespace "")
        model = eng.MODEL.replace("/", "-")
        mha = model + "_" + get_storage_hash_str(list(range(100_000, 100_000 + P)), None, P)[0]
        mla = model + "_" + get_storage_hash_str(list(range(300_000, 300_000 + P)), None, P)[0]
        assert [await client.exists(k, "") for k in (
            f"{mha}_0_k", f"{mha}_0_v", f"{mla}__k", f"{mla}__v")] == [True, True, True, False]
    names = [f"{k}-{lay}" for k, lay in mc.COMBOS] + ["standalone"]
    n, w = mc.PAGES, eng.SWA_PAGES
    assert sorted(summaries["write"]) == sorted(names + ["swa-hybrid"]) == sorted(
        summaries["read"])
    assert summaries["write"]["swa-hybrid"] == {"stored": n, "swa_stored": w}
    assert summaries["read"]["swa-hybrid"] == {"hit": n, "swa_hit": n, "read": n,
                                               "swa_read": w}
    for name in names:
        memory = "kvservice.compat.mooncake.memory" if name == "standalone" else \
            "sglang.srt.mem_cache.pool_host.common"
        facts = {"backend": "MooncakeStore", "store": "kvservice.compat.mooncake.store",
                 "host_memory": memory,
                 "mla": name.startswith("mla"), "zero_copy": True,
                 "standalone": name == "standalone"}
        assert summaries["write"][name] == {**facts, "stored": n}, name
        assert summaries["read"][name] == {**facts, "exists": n, "exists_past_gap": 2,
                                           "hit": n, "read": n}, name
    pages, compared = eng.compare_pages(
        tmp_path, [(c, n) for c in names] + [("swa-hybrid-kv", n), ("swa-hybrid-swa", w)])
    print(f"\n{len(names)} configurations x {n} pages + a hybrid SWA model ({n} KV, {w} SWA "
          f"pages): {pages} pages, {compared} bytes compared")


# ---- SGLang's MooncakeStore in this process, on the shim's mooncake.store ---------------------

@pytest.fixture
def shim(monkeypatch):
    """``mooncake.store`` is the shim's module (this process may hold the real wheel's)."""
    path = os.path.join(mooncake_shim_path(), "mooncake", "store.py")
    spec = importlib.util.spec_from_file_location("mooncake.store", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "mooncake.store", module)
    return module


def mooncake_store(extra: dict, pool=None, kind: str = "mha"):
    """SGLang's factory building its ``mooncake`` backend from the extra-config JSON's
    fields, then registering the host pool as its controller does."""
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=kind == "mla", enable_storage_metrics=False, is_page_first_layout=False,
        model_name=eng.MODEL, extra_config={"protocol": "tcp", **extra})
    store = StorageBackendFactory.create_backend("mooncake", config, pool)
    if pool is not None:
        store.register_mem_pool_host(pool)
    return store


def raw(pool) -> bytes:
    return pool.kv_buffer.view(-1).view(torch.uint8).numpy().tobytes()


async def test_bad_host_memory_refused_pool_untouched(url, shim):
    """Pages SGLang's MooncakeStore points outside the host pool it registered (slots past the
    pool, negative slots, an unregistered tensor) are refused (False), the pool and the target
    left as they were; an over-long key is a failed write and ends an existence prefix; after
    all that the store serves as before, and clear() removes what no read lease holds."""
    async with KVServer(url, pool_size=16 * MiB):
        pool = eng.host_pool("mha", "page_first")
        eng.fill(pool, seed=61)
        s = await run(mooncake_store, {"master_server_address": url}, pool)

        def calls():
            hashes = get_storage_hash_str(list(range(2 * P)), None, P)
            assert type(s.store).__module__ == "kvservice.compat.mooncake.store"
            assert s.batch_set_v1(hashes, torch.arange(2 * P)) == [True, True]
            before = raw(pool)
            far = torch.arange(3 * pool.size, 3 * pool.size + P)  # K and V both past the pool
            assert s.batch_get_v1(hashes[:1], far) == [False]
            near = torch.arange(-3 * pool.size, -3 * pool.size + P)  # both before the pool
            assert s.batch_get_v1(hashes[:1], near) == [False]
            assert s.batch_set_v1(["x"], far) == [False]
            assert s.batch_exists(["x"]) == 0
            assert raw(pool) == before

            other = torch.full((pool.get_dummy_flat_data_page().numel(),), 7, dtype=pool.dtype)
            size = other.numel() * other.element_size()
            assert s.get(f"{s.config_prefix}_{hashes[0]}_0_k", other.data_ptr(), size) is False
            assert bool((other == 7).all())

            long = "k" * 1100  # over kvservice's 1024-byte keys (Mooncake took them)
            assert s.batch_set_v1([long], torch.arange(4 * P, 5 * P)) == [False]
            assert s.batch_exists([hashes[0], long, hashes[1]]) == 1

            assert s.batch_get_v1(hashes, torch.arange(8 * P, 10 * P)) == [True, True]
            assert eng.page_bytes(pool, [8 * P, 9 * P]) == eng.page_bytes(pool, [0, P])
            unread = get_storage_hash_str(list(range(900, 900 + P)), None, P)
            assert s.batch_set_v1(unread, torch.arange(P)) == [True]
            # SGLang's clear() is Mooncake's non-forced remove_all: pages read in the last
            # kv_lease_ttl (10 s, Mooncake's default read lease) stay, as in Mooncake
            s.clear()
            assert (s.batch_exists(unread), s.batch_exists(hashes)) == (0, 2)

        try:
            await run(calls)
        finally:
            s.store.close()


async def test_service_gone_misses_not_raises(url, shim):
    """With the kvservice server gone SGLang's MooncakeStore sees misses and failed writes
    (the facade's RPC_FAIL codes), never an exception into SGLang's storage threads."""
    pool = eng.host_pool("mla", "layer_first")
    eng.fill(pool, seed=71)
    server = KVServer(url, pool_size=8 * MiB)
    await server.start()
    try:
        s = await run(mooncake_store, {"master_server_address": url}, pool, "mla")
        hashes = get_storage_hash_str(list(range(2 * P)), None, P)
        assert await run(s.batch_set_v1, hashes, torch.arange(2 * P)) == [True, True]
    finally:
        await server.close()

    def calls():
        assert s.batch_exists(hashes) == 0
        assert s.batch_get_v1(hashes, torch.arange(4 * P, 6 * P)) == [False, False]
        assert s.batch_set_v1(hashes, torch.arange(2 * P)) == [False, False]
        s.store.close()

    await run(calls)


async def test_setup_refused_with_a_clear_error(url, name, shim):
    """A Mooncake master address (host:port) is not a kvservice URL, a URL with no server
    behind it cannot connect: SGLang's MooncakeStore raises its setup error with the facade's
    code (INVALID_PARAMS -600, RPC_FAIL -900) at once; its standalone mode over a default host
    allocator is refused by SGLang itself."""
    with pytest.raises(RuntimeError, match="error code: -600"):
        await run(mooncake_store, {"master_server_address": "127.0.0.1:50051"})
    with pytest.raises(RuntimeError, match="error code: -900"):
        await run(mooncake_store, {"master_server_address": f"shm://{name}-absent"})
    async with KVServer(url, pool_size=8 * MiB):
        with pytest.raises(RuntimeError, match="requires MooncakeHostTensorAllocator"):
            await run(mooncake_store, {"client_server_address": url,
                                       "standalone_storage": True},
                      eng.host_pool("mha", "page_first"))
