"""SGLang 0.5.23's own ``mooncake`` HiCache backend (``MooncakeStore``) on kvservice's Mooncake
facade through the shim, driven by the real package on the CPU (issue 39).

Two engine processes (``sglang_mooncake_engine``) run SGLang's ``HiCacheController`` with
``storage_backend="mooncake"``, configured as the README says (``MOONCAKE_MASTER=shm://NAME``);
in this process SGLang's ``MooncakeStore`` is built on the shim's ``mooncake.store`` to check
what a buggy engine or a lost service does. ``sglang_engine`` explains how SGLang is imported
without torchvision.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sglang_engine as eng
import sglang_mooncake_engine as mc
from kvservice import KVClient, KVServer
from kvservice.compat import mooncake_shim_path

pytestmark = pytest.mark.engines

MiB = 1 << 20
P = eng.PAGE
run = asyncio.to_thread

eng.load_sglang()
import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402


def _engine_env(url: str) -> dict[str, str]:
    """The README's configuration: the shim first on PYTHONPATH, the kvservice URL as the
    Mooncake master, TCP (the facade accepts Mooncake's protocols and ignores them)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    path = [mooncake_shim_path(), os.path.dirname(tests), tests, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p),
            "MOONCAKE_MASTER": url, "MOONCAKE_PROTOCOL": "tcp"}


@pytest.mark.timeout(300)
async def test_sglang_mooncake_backend_across_two_processes(url, tmp_path):
    """A writer process backs up 8 pages per (pool kind, layout) through SGLang's controller
    and its MooncakeStore on the facade (zero-copy batch_set_v1 from the registered host pool);
    a fresh reader process finds them (batch_exists, also cut at a missing key) and prefetches
    them (batch_get_v1 into slots its host pool allocates): same bytes, page by page. Also
    SGLang's standalone-storage mode (host pool from MooncakeHostTensorAllocator, setup_dummy
    at client_server_address)."""
    async with KVServer(url, pool_size=64 * MiB), KVClient.connect(url) as client:
        summaries = {}
        for role in ("write", "read"):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(Path(mc.__file__)), role, url, str(tmp_path),
                env=_engine_env(url), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                out, err = await asyncio.wait_for(proc.communicate(), 240)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            assert proc.returncode == 0, err.decode()[-3000:]
            summaries[role] = json.loads(out.decode().strip().splitlines()[-1])
        # SGLang's MHA pages are two objects (K and V), MLA pages one, named as SGLang names them
        # (prefixed by the model name, in the facade's default namespace "")
        model = eng.MODEL.replace("/", "-")
        mha = model + "_" + get_storage_hash_str(list(range(100_000, 100_000 + P)), None, P)[0]
        mla = model + "_" + get_storage_hash_str(list(range(300_000, 300_000 + P)), None, P)[0]
        assert [await client.exists(k, "") for k in (
            f"{mha}_0_k", f"{mha}_0_v", f"{mla}__k", f"{mla}__v")] == [True, True, True, False]
    names = [f"{k}-{lay}" for k, lay in mc.COMBOS] + ["standalone"]
    assert sorted(summaries["write"]) == sorted(names) == sorted(summaries["read"])
    n = mc.PAGES
    for name in names:
        facts = {"backend": "MooncakeStore", "store": "kvservice.compat.mooncake.store",
                 "mla": name.startswith("mla"), "zero_copy": True,
                 "standalone": name == "standalone"}
        assert summaries["write"][name] == {**facts, "stored": n}, name
        assert summaries["read"][name] == {**facts, "exists": n, "exists_past_gap": 2,
                                           "hit": n, "read": n}, name
    compared = 0
    for name in names:
        written = (tmp_path / f"{name}.w").read_bytes()
        read = (tmp_path / f"{name}.r").read_bytes()
        size = len(written) // n
        assert size and len(read) == len(written), name
        assert any(written), name  # the writer's random pages, not an all-zero pool
        for i in range(n):
            assert read[i * size:(i + 1) * size] == written[i * size:(i + 1) * size], (name, i)
        compared += len(read)
    print(f"\n{len(names)} configurations x {n} pages: {len(names) * n} pages, "
          f"{compared} bytes compared")
