"""glibc malloc thresholds set by cxlrpc.process_heap: big bodies come and go without page faults.

Each case runs in a fresh interpreter: the thresholds are process-wide and set once.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# One process serves and calls: 1 MiB echo, 1 MiB to a sink, a 1 MiB reply, in turn. The live
# big bodies come and go, so glibc's default trim gives the heap top back between them.
ALTERNATING = """
import asyncio, resource, sys
import cxlrpc
from cxlrpc.process_heap import keep_freed_heap

async def main(url):
    server = cxlrpc.Server(url)
    big = b"\\x01" * (1 << 20)
    @server.method("echo")
    async def echo(p: bytes) -> bytes: return p
    @server.method("sink")
    async def sink(p: bytes) -> bytes: return b""
    @server.method("source")
    async def source(p: bytes) -> bytes: return big
    async with server:
        async with cxlrpc.connect(url) as c:
            async def rounds(n):
                for _ in range(n):  # each reply lives until the next one has come
                    r = await c.call("echo", big); assert r == big
                    r = await c.call("sink", big); assert r == b""
                    r = await c.call("source", b"x"); assert r == big
            await rounds(3)
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            await rounds(20)
            print(keep_freed_heap(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)

asyncio.run(main(sys.argv[1]))
"""


def _env(**env: str) -> dict[str, str]:
    """This environment without malloc choices of its own, plus ``env``."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("CXLRPC_KEEP_HEAP", "GLIBC_TUNABLES") and not k.startswith("MALLOC_")}
    return {**base, **env}


def _run(name: str, **env: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", ALTERNATING, f"shm://{name}"], env=_env(**env),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


def test_alternating_big_bodies_fault_no_pages(name: str) -> None:
    applied, faults = _run(name)
    assert applied
    # 20 rounds touch 60 MiB of fresh reply and request bodies: 15,360 pages if each faulted in
    assert faults < 200, faults


def test_opted_out_process_keeps_glibc_defaults(name: str) -> None:
    """The case the thresholds are for: without them, the heap top is given back and every
    big body faults its pages in again (what makes the test above fail when they are gone)."""
    applied, faults = _run(name, CXLRPC_KEEP_HEAP="0")
    assert not applied
    assert faults > 2000, faults


@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "1048576"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}])
def test_users_own_malloc_settings_are_left_alone(env: dict[str, str]) -> None:
    script = "from cxlrpc.process_heap import keep_freed_heap; print(keep_freed_heap())"
    out = subprocess.run([sys.executable, "-c", script], env=_env(**env), capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
