"""``mooncake.store`` backed by kvservice: ``setup()``'s ``master_server_addr`` is the kvservice
URL (``shm://NAME`` or ``file:///PATH``). See ``kvservice.compat.mooncake``."""
from kvservice.compat.mooncake import (  # noqa: F401
    DEFAULT_KV_LEASE_TTL,
    BufferHandle,
    ErrorCode,
    MooncakeDistributedStore,
    MooncakeHostMemAllocator,
    ReplicateConfig,
    SoftPinAction,
)

__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction", "BufferHandle",
           "ErrorCode", "MooncakeHostMemAllocator", "DEFAULT_KV_LEASE_TTL"]
