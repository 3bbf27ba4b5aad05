"""Attach, detach and region lifecycle: exclusive creation, takeover, fixed-size files, failed
attaches, and a client the server reaped while it was alive (frozen)."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import pytest

import cxlrpc
from cxlrpc.channel import client_wake_address, read_geometry
from cxlrpc.memory import ACQUIRE
from cxlrpc.region import Region

from procs import CTX, echo_server, stop, wait_for

pytestmark = pytest.mark.timeout(60)


def _race_main(url: str, go, results) -> None:
    async def main() -> None:
        server = cxlrpc.Server(url, slots=2, request_capacity=1 << 16, response_capacity=1 << 16,
                               heap_size=0)
        go.wait(10)
        try:
            await server.start()
        except FileExistsError as exc:
            results.put(("lost", str(exc)))
            return
        results.put(("won", os.getpid()))
        await asyncio.sleep(1.0)  # hold it while the others try
        await server.close()

    asyncio.run(main())


@pytest.mark.parametrize("existing", [False, True], ids=["new-file", "zeroed-file"])
def test_servers_racing_for_a_file_region_one_wins(tmp_path, existing):
    """Four servers start at once on one file:// URL (absent, or a zeroed file like a fresh
    device): exactly one serves, the others get FileExistsError."""
    path = tmp_path / "region"
    if existing:
        with open(path, "wb") as f:
            f.truncate(1 << 20)
    url = f"file://{path}"
    go, results = CTX.Event(), CTX.Queue()
    procs = [CTX.Process(target=_race_main, args=(url, go, results)) for _ in range(4)]
    for p in procs:
        p.start()
    try:
        go.set()
        outcomes = [results.get(timeout=30) for _ in procs]
    finally:
        for p in procs:
            stop(p)
    assert sorted(o[0] for o in outcomes) == ["lost", "lost", "lost", "won"], outcomes


async def test_restart_with_smaller_geometry_keeps_the_file_size(tmp_path):
    """An existing file is never resized: a server with a smaller geometry uses it whole, and
    clients (who map the whole file) agree with its header."""
    path = tmp_path / "region"
    url = f"file://{path}"
    async with cxlrpc.Server(url, slots=8) as big:
        big.add_method("echo", lambda p: p)
    size = path.stat().st_size
    async with cxlrpc.Server(url, slots=2, request_capacity=1 << 16, response_capacity=1 << 16) as small:
        small.add_method("echo", lambda p: p)
        assert path.stat().st_size == size
        async with cxlrpc.connect(url) as c:
            assert await c.call("echo", b"fits", timeout=5) == b"fits"
    with pytest.raises(cxlrpc.RegionError, match="never resized.*lower slots="):
        await cxlrpc.Server(url, slots=64).start()


async def test_cleanly_closed_file_region_is_taken_at_once(tmp_path):
    """A region whose server closed cleanly is free, even though that server's process (ours) lives on."""
    url = f"file://{tmp_path}/region"
    for _ in range(3):
        t = time.monotonic()
        async with cxlrpc.Server(url) as server:
            server.add_method("echo", lambda p: p)
            assert time.monotonic() - t < 1.0
            async with cxlrpc.connect(url) as c:
                assert await c.call("echo", b"again", timeout=5) == b"again"
    live = cxlrpc.Server(url)
    await live.start()
    try:
        with pytest.raises(FileExistsError, match="in use by live process"):
            await cxlrpc.Server(url).start()
    finally:
        await live.close()


def test_attach_skips_a_slot_whose_wake_address_is_taken(url):
    """A slot whose wake-up address cannot be bound is released, not leaked: the client takes
    the next slot, and the slot is claimable again (by its next generation)."""
    with echo_server(url, slots=2):
        with Region.open(url) as region:
            squatter = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            squatter.bind(client_wake_address(region.epoch, 0, 1))  # slot 0's first holder's
            try:
                with cxlrpc.connect_sync(url) as c:
                    assert c._conn.chan.slot == 1
                    assert c.call("echo", b"slot 1", timeout=5) == b"slot 1"
                    geo = read_geometry(region)
                    assert not region.mem.load(geo.slot(0), ACQUIRE) & 1, "the failed attach leaked slot 0"
                    with cxlrpc.connect_sync(url) as d:
                        assert (d._conn.chan.slot, d._conn.chan.gen) == (0, 2)
                        assert d.call("echo", b"slot 0", timeout=5) == b"slot 0"
            finally:
                squatter.close()


def _frozen_client_main(url: str, ready, resume, results) -> None:
    import cxlrpc

    async def main() -> None:
        async with cxlrpc.connect(url) as c:
            assert await c.call("echo", b"before", timeout=5) == b"before"
            ready.set()
            await asyncio.to_thread(resume.wait, 30)  # SIGSTOPped meanwhile, then SIGCONTed
            try:
                await c.call("echo", b"after", timeout=5)
                results.put("served")
            except cxlrpc.Unavailable as exc:
                results.put(f"unavailable: {exc}")
            except Exception as exc:
                results.put(f"{type(exc).__name__}: {exc}")

    asyncio.run(main())


def test_reaped_but_alive_client_learns_it(url):
    """A client frozen past client_timeout is reaped; when it resumes, its next call raises
    Unavailable naming the reason (not a timeout), and it does not disturb the slot's next holder."""
    with echo_server(url, slots=1, client_timeout=0.5):
        ready, resume, results = CTX.Event(), CTX.Event(), CTX.Queue()
        child = CTX.Process(target=_frozen_client_main, args=(url, ready, resume, results), daemon=True)
        child.start()
        try:
            assert ready.wait(20)
            os.kill(child.pid, signal.SIGSTOP)
            with Region.open(url) as region:
                geo = read_geometry(region)
                assert wait_for(lambda: not region.mem.load(geo.slot(0), ACQUIRE) & 1, 5), "frozen client never reaped"
            with cxlrpc.connect_sync(url) as successor:  # takes the reaped slot
                os.kill(child.pid, signal.SIGCONT)
                resume.set()
                outcome = results.get(timeout=20)
                assert outcome.startswith("unavailable:") and "reclaimed" in outcome, outcome
                assert successor.call("echo", b"mine", timeout=5) == b"mine"
        finally:
            os.kill(child.pid, signal.SIGCONT)
            stop(child)


async def test_kvservice_on_files_and_a_pool_that_cannot_be_made(tmp_path):
    """kvservice on file:// regions restarts on its own files; where the default pool path
    cannot hold a pool (a device's sysfs file has no sibling to create) the error says to pass
    pool_url=, and the service region is left free."""
    from kvservice import KVClient, KVServer

    url = f"file://{tmp_path}/kv"
    for value in (b"first", b"second"):
        async with KVServer(url, pool_size=1 << 20):
            async with KVClient.connect(url) as kv:
                await kv.put(b"k", value)
                assert await kv.get_bytes(b"k") == value
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "kv.pool").mkdir()  # not a file: stands in for a path no pool fits
    bad = KVServer(f"file://{tmp_path}/dev/kv", pool_size=1 << 20)
    with pytest.raises(cxlrpc.RegionError, match="pool_url="):
        await bad.start()
    async with KVServer(f"file://{tmp_path}/dev/kv", pool_size=1 << 20,
                        pool_url=f"file://{tmp_path}/pool"):
        pass


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small tmpfs")
def test_region_too_big_for_its_filesystem_is_a_clear_error_and_leaves_nothing(tmp_path):
    """Memory is reserved at creation: no SIGBUS on a later first touch, no half-made file."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        with pytest.raises(cxlrpc.RegionError, match=r"needs 4194304 bytes and .* bytes free"):
            Region.create(f"file://{mnt}/region", 4 << 20, kind=1)
        assert list(mnt.iterdir()) == []
        with Region.create(f"file://{mnt}/fits", 512 << 10, kind=1) as region:  # and one that fits
            region.buf[-1] = 1
        (mnt / "fits").unlink()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
