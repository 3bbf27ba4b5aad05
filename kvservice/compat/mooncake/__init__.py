"""Mooncake Store's Python API (``mooncake.store.MooncakeDistributedStore``) on kvservice.

Method names, keyword names, return values and error codes follow Mooncake's binding
(``mooncake-integration/store/store_py.cpp``) and its docs: ``0`` is success, failures are
Mooncake's negative ``ErrorCode`` values (``ErrorCode``), getters return ``b""`` / ``None``
when a key is missing. The one configuration change: ``setup``'s ``master_server_addr`` (or the
dict form's ``master_server_addr`` / ``master_server_address``) is the kvservice URL
(``shm://NAME`` or ``file:///PATH``); the other arguments are accepted and validated as Mooncake
does, then ignored (one shared pool: no segments to mount, no transport to pick).

Mooncake's API is synchronous, so this is built on ``kvservice.SyncKVClient``; calls on one
store are serialized by a lock (engines call it from worker threads). Differences from Mooncake
are listed in ``SEMANTIC_DIFFERENCES`` (and the README).
"""
from kvservice.compat.mooncake.config import (DEFAULT_KV_LEASE_TTL, ErrorCode, ReplicateConfig,
                                              SoftPinAction, parse_segment_size)
from kvservice.compat.mooncake.memory import BufferHandle, MooncakeHostMemAllocator, memory_problem
from kvservice.compat.mooncake.store import MooncakeDistributedStore

__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction", "BufferHandle",
           "ErrorCode", "MooncakeHostMemAllocator", "DEFAULT_KV_LEASE_TTL", "parse_segment_size",
           "memory_problem"]

#: Where this facade knowingly differs from Mooncake Store 0.3.13 (the README has the table);
#: tests/test_engines_mooncake.py checks the rest against the real wheel.
SEMANTIC_DIFFERENCES = {
    "setup": "master_server_addr (dict: master_server_addr / master_server_address) is the "
             "kvservice URL; the other arguments, 0.3.13's enable_ssd_offload, ssd_offload_path, "
             "tenant_id, enable_client_http_server and client_http_port included, are validated "
             "as Mooncake does, then ignored (the server owns tiers and namespaces)",
    "setup_dummy": "server_address is the kvservice URL too (SGLang: client_server_address); "
                   "a host:port is INVALID_PARAMS. alloc_from_mem_pool returns 0 (no shared pool: "
                   "allocate with MooncakeHostMemAllocator and register_buffer)",
    "ReplicateConfig": "0.3.13's fields; checked as Mooncake (soft_pin_ttl_ms only with ENABLE, "
                       "one group_id per key), otherwise ignored: one pool, no replicas, pins or "
                       "placement",
    "read lease": "its length is the store's kv_lease_ttl keyword (Mooncake: the master's "
                  "--default_kv_lease_ttl); reads by every client count, as in Mooncake",
    "get_buffer": "a zero-copy view of the pool under a kvservice lease (Mooncake copies into its "
                  "local buffer): while a handle is open a plain remove gets OBJECT_HAS_LEASE "
                  "(Mooncake: 0 once the read lease ends); remove(force=True) removes the key and "
                  "the handle keeps its bytes",
    "object lifetime": "objects outlive their writer's close() (a shared pool; Mooncake drops "
                       "them with the writer's segment)",
    "device memory": "register_buffer refuses device memory and ranges this process cannot "
                     "read and write (INVALID_PARAMS; transfers on them TRANSFER_FAIL): the "
                     "facade copies with the CPU. Mooncake moves GPU memory with its transport",
    "unregistered address": "TRANSFER_FAIL (-800); Mooncake returned -800 in one run and "
                            "crashed the process in another",
    "keys": "at most 1024 bytes of UTF-8 (longer: INVALID_PARAMS); Mooncake took 5000 bytes",
    "remove_by_regex": "Python re.search over the store's namespace (Mooncake: std::regex)",
    "not provided": "batch_replica_clear, batch_get_replica_desc, get_replica_desc (no replicas); "
                    "the tensor, safetensor, session, task, segment-mount and *_ranges put/get "
                    "variants and mooncake.structured_object_store (no engine path here calls "
                    "them; their wire formats would have to match Mooncake's to interoperate)",
    "concurrency": "calls on one store object are serialized by a lock",
}
