"""cxlrpc: RPC over shared-memory ring buffers (CXL-pooled memory, or POSIX shm on one host)."""
from .client import Client, SyncClient, connect, connect_sync
from .doorbell import WaitStrategy, adaptive, busy_spin, spin_yield
from .errors import (Cancelled, DeadlineExceeded, Internal, InvalidArgument, NotFound,
                     ResourceExhausted, RpcError, StatusCode, Unavailable)
from .loop import run
from .region import RegionError
from .server import Peer, Server, current_peer
from .service import Service

__all__ = [
    "Server", "Peer", "current_peer", "Service", "Client", "SyncClient", "connect", "connect_sync",
    "RpcError", "StatusCode", "Cancelled", "DeadlineExceeded", "Internal", "InvalidArgument",
    "NotFound", "ResourceExhausted", "Unavailable", "RegionError",
    "WaitStrategy", "adaptive", "busy_spin", "spin_yield", "run",
]
__version__ = "0.1.0"
