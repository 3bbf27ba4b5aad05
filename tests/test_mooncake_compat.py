"""kvservice.compat.mooncake: Mooncake Store's Python API on kvservice, checked against Mooncake's
documented behaviour (return values, error codes), and the opt-in ``mooncake`` shim."""
from __future__ import annotations

import asyncio
import ctypes
import gc
import importlib.util
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvservice import KVServer
from kvservice.compat import mooncake_shim_path
from kvservice.compat.mooncake import (DEFAULT_KV_LEASE_TTL, BufferHandle, MooncakeDistributedStore,
                                       MooncakeHostMemAllocator, ReplicateConfig, SoftPinAction,
                                       parse_segment_size)

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OK, OVERFLOW, NO_SPACE = 0, -10, -200
INVALID, NOT_FOUND, HAS_LEASE, LEASE_EXPIRED = -600, -704, -706, -707
TRANSFER_FAIL, RPC_FAIL = -800, -900


class ThreadServer:
    """A KVServer on its own event loop in a thread, so the blocking facade can run here."""

    def __init__(self, url: str, **opts) -> None:
        self.url = url
        self.server = KVServer(url, **{"pool_size": 16 * MiB, "alignment": 256, **opts})
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._stop = asyncio.Event()
            try:
                async with self.server:
                    self._ready.set()
                    await self._stop.wait()
            except BaseException as exc:  # pragma: no cover - start failures
                self._error = exc
                self._ready.set()
        self._loop.run_until_complete(main())
        self._loop.close()

    def __enter__(self) -> "ThreadServer":
        self._thread.start()
        if not self._ready.wait(20) or self._error is not None:
            raise RuntimeError(f"server did not start: {self._error}")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(20)
        assert not self._thread.is_alive()


@pytest.fixture
def kv_url(url):
    with ThreadServer(url) as srv:
        yield srv.url


def _setup(url: str, **kw) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore(**kw)
    assert store.setup("localhost", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "", url) == OK
    return store


@pytest.fixture
def store(kv_url):
    s = _setup(kv_url)
    yield s
    s.close()


# ---- setup --------------------------------------------------------------------------------

def test_setup_forms_and_validation(kv_url):
    s = MooncakeDistributedStore()
    assert s.put("k", b"v") == INVALID and s.get("k") == b"" and s.is_exist("k") == INVALID
    assert s.batch_is_exist(["a", "b"]) == [INVALID, INVALID] and s.get_buffer("k") is None
    assert s.health_check() == INVALID
    # positional, keyword, and Mooncake's size forms
    assert s.setup("localhost", "P2PHANDSHAKE", "16MB", "16 MB", "tcp", "", kv_url) == OK
    host, port = s.get_hostname().split(":")  # Mooncake names its segment host:port
    assert host == "localhost" and 12300 <= int(port) < 14300  # its transfer engine's ports
    assert s.health_check() == OK
    assert s.setup(local_hostname="h:1", metadata_server="http://m:8080/metadata",
                   global_segment_size=512 * MiB, local_buffer_size=0, protocol="rdma",
                   rdma_devices="mlx5_0", master_server_addr=kv_url) == OK
    assert s.get_hostname() == "h:1"
    # local_buffer_size=0: the calls staged through Mooncake's local buffer are refused
    assert s.put("k", b"v") == INVALID and s.get("k") == b"" and s.put_batch(["k"], [b"v"]) == INVALID
    # 0.3.13's keyword arguments (SGLang passes them), type-checked then ignored
    assert s.setup("h", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "", kv_url, None,
                   enable_ssd_offload=True, ssd_offload_path="/tmp/ssd", tenant_id="t1",
                   enable_client_http_server=False, client_http_port=9301) == OK
    with pytest.raises(TypeError):
        s.setup("h", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "", kv_url, tenant_id=3)
    assert s.put("k", b"v") == OK and s.get("k") == b"v"
    # the dict form: values are read as strings; an unparseable size is INVALID_PARAMS
    assert s.setup({"local_hostname": "h", "metadata_server": "P2PHANDSHAKE",
                    "global_segment_size": "1.5GB", "protocol": "tcp", "master_server_addr": kv_url,
                    "enable_ssd_offload": True, "tenant_id": "t", "client_http_port": 9300}) == OK
    for size in ("garbage", "50%", "-5"):
        assert s.setup({"local_hostname": "h", "metadata_server": "P2PHANDSHAKE",
                        "global_segment_size": size, "master_server_addr": kv_url}) == INVALID
    assert s.setup({"local_hostname": "h", "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": kv_url}) == OK  # LMCache/SGLang's key name
    bad = [
        dict(local_hostname=""), dict(metadata_server=""), dict(protocol="carrier-pigeon"),
        dict(global_segment_size=100), dict(local_buffer_size=(1 << 40) + 1),
        dict(global_segment_size="12 parsecs"), dict(master_server_addr="localhost:50051"),
    ]
    base = dict(local_hostname="h", metadata_server="P2PHANDSHAKE", global_segment_size=16 * MiB,
                local_buffer_size=16 * MiB, protocol="tcp", rdma_devices="",
                master_server_addr=kv_url)
    for change in bad:
        assert s.setup(**{**base, **change}) == INVALID, change
    assert s.setup({"metadata_server": "x", "master_server_addr": kv_url}) == INVALID
    with pytest.raises(TypeError):
        s.setup("h", "m", -1, 16 * MiB, "tcp", "", kv_url)  # pybind rejects a negative size_t
    # a kvservice URL where no server runs: RPC_FAIL
    assert s.setup(**{**base, "master_server_addr": kv_url + "-nobody"}) == RPC_FAIL
    assert s.close() == OK and s.close() == OK


def test_parse_segment_size():
    assert parse_segment_size(4096) == 4096
    assert parse_segment_size("16MB") == parse_segment_size("16 mb") == 16 * MiB
    assert parse_segment_size("2gb") == 2 << 30 and parse_segment_size("1.5G") == 3 << 29
    assert parse_segment_size(" 4096 ") == 4096 and parse_segment_size("8b") == 8
    for bad in ("", "gb", "x1"):
        with pytest.raises(ValueError):
            parse_segment_size(bad)


def test_setup_dummy_and_host_allocator(kv_url):
    s = MooncakeDistributedStore()
    assert s.setup_dummy(256 * MiB, 64 * MiB, "127.0.0.1:50052") == INVALID  # no kvservice URL
    assert s.setup_dummy(256 * MiB, 64 * MiB, kv_url) == OK
    assert s.put("d", b"dummy") == OK and s.get("d") == b"dummy"
    assert s.alloc_from_mem_pool(4096) == 0  # as Mooncake's non-dummy client: no shared pool
    # SGLang's MooncakeHostTensorAllocator: host memory to register and move KV through
    alloc = MooncakeHostMemAllocator()
    ptr = alloc.alloc(MiB)
    try:
        view = (ctypes.c_ubyte * MiB).from_address(ptr)
        view[:5] = list(b"hello")
        assert s.register_buffer(ptr, MiB) == OK and s.put_from("h", ptr, 5) == OK
        assert s.get_into("d", ptr + 8, 64) == 5 and bytes(view[8:13]) == b"dummy"
        assert s.get("h") == b"hello" and s.unregister_buffer(ptr) == OK
    finally:
        assert alloc.free(ptr) == OK
    assert alloc.free(ptr) == INVALID
    with pytest.raises(RuntimeError):
        alloc.alloc(0)
    s.close()


# ---- puts and gets ------------------------------------------------------------------------

def test_put_does_not_overwrite_upsert_does(store):
    assert store.put("k", b"first") == OK
    assert store.put("k", b"second") == OK  # Mooncake: OBJECT_ALREADY_EXISTS counts as success
    assert store.get("k") == b"first"
    assert store.upsert("k", b"third") == OK and store.get("k") == b"third"
    assert store.put_batch(["k", "n1"], [b"fourth", b"new"]) == OK
    assert store.get_batch(["k", "n1", "missing"]) == [b"third", b"new", b""]
    assert store.upsert_batch(["k", "n1"], [b"5", b"6"]) == OK
    assert store.get_batch(["k", "n1"]) == [b"5", b"6"]
    assert store.put_batch(["a", "b"], [b"x"]) == INVALID
    assert store.put_parts("p", b"Hello, ", bytearray(b"World"), memoryview(b"!")) == OK
    assert store.get("p") == b"Hello, World!"
    assert store.put_parts("p", b"other") == OK and store.get("p") == b"Hello, World!"
    assert store.upsert_parts("p", b"new ", b"parts") == OK and store.get("p") == b"new parts"
    assert store.put_parts("empty") == OK and store.is_exist("empty") == 0  # nothing stored
    with pytest.raises(RuntimeError):
        store.put_parts("bad", np.zeros((2, 2), np.uint8))  # Mooncake: "parts must be 1-D"
    # any buffer-protocol value; numpy arrays go as their bytes
    arr = np.arange(50_000, dtype=np.float32)  # 200 KB: the two-phase put path
    assert store.put("arr", arr) == OK
    assert np.array_equal(np.frombuffer(store.get("arr"), np.float32), arr)
    assert store.get_size("arr") == arr.nbytes and store.get_size("missing") == NOT_FOUND
    assert store.get("missing") == b""
    assert store.put("", b"x") == INVALID and store.put("e", b"") == INVALID
    cfg = ReplicateConfig()
    cfg.replica_num, cfg.preferred_segment, cfg.group_ids = 3, store.get_hostname(), ["g"]
    assert store.put("cfg", b"replicas ignored", cfg) == OK
    assert store.put("cfg2", b"kw", config=cfg) == OK and "replica_num: 3" in str(cfg)
    cfg.soft_pin_ttl_ms = 1000  # a TTL without soft_pin_action=ENABLE: Mooncake refuses
    assert store.put("cfg3", b"x", cfg) == INVALID and store.put_batch(["cfg3"], [b"x"], cfg) == INVALID
    cfg.soft_pin_action = SoftPinAction.ENABLE
    assert store.upsert("cfg3", b"x", cfg) == OK
    with pytest.raises(AttributeError):
        cfg.with_soft_pin = True  # dropped in 0.3.13


def test_exist_and_remove(store):
    assert store.put("a", b"1") == OK and store.put("b", b"2") == OK
    assert store.is_exist("a") == 1 and store.is_exist("zz") == 0
    assert store.batch_is_exist(["a", "zz", "b"]) == [1, 0, 1]
    assert store.remove("a") == OK and store.is_exist("a") == 0
    assert store.remove("a") == NOT_FOUND
    assert store.batch_remove(["b", "zz"]) == [OK, NOT_FOUND]
    for i in range(4):
        assert store.put(f"user_session_{i}", b"s") == OK
    assert store.put("keep_me", b"k") == OK
    assert store.remove_by_regex("^user_session_.*") == 4
    assert store.batch_is_exist(["user_session_0", "keep_me"]) == [0, 1]
    assert store.remove_by_regex("(") == INVALID
    assert store.remove_all() == 1 and store.is_exist("keep_me") == 0


def test_remove_under_read_lease(kv_url):
    store = _setup(kv_url, kv_lease_ttl=0.3)
    try:
        assert store.put("k", b"v") == OK
        assert store.remove("k") == OK  # a put grants no read lease
        assert store.put("k", b"v") == OK and store.get("k") == b"v"
        assert store.remove("k") == HAS_LEASE and store.is_exist("k") == 1
        assert store.batch_remove(["k"]) == [HAS_LEASE]
        assert store.remove_all() == 0 and store.remove_by_regex("k") == 0
        time.sleep(0.35)  # the read lease (kv_lease_ttl) ran out
        assert store.remove("k") == OK
        assert store.put("k", b"v") == OK and store.get_size("k") == 1
        assert store.remove("k") == HAS_LEASE
        assert store.remove("k", force=True) == OK and store.is_exist("k") == 0
        assert store.put("j", b"v") == OK and store.get("j") == b"v"
        assert store.remove_all(force=True) == 1
        assert MooncakeDistributedStore()._kv_lease_ttl == DEFAULT_KV_LEASE_TTL == 10.0  # 0.3.13's master
    finally:
        store.close()


# ---- registered buffers -------------------------------------------------------------------

def test_put_from_get_into_registered_numpy(store):
    src = np.random.default_rng(1).integers(0, 255, 3 * MiB, dtype=np.uint8)
    dst = np.zeros(4 * MiB, dtype=np.uint8)
    ptr, size = src.ctypes.data, src.nbytes
    assert store.put_from("t", ptr, size) == TRANSFER_FAIL  # not registered yet
    assert store.register_buffer(ptr, size) == OK
    assert store.register_buffer(dst.ctypes.data, dst.nbytes) == OK
    assert store.put_from("t", ptr, size) == OK
    assert store.get_into("t", dst.ctypes.data, dst.nbytes) == size
    assert np.array_equal(dst[:size], src)
    # sub-ranges of a registered buffer (as SGLang's page-first host pool uses them)
    assert store.batch_put_from(["p0", "p1", "p0"], [ptr, ptr + MiB, ptr + 2 * MiB],
                                [MiB, MiB, MiB]) == [OK, OK, OK]
    assert store.get("p0") == src[:MiB].tobytes()  # the repeated key kept its first value
    out = dst.ctypes.data
    assert store.batch_get_into(["p1", "missing", "p0"], [out, out + MiB, out + 2 * MiB],
                                [MiB, MiB, MiB]) == [MiB, NOT_FOUND, MiB]
    assert np.array_equal(dst[:MiB], src[MiB:2 * MiB])
    assert store.get_into("t", out, 100) == INVALID  # buffer smaller than the value (as Mooncake)
    assert store.get_into("t", out + dst.nbytes - 10, 1000) == OVERFLOW  # runs past the range
    assert store.put_from("x", ptr + size - 10, 20) == OVERFLOW
    assert store.get_into("missing", out, 10) == NOT_FOUND
    assert store.batch_get_into(["t"], [out], []) == [INVALID]
    assert store.upsert_from("p0", ptr + MiB, MiB) == OK and store.get("p0") == src[MiB:2 * MiB].tobytes()
    assert store.batch_upsert_from(["p0"], [ptr], [16]) == [OK] and store.get("p0") == src[:16].tobytes()
    assert store.unregister_buffer(ptr) == OK and store.unregister_buffer(ptr) == INVALID
    assert store.put_from("y", ptr, 16) == TRANSFER_FAIL
    assert store.get_into("t", 12345, 10) == TRANSFER_FAIL


def test_ctypes_buffers_multi_and_ranges(store):
    n = 32
    b0, b1 = (ctypes.c_ubyte * n)(), (ctypes.c_ubyte * n)()
    p0, p1 = ctypes.addressof(b0), ctypes.addressof(b1)
    assert store.register_buffer(p0, n) == OK and store.register_buffer(p1, n) == OK
    assert store.put("key1", bytes(range(40))) == OK and store.put("key2", bytes(range(100, 140))) == OK
    # the example of Mooncake's docs for get_into_ranges
    res = store.get_into_ranges([p0, p1], [["key1", "key2"], ["key2", "key1"]],
                                [[[0, 20], [8]], [[4], [16]]], [[[1, 30], [2]], [[0], [10]]],
                                [[[4, 3], [5]], [[6], [4]]])
    assert res == [[[4, 3], [5]], [[6], [4]]]
    assert bytes(b0[0:4]) == bytes(range(1, 5)) and bytes(b0[20:23]) == bytes(range(30, 33))
    assert bytes(b0[8:13]) == bytes(range(102, 107)) and bytes(b1[4:10]) == bytes(range(100, 106))
    assert bytes(b1[16:20]) == bytes(range(10, 14))
    res = store.get_into_ranges([p0], [["key1", "nokey"]], [[[0], [4]]], [[[38], [0]]], [[[4], [1]]])
    assert res == [[[INVALID], [NOT_FOUND]]]  # source range past the object; missing key
    assert store.get_into_ranges([p0], [["key1"]], [[[30]]], [[[0]]], [[[4]]]) == [[[INVALID]]]
    assert store.get_into_ranges([12345], [["key1"]], [[[0]]], [[[0]]], [[[4]]]) == [[[INVALID]]]
    assert store.get_into_ranges([p0, p1], [["key1"]], [[[0]]], [[[0]]], [[[4]]]) == [[[INVALID]], [[INVALID]]]
    # multi-buffer forms: one value gathered from / scattered to several ranges
    assert store.batch_put_from_multi_buffers(["mb"], [[p0, p1]], [[8, 8]]) == [OK]
    assert store.get("mb") == bytes(b0[:8]) + bytes(b1[:8])
    ctypes.memset(p0, 0, n)
    assert store.batch_get_into_multi_buffers(["mb", "zz"], [[p0 + 16, p0], [p0]], [[10, 10], [4]]) == [16, NOT_FOUND]
    assert bytes(b0[16:26]) + bytes(b0[:6]) == store.get("mb")


# ---- zero-copy buffers --------------------------------------------------------------------

def test_get_buffer_objects(kv_url):
    store = _setup(kv_url, kv_lease_ttl=0.2)
    try:
        data = np.arange(1000, dtype=np.int32)
        assert store.put("big", data) == OK and store.put("small", b"hi") == OK
        buf = store.get_buffer("big")
        assert isinstance(buf, BufferHandle) and buf and buf.size() == len(buf) == data.nbytes
        assert np.array_equal(np.frombuffer(buf, dtype=np.int32), data)
        assert np.array_equal(np.array(buf, copy=False).view(np.int32), data)
        assert bytes(memoryview(buf)[:8]) == data[:2].tobytes()
        assert ctypes.string_at(buf.ptr(), 4) == data[:1].tobytes()
        buf.check()
        assert store.get_buffer("missing") is None
        # an open handle pins the object: remove refuses until it is closed (and its lease ran out)
        assert store.remove("big") == HAS_LEASE
        buf.close()
        assert buf.closed
        time.sleep(0.25)
        assert store.remove("big") == OK
        bufs = store.batch_get_buffer(["small", "missing"])
        assert bufs[1] is None and bytes(bufs[0]) == b"hi"
        with bufs[0] as b:
            assert b.size() == 2
        # dropped without close: the garbage collector ends the lease
        assert store.put("gc", b"collect me") == OK
        h = store.get_buffer("gc")
        del h
        gc.collect()
        time.sleep(0.25)
        assert store.remove("gc") == OK
        stats = store._kv.stats()
        assert stats["leases"] == 0
    finally:
        store.close()


def test_handle_survives_force_remove_and_close(kv_url):
    store = _setup(kv_url)
    assert store.put("k", b"still here") == OK
    h = store.get_buffer("k")
    assert store.remove("k", force=True) == OK and store.is_exist("k") == 0
    assert bytes(h) == b"still here"  # a leased block is never freed under its reader
    store.close()
    assert bytes(h) == b"still here"  # the handle keeps the mapping alive
    h.close()


def test_server_gone_gives_rpc_fail(url):
    srv = ThreadServer(url).__enter__()
    store = _setup(url)
    assert store.put("k", b"v") == OK
    srv.__exit__(None, None, None)
    started = time.monotonic()
    assert store.put("k2", b"v") == RPC_FAIL
    assert store.get("k") == b"" and store.is_exist("k") == RPC_FAIL
    assert store.health_check() == RPC_FAIL
    assert time.monotonic() - started < 30
    store.close()


# ---- the opt-in shim ----------------------------------------------------------------------

def _run(code: str, pythonpath: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, ROOT) if p)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60, cwd="/")


def test_shim_importable_only_via_pythonpath(url):
    path = subprocess.run([sys.executable, "-m", "kvservice", "mooncake-shim-path"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert path == mooncake_shim_path() and os.path.isdir(os.path.join(path, "mooncake"))
    probe = ("import mooncake.store as s, kvservice.compat.mooncake as m; "
             "from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction, MooncakeHostMemAllocator; "
             "assert MooncakeDistributedStore is m.MooncakeDistributedStore; print(s.__file__)")
    with_shim = _run(probe, path)
    assert with_shim.returncode == 0, with_shim.stderr
    assert with_shim.stdout.strip().startswith(path)
    without = _run("import mooncake.store", None)
    if _real_mooncake() is None:
        assert without.returncode != 0 and "No module named 'mooncake'" in without.stderr
    # the shim drives a server end to end, as an engine's connector would
    with ThreadServer(url):
        script = (
            "from mooncake.store import MooncakeDistributedStore, ReplicateConfig\n"
            "s = MooncakeDistributedStore()\n"
            f"assert s.setup('localhost', 'P2PHANDSHAKE', 3355443200, 1073741824, 'tcp', '', {url!r}) == 0\n"
            "c = ReplicateConfig(); c.replica_num = 1; c.preferred_segment = s.get_hostname()\n"
            "assert s.put('warm', bytes(4096), c) == 0 and s.is_exist('warm') == 1\n"
            "assert s.get('warm') == bytes(4096)\n"
            "assert s.remove_all(force=True) == 1\n"
            "print(s.close())\n")
        res = _run(script, path)
        assert res.returncode == 0 and res.stdout.strip() == "0", res.stderr


def _real_mooncake():
    """The installed Mooncake store module (mooncake-transfer-engine[-non-cuda]), or None."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or (spec.origin or "").startswith(mooncake_shim_path()):
        return None
    try:
        import mooncake.store as real  # noqa: PLC0415
    except ImportError:
        return None
    return real
