"""cxlrpc: RPC over shared-memory ring buffers (CXL-pooled memory, or POSIX shm on one host)."""
from .client import Client, ClientInterceptor, SyncClient, connect, connect_sync
from .doorbell import WaitStrategy, adaptive, busy_spin, spin_yield
from .errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded,
                     FailedPrecondition, Internal, InvalidArgument, NotFound, OutOfRange,
                     PermissionDenied, ResourceExhausted, RpcError, StatusCode, Unauthenticated,
                     Unavailable, Unimplemented, Unknown, error_for)
from .loop import run
from .region import RegionError
from .server import (HandlerContext, Peer, PeerInfo, Server, ServerInterceptor, context,
                     current_peer)
from .service import Service
from .streams import StreamCall

__all__ = [
    "Server", "Peer", "PeerInfo", "HandlerContext", "ServerInterceptor", "context", "current_peer",
    "Service", "Client", "SyncClient", "ClientInterceptor", "StreamCall", "connect", "connect_sync",
    "RpcError", "StatusCode", "error_for", "Cancelled", "Unknown", "InvalidArgument",
    "DeadlineExceeded", "NotFound", "AlreadyExists", "PermissionDenied", "ResourceExhausted",
    "FailedPrecondition", "Aborted", "OutOfRange", "Unimplemented", "Internal", "Unavailable",
    "DataLoss", "Unauthenticated", "RegionError",
    "WaitStrategy", "adaptive", "busy_spin", "spin_yield", "run",
]
__version__ = "0.1.0"
