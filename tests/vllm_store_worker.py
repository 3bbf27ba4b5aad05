"""Runs vLLM 0.33's own ``MooncakeStoreWorker`` against the kvservice Mooncake facade with host
(CPU tensor) KV caches; one role per process, run by tests/test_engines_vllm.py in the vLLM
venv with the facade's ``mooncake`` shim first on PYTHONPATH and ``MOONCAKE_CONFIG_PATH`` naming
a config whose master address is the kvservice URL.

Each process runs the worker and the connector's scheduler side (``MooncakeStoreScheduler``,
with a real ``BlockPool`` and vLLM ``Request``s hashed by vLLM's block hasher) the way the
engine drives them: admission (lookup, block allocation, ``update_state_after_alloc``), one
``build_connector_meta`` step, then the worker. Not run: the engine core and model forward
(PyPI's vllm 0.33.0 is the CUDA build: its compiled ops, ``vllm._C``, do not load on the CPU)
and ``wait_for_save``, which records a CUDA event; the save
jobs it would enqueue are enqueued on the worker's sending thread directly.

``python vllm_store_worker.py ROLE MODEL_DIR OUT_JSON [PRODUCER_BLOCK_IDS]``; roles:

- ``store``: caches filled with seeded bytes; a prompt of 5 full blocks and a 9-token tail is
  prefilled and its save job runs on the sending thread (``batch_is_exist`` then
  ``batch_put_from_multi_buffers``).
- ``load``: fresh zeroed caches; the scheduler's lookups (LookupKeyClient over ZMQ to the
  worker's LookupKeyServer, ``batch_is_exist``) of the prompt, of its stored prefix alone and
  of a foreign prompt; the prompt admitted for an async load into other blocks than the
  producer's, loaded by the receiving threads (``batch_get_into_multi_buffers``) and compared
  byte for byte with the producer's blocks (PRODUCER_BLOCK_IDS).
- ``unreadable``: the worker's ``register_kv_caches`` on PROT_NONE mappings (standing in for
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
NUM_BLOCKS = 16                # blocks in each layer's cache
STORED_BLOCKS = 5              # full blocks the store role saves
PROMPT = [(7 * i + 3) % 251 for i in range(STORED_BLOCKS * BLOCK + 9)]  # 5 blocks + a tail
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


def _worker(config, kv_config):
    """vLLM's MooncakeStoreWorker, built under the config with world-size-1 gloo groups."""
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
        MooncakeStoreWorker)
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
    ps.ensure_model_parallel_initialized(1, 1)
    return MooncakeStoreWorker(config, kv_config)


def _scheduler(config, kv_config):
    """The connector's scheduler side (MooncakeStoreScheduler) with a real block pool bound, as
    the engine core binds it; its LookupKeyClient talks to the worker's LookupKeyServer."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler import (
        MooncakeStoreScheduler)
    from vllm.v1.core.block_pool import BlockPool
    scheduler = MooncakeStoreScheduler(config, kv_config)
    pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=BLOCK)
    scheduler.bind_gpu_block_pool(pool)
    return scheduler, pool


def _request(req_id: str, tokens: list[int]):
    """A vLLM Request whose block hashes vLLM's own hasher computes."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    init_none_hash(sha256_cbor)
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256_cbor))


def _admit(scheduler, pool, request, skip: int = 0) -> tuple[int, list[int]]:
    """The engine scheduler's admission of a new request: the connector's lookup
    (get_num_new_matched_tokens), blocks from the pool (after ``skip`` others), and
    update_state_after_alloc; (external hit tokens, the request's block ids)."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    hit, _ = scheduler.get_num_new_matched_tokens(request, 0)
    pool.get_new_blocks(skip)
    blocks = pool.get_new_blocks(-(-request.num_tokens // BLOCK))
    scheduler.update_state_after_alloc(request, KVCacheBlocks((blocks,)), hit)
    return hit, [b.block_id for b in blocks]


def _step(scheduler, scheduled: list[tuple[Any, list[int]]]):
    """One scheduler step's connector metadata: ``scheduled`` prefills (request, block ids)
    with all their tokens; requests admitted for an async load are not scheduled."""
    from vllm.v1.core.sched.output import KVConnectorBlockState, NewRequestData, SchedulerOutput
    out = SchedulerOutput.make_empty()
    tables = {req.request_id: (ids,) for req, ids in scheduled}
    for req, ids in scheduled:
        out.scheduled_new_reqs.append(NewRequestData.from_request(req, (ids,)))
        out.num_scheduled_tokens[req.request_id] = req.num_tokens
        out.total_num_scheduled_tokens += req.num_tokens
    out.kv_connector_block_state = KVConnectorBlockState(set(tables), tables.__getitem__, {})
    return scheduler.build_connector_meta(out)


def _store(config, kv_config, worker, caches, out: dict) -> None:
    worker.register_kv_caches(caches)
    scheduler, pool = _scheduler(config, kv_config)
    request = _request("req-store", PROMPT)
    hit, ids = _admit(scheduler, pool, request)
    meta = _step(scheduler, [(request, ids)])
    saves = [r for r in meta.requests if r.can_save]
    # wait_for_save enqueues these after recording a torch.cuda.Event, which the CPU torch
    # cannot make ("dummy base class Event"): no stream to fence, current_event stays None.
    for req_meta in saves:
        worker.kv_send_thread.add_request(req_meta)
    done = _wait("the save job", worker.build_connector_worker_meta)
    keys = [db.key_for(h) for db in worker.token_dbs
            for h in request.block_hashes[:STORED_BLOCKS]]
    exist = worker.store.batch_is_exist(keys)
    if exist != [1] * len(keys):
        raise AssertionError(f"saved keys missing after the job: {exist}")
    out.update(hit_before=hit, save_jobs=len(saves), completed_saves=len(done.completed_saves),
               block_ids=ids, stored_keys=len(keys),
               stored_bytes=sum(worker.store.get_size(k) for k in keys))


def _lookups(scheduler, out: dict) -> None:
    """The connector's lookups (LookupKeyClient over ZMQ to the worker's LookupKeyServer,
    which asks the store with ``batch_is_exist``): the stored prefix alone, a foreign prompt."""
    for name, tokens in (("hits_exact", PROMPT[:STORED_BLOCKS * BLOCK]),
                         ("hits_foreign", [250] * (BLOCK + 1))):
        out[name] = scheduler.get_num_new_matched_tokens(_request(name, tokens), 0)[0]


def _load(config, kv_config, worker, caches, seeded, src_ids: list[int], out: dict) -> None:
    worker.register_kv_caches(caches)
    scheduler, pool = _scheduler(config, kv_config)
    _lookups(scheduler, out)
    request = _request("req-load", PROMPT)
    hit, ids = _admit(scheduler, pool, request, skip=6)  # blocks the producer did not use
    out["hits_prompt"] = hit
    meta = _step(scheduler, [])
    worker.start_load_kv(meta)
    _wait("the load job", lambda: "req-load" in worker.get_finished(set(), meta)[1])
    errors = worker.get_block_ids_with_load_errors()
    if errors:
        raise AssertionError(f"vLLM reported load errors for blocks {sorted(errors)}")
    pairs = list(zip(src_ids, ids))[:hit // BLOCK]
    compared = 0
    for name, cache in caches.items():
        for src, dst in pairs:
            want = seeded[name][src].numpy().tobytes()
            got = cache[dst].numpy().tobytes()
            if got != want:
                raise AssertionError(f"{name}: block {dst} differs from stored block {src}")
            compared += len(got)
        untouched = [b for b in range(NUM_BLOCKS) if b not in dict(pairs).values()]
        if torch.count_nonzero(cache[untouched]).item():
            raise AssertionError(f"{name}: a block outside the load was written")
    out.update(loaded_blocks=len(pairs), block_ids=ids, compared_bytes=compared)


class _LogTap(logging.Handler):
    """Keeps the records vLLM's worker logger emits."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _unreadable(config, kv_config, worker, layers, spec, out: dict) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as wmod
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
        scheduler, pool = _scheduler(config, kv_config)
        out["hits_prompt"], out["block_ids"] = _admit(scheduler, pool, _request("req-bad", PROMPT))
        meta = _step(scheduler, [])
        worker.start_load_kv(meta)
        _wait("the failed load", lambda: "req-bad" in worker.get_finished(set(), meta)[1])
        out["load_error_blocks"] = sorted(worker.get_block_ids_with_load_errors())
        out["load_failures"] = [m for m in tap.messages if "Failed to get" in m]
    finally:
        wmod.logger.removeHandler(tap)
        tensors.clear()


def main() -> None:
    role, model_dir, out_path = sys.argv[1:4]
    src_ids = json.loads(sys.argv[4]) if len(sys.argv) > 4 else []
    from vllm.config import set_current_vllm_config
    config, kv_config, layers, spec = _configs(model_dir)
    out: dict = {"role": role}
    with set_current_vllm_config(config):
        worker = _worker(config, kv_config)
        try:
            if role == "store":
                _store(config, kv_config, worker, _caches(layers, spec, fill=True), out)
            elif role == "load":
                _load(config, kv_config, worker, _caches(layers, spec, fill=False),
                      _caches(layers, spec, fill=True), src_ids, out)
            elif role == "unreadable":
                _unreadable(config, kv_config, worker, layers, spec, out)
            else:
                raise SystemExit(f"unknown role {role!r}")
        finally:
            worker.close()  # as the connector's shutdown does (its lookup server stays up)
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
