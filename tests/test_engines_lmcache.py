"""Real LMCache 0.5.6 on kvservice: its config loader, cache engine, storage manager,
``CreateStorageBackends``, ``RemoteBackend``, connector manager and allocator drive our adapter.

The end-to-end tests run a writer engine and a reader engine in two processes
(``tests/lmcache_engine.py``, same ``PYTHONHASHSEED``) against a kvservice server process; the
others build one engine in this process and drive its ``RemoteBackend`` directly.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import lmcache_engine as le
from kvservice import KVClient
from kvservice.integrations.lmcache import KVServiceConnector, resolve_service_url

pytestmark = pytest.mark.engines

TESTS = Path(__file__).resolve().parent
NS = "lmc"
MiB = 1 << 20


class Server:
    """``python -m kvservice serve`` in a child process, ended by :meth:`stop`."""

    def __init__(self, url: str, pool: str = "32MiB") -> None:
        self.url = url
        self.proc = subprocess.Popen([sys.executable, "-m", "kvservice", "serve", "--url", url,
                                      "--pool-size", pool], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                KVClient.connect_sync(url).close()
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"kvservice server on {url} did not start")
                time.sleep(0.05)

    def stats(self, namespace: str | None = NS) -> dict[str, Any]:
        kv = KVClient.connect_sync(self.url)
        try:
            return kv.stats(namespace)
        finally:
            kv.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def server(url: str) -> Iterator[Server]:
    s = Server(url)
    try:
        yield s
    finally:
        s.stop()


def service(name: str) -> str:
    return f"kvservice://{name}?namespace={NS}"


@pytest.fixture
def engine() -> Iterator[Any]:
    """Builds engines in this process (``engine(config)``); destroys them after the test."""
    built: list[str] = []

    def build(config: dict) -> Any:
        instance = f"kvtest-{len(built)}"
        built.append(instance)
        return le.build(config, instance)

    try:
        yield build
    finally:
        for instance in built:
            le.destroy(instance)


def run_engine(op: str, config: dict, tmp: Path, returncode: int = 0) -> dict:
    """Run tests/lmcache_engine.py OP in a child process; its JSON report."""
    cfg, out = tmp / f"{op}.cfg.json", tmp / f"{op}.out.json"
    cfg.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONHASHSEED": "1234",
           "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    proc = subprocess.run([sys.executable, str(TESTS / "lmcache_engine.py"), op, str(cfg),
                           str(tmp / "kv.pt"), str(out)], env=env, capture_output=True,
                          text=True, timeout=90)
    assert proc.returncode == returncode, proc.stderr[-3000:]
    return json.loads(out.read_text())


CONFIGS = {
    "plugin": le.plugin_config,
    "legacy": le.legacy_config,
    "connector_class": lambda url: le.plugin_config(
        url, **{"remote_storage_plugin.kvservice.class_name": "KVServiceConnector"}),
}


# ---- two engines, two processes -------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", sorted(CONFIGS))
def test_second_process_engine_reads_first_engines_chunks(server, name, tmp_path, mode):
    """Engine A stores a 300-token KV cache (4 full chunks of 64 and one of 44); engine B, in
    another process with an empty local cache, retrieves all of it from kvservice."""
    config = CONFIGS[mode](service(name))
    kv = le.kv_cache()
    torch.save(kv, tmp_path / "kv.pt")
    wrote = run_engine("store", config, tmp_path)
    assert wrote["remote_backends"] == (["RemoteBackend"] if mode == "legacy"
                                        else ["RemoteBackend-kvservice"])
    assert wrote["connected"] == [True] and wrote["stored_chunks"] == 5
    before = server.stats()
    assert before["namespaces"][NS]["entries"] == 5 and before["hits"] == 0

    read = run_engine("retrieve", config, tmp_path)
    assert read["remote_backends"] == wrote["remote_backends"] and read["connected"] == [True]
    assert read["lookup"] == le.TOKENS and read["retrieved_tokens"] == le.TOKENS
    got = torch.load(tmp_path / "kv.pt.got")
    assert got.view(torch.uint8).numpy().tobytes() == kv.view(torch.uint8).numpy().tobytes()
    assert server.stats()["hits"] == 5  # the reader's chunks came out of kvservice


@pytest.mark.timeout(120)
def test_reader_misses_when_service_is_gone(server, name, tmp_path):
    """With the server stopped the reader retrieves nothing (and does not hang or crash): the
    hits of the test above are kvservice's, not a cache of the reader's."""
    config = le.plugin_config(service(name))
    torch.save(le.kv_cache(), tmp_path / "kv.pt")
    assert run_engine("store", config, tmp_path)["stored_chunks"] == 5
    server.stop()
    read = run_engine("retrieve", config, tmp_path)
    assert read["connected"] == [False]
    assert read["lookup"] == 0 and read["retrieved_tokens"] == 0


# ---- configuration ------------------------------------------------------------------------


def test_exactly_one_backend_for_each_configuration(server, name, engine):
    built = engine(le.plugin_config(service(name)))
    assert list(le.remote_backends(built)) == ["RemoteBackend-kvservice"]
    inner = built.storage_manager.storage_backends["RemoteBackend-kvservice"].connection
    inner = inner.getWrappedConnector()
    assert isinstance(inner, KVServiceConnector)
    assert (inner.service_url, inner.namespace) == (server.url, NS)
    legacy = engine(le.legacy_config(service(name)))
    assert list(le.remote_backends(legacy)) == ["RemoteBackend"]


def test_plugin_instances_each_get_their_url(server, name, engine):
    """kvservice.a and kvservice.b: two plugins, two backends, each on its own namespace."""
    config = le.plugin_config(service(name))
    extra = config["extra_config"]
    config["remote_storage_plugins"] = ["kvservice.a", "kvservice.b"]
    for p in ("a", "b"):
        for field in ("module_path", "class_name"):
            extra[f"remote_storage_plugin.kvservice.{p}.{field}"] = \
                extra[f"remote_storage_plugin.kvservice.{field}"]
        extra[f"remote_storage_plugin.kvservice.{p}.url"] = f"kvservice://{name}?namespace={p}"
    backends = le.remote_backends(engine(config))
    assert sorted(backends) == ["RemoteBackend-kvservice.a", "RemoteBackend-kvservice.b"]
    assert sorted(b.connection.getWrappedConnector().namespace
                  for b in backends.values()) == ["a", "b"]


def test_bad_configurations_fail_clearly(name):
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.exceptions import IrrecoverableException

    def cfg(d: dict) -> Any:
        return LMCacheEngineConfig.from_dict(d)

    url = service(name)
    both = le.plugin_config(url)
    both["remote_url"] = url
    with pytest.raises(IrrecoverableException, match="twice"):
        resolve_service_url(url, cfg(both))
    bare = le.plugin_config(url)
    del bare["extra_config"]["remote_storage_plugin.kvservice.url"]
    with pytest.raises(IrrecoverableException, match="remote_storage_plugin.kvservice.url"):
        resolve_service_url("plugin://kvservice", cfg(bare))
    with pytest.raises(IrrecoverableException, match="legacy"):
        resolve_service_url("plugin://kvservice", cfg(le.legacy_config(url)))
    two = le.plugin_config(url, **{"remote_storage_plugin.kvservice.class_name":
                                   "KVServiceConnector"})
    two["remote_storage_plugins"] = ["kvservice", "kvservice.b"]
    two["extra_config"].update({
        "remote_storage_plugin.kvservice.b.module_path": "kvservice.integrations.lmcache",
        "remote_storage_plugin.kvservice.b.class_name": "KVServiceConnector"})
    with pytest.raises(IrrecoverableException, match="2 remote_storage_plugins"):
        resolve_service_url(None, cfg(two), class_name="KVServiceConnector")
    assert resolve_service_url("plugin://kvservice", cfg(le.plugin_config(url))) == url


def test_both_urls_fail_the_engine(name, tmp_path):
    """remote_url and the plugin's url both naming a kvservice would double every write: the
    engine's creation fails (in a child process: LMCache then leaves a thread running)."""
    config = le.plugin_config(service(name))
    config["remote_url"] = service(name)
    out = run_engine("store", config, tmp_path, returncode=3)
    assert out["error"].startswith("IrrecoverableException") and "twice" in out["error"]


def test_plugin_without_url_builds_no_backend(name, engine):
    config = le.plugin_config(service(name))
    del config["extra_config"]["remote_storage_plugin.kvservice.url"]
    assert le.remote_backends(engine(config)) == {}


# ---- the connector under LMCache's RemoteBackend, real MemoryObjs and keys --------------------


class Remote:
    """An in-process engine's RemoteBackend, its allocator, and helpers to make chunks."""

    def __init__(self, engine: Any) -> None:
        (self.rb,) = le.remote_backends(engine).values()
        self.cpu = engine.storage_manager.local_cpu_backend
        self.conn = self.rb.connection  # LMCache's InstrumentedRemoteConnector
        self.inner = self.conn.getWrappedConnector()

    @staticmethod
    def key(i: int, model: str = le.MODEL) -> Any:
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey(model, 1, 0, 0xC0FFEE00 + i, le.DTYPE)

    def chunk(self, seed: int, tokens: int = le.CHUNK) -> Any:
        """A MemoryObj from LMCache's allocator holding random KV data (ref count 1)."""
        from lmcache.v1.memory_management import MemoryFormat

        obj = self.cpu.allocate(le.metadata().get_shapes(tokens), [le.DTYPE],
                                MemoryFormat.KV_2LTD, busy_loop=False)
        assert obj is not None
        obj.tensor.copy_(le.kv_cache(tokens, seed))
        return obj

    def put(self, keys: list, objs: list) -> None:
        """LMCache's batched put (asynchronous, untracked): wait until every key is there."""
        self.rb.batched_submit_put_task(keys, objs)
        deadline = time.monotonic() + 10
        while self.rb.batched_contains(keys) != len(keys):
            assert time.monotonic() < deadline, "puts did not land"
            time.sleep(0.01)

    def run(self, coro: Any, timeout: float = 10) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.rb.loop).result(timeout)


def raw(obj: Any) -> bytes:
    return obj.byte_array.numpy().tobytes() if hasattr(obj.byte_array, "numpy") \
        else bytes(obj.byte_array)


@pytest.fixture(params=[True, False], ids=["chunk_meta", "no_chunk_meta"])
def save_chunk_meta(request) -> bool:
    return request.param


def test_batched_put_get_contains(server, name, engine, save_chunk_meta):
    r = Remote(engine(le.plugin_config(service(name), save_chunk_meta=save_chunk_meta)))
    assert r.inner.save_chunk_meta is save_chunk_meta
    assert r.conn.support_batched_get() and r.conn.support_batched_put()
    assert r.conn.support_batched_contains() and r.conn.support_ping()
    assert r.run(r.conn.ping()) == 0 and r.run(r.conn.list()) == []
    keys = [r.key(i) for i in range(6)]
    objs = [r.chunk(100 + i) for i in range(6)]
    expected = [raw(o) for o in objs]
    stored = [0, 1, 2, 4, 5]  # chunk 3 is missing
    r.put([keys[i] for i in stored], [objs[i] for i in stored])
    assert [o.get_ref_count() for o in objs] == [1] * 6  # LMCache dropped its references
    value = server.stats()  # one value per chunk, header + KV bytes (or KV bytes alone)
    header = r.inner.remote_metadata_bytes if save_chunk_meta else 0
    assert value["namespaces"][NS]["entries"] == 5
    kv = KVClient.connect_sync(server.url)
    try:
        assert kv.get_bytes(keys[0].to_string(), NS)[header:] == expected[0]
    finally:
        kv.close()

    assert r.rb.batched_contains(keys) == 3 and r.rb.batched_contains(keys[4:]) == 2
    assert r.rb.contains(keys[4]) and not r.rb.contains(keys[3])
    got = r.rb.batched_get_blocking(keys)
    assert got[3] is None
    for i in stored:
        assert raw(got[i]) == expected[i] and got[i].get_shapes() == objs[i].get_shapes()
        got[i].ref_count_down()
    one = r.rb.get_blocking(keys[5])
    assert raw(one) == expected[5]
    one.ref_count_down()
    assert r.rb.get_blocking(keys[3]) is None
    assert r.rb.remove(keys[5]) is True and r.rb.get_blocking(keys[5]) is None
    for o in objs:
        o.ref_count_down()


def test_exists_sync_and_partial_last_chunk(server, name, engine, save_chunk_meta):
    """use_exists_sync routes contains through exists_sync; a 16-token last chunk comes back
    16 tokens long (without chunk metadata: reshape_partial_chunk from the value's size)."""
    r = Remote(engine(le.plugin_config(service(name), save_chunk_meta=save_chunk_meta,
                                       use_exists_sync=True)))
    part = r.chunk(5, tokens=16)
    r.put([r.key(1)], [part])
    assert r.rb.contains(r.key(1)) and not r.rb.contains(r.key(2))
    got = r.rb.get_blocking(r.key(1))
    assert got.get_shape() == part.get_shape() == (2, le.LAYERS, 16, le.HEADS * le.HEAD_DIM)
    assert torch.equal(got.tensor, part.tensor)
    got.ref_count_down()
    part.ref_count_down()


@pytest.mark.timeout(60)
def test_allocator_full_is_a_miss(server, name, engine):
    """A hit with no room in LMCache's allocator is a miss, not a wait on the storage loop."""
    r = Remote(engine(le.plugin_config(service(name))))
    r.put([r.key(0)], [r.chunk(3)])
    hold = []
    while (obj := r.cpu.allocate(le.metadata().get_shapes(le.CHUNK), [le.DTYPE],
                                 busy_loop=False, eviction=False)) is not None:
        hold.append(obj)
    start = time.monotonic()
    assert r.rb.get_blocking(r.key(0)) is None
    assert r.rb.batched_get_blocking([r.key(0)]) == [None]
    assert time.monotonic() - start < 5
    hold.pop().ref_count_down()
    got = r.rb.get_blocking(r.key(0))  # room again
    assert got is not None
    got.ref_count_down()
    for obj in hold:
        obj.ref_count_down()


def test_file_region(tmp_path, engine):
    """kvservice://file/ABS/PATH reaches a service on a file:// region."""
    path = tmp_path / "kv.region"
    s = Server(f"file://{path}")
    try:
        r = Remote(engine(le.plugin_config(f"kvservice://file{path}?namespace={NS}")))
        assert r.inner.service_url == f"file://{path}"
        obj = r.chunk(9)
        r.put([r.key(0)], [obj])
        got = r.rb.get_blocking(r.key(0))
        assert raw(got) == raw(obj)
        got.ref_count_down()
        obj.ref_count_down()
    finally:
        s.stop()


def test_no_server_is_a_clear_error_and_no_backend_connection(name, engine):
    """LMCache logs the connector's error and keeps a backend without a connection, which
    answers every call with a miss."""
    from lmcache.v1.storage_backend.connector import CreateConnector

    built = engine(le.plugin_config(service(name)))
    (rb,) = le.remote_backends(built).values()
    assert rb.connection is None
    assert rb.get_blocking(Remote.key(0)) is None and not rb.contains(Remote.key(0))
    with pytest.raises(Exception, match=name):
        CreateConnector("plugin://kvservice", rb.loop, rb.local_cpu_backend, rb.config,
                        rb.metadata, plugin_name="kvservice")


@pytest.mark.timeout(90)
def test_service_gone_is_a_miss(server, name, engine):
    r = Remote(engine(le.plugin_config(service(name))))
    obj = r.chunk(1)
    r.put([r.key(0)], [obj])
    server.stop()
    start = time.monotonic()
    assert r.rb.get_blocking(r.key(0)) is None
    assert r.rb.batched_get_blocking([r.key(0)]) == [None]
    assert not r.rb.contains(r.key(0)) and r.rb.batched_contains([r.key(0)]) == 0
    assert time.monotonic() - start < 30
    obj.ref_count_down()


# ---- bad input from the engine -----------------------------------------------------------------


def test_connector_used_after_close(server, name, engine):
    r = Remote(engine(le.plugin_config(service(name))))
    obj = r.chunk(1)
    r.put([r.key(0)], [obj])
    r.run(r.conn.close())
    with pytest.raises(RuntimeError, match="closed"):
        r.run(r.inner.get(r.key(0)))
    with pytest.raises(RuntimeError, match="closed"):
        r.inner.exists_sync(r.key(0))
    assert r.rb.get_blocking(r.key(0)) is None  # LMCache turns the error into a miss
    assert r.rb.batched_contains([r.key(0)]) == 0
    r.run(r.conn.close())  # twice: nothing
    obj.ref_count_down()


def test_stored_value_of_the_wrong_size_is_a_miss(server, name, engine, save_chunk_meta):
    """A value that does not fit the MemoryObj LMCache allocates (or whose header lies about
    its length) is a miss, never a partial or overrun copy."""
    r = Remote(engine(le.plugin_config(service(name), save_chunk_meta=save_chunk_meta)))
    full = le.CHUNK * le.LAYERS * 2 * le.HEADS * le.HEAD_DIM * 2
    kv = KVClient.connect_sync(server.url)
    try:
        if save_chunk_meta:
            good = r.chunk(2)
            r.put([r.key(0)], [good])
            value = bytearray(kv.get_bytes(r.key(0).to_string(), NS))
            kv.put(r.key(1).to_string(), bytes(value[:-100]), NS)   # truncated
            kv.put(r.key(2).to_string(), bytes(value[:10]), NS)     # shorter than its header
            good.ref_count_down()
        else:
            kv.put(r.key(1).to_string(), b"\x01" * (full + 64), NS)  # too big for a chunk
            kv.put(r.key(2).to_string(), b"\x01" * (full + 1), NS)
    finally:
        kv.close()
    for i in (1, 2):
        assert r.rb.get_blocking(r.key(i)) is None
    assert r.rb.batched_get_blocking([r.key(1), r.key(2)]) == [None, None]


def test_key_over_the_length_limit(server, name, engine):
    """A CacheEngineKey whose string is over kvservice's 1024-byte key limit is never stored,
    and reads of it are misses."""
    from kvservice.keys import MAX_KEY_BYTES

    r = Remote(engine(le.plugin_config(service(name))))
    long_key = r.key(0, model="m" * MAX_KEY_BYTES)
    assert len(long_key.to_string()) > MAX_KEY_BYTES
    obj = r.chunk(4)
    with pytest.raises(ValueError, match="limit"):
        r.run(r.inner.put(long_key, obj))
    r.rb.batched_submit_put_task([long_key], [obj])
    r.put([r.key(1)], [obj])  # a good put after it lands: the bad one was not stored
    assert server.stats()["namespaces"][NS]["entries"] == 1
    assert r.rb.get_blocking(long_key) is None and not r.rb.contains(long_key)
    assert r.rb.batched_contains([long_key]) == 0
    obj.ref_count_down()


def test_readme_yaml_through_lmcaches_file_loader(server, name, engine, tmp_path):
    """The README's plugin-mode YAML, read by LMCacheEngineConfig.from_file, stores and reads."""
    from lmcache.v1.config import LMCacheEngineConfig

    path = tmp_path / "lmcache.yaml"
    path.write_text(f"""\
chunk_size: {le.CHUNK}
local_cpu: false
max_local_cpu_size: 0.05
remote_serde: "naive"
remote_storage_plugins: ["kvservice"]
extra_config:
  remote_storage_plugin.kvservice.module_path: kvservice.integrations.lmcache
  remote_storage_plugin.kvservice.class_name: KVServiceConnectorAdapter
  remote_storage_plugin.kvservice.url: "{service(name)}"
""")
    r = Remote(engine(LMCacheEngineConfig.from_file(str(path)).to_dict()))
    assert r.inner.namespace == NS
    obj = r.chunk(11)
    r.put([r.key(0)], [obj])
    got = r.rb.get_blocking(r.key(0))
    assert raw(got) == raw(obj)
    got.ref_count_down()
    obj.ref_count_down()
