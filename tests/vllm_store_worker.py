"""Runs vLLM 0.33's own ``MooncakeStoreWorker`` against the kvservice Mooncake facade with host
(CPU tensor) KV caches; one role per process, run by tests/test_engines_vllm.py in the vLLM
venv with the facade's ``mooncake`` shim first on PYTHONPATH and ``MOONCAKE_CONFIG_PATH`` naming
a config whose master address is the kvservice URL.

``python vllm_store_worker.py ROLE MODEL_DIR OUT_JSON``; roles:

- ``store``: caches filled with seeded bytes, a save job of ``STORED_BLOCKS`` full blocks through
  the worker's sending thread (``batch_is_exist`` then ``batch_put_from_multi_buffers``).
- ``load``: fresh zeroed caches; lookups through vLLM's LookupKeyClient (the scheduler side's
  path to the worker) of the prompt, of its stored prefix alone and of a foreign one; a load job through the receiving threads (``batch_get_into_multi_buffers``) into
  other block ids; the loaded blocks compared byte for byte with the seeded ones.
- ``unreadable``: the worker's ``register_kv_caches`` on a PROT_NONE mapping (standing in for
  device memory): vLLM's own error log, then a load whose failure vLLM reports per block.

The figures go to OUT_JSON; every failure is an exception (exit status 1).
"""
from __future__ import annotations

import json
import logging
import mmap
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

BLOCK = 16                     # tokens per block (vLLM's cache_config.block_size)
NUM_BLOCKS = 12                # blocks in each layer's cache
STORED_BLOCKS = 5              # full blocks the store role saves
PROMPT = [(7 * i + 3) % 251 for i in range(STORED_BLOCKS * BLOCK + 9)]  # 5 blocks + a tail
STORE_BLOCK_IDS = [3, 8, 1, 10, 6]   # where the producer holds the prompt's blocks
LOAD_BLOCK_IDS = [0, 2, 4, 5, 7]     # where the consumer receives them
DEADLINE = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, check: Callable[[], Any]) -> Any:
    """Poll ``check`` until truthy (its value), or fail after DEADLINE seconds."""
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


def _configs(model_dir: str):
    """A VllmConfig of the local tiny model with MooncakeStoreConnector, and its KVCacheConfig."""
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                             VllmConfig)
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, KVCacheTensor)
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32",
                        max_model_len=256)
    config = VllmConfig(
        model_config=model, cache_config=CacheConfig(block_size=BLOCK),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(kv_connector="MooncakeStoreConnector",
                                            kv_role="kv_both"))
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    layers = [f"model.layers.{i}.self_attn.attn"
              for i in range(model.get_num_layers(config.parallel_config))]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=model.get_total_num_kv_heads(),
                             head_size=model.get_head_size(), dtype=torch.float32)
    kv_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes * NUM_BLOCKS, layers=[n],
                                        layer_stride=spec.page_size_bytes * NUM_BLOCKS,
                                        block_stride=spec.page_size_bytes) for n in layers],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    return config, kv_config, layers, spec


def _caches(layers: list[str], spec, fill: bool) -> dict[str, torch.Tensor]:
    """Block-major CPU caches ``(NUM_BLOCKS, 2, BLOCK, heads, head_size)``: seeded or zero."""
    shape = (NUM_BLOCKS, 2, BLOCK, spec.num_kv_heads, spec.head_size)
    gen = torch.Generator().manual_seed(39)
    return {n: torch.randn(shape, generator=gen) if fill else torch.zeros(shape)
            for n in layers}


def _block_hashes() -> list[bytes]:
    """The prompt's block hashes, by vLLM's own chained hash (sha256_cbor)."""
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils
    kv_cache_utils.init_none_hash(sha256_cbor)
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(PROMPT) - BLOCK + 1, BLOCK):
        parent = kv_cache_utils.hash_block_tokens(sha256_cbor, parent,
                                                  PROMPT[start:start + BLOCK])
        hashes.append(parent)
    return hashes


def _worker(config, kv_config):
    """vLLM's MooncakeStoreWorker, built under the config with world-size-1 gloo groups."""
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
        MooncakeStoreWorker)
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
    ps.ensure_model_parallel_initialized(1, 1)
    return MooncakeStoreWorker(config, kv_config)


def _store(worker, caches, out: dict) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import ReqMeta
    hashes = _block_hashes()
    worker.register_kv_caches(caches)
    # wait_for_save enqueues this same ReqMeta after recording a torch.cuda.Event, which the
    # CPU torch cannot make ("dummy base class Event"): no stream to fence, current_event None.
    meta = ReqMeta(req_id="req-store", token_len_chunk=STORED_BLOCKS * BLOCK,
                   block_ids=(list(STORE_BLOCK_IDS),), block_hashes=hashes, can_save=True,
                   store_job_id=1, token_ids=PROMPT[:STORED_BLOCKS * BLOCK],
                   prefill_end_tokens=len(PROMPT))
    worker.kv_send_thread.add_request(meta)
    _wait("the save job", lambda: worker.kv_send_thread.take_completed_saves())
    keys = [db.key_for(h) for db in worker.token_dbs for h in hashes[:STORED_BLOCKS]]
    exist = worker.store.batch_is_exist(keys)
    if exist != [1] * len(keys):
        raise AssertionError(f"saved keys missing after the job: {exist}")
    out.update(stored_blocks=STORED_BLOCKS, stored_keys=len(keys),
               stored_bytes=sum(worker.store.get_size(k) for k in keys))


def _lookups(config, out: dict):
    """Prefix lookups as the connector's scheduler side makes them: LookupKeyClient over ZMQ
    to the worker's LookupKeyServer, which asks the store (``batch_is_exist``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
        LookupKeyClient)
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils
    hashes = _block_hashes()
    foreign = [kv_cache_utils.hash_block_tokens(sha256_cbor, None, [250] * BLOCK)]
    client = LookupKeyClient(config)
    try:
        results = {name: client.lookup(req, tokens, block_hashes) for name, req, tokens,
                   block_hashes in (
                       ("hits_prompt", "a", len(PROMPT), hashes),
                       ("hits_exact", "b", STORED_BLOCKS * BLOCK, hashes[:STORED_BLOCKS]),
                       ("hits_foreign", "c", BLOCK + 1, foreign))}
    finally:
        client.close()
    out.update({name: result.hit_length for name, result in results.items()})
    return results["hits_prompt"]  # what the scheduler turns into the load's LoadSpec


def _load(config, worker, caches, seeded, out: dict) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        LoadSpec, MooncakeStoreConnectorMetadata, ReqMeta)
    hashes = _block_hashes()
    worker.register_kv_caches(caches)
    hit = _lookups(config, out)
    meta = MooncakeStoreConnectorMetadata(set(), set())
    meta.add_request(ReqMeta(
        req_id="req-load", token_len_chunk=len(PROMPT), block_ids=(list(LOAD_BLOCK_IDS),),
        block_hashes=hashes,
        load_spec=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=hit.hit_length,
                           can_load=True, tail_key_boundaries=hit.tail_key_boundaries)))
    worker.start_load_kv(meta)
    _wait("the load job", lambda: "req-load" in worker.get_finished(set(), meta)[1])
    errors = worker.get_block_ids_with_load_errors()
    if errors:
        raise AssertionError(f"vLLM reported load errors for blocks {sorted(errors)}")
    compared = 0
    for name, cache in caches.items():
        for src, dst in zip(STORE_BLOCK_IDS, LOAD_BLOCK_IDS):
            want = seeded[name][src].numpy().tobytes()
            got = cache[dst].numpy().tobytes()
            if got != want:
                raise AssertionError(f"{name}: block {dst} differs from stored block {src}")
            compared += len(got)
        untouched = [b for b in range(NUM_BLOCKS) if b not in LOAD_BLOCK_IDS]
        if torch.count_nonzero(cache[untouched]).item():
            raise AssertionError(f"{name}: a block outside the load was written")
    out.update(loaded_blocks=len(LOAD_BLOCK_IDS), compared_bytes=compared)


class _LogTap(logging.Handler):
    """Keeps the records vLLM's worker logger emits."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _unreadable(worker, layers, spec, out: dict) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as wmod
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        LoadSpec, MooncakeStoreConnectorMetadata, ReqMeta)
    tap = _LogTap()
    wmod.logger.addHandler(tap)
    shape = (NUM_BLOCKS, 2, BLOCK, spec.num_kv_heads, spec.head_size)
    nbytes = NUM_BLOCKS * 2 * BLOCK * spec.num_kv_heads * spec.head_size * 4
    # tensors over PROT_NONE (prot=0) pages, as a GPU cache is over memory the CPU cannot touch
    regions = [mmap.mmap(-1, nbytes, prot=0) for _ in layers]
    tensors: dict[str, torch.Tensor] = {}
    try:
        tensors = {n: torch.frombuffer(r, dtype=torch.float32).view(shape)
                   for n, r in zip(layers, regions)}
        worker.register_kv_caches(tensors)
        out["register_errors"] = [m for m in tap.messages if "register_buffer failed" in m]
        meta = MooncakeStoreConnectorMetadata(set(), set())
        meta.add_request(ReqMeta(
            req_id="req-bad", token_len_chunk=len(PROMPT), block_ids=(list(LOAD_BLOCK_IDS),),
            block_hashes=_block_hashes(),
            load_spec=LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=STORED_BLOCKS * BLOCK,
                               can_load=True)))
        worker.start_load_kv(meta)
        _wait("the failed load", lambda: "req-bad" in worker.get_finished(set(), meta)[1])
        out["load_error_blocks"] = sorted(worker.get_block_ids_with_load_errors())
        out["load_failures"] = [m for m in tap.messages if "Failed to get" in m]
    finally:
        wmod.logger.removeHandler(tap)
        tensors.clear()


def main() -> None:
    role, model_dir, out_path = sys.argv[1:4]
    from vllm.config import set_current_vllm_config
    config, kv_config, layers, spec = _configs(model_dir)
    out: dict = {"role": role}
    with set_current_vllm_config(config):
        worker = _worker(config, kv_config)
        try:
            if role == "store":
                _store(worker, _caches(layers, spec, fill=True), out)
            elif role == "load":
                _load(config, worker, _caches(layers, spec, fill=False),
                      _caches(layers, spec, fill=True), out)
            elif role == "unreadable":
                _unreadable(worker, layers, spec, out)
            else:
                raise SystemExit(f"unknown role {role!r}")
        finally:
            worker.close()  # as the connector's shutdown does (its lookup server stays up)
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
