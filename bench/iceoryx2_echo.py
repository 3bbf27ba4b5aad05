"""Reference row: iceoryx2 request-response echo (shared memory, ``Slice[c_uint8]`` payloads, busy-poll).

The Python bindings have no blocking receive for request-response, so both sides poll
(like the busy-spin rows, this keeps both cores busy). Every process uses a run-unique
resource prefix derived from the
address (``iox2_bench_<pid>_<n>_``, shared by the server and its client) so that cleanup removes only what this row created.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import re
import time
from multiprocessing.connection import Connection

import iceoryx2 as iox
from iceoryx2 import Slice

_BYTES = Slice[ctypes.c_uint8]
_PREFIXES: set[str] = set()
_ROOT = "/tmp/iceoryx2"
_ROOT_EXISTED = os.path.isdir(_ROOT)  # checked at import, before this process creates anything


def _open(address: str) -> tuple[iox.Node, iox.PortFactoryRequestResponse]:
    prefix = "iox2_" + re.sub(r"[^A-Za-z0-9]", "_", address.rsplit("/", 1)[-1]) + "_"
    if not _PREFIXES:
        atexit.register(cleanup)  # files dropped late (at interpreter exit) are caught too
    _PREFIXES.add(prefix)
    cfg = iox.config.default()
    cfg.global_cfg.prefix = iox.FileName.new(prefix)
    node = iox.NodeBuilder.new().config(cfg).create(iox.ServiceType.Ipc)
    svc = (node.service_builder(iox.ServiceName.new(address))
           .request_response(_BYTES, _BYTES).open_or_create())
    return node, svc


def cleanup() -> None:
    """Unlink this run's iceoryx2 files in /dev/shm; drop /tmp/iceoryx2 if this process created it and it is empty."""
    for name in os.listdir("/dev/shm"):
        if name.startswith(tuple(_PREFIXES)):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass
    if not _ROOT_EXISTED:
        for sub in ("nodes", "services", ""):
            try:
                os.rmdir(os.path.join(_ROOT, sub))
            except OSError:  # not empty (another user), or gone
                pass


def serve(conn: Connection, address: str, max_payload: int = 1 << 20, **_: object) -> None:
    """Server port answering every request with its own bytes until the parent says stop."""
    node = svc = srv = receive = None
    try:
        node, svc = _open(address)
        srv = (svc.server_builder().initial_max_slice_len(max_payload)
               .allocation_strategy(iox.AllocationStrategy.PowerOfTwo).create())
        conn.send(("ready", {"pid": os.getpid(), "address": address}))
        receive, memmove, i = srv.receive, ctypes.memmove, 0
        while True:
            req = receive()
            if req is None:
                i += 1
                if not i & 1023 and conn.poll():
                    break
                continue
            p = req.payload()
            n = p.len()
            resp = req.loan_slice_uninit(n)
            memmove(resp.payload_ptr, p.as_ptr(), n)
            resp.assume_init().send()
            req.delete()
    finally:
        if srv is not None:
            srv.delete()
        del receive, srv, svc, node  # the node's drop removes its files; cleanup() catches the rest
        cleanup()


class Iceoryx2Client:
    """Client port: ``client.call(payload) -> bytes`` (loan, copy in, send, poll for the response, copy out)."""

    def __init__(self, address: str, max_payload: int) -> None:
        self.node, self.svc = _open(address)
        self.cli = (self.svc.client_builder().initial_max_slice_len(max_payload)
                    .allocation_strategy(iox.AllocationStrategy.PowerOfTwo).create())
        deadline = time.monotonic() + 10
        while self.svc.dynamic_config.number_of_servers < 1:
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"no iceoryx2 server on {address}")
            time.sleep(0.001)

    def call(self, payload: bytes) -> bytes:
        n = len(payload)
        req = self.cli.loan_slice_uninit(n)
        ctypes.memmove(req.payload_ptr, payload, n)
        pending = req.assume_init().send()
        receive, spins = pending.receive, 0
        while True:
            resp = receive()
            if resp is not None:
                break
            spins += 1
            if not spins & 0xFFFFF and not pending.is_connected:
                raise ConnectionError("iceoryx2 server went away")
        out = bytes(resp.payload().as_memory_view())
        resp.delete()
        pending.delete()
        return out

    def close(self) -> None:
        self.cli.delete()
        del self.cli, self.svc, self.node
        cleanup()


def open_sync(address: str, max_payload: int = 1 << 20, **_: object) -> Iceoryx2Client:
    """Open a client port on the server's service."""
    return Iceoryx2Client(address, max_payload)
