"""Real SGLang 0.5.23 pieces for the engines tests, and the second process they start.

SGLang's host pools import ``sglang.srt.configs``, whose multimodal configs import
``torchvision`` at module level (``sglang/srt/multimodal/internvl_utils.py``; nothing on the
storage path uses it). PyPI's torchvision is a CUDA build that would replace the CPU torch, so
:func:`load_sglang` imports SGLang (its transformers patches decide then that torchvision is
absent) and only then lets ``import torchvision`` yield an inert module whose every name raises
when used: the storage code runs exactly as shipped.

Run as a script (``python tests/sglang_engine.py write|read URL OUT_DIR``) it is one engine
process: for each pool kind (MHA, MLA), storage layout and page path (generic, zero-copy), SGLang's
own ``HiCacheController`` over real pools attaches the kvservice backend from the README's extra
config and backs pages up (``write``) or prefetches them (``read``) with its storage threads;
then a hybrid SWA model's KV and sliding-window pages (the v2 calls). It saves the pages' bytes
to OUT_DIR and prints a JSON summary.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import json
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PAGE = 4          # tokens per page
PAGES = 8         # pages each combination stores
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
KINDS = ("mha", "mla")
PATHS = ("generic", "interface_v1")
SWA_PAGES = 2     # the sliding window's pages a hybrid model keeps per prefix
MODEL = "Qwen/Qwen3-0.6B"
EXTRA = {"backend_name": "kvservice", "module_path": "kvservice.integrations.sglang",
         "class_name": "KVServiceHiCacheStorage", "url": "kvservice://kv",
         "namespace": "sglang", "interface_v1": 1}


class _InertTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torchvision`` (and submodules) as modules whose names raise when used."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        def absent(*_a: Any, **_k: Any) -> Any:
            raise RuntimeError("torchvision is not installed (engines suite: CPU torch)")

        def __getattr__(attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (), {"__init__": absent, "__getattr__": absent})

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        module.__path__ = []


def load_sglang() -> None:
    """Import SGLang so that its host pools and cache controller import without torchvision."""
    import sglang  # noqa: F401  (applies its transformers patches first)
    from transformers.utils import import_utils

    if not any(isinstance(f, _InertTorchvision) for f in sys.meta_path):
        assert not import_utils.is_torchvision_available()
        sys.meta_path.append(_InertTorchvision())


def device_pool(kind: str, slots: int = 64) -> Any:
    """A real SGLang device KV pool (MHA or MLA) on CPU tensors."""
    load_sglang()
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if kind == "mha":
        return MHATokenToKVPool(size=slots, page_size=PAGE, dtype=torch.bfloat16, head_num=2,
                                head_dim=8, layer_num=3, device="cpu", enable_memory_saver=False)
    return MLATokenToKVPool(size=slots, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=16,
                            qk_rope_head_dim=8, layer_num=3, device="cpu",
                            enable_memory_saver=False)


def host_pool(kind: str, layout: str, slots: int = 64, dev: Any = None,
              allocator_type: str = "default") -> Any:
    """A real SGLang host pool (MHA or MLA) over a real device pool, both on CPU tensors;
    ``allocator_type`` as SGLang derives it from the storage backend (``mooncake``: host memory
    from ``MooncakeHostTensorAllocator``, its standalone-storage mode)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dev = dev if dev is not None else device_pool(kind, slots)
    host = dict(host_to_device_ratio=2.0, host_size=0, page_size=PAGE, layout=layout,
                pin_memory=False, device="cpu", allocator_type=allocator_type)
    if kind == "mha":
        cls, info, kw = _mha_host_inputs(dev)
        return cls(info, **kw, **host)
    return MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info,
                                device_capacity_tokens=dev.size, start_layer=dev.start_layer,
                                end_layer=dev.end_layer, target_layer_num=dev.layer_num,
                                override_kv_cache_dim=dev.kv_cache_dim, **host)


@contextlib.contextmanager
def engine(url: str, kind: str, layout: str, interface_v1: bool) -> Iterator[Any]:
    """SGLang's own ``HiCacheController`` over real pools on CPU (one TP rank), the kvservice
    backend attached by its own attach path from the command-line JSON, its storage threads
    running; detached (threads stopped, backend closed) on exit."""
    load_sglang()
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.runtime_context import get_parallel

    dev = device_pool(kind)
    allocator = PagedTokenToKVPoolAllocator(dev.size, PAGE, torch.bfloat16, "cpu", dev, False)
    arg = json.dumps({**EXTRA, "url": _service(url), "interface_v1": int(interface_v1)})
    config, *_ = HybridCacheController.parse_storage_backend_extra_config(arg)
    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1,
                                 attn_dcp_rank=0):
        ctrl = HiCacheController(allocator, host_pool(kind, layout, dev=dev), PAGE, None,
                                 threading.Event(), io_backend="direct",
                                 storage_backend="dynamic", model_name=MODEL,
                                 storage_backend_extra_config=config)
        try:
            yield ctrl
        finally:
            ctrl.detach_storage_backend()


def _wait(queue: Any, match: Any, deadline: float) -> Any:
    """The first item of ``queue`` that ``match`` accepts, before ``deadline``."""
    from queue import Empty

    while time.monotonic() < deadline:
        try:
            item = queue.get(timeout=0.2)
        except Empty:
            continue
        if match(item):
            return item
    raise TimeoutError("SGLang's storage threads did not answer in time")


def backup(ctrl: Any, token_ids: list[int], host_indices: Any, timeout: float = 30) -> int:
    """Back pages up as SGLang's tree cache does (``write_storage`` with the page hashes); the
    tokens SGLang's backup thread reports stored."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    hashes = get_storage_hash_str(token_ids, None, PAGE)
    op_id = ctrl.write_storage(host_indices, token_ids, hash_value=hashes)
    op = _wait(ctrl.ack_backup_queue, lambda o: o.id == op_id, time.monotonic() + timeout)
    return int(op.completed_tokens)


def prefetch(ctrl: Any, rid: str, token_ids: list[int], timeout: float = 30
             ) -> tuple[int, int, Any]:
    """Prefetch as SGLang's scheduler does: the prefetch thread's hit query, host slots for the
    hit, the I/O thread's transfer. (hit tokens, loaded tokens, host indices)."""
    deadline = time.monotonic() + timeout
    op = ctrl.prefetch(rid, token_ids)
    _wait(ctrl.prefetch_hit_queue, lambda o: o is op, deadline)
    hit = int(op.storage_hit_count)
    if hit == 0:
        return 0, 0, None
    op.host_indices = ctrl.mem_pool_host.alloc(hit)
    if op.host_indices is None:
        raise RuntimeError(f"the host pool has no {hit} free slots for the prefetch")
    ctrl.prefetch_buffer.put(op)
    loaded = 0
    while True:
        ack = _wait(ctrl.ack_prefetch_queue, lambda a: a.rid == rid, deadline)
        loaded = max(loaded, ack.completed_tokens or 0)
        if ack.completed_req:
            return hit, loaded, op.host_indices


def hybrid_swa_group(layout: str = "page_first") -> Any:
    """SGLang's ``HostPoolGroup`` of a hybrid sliding-window model on CPU: a real ``SWAKVPool``
    (full-attention layers 1 and 3, SWA layers 0 and 2) and a host pool for each of its
    sub-pools, entries ``kv`` (the anchor) and ``swa`` as SGLang's assembler names them."""
    load_sglang()
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (_mha_host_inputs,
                                                                         build_pool_entry)
    from sglang.srt.mem_cache.pool_host import HostPoolGroup
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    dev = SWAKVPool(size=64, size_swa=32, page_size=PAGE, dtype=torch.bfloat16, head_num=2,
                    head_dim=8, swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1, 3],
                    device="cpu")

    def host(pool: Any) -> Any:
        cls, info, kw = _mha_host_inputs(pool)
        return cls(info, **kw, host_to_device_ratio=2.0, host_size=0, page_size=PAGE,
                   layout=layout, pin_memory=False, device="cpu")

    return HostPoolGroup([
        build_pool_entry(name=PoolName.KV, host_pool=host(dev.full_kv_pool),
                         device_pool=dev.full_kv_pool, layer_mapping={1: 0, 3: 1},
                         transfer_layer_id_max=4, is_anchor=True),
        build_pool_entry(name=PoolName.SWA, host_pool=host(dev.swa_kv_pool),
                         device_pool=dev.swa_kv_pool, layer_mapping={0: 0, 2: 1},
                         transfer_layer_id_max=4)])


def mamba_host_pool(slots: int = 8) -> Any:
    """A real ``MambaPoolHost`` (page_first, one slot a page: the conv and temporal states of
    two Mamba2 layers) over a real ``MambaPool`` on CPU."""
    load_sglang()
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import MambaPool
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=32, n_groups=1,
                                    num_heads=2, head_dim=16, state_size=8, conv_kernel=4)
    dev = MambaPool(size=slots, spec_state_size=0, cache_params=Mamba2CacheParams(
        shape=shape, layers=[0, 2]), mamba_layer_ids=[0, 2], device="cpu")
    return MambaPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0,
                         device_capacity=dev.size, pin_memory=False, device="cpu",
                         layout="page_first")


def attach_group(storage: Any, group: Any) -> Any:
    """Register a host pool group as SGLang's ``HybridCacheController.attach_storage_backend``
    does: the anchor's pool, then every entry through the v2 call."""
    storage.register_mem_pool_host(group.anchor_entry.host_pool)
    for entry in group.entries:
        storage.register_mem_host_pool_v2(entry.host_pool, entry.name)
    storage.on_host_pools_registered()
    return storage


def fill(pool: Any, seed: int) -> None:
    """Random bytes in every host tensor of ``pool``."""
    import torch

    from kvservice.integrations.sglang import _tensors

    gen = torch.Generator().manual_seed(seed)
    for t in _tensors(pool.kv_buffer):
        raw = t.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def backend(url: str, kind: str, interface_v1: bool, namespace: str = "sglang",
            enable_storage_metrics: bool = False, **extra: Any) -> Any:
    """SGLang's factory building our backend from the command-line JSON, parsed by SGLang."""
    load_sglang()
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    arg = json.dumps({**EXTRA, "url": _service(url),
                      "namespace": namespace, "interface_v1": int(interface_v1), **extra})
    config, *_ = HybridCacheController.parse_storage_backend_extra_config(arg)
    storage_config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=kind == "mla", enable_storage_metrics=enable_storage_metrics,
        is_page_first_layout=False, model_name=MODEL, extra_config=config)
    return StorageBackendFactory.create_backend("dynamic", storage_config, None)


def _service(url: str) -> str:
    """The kvservice:// form of a server URL (shm://NAME -> kvservice://NAME)."""
    scheme, rest = url.split("://", 1)
    return f"kvservice://{rest}" if scheme == "shm" else f"kvservice://{scheme}{rest}"


def controller(pool: Any, storage: Any) -> Any:
    """What SGLang's ``HiCacheController`` storage methods read from ``self``."""
    return types.SimpleNamespace(storage_host_pool=pool, mem_pool_host=pool,
                                 storage_backend=storage, page_size=PAGE)


class _Op:
    request_id = "engines-test"

    @staticmethod
    def is_terminated() -> bool:
        return False


def tokens(kind: str, layout: str, path: str) -> list[int]:
    """Token ids of one combination (disjoint page hashes across combinations)."""
    base = (KINDS.index(kind) * 100 + LAYOUTS.index(layout) * 10 + PATHS.index(path)) * 10_000
    return list(range(base, base + PAGES * PAGE))


def compare_pages(out: Path, counts: list[tuple[str, int]]) -> tuple[int, int]:
    """Assert each (name, pages) pair's pages read back (``OUT/NAME.r``) equal those written
    (``OUT/NAME.w``), page by page, and that the writer's were not all zero: (pages, bytes)."""
    compared = pages = 0
    for name, count in counts:
        written = (out / f"{name}.w").read_bytes()
        read = (out / f"{name}.r").read_bytes()
        size = len(written) // count
        assert size and len(read) == len(written), name
        assert any(written), name  # the writer's random pages, not an all-zero pool
        for i in range(count):
            assert read[i * size:(i + 1) * size] == written[i * size:(i + 1) * size], (name, i)
        compared += len(read)
        pages += count
    return pages, compared


def page_bytes(pool: Any, starts: Any) -> list[bytes]:
    """The flat data page starting at each slot of ``starts``."""
    import torch

    return [pool.get_data_page(int(i), flat=True).view(-1).view(torch.uint8).numpy().tobytes()
            for i in starts]


def run_hybrid(role: str, url: str, out: Path) -> dict[str, Any]:
    """The hybrid SWA model's storage traffic: KV pages through the controller's zero-copy
    path, the sliding window's last SWA_PAGES pages through the v2 calls (as SGLang's hybrid
    controller backs them up and prefetches them)."""
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from kvservice.integrations.sglang import _tensors

    group = hybrid_swa_group()
    kv, swa = group.get_pool(PoolName.KV), group.get_pool(PoolName.SWA)
    storage = attach_group(backend(url, "mha", True), group)
    try:
        hashes = get_storage_hash_str(list(range(7_000_000, 7_000_000 + PAGES * PAGE)), None,
                                      PAGE)
        first = 2 if role == "write" else 5
        kv_slots = torch.arange(first * PAGE, (first + PAGES) * PAGE)
        swa_slots = torch.arange(first * PAGE, (first + SWA_PAGES) * PAGE)
        window = PoolTransfer(PoolName.SWA, host_indices=swa_slots, keys=hashes[-SWA_PAGES:],
                              hit_policy=PoolHitPolicy.TRAILING_PAGES)
        ctrl = controller(kv, storage)
        if role == "write":
            fill(kv, seed=101)
            fill(swa, seed=102)
            swa_ok = storage.batch_set_v2([window])[PoolName.SWA]
            kv_ok = HiCacheController._page_set_zero_copy(ctrl, hashes, kv_slots)
            summary = {"stored": PAGES if kv_ok else 0, "swa_stored": sum(swa_ok)}
        else:
            for t in _tensors(kv.kv_buffer) + _tensors(swa.kv_buffer):
                t.zero_()
            hit = storage.batch_exists_v2(hashes, [window])
            kv_read = HiCacheController._page_get_zero_copy(ctrl, _Op(), hashes, kv_slots)
            swa_read = storage.batch_get_v2([window])[PoolName.SWA]
            summary = {"hit": hit.kv_hit_pages, "swa_hit": hit.extra_pool_hit_pages.get("swa"),
                       "read": kv_read, "swa_read": sum(swa_read)}
        suffix = "w" if role == "write" else "r"
        (out / f"swa-hybrid-kv.{suffix}").write_bytes(b"".join(page_bytes(kv, kv_slots[::PAGE])))
        (out / f"swa-hybrid-swa.{suffix}").write_bytes(
            b"".join(page_bytes(swa, swa_slots[::PAGE])))
    finally:
        storage.close()
    return summary


def run(role: str, url: str, out: Path) -> dict[str, Any]:
    """One engine process: for every (pool kind, layout, path), SGLang's controller backs pages
    up (``write``) or prefetches them into a zeroed pool (``read``); pages' bytes saved."""
    import torch

    summary: dict[str, Any] = {}
    for kind in KINDS:
        for layout in LAYOUTS:
            for path in PATHS:
                name = f"{kind}-{layout}-{path}"
                token_ids = tokens(kind, layout, path)
                with engine(url, kind, layout, path == "interface_v1") as ctrl:
                    pool = ctrl.mem_pool_host
                    facts = {"mla": ctrl.storage_config.is_mla_model,
                             "zero_copy": ctrl.page_set_func.__name__ == "_page_set_zero_copy"}
                    if role == "write":
                        fill(pool, seed=len(summary) + 1)
                        slots = torch.arange(2 * PAGE, (2 + PAGES) * PAGE)
                        stored = backup(ctrl, token_ids, slots)
                        summary[name] = {"stored": stored // PAGE, **facts}
                        starts = slots[::PAGE]
                    else:
                        hit, loaded, slots = prefetch(ctrl, name, token_ids)
                        summary[name] = {"hit": hit // PAGE, "read": loaded // PAGE, **facts}
                        starts = slots[::PAGE] if slots is not None else []
                    (out / f"{name}.{role[0]}").write_bytes(b"".join(page_bytes(pool, starts)))
    summary["swa-hybrid"] = run_hybrid(role, url, out)
    return summary


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], sys.argv[2], Path(sys.argv[3]))), flush=True)
