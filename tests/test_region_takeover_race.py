"""Taking over a stale shm region while another process replaces it: the winner retires the
old segment (a tombstone in its epoch word) before unlinking its name, so a process that still
maps the old segment never claims it again nor unlinks the winner's new segment."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cxlrpc import region as region_mod
from cxlrpc.memory import ACQUIRE, RELEASE, AtomicMemory
from cxlrpc.region import HEADER_SIZE, Region, in_use, parse_url, unlink_shm
from cxlrpc.simulator import CacheSim

pytestmark = pytest.mark.timeout(60)

SIZE = 1 << 16
KIND = 7


def _leave_stale(url: str) -> None:
    """A child process creates and publishes the region, then exits without unlinking it."""
    code = (f"from cxlrpc.region import Region\n"
            f"Region.create({url!r}, {SIZE}, kind={KIND}).publish()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def _dead_pid() -> int:
    """The PID of a child that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait(timeout=30)
    return child.pid


def _epoch_under_name(url: str) -> int:
    """The epoch word of the segment the region's name holds now (published or not)."""
    backend, path = parse_url(url)
    mapping, _, fd = region_mod._map_existing(url, backend, path)
    os.close(fd)
    try:
        with AtomicMemory(mapping) as mem:
            return mem.load(region_mod._EPOCH, ACQUIRE)
    finally:
        mapping.close()


def test_a_mapping_of_the_replaced_segment_does_not_take_the_name_again(url, name, monkeypatch):
    """B mapped the stale segment before A retired and unlinked it; B's acquire must then find
    A's new segment in use, not claim the old one and unlink A's."""
    _, path = parse_url(url)
    _leave_stale(url)
    old, actual, old_fd = region_mod._map_existing(url, "shm", path)  # B's view, taken before A's unlink
    a = b = None
    try:
        a = Region.acquire(url, SIZE, KIND)
        a.publish()
        real_map = region_mod._map_existing
        handed = []

        def old_mapping_once(*args: str) -> tuple:
            if handed:
                return real_map(*args)
            handed.append(old)
            return old, actual, os.dup(old_fd)

        monkeypatch.setattr(region_mod, "_map_existing", old_mapping_once)
        with pytest.raises(FileExistsError, match=f"in use by live process {os.getpid()}"):
            b = Region.acquire(url, SIZE, KIND)
        monkeypatch.undo()
        assert handed == [old]
        with Region.open(url, kind=KIND) as now:
            assert now.epoch == a.epoch
            assert now.info().owner_pid == os.getpid()
    finally:
        old.close()
        os.close(old_fd)
        for region in (b, a):
            if region is not None:
                region.close()
        unlink_shm(path)


def test_a_claim_read_before_the_winner_retired_the_segment_retries(url, monkeypatch):
    """B judged the stale segment free, then A took it over before B's CAS: B's CAS meets A's
    tombstone, and B reports A's new segment in use rather than losing a race to nobody."""
    _, path = parse_url(url)
    _leave_stale(url)
    real_busy = region_mod._busy_reason
    winners: list[Region] = []

    def a_takes_over_meanwhile(*args: object) -> str | None:
        verdict = real_busy(*args)
        monkeypatch.setattr(region_mod, "_busy_reason", real_busy)  # A's own check is real
        winners.append(Region.acquire(url, SIZE, KIND))  # A, between B's check and B's CAS
        winners[0].publish()
        return verdict

    monkeypatch.setattr(region_mod, "_busy_reason", a_takes_over_meanwhile)
    b = None
    try:
        with pytest.raises(FileExistsError, match=f"in use by live process {os.getpid()}"):
            b = Region.acquire(url, SIZE, KIND)
        monkeypatch.undo()
        assert len(winners) == 1
        with Region.open(url, kind=KIND) as now:
            assert now.epoch == winners[0].epoch
    finally:
        for region in [b, *winners]:
            if region is not None:
                region.close()
        unlink_shm(path)


def _retire(url: str, pid: int) -> int:
    """Leave the region's segment retired by ``pid``, as a replacer that died before unlinking
    it would; returns the tombstone."""
    region = Region.create(url, SIZE, KIND)
    region.publish()
    tombstone = region_mod._RETIRED | pid
    region.mem.store(region_mod._EPOCH, tombstone, RELEASE)
    region.mem.store(region_mod._MAGIC, 0, RELEASE)
    region.close()
    return tombstone


def test_an_orphaned_retired_segment_is_never_claimed_and_clean_may_remove_it(url, name):
    """A replacer died between retiring the old segment and unlinking it: acquire gives up after
    its bounded retries with an error saying how to remove it, and leaves it alone; ``in_use``
    (what ``clean`` asks) lets it go only once its retirer is dead."""
    _, path = parse_url(url)
    try:
        dead = _dead_pid()
        tombstone = _retire(url, dead)
        started = time.monotonic()
        with pytest.raises(FileExistsError, match=f"retired by process {dead}.*cxlrpc clean"):
            Region.acquire(url, SIZE, KIND)
        assert time.monotonic() - started < 10
        assert _epoch_under_name(url) == tombstone
        assert in_use(url, 0.1) is None
        unlink_shm(path)
        _retire(url, os.getpid())
        assert in_use(url, 0.1) == f"being replaced by process {os.getpid()}"
    finally:
        unlink_shm(path)


def test_a_file_region_ignores_what_would_be_a_tombstone_in_shm(tmp_path):
    """Files and devices are taken over in place, never retired: an unpublished device whose
    epoch word happens to have the tombstone bit (garbage) is still taken."""
    path = tmp_path / "device"
    header = bytearray(HEADER_SIZE)
    header[region_mod._EPOCH:region_mod._EPOCH + 8] = (region_mod._RETIRED | 12345).to_bytes(8, "little")
    path.write_bytes(bytes(header) + bytes(SIZE - HEADER_SIZE))
    with Region.acquire(f"file://{path}", SIZE, KIND, stale_after=0.1) as region:
        assert region.epoch & region_mod._RETIRED == 0


def _stale_taker(url: str):
    """On memory without coherence (sim): a region closed cleanly, a taker whose cache holds
    that closed header, and a live owner that took the region over in place since. Returns
    (taker's cache, its descriptor, the live owner, the closed region's epoch)."""
    _, path = parse_url(url)
    old = Region.create(url, SIZE, KIND)
    old.publish()
    old.mark_closed()
    closed_epoch = old.epoch
    old.close()
    mapping, _, taker_fd = region_mod._map_existing(url, "sim", path)
    taker = CacheSim(mapping)  # caches the closed header now
    mapping, _, fd = region_mod._map_existing(url, "sim", path)
    owner = Region._claim(url, "sim", path, CacheSim(mapping), KIND, closed_epoch,
                          coherence="flush", fd=fd)
    owner.publish()
    return taker, taker_fd, owner, closed_epoch


def _still_owned_by(url: str, owner: Region) -> bool:
    with Region.open(url, kind=KIND) as now:  # a cold cache: memory as it is
        return now.epoch == owner.epoch and owner.still_ours()


def test_a_claim_from_a_stale_cached_header_fails_and_leaves_the_owner_alone(name):
    """Issue 42: the epoch CAS ran on the taker's cached line 0 (the closed owner's epoch), so
    it won a region a live owner holds, and writing that line back overwrote the owner's epoch
    and magic. The CAS runs on the line memory holds."""
    url = f"sim://{name}"
    taker, taker_fd, owner, closed_epoch = _stale_taker(url)
    won = None
    try:
        with pytest.raises(FileExistsError, match="taken over by another process first"):
            won = Region._claim(url, "sim", parse_url(url)[1], taker, KIND, closed_epoch,
                                coherence="flush", fd=taker_fd)  # closes them when it fails
        assert _still_owned_by(url, owner)
    finally:
        if won is not None:
            won.close()
        owner.close()
        unlink_shm(parse_url(url)[1])


def test_a_takeover_reads_the_header_memory_holds_not_a_stale_cached_one(name):
    """Issue 42: _takeover_epoch read the epoch, magic, owner state and identity from the
    taker's cache, which still held a closed header: a live owner was judged gone. It
    invalidates the header first, and finds the owner live."""
    url = f"sim://{name}"
    taker, taker_fd, owner, _ = _stale_taker(url)
    os.close(taker_fd)
    try:
        with pytest.raises(FileExistsError, match=f"in use by live process {os.getpid()}"):
            region_mod._takeover_epoch(url, taker, stale_after=0.1, retirable=True)
        assert _still_owned_by(url, owner)
    finally:
        taker.close()
        owner.close()
        unlink_shm(parse_url(url)[1])
