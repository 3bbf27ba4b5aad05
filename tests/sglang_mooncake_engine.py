"""One SGLang 0.5.23 engine process whose HiCache storage is SGLang's own ``mooncake`` backend
(``MooncakeStore``) on kvservice's Mooncake facade, through the shim.

Run as ``python tests/sglang_mooncake_engine.py write|read URL OUT_DIR`` with the shim directory
(``python -m kvservice mooncake-shim-path``) first on PYTHONPATH, so ``mooncake.store`` is the
facade, and ``MOONCAKE_MASTER=URL`` in the environment, as the README says to run SGLang. For each (pool kind, layout) SGLang's Mooncake backend supports, SGLang's
own ``HiCacheController`` (``storage_backend="mooncake"``: its factory builds ``MooncakeStore``
from those variables, registers the host pool's memory, and picks the zero-copy page functions
``batch_set_v1`` / ``batch_get_v1``) backs pages up (``write``) or prefetches them into a fresh
pool (``read``). Then SGLang's standalone-storage mode: host pool memory from
``MooncakeHostTensorAllocator``, ``setup_dummy`` at ``client_server_address`` (the extra-config
JSON). Then a hybrid SWA model's pool group (the v2 calls). Pages' bytes go to OUT_DIR, a JSON
summary to stdout.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sglang_engine as eng

#: what SGLang's Mooncake backend stores: MHA in the page-first layouts (its layer_first is
#: MLA only: one multi-buffer object per page), MLA in all three
COMBOS = (("mha", "page_first"), ("mha", "page_first_direct"), ("mla", "layer_first"),
          ("mla", "page_first"), ("mla", "page_first_direct"))
STANDALONE = ("mha", "page_first")
PAGES = eng.PAGES


@contextlib.contextmanager
def engine(kind: str, layout: str, extra: dict | None = None,
           allocator_type: str = "default") -> Iterator[Any]:
    """SGLang's ``HiCacheController`` (one TP rank, CPU pools) with storage backend
    ``mooncake``; on exit SGLang detaches it, then the facade's connection is closed (SGLang's
    ``MooncakeStore.close`` leaves that to the store's destructor)."""
    eng.load_sglang()
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.runtime_context import get_parallel

    dev = eng.device_pool(kind)
    allocator = PagedTokenToKVPoolAllocator(dev.size, eng.PAGE, torch.bfloat16, "cpu", dev, False)
    pool = eng.host_pool(kind, layout, dev=dev, allocator_type=allocator_type)
    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1,
                                 attn_dcp_rank=0):
        ctrl = HiCacheController(allocator, pool, eng.PAGE, None, threading.Event(),
                                 io_backend="direct", storage_backend="mooncake",
                                 model_name=eng.MODEL, storage_backend_extra_config=extra)
        backend = ctrl.storage_backend
        try:
            yield ctrl
        finally:
            ctrl.detach_storage_backend()
            backend.store.close()


def facts(ctrl: Any) -> dict[str, Any]:
    """What SGLang chose, checked by the test: its MooncakeStore on the facade, where its host
    pool's memory came from (standalone: the facade's MooncakeHostMemAllocator), MLA derived
    from the device pool, the zero-copy page functions, the standalone mode."""
    backend, allocator = ctrl.storage_backend, ctrl.mem_pool_host.allocator
    return {"backend": type(backend).__name__, "store": type(backend.store).__module__,
            "host_memory": type(getattr(allocator, "allocator", allocator)).__module__,
            "mla": backend.is_mla_backend,
            "zero_copy": ctrl.page_set_func.__name__ == "_page_set_zero_copy",
            "standalone": bool(backend.config.standalone_storage)}


def run_one(role: str, name: str, token_ids: list[int], out: Path, **engine_kw: Any
            ) -> dict[str, Any]:
    """Back up (``write``) or prefetch (``read``) PAGES pages of ``token_ids``."""
    import torch
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    with engine(**engine_kw) as ctrl:
        pool = ctrl.mem_pool_host
        summary = facts(ctrl)
        if role == "write":
            eng.fill(pool, seed=sum(map(ord, name)))
            slots = torch.arange(2 * eng.PAGE, (2 + PAGES) * eng.PAGE)
            summary["stored"] = eng.backup(ctrl, token_ids, slots) // eng.PAGE
            starts = slots[::eng.PAGE]
        else:
            hashes = get_storage_hash_str(token_ids, None, eng.PAGE)
            summary["exists"] = ctrl.storage_backend.batch_exists(hashes)
            summary["exists_past_gap"] = ctrl.storage_backend.batch_exists(
                hashes[:2] + ["never-stored"] + hashes[2:])
            hit, loaded, slots = eng.prefetch(ctrl, name, token_ids)
            summary.update(hit=hit // eng.PAGE, read=loaded // eng.PAGE)
            starts = slots[::eng.PAGE] if slots is not None else []
        (out / f"{name}.{role[0]}").write_bytes(b"".join(eng.page_bytes(pool, starts)))
    return summary


def run_hybrid(role: str, out: Path) -> dict[str, Any]:
    """A hybrid sliding-window model (SGLang's host pool group over a real SWAKVPool) on
    SGLang's MooncakeStore, registered as its hybrid controller registers it: KV pages through
    the controller's zero-copy page functions, the window's last SWA_PAGES pages through the
    v2 calls (batch_set_v2, batch_exists_v2 with its trailing-pages policy, batch_get_v2)."""
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageConfig, PoolHitPolicy,
                                                      PoolName, PoolTransfer)
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from kvservice.integrations.sglang import _tensors

    group = eng.hybrid_swa_group()
    kv, swa = group.get_pool(PoolName.KV), group.get_pool(PoolName.SWA)
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=eng.MODEL, extra_config={})
    storage = eng.attach_group(StorageBackendFactory.create_backend("mooncake", config, group),
                               group)
    try:
        hashes = get_storage_hash_str(list(range(7_000_000, 7_000_000 + PAGES * eng.PAGE)),
                                      None, eng.PAGE)
        first = 2 if role == "write" else 5
        kv_slots = torch.arange(first * eng.PAGE, (first + PAGES) * eng.PAGE)
        swa_slots = torch.arange(first * eng.PAGE, (first + eng.SWA_PAGES) * eng.PAGE)
        window = PoolTransfer(PoolName.SWA, host_indices=swa_slots,
                              keys=hashes[-eng.SWA_PAGES:],
                              hit_policy=PoolHitPolicy.TRAILING_PAGES)
        ctrl = eng.controller(kv, storage)
        if role == "write":
            eng.fill(kv, seed=201)
            eng.fill(swa, seed=202)
            kv_ok = HiCacheController._page_set_zero_copy(ctrl, hashes, kv_slots)
            swa_ok = storage.batch_set_v2([window])[PoolName.SWA]
            summary = {"stored": PAGES if kv_ok else 0, "swa_stored": sum(swa_ok)}
        else:
            for t in _tensors(kv.kv_buffer) + _tensors(swa.kv_buffer):
                t.zero_()
            hit = storage.batch_exists_v2(hashes, [window])
            kv_read = HiCacheController._page_get_zero_copy(ctrl, eng._Op(), hashes, kv_slots)
            swa_read = storage.batch_get_v2([window])[PoolName.SWA]
            summary = {"hit": hit.kv_hit_pages, "swa_hit": hit.extra_pool_hit_pages.get("swa"),
                       "read": kv_read, "swa_read": sum(swa_read)}
        suffix = role[0]
        (out / f"swa-hybrid-kv.{suffix}").write_bytes(
            b"".join(eng.page_bytes(kv, kv_slots[::eng.PAGE])))
        (out / f"swa-hybrid-swa.{suffix}").write_bytes(
            b"".join(eng.page_bytes(swa, swa_slots[::eng.PAGE])))
    finally:
        storage.store.close()
    return summary


def run(role: str, url: str, out: Path) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for i, (kind, layout) in enumerate(COMBOS):
        name = f"{kind}-{layout}"
        tokens = list(range((i + 1) * 100_000, (i + 1) * 100_000 + PAGES * eng.PAGE))
        summary[name] = run_one(role, name, tokens, out, kind=kind, layout=layout)
    kind, layout = STANDALONE
    tokens = list(range(9_000_000, 9_000_000 + PAGES * eng.PAGE))
    summary["standalone"] = run_one(
        role, "standalone", tokens, out, kind=kind, layout=layout, allocator_type="mooncake",
        extra={"client_server_address": url, "standalone_storage": True})
    summary["swa-hybrid"] = run_hybrid(role, out)
    return summary


if __name__ == "__main__":
    import mooncake.store

    # the shim must be what SGLang imports (not the installed Mooncake wheel)
    assert mooncake.store.__name__ == "mooncake.store" and mooncake.store.__file__.startswith(
        os.path.dirname(os.path.dirname(eng.__file__))), mooncake.store.__file__
    print(json.dumps(run(sys.argv[1], sys.argv[2], Path(sys.argv[3]))), flush=True)
