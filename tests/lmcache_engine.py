"""A real LMCache 0.5.6 cache engine on the CPU, over kvservice (for tests/test_engines_lmcache.py).

``python tests/lmcache_engine.py store|retrieve CONFIG.json KV.pt OUT.json`` builds an engine with
LMCache's own pieces (``LMCacheEngineConfig.from_dict``, ``LMCacheEngineBuilder``, its
``StorageManager`` and ``CreateStorageBackends``, ``RemoteBackend``, naive serde) for a tiny
synthetic model, stores the KV cache in KV.pt for its tokens, or retrieves it into a zeroed
cache (written back to KV.pt's ``.got`` sibling), and writes what it saw as JSON. The one piece
that is ours is :class:`CPUKVConnector`: LMCache's GPU connectors copy to and from vLLM's paged
GPU memory, which a CPU machine has not; it copies the same slices of a CPU tensor instead.
Processes that share chunks must run with the same ``PYTHONHASHSEED`` (LMCache keys chunks with
``hash``).
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

LAYERS, HEADS, HEAD_DIM, CHUNK = 2, 4, 32, 64   # a chunk: 2 x 2 x 64 x 128 bf16 = 64 KiB
TOKENS = 300                                   # 4 full chunks and a partial one of 44 tokens
DTYPE = torch.bfloat16
MODEL = "tiny-kv-test"


def plugin_config(url: str, **extra: Any) -> dict:
    """Plugin mode as LMCache documents it: no remote_url, the URL in the plugin's keys."""
    return {"chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": 0.05,
            "save_unfull_chunk": True,
            "remote_serde": "naive", "remote_storage_plugins": ["kvservice"],
            "extra_config": {
                "remote_storage_plugin.kvservice.module_path": "kvservice.integrations.lmcache",
                "remote_storage_plugin.kvservice.class_name": "KVServiceConnectorAdapter",
                "remote_storage_plugin.kvservice.url": url, **extra}}


def legacy_config(url: str, **extra: Any) -> dict:
    """Legacy mode: remote_url names the service; the plugin entry only loads the adapter."""
    cfg = plugin_config(url, **extra)
    del cfg["extra_config"]["remote_storage_plugin.kvservice.url"]
    cfg["remote_url"] = url
    return cfg


def metadata(chunk: int = CHUNK) -> LMCacheMetadata:
    return LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=DTYPE,
                           kv_shape=(LAYERS, 2, chunk, HEADS, HEAD_DIM), chunk_size=chunk)


def kv_cache(tokens: int = TOKENS, seed: int = 0) -> torch.Tensor:
    """A tiny model's KV cache for ``tokens`` tokens: (2, layers, tokens, heads * head_dim)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, LAYERS, tokens, HEADS * HEAD_DIM, generator=gen).to(DTYPE)


class CPUKVConnector(GPUConnectorInterface):
    """Copies tokens [start, end) between the ``kvcache`` tensor a call passes and LMCache's
    MemoryObjs (KV_2LTD: (2, layers, tokens, hidden)), in place of a GPU connector."""

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(kwargs["kvcache"][:, :, start:end])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        kwargs["kvcache"][:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, HEADS * HEAD_DIM])


def build(config: dict, instance: str = "kvtest") -> Any:
    """An LMCacheEngine built by LMCacheEngineBuilder, post-initialised (storage manager)."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    engine = LMCacheEngineBuilder.get_or_create(
        instance, LMCacheEngineConfig.from_dict(config), metadata(config["chunk_size"]),
        CPUKVConnector(), lambda t, r: None, lambda o, r: o)
    engine.post_init()
    return engine


def remote_backends(engine: Any) -> dict[str, Any]:
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    return {n: b for n, b in engine.storage_manager.storage_backends.items()
            if isinstance(b, RemoteBackend)}


def destroy(instance: str = "kvtest") -> None:
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    LMCacheEngineBuilder.destroy(instance)


def tokens(n: int = TOKENS) -> torch.Tensor:
    return torch.arange(1000, 1000 + n, dtype=torch.long)


def main(argv: list[str]) -> None:
    """Store or retrieve (see the module docstring); JSON out: backends, counts, the mask."""
    op, config_path, kv_path, out_path = argv
    with open(config_path) as f:
        config = json.load(f)
    try:
        engine = build(config)
    except Exception as exc:
        # LMCache's StorageManager leaves its event-loop thread running when its backends
        # fail to build, which would keep this process alive: report and leave at once
        with open(out_path, "w") as f:
            json.dump({"error": f"{type(exc).__name__}: {exc}"}, f)
        os._exit(3)
    try:
        backends = remote_backends(engine)
        toks = tokens()
        out: dict[str, Any] = {"remote_backends": sorted(backends),
                               "connected": [b.connection is not None for b in backends.values()]}
        if op == "store":
            engine.store(toks, kvcache=torch.load(kv_path))
            keys = [key for _, _, key in engine.token_database.process_tokens(toks)]
            # batched puts run on LMCache's storage loop, untracked: poll the backend for them
            deadline = time.monotonic() + 20
            while not all(b.batched_contains(keys) == len(keys) for b in backends.values()):
                if time.monotonic() > deadline:
                    raise TimeoutError("LMCache's remote puts did not land in 20 s")
                time.sleep(0.01)
            out["stored_chunks"] = len(keys)
        else:
            out["lookup"] = engine.lookup(toks)
            got = torch.zeros(2, LAYERS, TOKENS, HEADS * HEAD_DIM, dtype=DTYPE)
            mask = engine.retrieve(toks, kvcache=got)
            out["retrieved_tokens"] = int(mask.sum())
            torch.save(got, kv_path + ".got")
        with open(out_path, "w") as f:
            json.dump(out, f)
    finally:
        destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
