"""The kvservice rows: the shm service, its gRPC twin and (where installed) Mooncake Store.

Each backend has a server entry point (a worker started by ``procs.Worker``) and a client
adapter with the same five operations, so the timing loops in ``kv.py`` are one piece of code:
``put(key, value)``, ``get(key)`` (lease the value and read one byte of it, then end the lease),
``get_into(key, out)`` (copy out into a preallocated buffer), ``exists(key)`` and
``batch_get(keys)`` (every value, one byte read from each). The shm and gRPC adapters are
asyncio (KVClient / GrpcKVClient share an API); the Mooncake adapter is blocking (its client is).
"""
from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from .grpc_echo import run_loop
from .procs import RUN_ID, wait_for_stop, wait_readable


@dataclass(frozen=True)
class Backend:
    """One row family of the kv tables: how to start its server and open its client."""

    key: str
    label: str
    family: str  # "kvservice", "grpc" (the baseline) or "mooncake"
    server: str  # module:function of the server worker
    addr: str  # "shm", "tcp" or "mooncake"
    is_async: bool
    client_env: dict[str, str] = field(default_factory=dict)
    rpc_options: dict[str, Any] = field(default_factory=dict)  # cxlrpc options of server and client
    default: bool = True  # in the default run; others only when named with --transports
    coherence: str = "hardware"  # the kvservice server's layout ("flush": no cross-host coherence)
    hardware: str = ""  # a flush-mode row's hardware-coherence twin: the tables show its cost over that row
    idle: str = "sleep"  # what its peers do between turns (bench.turns): "sleep", "pause" or "solo"

    def address(self, n: int) -> str:
        return {"shm": f"shm://{RUN_ID}-kv-{n}", "tcp": "127.0.0.1:0", "mooncake": "127.0.0.1"}[self.addr]

    def skip_reason(self) -> str | None:
        if self.family == "mooncake":
            return mooncake_skip_reason()
        return None


KV_SHM = Backend("kv-shm", "kvservice aio adaptive", "kvservice", "bench.kv_backends:serve_kv", "shm", True,
                 rpc_options={"doorbell": "adaptive"})
KV_SPIN = Backend("kv-shm-spin", "kvservice aio busy-spin", "kvservice", "bench.kv_backends:serve_kv", "shm",
                  True, rpc_options={"doorbell": "busy-spin"}, default=False, idle="solo")
KV_SYNC = Backend("kv-shm-sync", "kvservice sync adaptive", "kvservice", "bench.kv_backends:serve_kv", "shm",
                  False, rpc_options={"doorbell": "adaptive"})
KV_FLUSH = Backend("kv-shm-flush", "kvservice aio adaptive, flush mode", "kvservice", "bench.kv_backends:serve_kv",
                   "shm", True, rpc_options={"doorbell": "adaptive"}, coherence="flush", hardware=KV_SHM.key)
KV_GRPC = Backend("kv-grpc", "gRPC twin (grpc.aio TCP)", "grpc", "bench.kv_backends:serve_grpc_kv", "tcp", True)
MC_MEMCPY = Backend("mc-memcpy", "Mooncake Store memcpy", "mooncake", "bench.kv_backends:serve_mooncake",
                    "mooncake", False, {"MC_TCP_BIND_ADDRESS": "127.0.0.1"})
MC_TCP = Backend("mc-tcp", "Mooncake Store TCP", "mooncake", "bench.kv_backends:serve_mooncake", "mooncake",
                 False, {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_STORE_MEMCPY": "0"})
KV_MC_API = Backend("kv-mc-api", "kvservice, Mooncake API (facade)", "mooncake-api",
                    "bench.kv_backends:serve_kv", "shm", False)
BACKENDS: tuple[Backend, ...] = (KV_SHM, KV_SPIN, KV_SYNC, KV_FLUSH, KV_GRPC, KV_MC_API, MC_MEMCPY, MC_TCP)
BY_KEY: dict[str, Backend] = {b.key: b for b in BACKENDS}


# ---- kvservice and its gRPC twin ------------------------------------------------------------

def serve_kv(conn: Connection, address: str, pool_size: int, loop: str = "uvloop",
             rpc_options: dict | None = None, coherence: str = "hardware", **_: object) -> None:
    """KVServer on ``address`` until the parent says stop; closing unlinks its region and pool.

    ``coherence`` goes to the server alone (clients read it from the region header)."""
    from kvservice import KVServer

    async def main() -> None:
        async with KVServer(address, pool_size, coherence=coherence, **(rpc_options or {})) as server:
            conn.send(("ready", {"pid": os.getpid(), "address": address, "pool_url": server.pool_url}))
            await wait_readable(conn, on_sigterm=True)

    run_loop(main(), loop)


def serve_grpc_kv(conn: Connection, address: str, pool_size: int, loop: str = "uvloop", **_: object) -> None:
    """GrpcKVServer (grpc.aio) on ``address`` (port 0 = any) until the parent says stop."""
    from kvservice.grpc_twin import GrpcKVServer

    async def main() -> None:
        async with GrpcKVServer(address, pool_size) as server:
            conn.send(("ready", {"pid": os.getpid(), "address": server.address}))
            await wait_readable(conn, on_sigterm=True)

    run_loop(main(), loop)


class AsyncKV:
    """KVClient or GrpcKVClient behind the five timed operations."""

    is_async = True

    def __init__(self, kv: Any) -> None:
        self.kv = kv

    @classmethod
    async def open(cls, backend: Backend, address: Any) -> "AsyncKV":
        if backend.family == "grpc":
            from kvservice.grpc_twin import GrpcKVClient

            client = GrpcKVClient(address)
            await client.channel.channel_ready()
            return cls(client)
        from kvservice import KVClient

        return cls(await KVClient.connect(address, **backend.rpc_options))

    def out_buffer(self, size: int) -> Any:
        return np.empty(size, np.uint8)

    async def put(self, key: str, value: Any) -> None:
        await self.kv.put(key, value)

    async def get(self, key: str) -> int:
        with await self.kv.get(key) as block:
            return block.view()[0]

    async def get_into(self, key: str, out: Any) -> int:
        return await self.kv.get_into(key, out)

    async def exists(self, key: str) -> bool:
        return await self.kv.exists(key)

    async def batch_get(self, keys: list[str]) -> int:
        n = 0
        for block in await self.kv.batch_get(keys):
            with block:
                n += block.view()[0]
        return n

    async def close(self) -> None:
        await self.kv.close()


class SyncKV:
    """SyncKVClient (the blocking client inference-engine connectors use) behind the same operations."""

    is_async = False

    def __init__(self, kv: Any) -> None:
        self.kv = kv

    @classmethod
    def open(cls, backend: Backend, address: str) -> "SyncKV":
        from kvservice import SyncKVClient

        return cls(SyncKVClient.connect(address, **backend.rpc_options))

    def out_buffer(self, size: int) -> Any:
        return np.empty(size, np.uint8)

    def put(self, key: str, value: Any) -> None:
        self.kv.put(key, value)

    def get(self, key: str) -> int:
        with self.kv.get(key) as block:
            return block.view()[0]

    def get_into(self, key: str, out: Any) -> int:
        return self.kv.get_into(key, out)

    def exists(self, key: str) -> bool:
        return self.kv.exists(key)

    def batch_get(self, keys: list[str]) -> int:
        n = 0
        for block in self.kv.batch_get(keys):
            with block:
                n += block.view()[0]
        return n

    def close(self) -> None:
        self.kv.close()


# ---- Mooncake Store ------------------------------------------------------------------------

def _mooncake_master_binary() -> str | None:
    spec = importlib.util.find_spec("mooncake")
    if spec and spec.origin:
        path = Path(spec.origin).parent / "mooncake_master"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which("mooncake_master")


_MC_REASON: list[str | None] = []


def mooncake_skip_reason() -> str | None:
    """Why the Mooncake rows cannot run here, or None (checked once per process)."""
    if not _MC_REASON:
        reason = None
        try:
            importlib.import_module("mooncake.store").MooncakeDistributedStore  # noqa: B018
        except Exception as exc:  # ImportError, or a missing shared library (libibverbs)
            reason = f"import mooncake.store failed: {type(exc).__name__}: {exc}"
        if reason is None and _mooncake_master_binary() is None:
            reason = "mooncake_master binary not found"
        _MC_REASON.append(reason)
    return _MC_REASON[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the child when the worker that started it dies (Linux prctl)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _wait_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"mooncake_master did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


def log_tail(path: str, lines: int = 5) -> str:
    """The last warning/error lines of a Mooncake log (glog lines start with E, F or W)."""
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return " | ".join([line for line in text if line[:1] in ("E", "F", "W") or "rror" in line][-lines:])


def serve_mooncake(conn: Connection, log: str, **_: object) -> None:
    """Run ``mooncake_master`` (RPC and HTTP metadata server on 127.0.0.1) until told to stop."""
    binary = _mooncake_master_binary()
    if binary is None:
        raise RuntimeError("mooncake_master binary not found")
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    cmd = [binary, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
           "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
           "--metrics_host=127.0.0.1", f"--metrics_port={metrics}", "--rpc_thread_num=2"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent)
    try:
        try:
            _wait_port(rpc, proc, 20)
            _wait_port(http, proc, 20)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; log: {log_tail(log)}") from None
        conn.send(("ready", {"pid": os.getpid(), "master_pid": proc.pid,
                             "address": {"master": f"127.0.0.1:{rpc}",
                                         "metadata": f"http://127.0.0.1:{http}/metadata"}}))
        wait_for_stop(conn)
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


class MooncakeKV:
    """A blocking MooncakeDistributedStore client that mounts its own segment (``setup``).

    put = ``upsert`` (kvservice's put overwrites; Mooncake's put of an existing key does not);
    get = ``get_buffer`` (a handle on the client's local buffer; one byte read through ctypes);
    get_into = ``get_into`` a registered buffer; exists = ``is_exist``; batch_get = ``batch_get_buffer``.
    """

    is_async = False

    def __init__(self, store: Any, registered: np.ndarray) -> None:
        self.store = store
        self.registered = registered
        self.ptr = registered.ctypes.data

    @classmethod
    def open(cls, address: dict | str, segment: int, local_buffer: int, out_max: int) -> "MooncakeKV":
        """Real Mooncake (``address``: its master and metadata server), or kvservice's facade
        (``address``: the kvservice URL, which is all a Mooncake config changes)."""
        if isinstance(address, str):
            from kvservice.compat.mooncake import MooncakeDistributedStore
            address = {"metadata": "P2PHANDSHAKE", "master": address}
        else:
            from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", address["metadata"], segment, local_buffer, "tcp", "", address["master"])
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        buf = np.empty(out_max, np.uint8)
        rc = store.register_buffer(buf.ctypes.data, buf.nbytes)
        if rc != 0:
            store.close()
            raise RuntimeError(f"register_buffer returned {rc}")
        return cls(store, buf)

    def out_buffer(self, size: int) -> Any:
        return size

    def put(self, key: str, value: Any) -> None:
        rc = self.store.upsert(key, value)
        if rc != 0:
            raise RuntimeError(f"upsert({key!r}) returned {rc}")

    def get(self, key: str) -> int:
        handle = self.store.get_buffer(key)
        if handle is None:
            raise KeyError(key)
        return ctypes.c_ubyte.from_address(handle.ptr()).value

    def get_into(self, key: str, size: int) -> int:
        n = self.store.get_into(key, self.ptr, size)
        if n < 0:
            raise RuntimeError(f"get_into({key!r}) returned {n}")
        return n

    def exists(self, key: str) -> bool:
        return self.store.is_exist(key) == 1

    def batch_get(self, keys: list[str]) -> int:
        n = 0
        for handle in self.store.batch_get_buffer(keys):
            if handle is None:
                raise KeyError("batch_get_buffer: a key is missing")
            n += ctypes.c_ubyte.from_address(handle.ptr()).value
        return n

    def close(self) -> None:
        try:
            self.store.unregister_buffer(self.ptr)
        finally:
            self.store.close()


def quiet_stderr(log: str) -> None:
    """Send this process's fd 2 (Mooncake's glog lines) to ``log`` instead of the console."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
