"""Sub-regions (``file:///PATH?offset=&size=``): one range each of a fixed-size file or device,
so one device holds the RPC region and the kvservice pool. A fallocated file stands in for the
device (fixed size; never grown), /dev/zero with a stand-in sysfs for a DAX device's alignment."""
from __future__ import annotations

import asyncio
import errno
import mmap
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import cxlrpc
from cxlrpc import region as region_module
from cxlrpc.region import DAX_ALIGNMENT, HEADER_SIZE, MAGIC, Region, RegionError, in_use, parse_url
from kvservice import KVClient, KVServer

from procs import CTX, echo_server, stop

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
DEVICE_SIZE = 64 * MiB
PAGE = mmap.PAGESIZE
SMALL_RPC = {"slots": 2, "request_capacity": 1 << 16, "response_capacity": 1 << 16,
             "max_message_size": 1 << 20}


@pytest.fixture
def device(tmp_path: Path) -> Path:
    """A 64 MiB file allocated up front, standing in for a DAX device."""
    path = tmp_path / "dax0.0"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, DEVICE_SIZE)
    finally:
        os.close(fd)
    return path


def sub(path: Path, offset: int, size: int) -> str:
    return f"file://{path}?offset={offset}&size={size}"


def _marker(offset: int) -> bytes:
    return offset.to_bytes(8, "little") * (PAGE // 8)


def mark_edges(path: Path, ranges: list[tuple[int, int]]) -> list[int]:
    """Write a marker page just before and just after each range (where that is outside every
    range and inside the file); the offsets marked."""
    edges = {e for start, size in ranges for e in (start - PAGE, start + size)}
    marked = sorted(e for e in edges if 0 <= e <= DEVICE_SIZE - PAGE
                    and not any(s <= e < s + n for s, n in ranges))
    with open(path, "r+b") as f:
        for offset in marked:
            f.seek(offset)
            f.write(_marker(offset))
    return marked


def assert_untouched(path: Path, marked: list[int]) -> None:
    """The file kept its size and every marker page outside the ranges."""
    assert path.stat().st_size == DEVICE_SIZE
    with open(path, "rb") as f:
        for offset in marked:
            f.seek(offset)
            assert f.read(PAGE) == _marker(offset), f"bytes at {offset} changed"


# ---- URLs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["file:///d?offset=2M&size=4M", "file:///d?size=8192",
                                 "file:///d?offset=1G", "file:///d?size=4K&offset=0"])
def test_sub_region_urls_name_the_file(url):
    assert parse_url(url) == ("file", "/d")


@pytest.mark.parametrize("url,match", [
    ("file:///d?offset=0&offset=4096", "offset= given twice"),
    ("file:///d?count=1", "bad query item 'count=1'"),
    ("file:///d?", "bad query item ''"),
    ("file:///d?offset", "bad query item 'offset'"),
    ("file:///d?offset=-4096", "bad offset='-4096'"),
    ("file:///d?size=1.5M", "bad size='1.5M'"),
    ("file:///d?size=4MiB", "bad size='4MiB'"),
    ("file:///d?size=4m", "bad size='4m'"),
    ("file:///d?size=0", "size=0"),
    ("file:///d?offset=99999999T", "beyond any file"),
    ("shm://kv?offset=0", "only file:// URLs"),
    ("sim://kv?size=4M", "only file:// URLs"),
])
def test_bad_sub_region_urls(url, match):
    with pytest.raises(RegionError, match=match):
        parse_url(url)
    with pytest.raises(RegionError, match=match):
        cxlrpc.Server(url)


# ---- regions -------------------------------------------------------------------------------

def test_two_sub_regions_in_one_device_do_not_disturb_each_other(device):
    a_url, b_url = sub(device, 0, 8 * MiB), f"file://{device}?offset=16M&size=16M"
    marked = mark_edges(device, [(0, 8 * MiB), (16 * MiB, 16 * MiB)])
    a = Region.create(a_url, 1 << 16, kind=7)
    b = Region.create(b_url, 1 << 16, kind=8)
    try:
        assert (a.size, b.size, a.url, b.url) == (8 * MiB, 16 * MiB, a_url, b_url)
        a.buf[HEADER_SIZE:] = b"\xaa" * (a.size - HEADER_SIZE)
        b.buf[HEADER_SIZE:] = b"\xbb" * (b.size - HEADER_SIZE)
        a.publish()
        b.publish()
        with open(device, "rb") as f:  # each header sits at its range's offset
            assert int.from_bytes(f.read(8), "little") == MAGIC
            f.seek(16 * MiB)
            assert int.from_bytes(f.read(8), "little") == MAGIC
        with Region.open(b_url, kind=8) as seen:
            assert (seen.epoch, seen.size) == (b.epoch, 16 * MiB) and seen.epoch != a.epoch
            assert bytes(seen.buf[HEADER_SIZE:]) == b"\xbb" * (b.size - HEADER_SIZE)
        assert bytes(a.buf[HEADER_SIZE:]) == b"\xaa" * (a.size - HEADER_SIZE)
        with pytest.raises(RegionError, match="header says 8388608 bytes but the mapping is 67108864"):
            Region.open(f"file://{device}")  # the whole device is no region of its own
        assert in_use(a_url, 0.1) == f"in use by live process {os.getpid()}"
        with pytest.raises(FileExistsError, match="already holds a region"):
            Region.create(a_url, 1 << 16, kind=7)
        with pytest.raises(FileExistsError, match="in use by live process"):
            Region.acquire(a_url, 1 << 16, kind=7)
        a.mark_closed()
        a.close()
        assert in_use(a_url, 0.1) is None
        with Region.acquire(a_url, 1 << 16, kind=9) as again:
            assert again.epoch != a.epoch and again.size == 8 * MiB
            again.publish()
        with Region.open(b_url, kind=8) as seen:
            assert bytes(seen.buf[HEADER_SIZE:]) == b"\xbb" * (b.size - HEADER_SIZE)
    finally:
        a.close()
        b.close()
    assert_untouched(device, marked)


def test_size_may_be_left_to_the_end_of_the_file(device):
    with Region.create(f"file://{device}?offset=60M", 1 << 16, kind=7) as region:
        assert region.size == 4 * MiB


@pytest.mark.parametrize("query,match", [
    ("offset=1000&size=4M", f"offset 1000 is not a multiple of {mmap.ALLOCATIONGRANULARITY} "
                            r"\(the page size\)"),
    ("offset=0&size=5000", rf"size 5000 is not a multiple of {PAGE}"),
    ("offset=60M&size=8M", r"offset 62914560 \+ size 8388608 = 71303168 is past the end of .* "
                           r"\(67108864 bytes\); a sub-region never grows its file"),
    ("offset=64M", r"offset 67108864 is past the end of .* \(67108864 bytes\)"),
])
@pytest.mark.parametrize("op", ["create", "acquire", "open", "in_use"])
def test_sub_regions_outside_or_across_pages_are_refused(device, query, match, op):
    url = f"file://{device}?{query}"
    with pytest.raises(RegionError, match=match):
        _do(op, url)
    assert_untouched(device, [])
    with open(device, "rb") as f:
        assert f.read(PAGE) == bytes(PAGE)


@pytest.mark.parametrize("op", ["create", "acquire", "open", "in_use"])
def test_a_sub_region_of_a_missing_file_is_never_created(tmp_path, op):
    path = tmp_path / "absent"
    with pytest.raises(FileNotFoundError, match="never created"):
        _do(op, sub(path, 0, 4 * MiB))
    assert not path.exists()


def _do(op: str, url: str) -> None:
    if op == "create":
        Region.create(url, 1 << 16, kind=7).close()
    elif op == "acquire":
        Region.acquire(url, 1 << 16, kind=7).close()
    elif op == "open":
        Region.open(url).close()
    else:
        in_use(url, 0.1)


async def test_a_region_that_needs_more_than_its_range_is_refused(device):
    url = sub(device, 0, 2 * MiB)
    with pytest.raises(RegionError, match="is 2097152 bytes, this server needs 4194304; .*never resized"):
        Region.acquire(url, 4 * MiB, kind=7)
    with pytest.raises(RegionError, match="never resized.*lower slots="):
        await cxlrpc.Server(url).start()  # 16 slots of 4 MiB rings
    assert_untouched(device, [])


def test_dax_alignment_comes_from_sysfs(tmp_path, monkeypatch):
    """/dev/zero (a character device that maps) stands in for a DAX device, a directory for
    its sysfs: offsets and sizes must be multiples of the ``align`` it gives, else 2 MiB.
    (A shared mapping of /dev/zero is fresh memory of the mapping's size, paged from
    ``offset`` on: the ranges mapped here start below their size, or touching them faults.)"""
    zero = os.stat("/dev/zero")
    attrs = tmp_path / f"{os.major(zero.st_rdev)}:{os.minor(zero.st_rdev)}"
    attrs.mkdir()
    (attrs / "size").write_text(f"{DEVICE_SIZE}\n")
    monkeypatch.setattr(region_module, "_SYSFS_CHAR", str(tmp_path))
    for query in ("offset=1M&size=4M", "offset=2M&size=3M"):
        with pytest.raises(RegionError, match=f"not a multiple of {DAX_ALIGNMENT} "
                                              r"\(the alignment of device /dev/zero\)"):
            Region.create(f"file:///dev/zero?{query}", 1 << 16, kind=7)
    with Region.create("file:///dev/zero?offset=2M&size=4M", 1 << 16, kind=7) as region:
        assert region.size == 4 * MiB
    (attrs / "align").write_text(f"{4 * MiB}\n")
    with pytest.raises(RegionError, match=f"offset {2 * MiB} is not a multiple of {4 * MiB}"):
        Region.create("file:///dev/zero?offset=2M&size=4M", 1 << 16, kind=7)
    with Region.create("file:///dev/zero?offset=4M&size=8M", 1 << 16, kind=7) as region:
        assert region.size == 8 * MiB
    with pytest.raises(RegionError, match=r"offset 62914560 \+ size 8388608 .* past the end"):
        Region.create("file:///dev/zero?offset=60M&size=8M", 1 << 16, kind=7)
    for bad, match in (("3000", "not a power of two"), ("junk", "cannot be read")):
        (attrs / "align").write_text(bad)
        with pytest.raises(RegionError, match=match):
            Region.open("file:///dev/zero?offset=4M&size=4M")


def test_a_full_tmpfs_file_is_never_grown(tmp_path):
    """On a tmpfs the file fills, growing is impossible: a range past its end and a whole-file
    region bigger than it are refused, and the file keeps its size and blocks."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "none", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        path = mnt / "dev"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, 8 * MiB)
            with pytest.raises(OSError) as grown:
                os.posix_fallocate(fd, 8 * MiB, PAGE)
            assert grown.value.errno == errno.ENOSPC
        finally:
            os.close(fd)
        before = path.stat()
        with pytest.raises(RegionError, match="past the end"):
            Region.acquire(sub(path, 4 * MiB, 8 * MiB), 1 << 16, kind=7)
        with pytest.raises(RegionError, match="never resized"):
            Region.acquire(f"file://{path}", 16 * MiB, kind=7)
        with Region.acquire(sub(path, 4 * MiB, 4 * MiB), 1 << 16, kind=7) as region:
            region.publish()
        after = path.stat()
        assert (after.st_size, after.st_blocks) == (8 * MiB, before.st_blocks)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)  # -l: even if a test mapping lingers


# ---- servers -------------------------------------------------------------------------------

async def test_rpc_echo_over_a_sub_region(device):
    url = sub(device, 8 * MiB, 8 * MiB)
    marked = mark_edges(device, [(8 * MiB, 8 * MiB)])
    big = os.urandom(20_000)
    for _ in range(2):  # the second server takes the range its predecessor closed
        async with cxlrpc.Server(url, **SMALL_RPC) as server:
            server.add_method("echo", lambda p: p)
            async with cxlrpc.connect(url) as client:
                assert await client.call("echo", b"over a sub-region", timeout=5) == b"over a sub-region"
                assert await client.call("echo", big, timeout=5) == big
        assert_untouched(device, marked)
    with Region.open(url) as region:
        assert region.info().closed and region.size == 8 * MiB


def _race_main(url: str, go, results) -> None:
    async def main() -> None:
        server = cxlrpc.Server(url, **SMALL_RPC)
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


def test_servers_racing_for_a_zeroed_sub_region_one_wins(device):
    url = sub(device, 4 * MiB, 4 * MiB)
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


async def test_a_killed_servers_sub_region_is_taken_over(device):
    url = sub(device, 32 * MiB, 4 * MiB)
    with echo_server(url, **SMALL_RPC) as proc:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    assert in_use(url, 0.1) is None
    t = time.monotonic()
    async with cxlrpc.Server(url, **SMALL_RPC) as server:
        server.add_method("echo", lambda p: p)
        assert time.monotonic() - t < 2.0
        async with cxlrpc.connect(url) as client:
            assert await client.call("echo", b"taken over", timeout=5) == b"taken over"


# ---- kvservice -----------------------------------------------------------------------------

async def test_kv_round_trip_with_service_and_pool_in_one_device(device):
    url, pool_url = sub(device, 0, 8 * MiB), f"file://{device}?offset=16M&size=32M"
    marked = mark_edges(device, [(0, 8 * MiB), (16 * MiB, 32 * MiB)])
    value = np.arange(50_000, dtype=np.float32)  # 200 KB: reserved, copied in place, committed
    for _ in range(2):  # a restarted service takes both ranges back
        async with KVServer(url, pool_size=16 * MiB, pool_url=pool_url, slots=4,
                            request_capacity=1 << 20, max_message_size=1 << 20) as server, \
                KVClient.connect(url) as kv:
            assert server.stats()["pool_url"] == pool_url
            await kv.put("small", b"inline")
            await kv.put("big", value)
            assert await kv.get_bytes("small") == b"inline"
            with await kv.get("big") as block:
                np.testing.assert_array_equal(block.array(np.float32), value)
        assert_untouched(device, marked)


def test_kv_server_needs_a_pool_range_of_its_own(device):
    url = sub(device, 0, 8 * MiB)
    with pytest.raises(RegionError, match="is a sub-region: pass pool_url="):
        KVServer(url, pool_size=MiB)
    for pool_url in (f"file://{device}?offset=4M&size=8M", f"file://{device}",
                     f"file://{device.parent}/./{device.name}?size=4M"):
        with pytest.raises(RegionError, match="overlap"):
            KVServer(url, pool_size=MiB, pool_url=pool_url)
    KVServer(url, pool_size=MiB, pool_url=f"file://{device}?offset=8M")  # adjacent: fine
