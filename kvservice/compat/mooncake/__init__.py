"""Mooncake Store's Python API (``mooncake.store.MooncakeDistributedStore``) on kvservice.

Method names, keyword names, return values and error codes follow Mooncake's binding
(``mooncake-integration/store/store_py.cpp``) and its docs: ``0`` is success, failures are
Mooncake's negative ``ErrorCode`` values (:class:`ErrorCode`), getters return ``b""`` / ``None``
when a key is missing. The one configuration change: ``setup``'s ``master_server_addr`` (or the
dict form's ``master_server_addr`` / ``master_server_address``) is the kvservice URL
(``shm://NAME`` or ``file:///PATH``); the other arguments are accepted and validated as Mooncake
does, then ignored (one shared pool: no segments to mount, no transport to pick).

Mooncake's API is synchronous, so this is built on :class:`kvservice.SyncKVClient`; calls on one
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

#: Where this facade knowingly differs from Mooncake Store (the README has the table).
SEMANTIC_DIFFERENCES = {
    "setup": "master_server_addr is a kvservice URL; other arguments validated then ignored; "
             "size strings ('16MB', '16 MB', '1.5GB') accepted in both forms",
    "ReplicateConfig": "accepted, ignored (one pool: no replicas, pins or placement)",
    "put no-overwrite": "exists-then-put on the client: two writers racing on a new key may "
                        "both write (last commit wins)",
    "read leases": "OBJECT_HAS_LEASE only for reads through this store object (kvservice "
                   "does not report other clients' leases)",
    "remove_by_regex/remove_all": "only keys this store object put or read",
    "get_buffer": "zero-copy view of the pool under a kvservice lease (Mooncake copies into "
                  "its local buffer); check() raises LeaseExpired if held past the lease",
    "empty values": "put of b'' returns INVALID_PARAMS (kvservice stores no empty values)",
    "unregistered address": "TRANSFER_FAIL (-800) instead of undefined behaviour",
    "concurrency": "calls on one store object are serialized by a lock",
}
