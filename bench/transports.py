"""The transports under test: how to start each one's server and open its client."""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any

from .procs import RUN_ID


@dataclass(frozen=True)
class Transport:
    """One row of the echo table: a server entry point and a client opener (``module:function``)."""

    key: str
    label: str
    family: str  # "cxlrpc", "grpc" or "ref"
    server: str
    opener: str
    is_async: bool
    addr: str  # "shm", "ring", "tcp", "unix", "ipc" or "iox" (an iceoryx2 service name)
    server_opts: dict[str, Any] = field(default_factory=dict)
    client_opts: dict[str, Any] = field(default_factory=dict)
    needs: str = ""  # module that must be importable, else the row is skipped
    hardware: str = ""  # a flush-mode row's hardware-coherence twin: the tables show its cost over that row
    #: What its peers do between turns of the echo section: "sleep" (interleaved with the
    #: others), "pause" (they busy-poll, without heartbeats: interleaved, SIGSTOPped between
    #: turns) or "solo" (they busy-poll and beat heartbeats a pause would stop: run alone).
    idle: str = "sleep"

    def address(self, n: int) -> str:
        """A fresh address for run-unique instance ``n`` (servers may rewrite it, e.g. port 0)."""
        return {
            "shm": f"shm://{RUN_ID}-{n}",
            "ring": f"/cxlrpc.{RUN_ID}-ring-{n}",
            "tcp": "127.0.0.1:0",
            "unix": f"unix:/tmp/{RUN_ID}-{n}.sock",
            "ipc": f"ipc:///tmp/{RUN_ID}-{n}.zmq",
            "iox": f"cxlrpc/{RUN_ID}-{n}",
        }[self.addr]

    def skip_reason(self) -> str | None:
        """Why this transport cannot run here (a module fails to import), or None."""
        if not self.needs:
            return None
        try:
            importlib.import_module(self.needs)
        except Exception as exc:  # ImportError, or a half-written package
            return f"import {self.needs} failed: {type(exc).__name__}: {exc}"
        return None


_CXL_SRV, _CXL_AIO, _CXL_SYNC = "bench.cxl_echo:serve", "bench.cxl_echo:open_async", "bench.cxl_echo:open_sync"
_G_AIO_SRV, _G_SYNC_SRV = "bench.grpc_echo:serve_aio", "bench.grpc_echo:serve_sync"
_G_AIO, _G_SYNC = "bench.grpc_echo:open_aio", "bench.grpc_echo:open_sync"

# cxlrpc servers use an ``async def`` handler (the shape users write, as grpc.aio's servicers
# are) unless the row says "plain handler" (a plain function; "memoryview": taking the request
# as a memoryview, read in place). Flush-mode rows lay the region out for memory without
# cross-host coherence: on this machine's normal memory their write-backs and invalidations are
# real instructions, so they show a lower bound of that cost.
ECHO: tuple[Transport, ...] = (
    Transport("cxl-aio", "cxlrpc aio adaptive", "cxlrpc", _CXL_SRV, _CXL_AIO, True, "shm",
              {"doorbell": "adaptive"}, {"doorbell": "adaptive"}, needs="cxlrpc"),
    Transport("cxl-aio-flush", "cxlrpc aio adaptive, flush mode", "cxlrpc", _CXL_SRV, _CXL_AIO, True, "shm",
              {"doorbell": "adaptive", "coherence": "flush"}, {"doorbell": "adaptive"}, needs="cxlrpc",
              hardware="cxl-aio"),
    Transport("cxl-aio-plain", "cxlrpc aio adaptive, plain handler", "cxlrpc", _CXL_SRV, _CXL_AIO,
              True, "shm", {"doorbell": "adaptive", "handler": "plain"}, {"doorbell": "adaptive"},
              needs="cxlrpc"),
    Transport("cxl-aio-view", "cxlrpc aio adaptive, plain memoryview handler", "cxlrpc", _CXL_SRV,
              _CXL_AIO, True, "shm", {"doorbell": "adaptive", "handler": "view"},
              {"doorbell": "adaptive"}, needs="cxlrpc"),
    Transport("cxl-sync", "cxlrpc sync adaptive", "cxlrpc", _CXL_SRV, _CXL_SYNC, False, "shm",
              {"doorbell": "adaptive"}, {"doorbell": "adaptive"}, needs="cxlrpc"),
    Transport("cxl-aio-spin", "cxlrpc aio busy-spin", "cxlrpc", _CXL_SRV, _CXL_AIO, True, "shm",
              {"doorbell": "busy-spin"}, {"doorbell": "busy-spin"}, needs="cxlrpc", idle="solo"),
    Transport("ring", "bare ring ping-pong", "cxlrpc", "bench.ring_pingpong:serve",
              "bench.ring_pingpong:open_sync", False, "ring", needs="cxlrpc.ring", idle="pause"),
    Transport("grpc-aio-tcp", "grpc.aio TCP", "grpc", _G_AIO_SRV, _G_AIO, True, "tcp"),
    Transport("grpc-sync-tcp", "grpc sync TCP", "grpc", _G_SYNC_SRV, _G_SYNC, False, "tcp"),
    Transport("grpc-aio-unix", "grpc.aio unix", "grpc", _G_AIO_SRV, _G_AIO, True, "unix"),
    Transport("zmq-ipc", "zmq REQ/REP ipc", "ref", "bench.zmq_echo:serve", "bench.zmq_echo:open_sync",
              False, "ipc", needs="zmq"),
    Transport("iceoryx2", "iceoryx2 request-response", "ref", "bench.iceoryx2_echo:serve",
              "bench.iceoryx2_echo:open_sync", False, "iox", needs="iceoryx2", idle="pause"),
)
BY_KEY: dict[str, Transport] = {t.key: t for t in ECHO}


def resolve(target: str) -> Any:
    """Import ``module:function``."""
    mod, name = target.split(":")
    return getattr(importlib.import_module(mod), name)
