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


def run_engine(op: str, config: dict, tmp: Path) -> dict:
    """Run tests/lmcache_engine.py OP in a child process; its JSON report."""
    cfg, out = tmp / f"{op}.cfg.json", tmp / f"{op}.out.json"
    cfg.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONHASHSEED": "1234",
           "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    proc = subprocess.run([sys.executable, str(TESTS / "lmcache_engine.py"), op, str(cfg),
                           str(tmp / "kv.pt"), str(out)], env=env, capture_output=True,
                          text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
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


def test_both_urls_fail_the_engine(name, engine):
    """remote_url and the plugin's url both naming a kvservice would double every write."""
    from lmcache.v1.exceptions import IrrecoverableException

    config = le.plugin_config(service(name))
    config["remote_url"] = service(name)
    with pytest.raises(IrrecoverableException, match="twice"):
        engine(config)


def test_plugin_without_url_builds_no_backend(name, engine):
    config = le.plugin_config(service(name))
    del config["extra_config"]["remote_storage_plugin.kvservice.url"]
    assert le.remote_backends(engine(config)) == {}
