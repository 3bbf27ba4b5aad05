"""Engines suite: the Mooncake Store facade against the real ``mooncake-transfer-engine-non-cuda``
wheel (0.3.13.post1), call by call, with the argument shapes vLLM's, SGLang's and LMCache's
Mooncake code paths use; and the bad input an engine may give (device or unreadable
addresses, wrong sizes, over-long keys, a closed store) answered with a code, never a crash."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import kvservice.compat.mooncake as facade
from kvservice.compat.mooncake import MooncakeDistributedStore
from test_mooncake_compat import ThreadServer

pytestmark = pytest.mark.engines

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEASE_MS = 500  # the read lease both sides are configured with (master flag / facade kwarg)
OK, INVALID, HAS_LEASE, TRANSFER_FAIL = 0, -600, -706, -800


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"mooncake_master exited with {proc.returncode}"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"mooncake_master did not listen on {port}")


@pytest.fixture
def real_master(monkeypatch) -> Iterator[tuple[str, str]]:
    """A real mooncake_master on loopback (its own rpc, metadata and admin ports, the read
    lease at LEASE_MS): (master address, metadata URL)."""
    import mooncake  # noqa: PLC0415 - the engines suite has the wheel installed
    # the binary itself: the console script on PATH is a Python wrapper that would outlive
    # terminate() (its child, the master, left running)
    exe = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    rpc, http, admin = _free_port(), _free_port(), _free_port()
    proc = subprocess.Popen([exe, f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                             f"--http_metadata_server_port={http}", f"--metrics_port={admin}",
                             f"--default_kv_lease_ttl={LEASE_MS}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        _wait_port(rpc, proc, deadline)
        _wait_port(http, proc, deadline)
        monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        yield f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _blocked_for(remove: Callable[[], int], limit: float = 5.0) -> tuple[int, bool]:
    """The first code of ``remove`` and whether it succeeded within ``limit`` seconds (polled)."""
    first = remove()
    deadline = time.monotonic() + limit
    code = first
    while code != OK and time.monotonic() < deadline:
        time.sleep(0.05)
        code = remove()
    return first, code == OK


def scenario(mod: types.ModuleType, new_store: Callable[[], MooncakeDistributedStore],
             setup_args: tuple) -> dict:
    """The calls of vLLM's, SGLang's and LMCache's Mooncake paths, with their shapes, on two
    stores of one cluster; results that must be equal between Mooncake and the facade.
    ``mod``: the module whose ReplicateConfig and SoftPinAction go with the stores."""
    r: dict = {}
    a, b = new_store(), new_store()
    r["setup"] = a.setup(*setup_args)
    # SGLang passes 0.3.13's keyword arguments
    r["setup_kwargs"] = b.setup(*setup_args, None, enable_ssd_offload=False, ssd_offload_path="",
                                tenant_id="default", enable_client_http_server=False,
                                client_http_port=9300)
    host, _, port = a.get_hostname().rpartition(":")
    r["hostname"] = (host, port.isdigit())
    try:
        # copying puts and gets (LMCache's put/get, SGLang's warm-up)
        r["put"] = [a.put("sd_k", b"first"), a.put("sd_k", b"second"), a.get("sd_k")]
        r["upsert"] = [a.upsert("sd_k", b"third"), b.get("sd_k")]
        r["missing"] = [a.get("sd_none"), a.get_size("sd_none"), a.get_buffer("sd_none")]
        r["size"] = a.get_size("sd_k")
        r["empty_value"] = a.put("sd_e", b"")
        r["batches"] = [a.put_batch(["sd_b1", "sd_b2"], [b"1", b"22"]),
                        a.upsert_batch(["sd_b2"], [b"23"]),
                        a.get_batch(["sd_b1", "sd_none", "sd_b2"])]
        r["parts"] = [a.put_parts("sd_p", b"ab", b"cd"), a.upsert_parts("sd_p", b"x", b"y"),
                      a.get("sd_p")]
        r["exist"] = [a.is_exist("sd_k"), a.is_exist("sd_none"),
                      b.batch_is_exist(["sd_k", "sd_none", "sd_b1"])]
        # replicate configs (SGLang: group_ids; vLLM/LMCache: replica_num, preferred segment)
        def cfg(*groups: str) -> object:
            c = mod.ReplicateConfig()
            c.replica_num, c.preferred_segment = 1, a.get_hostname()
            if groups:
                c.group_ids = list(groups)  # SGLang: one group id per key
            return c
        pin = mod.ReplicateConfig()
        pin.soft_pin_ttl_ms = 1000  # without ENABLE: refused
        r["config"] = [a.put("sd_c", b"c", cfg("g")), a.put("sd_pin", b"p", pin),
                       a.put("sd_g2", b"c", cfg("g", "h")), a.put_batch(["sd_g3", "sd_g4"],
                                                                   [b"3", b"4"], cfg("g"))]
        pin.soft_pin_action = mod.SoftPinAction.ENABLE
        r["config"].append(a.put("sd_pin", b"p", pin))
        # registered buffers: vLLM's/SGLang's zero-copy paths, batched and multi-buffer
        src = np.arange(16384, dtype=np.uint8)
        dst = np.zeros(16384, dtype=np.uint8)
        s0, d0 = src.ctypes.data, dst.ctypes.data
        r["register"] = [a.register_buffer(s0, src.nbytes), a.register_buffer(d0, dst.nbytes),
                         b.register_buffer(d0, dst.nbytes)]
        r["put_from"] = [a.put_from("sd_z", s0, 4096, cfg("g")),
                         a.upsert_from("sd_z", s0 + 1, 4096, cfg()),
                         a.batch_put_from(["sd_f0", "sd_f1"], [s0, s0 + 4096], [4096, 2048],
                                          cfg("g", "g")),
                         a.batch_put_from(["sd_x0", "sd_x1"], [s0, s0], [8, 8], cfg("g")),
                         a.batch_upsert_from(["sd_f1"], [s0 + 8192], [2048]),
                         a.batch_put_from_multi_buffers(["sd_m0", "sd_m1"],
                                                        [[s0, s0 + 8192], [s0 + 100]],
                                                        [[1024, 1024], [512]], cfg("g", "h"))]
        r["get_into"] = [b.get_into("sd_z", d0, 16384),
                         b.batch_get_into(["sd_f0", "sd_none", "sd_f1"], [d0, d0 + 4096, d0 + 8192],
                                          [4096, 4096, 4096]),
                         b.batch_get_into_multi_buffers(["sd_m0", "sd_none"], [[d0 + 12288, d0],
                                                                               [d0 + 2048]],
                                                        [[1536, 512], [512]])]
        want = np.concatenate([src[:512], src[4096:4608], src[8192:9216]])
        r["get_into_bytes"] = (bool(np.array_equal(dst[:512], want[:512])),
                               bool(np.array_equal(dst[12288:13824], want[512:2048])))
        r["get_into_small"] = b.get_into("sd_z", d0, 100)
        r["ranges"] = [b.get_into_ranges([d0], [["sd_z", "sd_none"]], [[[0, 64], [200]]],
                                         [[[1, 100], [0]]], [[[8, 8], [4]]]),
                       b.get_into_ranges([d0], [["sd_z"]], [[[0]]], [[[4095]]], [[[8]]]),
                       b.get_into_ranges([d0, d0], [["sd_z"]], [[[0]]], [[[0]]], [[[4]]]),
                       b.get_into_ranges([d0], [["sd_z"]], [[[16380]]], [[[0]]], [[[8]]])]
        # (no unregistered address here: real Mooncake returned -800 in one run and segfaulted in
        # another; the facade's answer is tested in test_bad_sizes_keys_and_closed_store)
        buf = a.get_buffer("sd_p")
        r["get_buffer"] = (buf.size(), bytes(memoryview(buf)))
        del buf
        # read leases: a get by another store blocks a plain remove for the lease time only
        time.sleep(LEASE_MS / 1000 + 0.1)  # the leases of the reads above ran out
        r["remove_unread"] = a.remove("sd_b1")
        r["lease_after_get"] = [b.get("sd_k")] + list(_blocked_for(lambda: a.remove("sd_k")))
        r["lease_after_batch_get_into"] = [b.batch_get_into(["sd_f0"], [d0], [4096])] + \
            list(_blocked_for(lambda: a.batch_remove(["sd_f0"])[0]))
        r["remove_force_leased"] = [b.get_size("sd_f1"), a.remove("sd_f1", force=True),
                                    a.is_exist("sd_f1")]
        r["remove"] = [a.remove("sd_none"), a.batch_remove(["sd_b2", "sd_none"], force=True),
                       a.remove_by_regex("^sd_m", force=True)]
        r["remove_all"] = a.remove_all(force=True) > 0
        r["unregister"] = [a.unregister_buffer(s0), a.unregister_buffer(d0),
                           b.unregister_buffer(d0)]
    finally:
        a.close()
        b.close()
    # setup validation (LMCache's dict form; SGLang's sizes)
    c = new_store()
    try:
        conf = {"local_hostname": setup_args[0], "metadata_server": setup_args[1],
                "master_server_addr": setup_args[6], "protocol": "tcp"}
        r["setup_dict_percent"] = c.setup({**conf, "global_segment_size": "50%"})
        r["setup_no_local_buffer"] = c.setup(*setup_args[:3], 0, *setup_args[4:])
        r["no_local_buffer"] = [c.put("sd_n", b"n"), c.get("sd_k")]
    finally:
        c.close()
    return r


@pytest.mark.timeout(120)
def test_semantic_diff_against_real_mooncake(url, real_master):
    """Every call of the scenario answers as real Mooncake does (codes, shapes, bytes)."""
    import mooncake.store as real  # noqa: PLC0415
    master, metadata = real_master
    with ThreadServer(url) as srv:
        ours = scenario(facade, lambda: MooncakeDistributedStore(kv_lease_ttl=LEASE_MS / 1000),
                        ("127.0.0.1", "P2PHANDSHAKE", 64 * MiB, 16 * MiB, "tcp", "", srv.url))
    theirs = scenario(real, real.MooncakeDistributedStore,
                      ("127.0.0.1", metadata, 64 * MiB, 16 * MiB, "tcp", "", master))
    assert theirs["setup"] == OK, "real Mooncake did not set up here"
    assert theirs["lease_after_get"][1:] == [HAS_LEASE, True]  # the scenario tests leases
    diffs = {k: (ours[k], theirs[k]) for k in theirs if ours.get(k) != theirs[k]}
    assert not diffs, f"facade vs Mooncake (ours, theirs): {diffs}"


# ---- bad input from an engine ---------------------------------------------------------------

_UNREADABLE = r"""
import ctypes, mmap, sys
from kvservice.compat.mooncake import MooncakeDistributedStore
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
s = MooncakeDistributedStore()
assert s.setup("h", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", sys.argv[1]) == 0
assert s.put("k", bytes(range(64))) == 0
out = []
for prot in (0, mmap.PROT_READ):  # PROT_NONE, a device-like page; a page it cannot write
    page = libc.mmap(None, 4096, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    try:
        out += [s.register_buffer(page, 4096), s.put_from("p", page, 64),
                s.get_into("k", page, 4096), s.batch_get_into(["k"], [page], [4096])[0],
                s.batch_put_from_multi_buffers(["m"], [[page]], [[64]])[0],
                s.batch_get_into_multi_buffers(["k"], [[page]], [[4096]])[0],
                s.get_into_ranges([page], [["k"]], [[[0]]], [[[0]]], [[[8]]])[0][0][0]]
    finally:
        libc.munmap(page, 4096)
s.close()
print(out)
"""


@pytest.mark.timeout(60)
def test_unreadable_or_device_memory_is_refused_not_dereferenced(url):
    """vLLM registers its GPU KV cache; the facade copies with the CPU. Memory it cannot read
    and write (a PROT_NONE page, as CUDA reserves device addresses; a read-only page) is
    refused at register_buffer, and every transfer on it gets a code: the process lives."""
    with ThreadServer(url) as srv:
        env = {**os.environ, "PYTHONPATH": ROOT}
        res = subprocess.run([sys.executable, "-c", _UNREADABLE, srv.url], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=50)
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-2000:]}"
    assert res.stdout.strip() == str(([INVALID] + [TRANSFER_FAIL] * 5 + [INVALID]) * 2)


def test_bad_sizes_keys_and_closed_store(url):
    """Wrong sizes, over-long keys and a closed store give codes (or Python exceptions)."""
    with ThreadServer(url) as srv:
        s = MooncakeDistributedStore()
        assert s.setup("h", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "", srv.url) == OK
        buf = np.zeros(4096, dtype=np.uint8)
        p = buf.ctypes.data
        assert s.register_buffer(p, 4096) == OK and s.put("k", bytes(100)) == OK
        assert s.put_from("x", 4096, 16) == TRANSFER_FAIL and s.get_into("k", 4096, 4096) == TRANSFER_FAIL
        assert s.batch_get_into_multi_buffers(["k"], [[4096]], [[100]]) == [TRANSFER_FAIL]
        # sizes: negative, past the registered range, smaller than the value, list mismatch
        assert s.put_from("x", p, -1) == INVALID and s.get_into("k", p, -5) == INVALID
        assert s.put_from("x", p + 4000, 200) == -10 and s.get_into("k", p + 4090, 100) == -10
        assert s.get_into("k", p, 50) == INVALID and s.batch_get_into(["k", "k"], [p], [100]) == [INVALID] * 2
        assert s.batch_put_from_multi_buffers(["a"], [[p, p + 8]], [[8]]) == [INVALID]
        assert s.register_buffer(p, 0) == INVALID and s.register_buffer(-p, 16) == INVALID
        # keys: kvservice's limit is 1024 bytes (Mooncake has none): INVALID_PARAMS, nothing stored
        long_key = "k" * 1025
        assert s.put(long_key, b"v") == INVALID and s.put_from(long_key, p, 8) == INVALID
        assert s.get(long_key) == b"" and s.is_exist(long_key) == INVALID
        assert s.batch_is_exist(["k", long_key]) == [1, INVALID]
        assert s.put("", b"v") == INVALID
        with pytest.raises(TypeError):
            s.put("k", 12)  # not a buffer: pybind's TypeError
        assert s.close() == OK
        # a closed store: codes, empty results, never a crash
        assert s.put("k", b"v") == INVALID and s.get("k") == b"" and s.get_buffer("k") is None
        assert s.put_from("k", p, 8) == INVALID and s.get_into("k", p, 100) == INVALID
        assert s.batch_get_into(["k"], [p], [100]) == [INVALID] and s.is_exist("k") == INVALID
        assert s.remove("k") == INVALID and s.health_check() == INVALID


# ---- LMCache's own Mooncake connector through the shim -------------------------------------

_LMCACHE = r'''
import asyncio, sys, torch
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.connector.mooncakestore_connector import MooncakestoreConnector
from lmcache.utils import CacheEngineKey
import mooncake.store
url, meta, shim = sys.argv[1], sys.argv[2] == "meta", sys.argv[3] == "shim"
assert ("kvservice" in (mooncake.store.__doc__ or "")) == shim  # the shim, or the wheel
cfg = LMCacheEngineConfig.from_defaults(chunk_size=16, local_cpu=True, max_local_cpu_size=0.05,
    extra_config={"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                  "mooncake_master_server_addr": url, "global_segment_size": "64MB", "local_buffer_size": "16MB",
                  "save_chunk_meta": meta, "mooncake_prefer_local_alloc": True})
md = LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                     kv_dtype=torch.bfloat16, kv_shape=(2, 2, 16, 4, 8))
backend = LocalCPUBackend(cfg, md)
loop = asyncio.new_event_loop()
conn = MooncakestoreConnector(loop, backend, cfg)
assert conn.registered_buffer_ptr is not None  # its pinned CPU pool was registered
keys = [CacheEngineKey("m", 1, 0, h, torch.bfloat16) for h in (11, 22, 33)]
objs = []
for i in range(3):
    o = backend.allocate(conn.meta_shapes, conn.meta_dtypes, conn.meta_fmt)
    o.raw_tensor.copy_(torch.full_like(o.raw_tensor, 7 + i))
    objs.append(o)
async def main():
    await conn.put(keys[0], objs[0])
    await conn.batched_put(keys[1:], objs[1:])
    ex = [conn.exists_sync(k) for k in keys] + [conn.exists_sync(CacheEngineKey("m", 1, 0, 99, torch.bfloat16))]
    got = await conn.batched_get(keys + [CacheEngineKey("m", 1, 0, 99, torch.bfloat16)])
    same = [g is not None and torch.equal(g.raw_tensor, o.raw_tensor) for g, o in zip(got, objs)]
    contains = await conn.batched_async_contains("lookup", keys, pin=False) if hasattr(conn, "batched_async_contains") else None
    await conn.close()
    return ex, same, got[3] is None, contains
print(repr(loop.run_until_complete(main())))
'''


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["meta", "nometa"])
def test_lmcache_mooncakestore_connector_through_shim(url, real_master, mode):
    """LMCache 0.5.6's MooncakestoreConnector, unchanged, on the facade (``import mooncake.store``
    resolves to the shim) and on real Mooncake: dict setup, its pinned CPU pool registered,
    put/batched_put, batched_get, exists and batched_async_contains answer the same.
    ``meta`` (save_chunk_meta): put_parts and batch_get_buffer; ``nometa``: put_from /
    batch_put_from and batch_get_into (zero-copy on the registered pool)."""
    from kvservice.compat import mooncake_shim_path  # noqa: PLC0415

    def run(pythonpath: str, address: str, shim: str) -> str:
        env = {**os.environ, "PYTHONPATH": pythonpath}
        res = subprocess.run([sys.executable, "-c", _LMCACHE, address, mode, shim], env=env,
                             cwd=ROOT, capture_output=True, text=True, timeout=80)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stdout.strip().splitlines()[-1]

    with ThreadServer(url) as srv:
        ours = run(os.pathsep.join([mooncake_shim_path(), ROOT]), srv.url, "shim")
    theirs = run(ROOT, real_master[0], "real")
    # exists: three keys and a missing one; the bytes back equal; the missing key None
    assert ours == theirs == "([1, 1, 1, 0], [True, True, True], True, 3)"
